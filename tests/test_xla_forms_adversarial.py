"""The one-node XLA kernel's XLA:CPU forms (``Builder.in_turn``, ``once``/``barrier``, the
4-bit bitcast packing, ``cpu_forms``) against the torch path, on inputs the other tests leave
out (from a review, 2026-12-05).

* ``test_unsigned_stochastic_code_at_its_draw_is_the_cpus``: the codec alone, given the same
  fp32 values and the same 24-bit draws, gives the torch path's codes on the CPU (the
  specification), in the node's both forms and on the torch path traced on XLA. The draws
  sit at each element's rounding probability ``(y*y - a*a) / (b*b - a*a)``, where one
  rounding more or less decides the code. XLA:CPU fused ``b*b - a*a`` (and ``y*y - a*a``)
  into one multiply-add and picked another code for 31 of these 64 elements (about one code
  in 2.5 million a step with ordinary draws); ``_quantize.square`` now keeps the products
  apart.
* ``test_in_turn_and_barriers_on_adversarial_steps``: ``in_turn``/``once`` with NaN and inf
  first elements in the leaves waited on, non-finite and huge grads, skipped steps, tensor
  lr, loss scale, and a resume into fresh tensors.
"""

from __future__ import annotations

import math
from typing import Any

import optree
import pytest
import torch

import mpfunc
from mpfunc.backends import _xla_kernels
from mpfunc.state_formats import _quantize, _quantize4

U4: Any = torch.uint4  # type: ignore[attr-defined]
SHAPE = (4, 16)  # in test_xla_codec.py's catalog


def _encode_node(forms: str, bits: int, x: torch.Tensor, noise: torch.Tensor, dev: Any) -> Any:
    b = _xla_kernels.Builder("review_codec")
    b.cpu_forms = forms == "cpu"
    p, nz = b.param(SHAPE, torch.float32), b.param(SHAPE, torch.float32)
    if bits == 8:
        outs = list(b.encode(p, False, nz, SHAPE))
    else:
        outs = list(_quantize4.encode_ops(b, p, False, nz, SHAPE))
    comp = b.xb.Op.tuple(outs).build("review_codec")
    res = _xla_kernels._xlac()._xla_user_computation(
        "xla::review_codec", [x.to(dev), noise.to(dev)], comp
    )
    return [t.cpu() for t in res]


def _draws_at_the_ratio(x: torch.Tensor, bits: int) -> torch.Tensor:
    """24-bit draws (what ``_rng.uniform`` can return) at the unsigned rounding probability
    of each element, as the torch path computes it on the CPU: the draws where one rounding
    of that probability more or less decides the code."""
    q = _quantize if bits == 8 else _quantize4
    levels = q._U_LEVELS
    xb = _quantize._as_blocks(x.reshape(-1))
    vals = _quantize.sqrt_rn(xb)
    s = vals.amax(dim=1).clamp(max=_quantize.BF16_MAX).to(torch.bfloat16).float()
    y = _quantize._flush(vals / torch.where(s > 0, s, 1.0).unsqueeze(1))
    t = (y + y) / (y.abs() + 1.0)
    lo = torch.floor(t * levels).clamp(0, levels - 1).long()
    table = q._TABLE_CPU[False]
    a, b = table[lo], table[lo + 1]
    r = (_quantize._flush(y * y) - a * a) / (b * b - a * a)
    draws = (r.reshape(-1)[: x.numel()] * 2**24).floor().clamp(0, 2**24 - 1) * 2.0**-24
    return draws.reshape(x.shape)


@pytest.mark.parametrize("forms", ["cpu", "plain"])
@pytest.mark.parametrize("bits", [8, 4])
def test_unsigned_stochastic_code_at_its_draw_is_the_cpus(
    xla_device: torch.device, bits: int, forms: str
) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(SHAPE, generator=gen) * 1e-3  # second moments of a typical size
    noise = _draws_at_the_ratio(x, bits)
    quantize = _quantize.quantize if bits == 8 else _quantize4.quantize4
    want = quantize(x, False, noise=noise)  # the torch path on the CPU: the specification
    got = _encode_node(forms, bits, x, noise, xla_device)
    on_xla = quantize(x.to(xla_device), False, noise=noise.to(xla_device))  # torch path, XLA
    assert torch.equal(on_xla.codes.cpu(), want.codes)
    assert torch.equal(on_xla.scale.cpu().view(torch.int16), want.scale.view(torch.int16))
    bad = (got[0] != want.codes).view(-1).nonzero().flatten().tolist()
    assert torch.equal(got[1].view(torch.int16), want.scale.view(torch.int16))
    assert not bad, (
        f"{len(bad)} of {want.codes.numel()} code bytes differ from the CPU's; first at "
        f"{bad[0]}: node {int(got[0].view(-1)[bad[0]])}, CPU {int(want.codes.view(-1)[bad[0]])}, "
        f"torch path on XLA {int(on_xla.codes.cpu().view(-1)[bad[0]])}"
    )


# --- in_turn / once on adversarial steps (passes) ---------------------------------------------

LAYOUT = {"a": (41,), "b": (4, 16), "c": (3, 40)}


def _inputs() -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
    gen = torch.Generator().manual_seed(1)
    params = {k: (torch.randn(s, generator=gen) * 2).bfloat16() for k, s in LAYOUT.items()}
    params["a"][0] = math.nan  # b waits on a's first element
    params["b"].view(-1)[0] = math.inf  # c waits on b's
    grads = []
    for t in range(5):
        big = 1000.0 if t == 2 else 1.0
        g = {k: (torch.randn(s, generator=gen) * 64 * big).bfloat16() for k, s in LAYOUT.items()}
        if t == 2:
            g["a"][1], g["a"][2], g["a"][40] = math.nan, math.inf, -3e38
            g["c"].view(-1)[119] = 3e38
        if t == 4:
            g["b"].view(-1)[5] = -math.inf
        grads.append(g)
    return params, grads


SKIPS = (False, True, False, False, True)
LRS: tuple[Any, ...] = (1e-2, 1e-2, "t5e-3", 2.5e-3, "t1e-3")


def _steps(
    dev: torch.device, impl: str, strategy: str, state_dtype: Any, resume_at: int | None = None
) -> list[torch.Tensor]:
    params, grads = _inputs()

    def opt(lr: Any) -> mpfunc.Optimizer:
        return mpfunc.adamw(
            lr=lr, weight_decay=0.1, amsgrad=True, impl=impl, state_dtype=state_dtype
        )  # type: ignore[arg-type]

    masters = mpfunc.init_master({k: v.to(dev) for k, v in params.items()}, strategy=strategy)
    state = opt(1e-2).init(masters)
    for t, g in enumerate(grads):
        if t == resume_at:  # fresh tensors: a new tensor-id order of the node's inputs
            sd = {k: v.cpu() for k, v in mpfunc.state_dict({"m": masters, "s": state}).items()}
            fresh = mpfunc.init_master(
                {k: torch.zeros_like(v).to(dev) for k, v in params.items()}, strategy=strategy
            )
            tree = mpfunc.load_state_dict({"m": fresh, "s": opt(1e-2).init(fresh)}, sd)
            masters, state = tree["m"], tree["s"]
        lr = LRS[t]
        lr = torch.tensor(float(lr[1:]), device=dev) if isinstance(lr, str) else lr
        mpfunc.apply_update_(
            masters,
            {k: v.to(dev) for k, v in g.items()},
            state,
            opt(lr),
            skip=torch.tensor(SKIPS[t], device=dev),
            scale=64.0,
        )
        if dev.type == "xla":
            import torch_xla

            torch_xla.sync()
    tree = (masters, state)
    return [x.cpu() for x in optree.tree_leaves(tree) if isinstance(x, torch.Tensor)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    width = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
    return t.view(width[t.dtype]) if t.dtype in width else t


@pytest.mark.parametrize(
    ("strategy", "state_dtype"),
    [("remainder", U4), ("kahan", torch.uint8)],
    ids=["remainder-uint4", "kahan-uint8"],
)
def test_in_turn_and_barriers_on_adversarial_steps(
    xla_device: torch.device, strategy: str, state_dtype: Any
) -> None:
    """The node with the XLA:CPU forms: the same bits as the foreach path on XLA and as itself
    resumed from a state dict into fresh tensors, with NaN/inf first elements in the leaves
    ``in_turn`` waits on, non-finite and huge grads, skipped steps, a tensor lr and a loss
    scale."""
    node = _steps(xla_device, "auto", strategy, state_dtype)
    resumed = _steps(xla_device, "auto", strategy, state_dtype, resume_at=3)
    foreach = _steps(xla_device, "foreach", strategy, state_dtype)
    for i, (a, r, f) in enumerate(zip(node, resumed, foreach, strict=True)):
        assert torch.equal(_bits(a), _bits(r)), (i, a.dtype)
        assert torch.equal(_bits(a), _bits(f)), (i, a.dtype)

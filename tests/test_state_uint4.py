"""4-bit moments (``state_dtype=torch.uint4``, ``state_formats/_uint4.py``), wired as a
state format on the torch path.

* a step with 4-bit state is, bit for bit, the same step with fp32 moments whose moments
  are then passed through the standalone codec (``_quantize4``: first moments to
  nearest, second moments stochastically with the draws keyed on the step count and the
  leaf's salt), for AdamW, SGD with momentum and Lion, every master strategy;
* resume through ``save``/``load_`` is bit-exact, every strategy;
* bad input (a leaf smaller than a block, a state from another format or shape) is a
  clear error naming the path, before anything is written;
* XLA (through torch ops) gives the CPU's bits on a small catalog of shapes.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from support.helpers import bits, laid_out

import mpfunc
from mpfunc.core import _rng
from mpfunc.state_formats import _quantize4, _state_format
from mpfunc.state_formats._quantize4 import Q4State

BF16 = torch.bfloat16
U4 = torch.uint4  # type: ignore[attr-defined]
STRATEGIES = ["fp32", "remainder", "kahan", "stochastic", "none"]
OPTIMIZERS = {
    "adamw": lambda sd: mpfunc.adamw(lr=1e-2, weight_decay=1e-2, impl="foreach", state_dtype=sd),
    "sgd": lambda sd: mpfunc.sgd(lr=1e-2, momentum=0.9, impl="foreach", state_dtype=sd),
    "lion": lambda sd: mpfunc.lion(lr=1e-3, impl="foreach", state_dtype=sd),
}
# Shapes of at least one block, odd element counts and partial blocks among them.
SHAPES = [(32,), (33,), (8, 8), (5, 13), (3, 4, 5), (2, 3, 7, 3)]


def _tree(seed: int = 0, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(8, 8, generator=gen).to(BF16).to(device),
            "b": torch.randn(40, generator=gen).to(BF16).to(device)}  # fmt: skip


def _grads(n: int, shapes: dict[str, Any], seed: int = 1) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        {k: (torch.randn(s, generator=gen) * 3).to(BF16) for k, s in shapes.items()}
        for _ in range(n)
    ]


def _same(a: Any, b: Any, what: str) -> None:
    la, lb = mpfunc.state_dict(a), mpfunc.state_dict(b)
    assert la.keys() == lb.keys(), what
    for k in la:
        x, y = la[k].detach().cpu(), lb[k].detach().cpu()
        assert x.dtype == y.dtype and x.shape == y.shape, (what, k)
        same = torch.equal(bits(x), bits(y)) if x.is_floating_point() else torch.equal(x, y)
        assert same, (what, k)


def _round_trip(x: torch.Tensor, square: bool, step: torch.Tensor, salt: int) -> torch.Tensor:
    """The codec's reading of a moment after a store (the reference of the wiring)."""
    noise = None
    if square:
        key = _state_format._keys([step], [salt])[0]
        noise = _rng.uniform(key, x.shape)
    q = _quantize4.quantize4(x.contiguous(), not square, noise=noise)
    return _quantize4.dequantize4(q, x.shape)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_step_is_the_fp32_step_through_the_codec(name: str, strategy: str) -> None:
    p4, pr = _tree(), _tree()
    o4, oref = OPTIMIZERS[name](U4), OPTIMIZERS[name](None)
    m4 = mpfunc.init_master(p4, strategy=strategy, seed=3)
    mr = mpfunc.init_master(pr, strategy=strategy, seed=3)
    s4, sr = o4.init(m4), oref.init(mr)
    fields = [f for f in s4._fields if isinstance(getattr(s4, f), dict) and f != "step"]
    assert fields
    for f in fields:
        for k, q in getattr(s4, f).items():
            assert isinstance(q, Q4State), (f, k)
            assert q.codes.dtype == (torch.uint8 if "sq" in f else torch.int8)
            assert q.codes.shape == (_quantize4.packed_bytes(pr[k].numel()),)
    salts = {k: i for i, k in enumerate(sorted(pr))}  # the leaves' places in the tree
    for g in _grads(4, {k: v.shape for k, v in pr.items()}):
        mpfunc.apply_update_(m4, g, s4, o4, params=p4)
        mpfunc.apply_update_(mr, g, sr, oref, params=pr)
        for f in fields:
            for k, t in getattr(sr, f).items():
                t.copy_(_round_trip(t, "sq" in f, sr.step[k], salts[k]))
    _same({"m": m4, "p": p4, "step": s4.step}, {"m": mr, "p": pr, "step": sr.step}, "step")
    for f in fields:
        for k, q in getattr(s4, f).items():
            got = _quantize4.dequantize4(q, pr[k].shape)
            assert torch.equal(bits(got), bits(getattr(sr, f)[k])), (f, k)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_auto_adamw_tracks_fp32_moments(strategy: str) -> None:
    """impl="auto" (the planner's pick for 4-bit leaves) trains: the masters move as
    fp32-moment AdamW moves them, within the coarseness of 4 bits."""
    base = torch.randn(64, 64, generator=torch.Generator().manual_seed(4))
    moved = {}
    for sd in (None, U4):
        p = {"w": base.to(BF16)}
        m = mpfunc.init_master(p, strategy=strategy, seed=1)
        opt = mpfunc.adamw(lr=1e-3, state_dtype=sd)
        s = opt.init(m)
        gen = torch.Generator().manual_seed(9)
        for _ in range(30):
            g = {"w": (torch.randn(64, 64, generator=gen) + 0.5).to(BF16)}
            mpfunc.apply_update_(m, g, s, opt, params=p)
        moved[sd] = p["w"].float() - base.to(BF16).float()
        assert bool(torch.isfinite(moved[sd]).all())
    ref = moved[None]
    assert float((moved[U4] - ref).norm() / ref.norm()) < 0.5


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_resume_is_bit_exact(strategy: str, tmp_path: Any) -> None:
    grads = _grads(4, {"w": (8, 8), "b": (40,)})
    opt = mpfunc.adamw(lr=1e-2, state_dtype=U4)
    p = _tree()
    m = mpfunc.init_master(p, strategy=strategy, seed=5)
    s = opt.init(m)
    for g in grads[:2]:
        mpfunc.apply_update_(m, g, s, opt, params=p)
    mpfunc.save(tmp_path / "ckpt.pt", {"masters": m, "state": s})
    p2 = _tree(seed=99)  # other values: everything must come from the file
    m2 = mpfunc.init_master(p2, strategy=strategy, seed=6)
    s2 = opt.init(m2)
    mpfunc.load_(tmp_path / "ckpt.pt", {"masters": m2, "state": s2})
    if strategy == "fp32":
        mpfunc.masters_to_model_(m2, p2)
    _same({"m": m, "s": s}, {"m": m2, "s": s2}, "loaded")
    for g in grads[2:]:
        mpfunc.apply_update_(m, g, s, opt, params=p)
        mpfunc.apply_update_(m2, g, s2, opt, params=p2)
    _same({"m": m, "s": s, "p": p}, {"m": m2, "s": s2, "p": p2}, "resumed")


def _raises(exc: type[Exception], match: str, fn: Any, *args: Any, **kwargs: Any) -> None:
    from support.helpers import assert_unchanged, snapshot

    before = snapshot((args, kwargs))
    with pytest.raises(exc, match=match):
        fn(*args, **kwargs)
    assert_unchanged((args, kwargs), before)


def test_bad_input_names_the_path_and_writes_nothing() -> None:
    small = {"w": torch.zeros(64, dtype=BF16), "b": torch.zeros(3, dtype=BF16)}
    m = mpfunc.init_master(small)
    opt = mpfunc.adamw(lr=1e-2, state_dtype=U4)
    _raises(ValueError, r"adamw\.init: at 'masters\.b': expected a leaf of at least 32 "
            r"elements for state_dtype=torch\.uint4, got 3 elements.*partition",
            opt.init, m)  # fmt: skip
    p = _tree()
    m = mpfunc.init_master(p, strategy="stochastic")
    s = opt.init(m)
    g = _grads(1, {"w": (8, 8), "b": (40,)})[0]
    # The 8-bit format's state for a 4-bit optimizer; codes of another leaf's size.
    s8 = mpfunc.adamw(lr=1e-2, state_dtype=torch.uint8).init(m)
    _raises(TypeError, r"at 'state\.exp_avg\.b': expected a Q4State",
            mpfunc.apply_update_, m, g, s8, opt)  # fmt: skip
    bad = s._replace(exp_avg_sq={"w": s.exp_avg_sq["b"], "b": s.exp_avg_sq["b"]})
    _raises(ValueError, r"at 'state\.exp_avg_sq\.w': expected packed codes torch\.uint8 of "
            r"shape \(32,\)", mpfunc.apply_update_, m, g, bad, opt)  # fmt: skip
    _raises(ValueError, r"state_dtype: expected None or one of .*torch\.uint4",
            mpfunc.adamw, state_dtype=torch.uint2)  # fmt: skip


def test_registry_says_which_back_ends_serve_it() -> None:
    f = _state_format.FORMATS[U4]
    assert f.container is Q4State and f.native == 3 and f.xla and f.salted
    from mpfunc.backends import _native

    assert _native.FORMAT_CODES[U4] == 3


def _run(device: torch.device, strategy: str, steps: int) -> Any:
    params = {
        f"l{i}": torch.randn(s, generator=torch.Generator().manual_seed(i)).to(BF16).to(device)
        for i, s in enumerate(SHAPES)
    }
    m = mpfunc.init_master(params, strategy=strategy, seed=2)
    opt = mpfunc.adamw(lr=1e-2, state_dtype=U4)
    s = opt.init(m)
    for g in _grads(steps, {k: v.shape for k, v in params.items()}, seed=7):
        g = {k: v.to(device) for k, v in g.items()}
        mpfunc.apply_update_(m, g, s, opt, params=params if strategy == "fp32" else None)
        if device.type == "xla":
            import torch_xla

            torch_xla.sync()
    return {"m": m, "s": s}


@pytest.mark.xla
@pytest.mark.parametrize("strategy", ["fp32", "stochastic"])
def test_xla_gives_the_cpu_bits(xla_device: torch.device, strategy: str) -> None:
    """The state (every code and scale) bit for bit, after one step from zero moments
    and after three; the masters within the suite's XLA bound (XLA:CPU fuses ``a*b + c``
    as its whole graph decides, so the fp32 step itself may differ in its last bit)."""
    for steps in (1, 3):
        cpu, xla = _run(torch.device("cpu"), strategy, steps), _run(xla_device, strategy, steps)
        _same(cpu["s"], xla["s"], f"state after {steps} steps")
        la, lb = mpfunc.state_dict(cpu["m"]), mpfunc.state_dict(xla["m"])
        for k in la:
            x, y = la[k].double(), lb[k].detach().cpu().double()
            assert float((x - y).abs().max()) <= 1e-6 * float(x.abs().max()) + 1e-12, k


# --- properties, drawn (as the 8-bit format's in test_native_composed/test_strategies) ----

# Param layouts of at least one block (a leaf under a block is refused: test above): an odd
# count (a half-used last byte), transposed, channels_last and a non-dense slice.
P_LAYOUTS: dict[str, tuple[int, ...]] = {
    "contiguous": (37,),
    "transposed": (9, 7),
    "channels_last": (2, 3, 4, 3),
    "sliced": (6, 8),
}
PROP_OPTS: dict[str, tuple[Any, dict[str, Any]]] = {
    "adamw": (mpfunc.adamw, dict(weight_decay=0.1)),
    "adamw-amsgrad": (mpfunc.adamw, dict(amsgrad=True)),
    "adam": (mpfunc.adam, dict(weight_decay=0.1, maximize=True)),
    "sgd": (mpfunc.sgd, dict(momentum=0.9, dampening=0.1)),
    "sgd-nesterov": (mpfunc.sgd, dict(momentum=0.9, nesterov=True)),
    "lion": (mpfunc.lion, dict(weight_decay=0.1)),
}


def _grad(kind: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    if kind == "expanded":
        return (torch.randn(1, *shape[1:], generator=gen) * 3).to(BF16).expand(shape)
    g = (torch.randn(shape, generator=gen) * 3).to(BF16)
    if kind == "transposed" and len(shape) == 2:
        return g.t().contiguous().t()
    if kind == "channels_last" and len(shape) == 4:
        return g.contiguous(memory_format=torch.channels_last)
    return g


def _prop_case(data: Any) -> dict[str, Any]:
    n = data.draw(st.integers(1, 3), "leaves")
    steps = data.draw(st.integers(1, 3), "steps")
    return dict(
        opt=data.draw(st.sampled_from(sorted(PROP_OPTS)), "optimizer"),
        strategy=data.draw(st.sampled_from(STRATEGIES), "strategy"),
        layouts=[data.draw(st.sampled_from(sorted(P_LAYOUTS)), f"layout{i}") for i in range(n)],
        grads=[data.draw(st.sampled_from(["contiguous", "transposed", "expanded",
                                          "channels_last"]), f"grad{i}") for i in range(n)],
        holes=[[i > 0 and data.draw(st.booleans(), f"hole{k}.{i}") for i in range(n)]
               for k in range(steps)],
        skips=[data.draw(st.booleans(), f"skip{k}") for k in range(steps)],
        scale=data.draw(st.sampled_from([None, 64.0, "tensor"]), "scale"),
        tensor_lr=data.draw(st.booleans(), "tensor lr"),
        seed=data.draw(st.integers(0, 2**16), "seed"),
    )  # fmt: skip


def _prop_run(c: dict[str, Any], sd: Any, device: torch.device) -> Any:
    """Steps of case ``c`` with state dtype ``sd`` (``None``: fp32 moments, passed through
    the standalone codec after each step: the reference)."""
    gen = torch.Generator().manual_seed(c["seed"])
    params = {
        f"p{i}": laid_out(
            kind, P_LAYOUTS[kind], torch.randn(math.prod(P_LAYOUTS[kind]), generator=gen).to(BF16)
        ).to(device)
        for i, kind in enumerate(c["layouts"])
    }
    masters = mpfunc.init_master(params, strategy=c["strategy"], seed=3)
    lr: Any = torch.tensor(1e-2, device=device) if c["tensor_lr"] else 1e-2
    make, hyper = PROP_OPTS[c["opt"]]
    # One kernel for both runs (``auto`` could pick torch's fused kernel for the fp32 run,
    # whose last bits differ from foreach's): the codec is what is compared.
    opt = make(lr=lr, state_dtype=sd, impl="foreach", **hyper)
    state = opt.init(masters)
    fields = [f for f in state._fields if isinstance(getattr(state, f), dict) and f != "step"]
    salts = {k: i for i, k in enumerate(sorted(params))}
    kw: dict[str, Any] = {"params": params} if c["strategy"] == "fp32" else {}
    for k, skip in enumerate(c["skips"]):
        grads: dict[str, Any] = {
            name: None
            if c["holes"][k][i]
            else _grad(c["grads"][i], P_LAYOUTS[kind], gen).to(device)
            for i, (name, kind) in enumerate(zip(params, c["layouts"]))
        }
        scale = c["scale"]
        if scale == "tensor":
            scale = torch.tensor(64.0, device=device)
        mpfunc.apply_update_(masters, grads, state, opt, skip=torch.tensor(skip, device=device),
                             scale=scale, **kw)  # fmt: skip
        if sd is None and not skip:
            # Only the moments a step wrote: a skipped step or a leaf without a grad keeps
            # its codes (re-encoding a decoded second moment is not always exact: sqrt of
            # a rounded square can sit an ulp off a level, and a draw may then move it).
            for f in fields:
                for name, t in getattr(state, f).items():
                    if grads[name] is not None:
                        t.copy_(_round_trip(t, "sq" in f, state.step[name], salts[name]))
    return {"m": masters, "p": params, "step": state.step}, state, fields


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_property_step_is_the_fp32_step_through_the_codec(data: st.DataObject) -> None:
    """Drawn: optimizer (AdamW, amsgrad, Adam with L2 decay and maximize, SGD with
    momentum or Nesterov, Lion), strategy, param layouts (odd counts, transposed,
    channels_last, sliced), grad layouts (expanded included), leaves without a grad at a
    step (None holes), skipped steps, loss scales (float, tensor), a tensor lr: masters,
    params, step counts and every decoded moment are bit for bit the fp32-moment run's
    with its moments passed through the codec after each step."""
    c = _prop_case(data)
    cpu = torch.device("cpu")
    got, s4, fields = _prop_run(c, U4, cpu)
    want, sref, _ = _prop_run(c, None, cpu)
    _same(got, want, "masters, params, steps")
    for f in fields:
        for k, q in getattr(s4, f).items():
            ref = getattr(sref, f)[k]
            dec = _quantize4.dequantize4(q, ref.shape)
            assert torch.equal(bits(dec), bits(ref.contiguous())), (f, k)


def test_aliased_state_is_refused_and_nothing_written() -> None:
    """Two leaves whose 4-bit moments share one codes tensor (a state built by hand) are
    refused naming both paths; no tensor's bits or version change."""
    p = {"a": torch.randn(64).to(BF16), "b": torch.randn(64).to(BF16)}
    m = mpfunc.init_master(p, strategy="stochastic", seed=1)
    opt = mpfunc.adamw(lr=1e-2, state_dtype=U4)
    s = opt.init(m)
    shared = s.exp_avg["a"]
    bad = s._replace(exp_avg={"a": shared, "b": shared})
    g = {k: torch.randn(64).to(BF16) for k in p}
    both = r"exp_avg\.a.*exp_avg\.b|exp_avg\.b.*exp_avg\.a"
    _raises(ValueError, both, mpfunc.apply_update_, m, g, bad, opt)


@pytest.mark.parametrize("shape", [(), (31,)])
def test_zero_d_and_small_leaves_point_at_partition(shape: tuple[int, ...]) -> None:
    """A 0-d leaf (or any under one block) cannot take 4-bit moments: ``init`` says so,
    naming the path and pointing at ``partition``; with ``partition`` it trains."""
    p = {"w": torch.randn(8, 8).to(BF16), "t": torch.randn(shape).to(BF16)}
    m = mpfunc.init_master(p, strategy="stochastic", seed=1)
    _raises(ValueError, r"at 'masters\.t': expected a leaf of at least 32 elements.*partition",
            mpfunc.adamw(lr=1e-2, state_dtype=U4).init, m)  # fmt: skip
    opt = mpfunc.partition(
        {"big": mpfunc.adamw(lr=1e-2, state_dtype=U4), "small": mpfunc.adamw(lr=1e-2)},
        lambda path, x: "big" if x.numel() >= 32 else "small",
    )
    s = opt.init(m)
    mpfunc.apply_update_(m, {k: torch.ones_like(v) for k, v in p.items()}, s, opt)
    held = [k for k in mpfunc.state_dict(s) if "codes" in k]
    assert held and all(".w" in k for k in held), held

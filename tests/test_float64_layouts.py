"""Float64 leaves in every layout people have, with every state format and optimizer.

A float64 leaf steps in float64 (``tests/test_float64_masters.py`` compares a contiguous
one with torch.optim on float64 copies). Here the property is that its layout changes
nothing: a transposed, channels_last, sliced (not dense) or offset float64 leaf, with a
grad in its own layout, ends bit for bit where the same values laid out contiguously end,
for masters (``"fp32"``, model params written back) and params stepped as themselves
(``"none"``), on the native pass and the torch path, and its 8- and 4-bit moments hold the
same codes and scales (the codes follow the leaf's row-major order, whatever its strides).
A bf16 leaf beside it keeps the group mixed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from support.helpers import assert_bits_equal, leaves

import mpfunc

U4 = torch.uint4  # type: ignore[attr-defined]
F64 = torch.float64


def _values(gen: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)


# Each layout: (shape, make(values of that shape) -> the same values in the layout). Every
# leaf holds at least one 8-bit block (32 elements), and none a whole number of blocks.
LAYOUTS: dict[str, tuple[tuple[int, ...], Callable[[torch.Tensor], torch.Tensor]]] = {
    "contiguous": ((7, 9), lambda x: x.clone()),
    "transposed": ((7, 9), lambda x: x.t().contiguous().t()),
    "channels_last": ((2, 5, 3, 3), lambda x: x.contiguous(memory_format=torch.channels_last)),
    "sliced": (
        (6, 7),
        lambda x: torch.zeros(6, 14, dtype=x.dtype).index_copy_(1, torch.arange(0, 14, 2), x)[
            :, ::2
        ],
    ),
    "offset": ((65,), lambda x: torch.cat([torch.zeros(5, dtype=x.dtype), x, x[:3]])[5:70]),
}
GRAD_LAYOUTS = ["contiguous", "transposed", "expanded", "channels_last"]


def _grad(kind: str, shape: tuple[int, ...], gen: torch.Generator, dense: bool) -> torch.Tensor:
    """A float64 grad in layout ``kind`` (``dense``: its values laid out contiguously)."""
    g = _values(gen, shape, F64)
    if kind == "transposed" and len(shape) == 2:
        g = g.t().contiguous().t()
    elif kind == "expanded":
        g = g[:1].expand(shape)
    elif kind == "channels_last" and len(shape) == 4:
        g = g.contiguous(memory_format=torch.channels_last)
    return g.contiguous() if dense else g


OPTIMIZERS: dict[str, Callable[..., mpfunc.Optimizer]] = {
    "adamw": lambda **k: mpfunc.adamw(lr=1e-2, weight_decay=0.1, **k),
    "adam-amsgrad": lambda **k: mpfunc.adam(lr=1e-2, amsgrad=True, **k),
    "sgd-nesterov": lambda **k: mpfunc.sgd(lr=1e-2, momentum=0.9, nesterov=True, **k),
    "lion": lambda **k: mpfunc.lion(lr=1e-3, weight_decay=0.1, **k),
}


def _run(
    layout: str,
    grad_kind: str,
    strategy: str,
    rule: str,
    state_dtype: Any,
    impl: str,
    steps: int,
    dense: bool = False,
) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """The float64 leaf ``w`` after ``steps`` steps (its master, its state's tensors, the
    bf16 neighbour's master), laid out as ``layout`` (values the same for every layout),
    its grads in ``grad_kind`` (``dense``: the same values and shapes, contiguous)."""
    shape, make = LAYOUTS[layout]
    gen = torch.Generator().manual_seed(0)
    w = _values(gen, shape, F64)
    params = {"a": _values(gen, (40,), torch.bfloat16), "w": w if dense else make(w)}
    masters = mpfunc.init_master(params, strategy=strategy)
    opt = OPTIMIZERS[rule](state_dtype=state_dtype, impl=impl)
    state = opt.init(masters)
    for _ in range(steps):
        grads = {"a": _values(gen, (40,), torch.bfloat16), "w": _grad(grad_kind, shape, gen, dense)}
        kw = {"params": params} if strategy == "fp32" else {}
        mpfunc.apply_update_(masters, grads, state, opt, **kw)
        if strategy == "fp32":  # the float64 model param is its master's value
            assert_bits_equal(params["w"], masters["w"])
    w = masters["w"] if strategy == "fp32" else params["w"]
    assert w.dtype == F64
    fields = [getattr(state, f) for f in state._fields if getattr(state, f) is not None]
    kept = [t.contiguous() for f in fields for t in leaves(f["w"] if isinstance(f, dict) else f)]
    a = masters["a"] if strategy == "fp32" else params["a"]
    return w.contiguous(), kept, a


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_a_float64_leaf_steps_alike_in_every_layout(data: st.DataObject) -> None:
    layout = data.draw(st.sampled_from(sorted(LAYOUTS)), label="layout")
    grad_kind = data.draw(st.sampled_from(GRAD_LAYOUTS), label="grad layout")
    strategy = data.draw(st.sampled_from(["fp32", "none"]), label="strategy")
    rule = data.draw(st.sampled_from(sorted(OPTIMIZERS)), label="optimizer")
    state_dtype = data.draw(
        st.sampled_from([None, torch.bfloat16, torch.uint8, U4]), label="state_dtype"
    )
    impl = data.draw(st.sampled_from(["auto", "foreach", "reference"]), label="impl")
    steps = data.draw(st.integers(1, 3), label="steps")
    got = _run(layout, grad_kind, strategy, rule, state_dtype, impl, steps)
    want = _run(layout, grad_kind, strategy, rule, state_dtype, impl, steps, dense=True)
    if impl == "auto":
        # The kernel may differ with the layout (torch's fused one takes a dense leaf,
        # the foreach chain any other): the same float64 math in another order.
        torch.testing.assert_close(got[0], want[0], rtol=1e-13, atol=1e-15)
    else:
        assert_bits_equal(got[0], want[0])
    assert_bits_equal(got[2], want[2])
    assert len(got[1]) == len(want[1])
    for x, y in zip(got[1], want[1]):
        assert x.dtype == y.dtype and x.shape == y.shape
        if impl == "auto" and x.dtype == F64:  # float64 moments: as the master
            torch.testing.assert_close(x, y, rtol=1e-13, atol=1e-15)
        else:
            assert torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("state_dtype", [torch.uint8, U4], ids=str)
def test_float64_master_in_each_layout_with_encoded_state(layout: str, state_dtype: Any) -> None:
    # Every layout at least once, with the expanded grad (stride 0) that must be read by
    # value, for the two encoded formats.
    got = _run(layout, "expanded", "fp32", "adamw", state_dtype, "foreach", 3)
    want = _run(layout, "expanded", "fp32", "adamw", state_dtype, "foreach", 3, dense=True)
    assert_bits_equal(got[0], want[0])
    for x, y in zip(got[1], want[1], strict=True):
        assert torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("impl", ["auto", "fused", "foreach", "reference"])
@pytest.mark.parametrize("rule", ["adam", "adamw", "amsgrad"])
@pytest.mark.parametrize("state_dtype", [None, torch.bfloat16, torch.uint8, U4], ids=str)
def test_float64_adam_step_is_torch_optims_in_float64(
    layout: str, impl: str, rule: str, state_dtype: Any
) -> None:
    # One step from zero moments (stored exactly in every format), against torch.optim on a
    # float64 copy. The bias corrections once came from the float32 step counts on every
    # path but torch's fused kernel: 1.1e-9 off after this one step.
    shape, make = LAYOUTS[layout]
    gen = torch.Generator().manual_seed(3)
    w, g = _values(gen, shape, F64), _values(gen, shape, F64)
    hp = dict(lr=1e-2, weight_decay=0.1, amsgrad=rule == "amsgrad")
    torch_cls = torch.optim.AdamW if rule == "adamw" else torch.optim.Adam
    factory = mpfunc.adamw if rule == "adamw" else mpfunc.adam
    ref = torch.nn.Parameter(w.clone())
    ref.grad = g.clone()
    torch_cls([ref], foreach=False, **hp).step()
    for strategy in ("fp32", "none"):
        params = {"w": make(w)}
        masters = mpfunc.init_master(params, strategy=strategy)
        opt = factory(state_dtype=state_dtype, impl=impl, **hp)
        state = opt.init(masters)
        kw = {"params": params} if strategy == "fp32" else {}
        mpfunc.apply_update_(masters, {"w": make(g)}, state, opt, **kw)
        got = masters["w"] if strategy == "fp32" else params["w"]
        torch.testing.assert_close(got, ref.detach(), rtol=1e-14, atol=1e-16)

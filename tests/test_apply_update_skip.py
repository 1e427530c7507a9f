"""A skipped step changes no bit of masters or state, at any step count."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import pytest
import torch
from support.hardening import F32, W, _to, _tree, _with
from support.helpers import assert_trees_bits_equal, leaves

import mpfunc

# torch warns once per process that CSR support is in beta; these tests only hand CSR
# tensors to functions that must refuse them.
pytestmark = pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta:UserWarning")


SKIPPED: dict[str, Callable[[], mpfunc.Optimizer]] = {
    **{
        f"{n}-{impl}": partial(f, lr=0.1, weight_decay=0.01, amsgrad=True, impl=impl)
        for n, f in (("adam", mpfunc.adam), ("adamw", mpfunc.adamw))
        for impl in ("fused", "foreach", "reference")
    },
    **{
        f"sgd-{impl}": partial(mpfunc.sgd, lr=0.1, momentum=0.9, dampening=0.1, impl=impl)
        for impl in ("foreach", "reference")
    },
    **{
        f"lion-{impl}": partial(mpfunc.lion, lr=0.1, weight_decay=0.01, impl=impl)
        for impl in ("foreach", "reference")
    },
}


def _clone(tree: Any) -> Any:
    return _tree_map(tree, lambda t: t.detach().clone())


def _tree_map(tree: Any, f: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    import optree

    return optree.tree_map(lambda t: None if t is None else f(t), tree, none_is_leaf=True)


@pytest.mark.parametrize("count", [2**24, 2**24 + 2, 2**30])
@pytest.mark.parametrize("name", sorted(SKIPPED))
def test_skipped_step_at_large_counts_is_bit_identical(
    device: torch.device, name: str, count: int
) -> None:
    if name.endswith("fused") and device.type != "cpu":
        pytest.skip("torch has no fused kernel on XLA")
    opt = SKIPPED[name]()
    masters = _to(_tree(F32, 0), device)
    state = opt.init(masters)
    mpfunc.apply_update_(masters, _to(_tree(F32, 1), device), state, opt)  # moments non-zero
    for t in leaves(state.step):
        t.copy_(torch.tensor(float(count)))
    assert float(torch.tensor(float(count))) == count  # exact in float32
    grads = _to(_with(_tree(F32, 2), "z.w", torch.full(W, float("inf"))), device)
    skip = torch.tensor(True, device=device)
    before_m, before_s = _clone(masters), _clone(state)
    new_m, new_s = mpfunc.apply_update(masters, grads, state, opt, skip=skip)
    assert_trees_bits_equal(new_m, before_m)
    assert_trees_bits_equal(new_s, before_s)
    mpfunc.apply_update_(masters, grads, state, opt, skip=skip)
    assert_trees_bits_equal(masters, before_m)
    assert_trees_bits_equal(state, before_s)

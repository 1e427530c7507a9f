"""The pure forms return detached results and grow no autograd graph."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from support.hardening import BF16, F32, OPTS, _to, _tree
from support.helpers import leaves, settle

import mpfunc

# torch warns once per process that CSR support is in beta; these tests only hand CSR
# tensors to functions that must refuse them.
pytestmark = pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta:UserWarning")


def _requiring_grad(tree: Any) -> Any:
    return _to_each(tree, lambda t: t.detach().requires_grad_(True))


def _to_each(tree: Any, f: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(tree, dict):
        return {k: _to_each(v, f) for k, v in tree.items()}
    return f(tree)


def _assert_detached(tree: Any) -> None:
    for t in leaves(tree):
        if isinstance(t, torch.Tensor):
            assert t.grad_fn is None and not t.requires_grad, t


@pytest.mark.parametrize("name", ["sgd", "adamw", "lion"])
def test_pure_apply_update_on_masters_requiring_grad_grows_no_graph(
    device: torch.device, name: str
) -> None:
    opt = OPTS[name]()
    masters = _requiring_grad(_to(_tree(F32, 0), device))
    state = opt.init(masters)
    for step in range(20):
        grads = _requiring_grad(_to(_tree(F32, 100 + step), device))
        new_masters, state = mpfunc.apply_update(masters, grads, state, opt)
        _assert_detached(new_masters)
        _assert_detached(state)
        settle(leaves(new_masters)[0])
        masters = _requiring_grad(new_masters)  # as a user who keeps requires_grad on would


def test_pure_transforms_return_detached_results() -> None:
    params = _requiring_grad(_tree(BF16, 0))
    grads = _requiring_grad(_tree(BF16, 1))
    masters = _requiring_grad(_tree(F32, 2))
    acc = _requiring_grad(_tree(F32, 3))
    _assert_detached(mpfunc.init_master(params))
    _assert_detached(mpfunc.init_grads(params))
    _assert_detached(mpfunc.grads_to_fp32(grads, scale=2.0))
    _assert_detached(mpfunc.masters_to_model(masters, params))
    _assert_detached(mpfunc.accumulate_grads(acc, grads))
    _assert_detached(mpfunc.clip_by_global_norm(_requiring_grad(_tree(F32, 4)), 0.1))

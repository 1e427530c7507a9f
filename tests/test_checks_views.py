"""Negative and conjugate views: read as their values (grads, casts, after a remembered
step), refused where they would be written."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from support.entry_checks import (
    BF16,
    F32,
    _assert_unchanged,
    _at,
    _grads,
    _params,
    _refused,
    _setup,
    _snapshot,
)

import mpfunc
from tests.support.helpers import assert_bits_equal, assert_trees_bits_equal
from tests.support.native import native_module

_UPDATABLE = "a tensor that can be updated in place"


@pytest.fixture(scope="module")
def native() -> Any:
    return native_module()


def _step(opt: mpfunc.Optimizer, grads: dict[str, torch.Tensor]) -> Any:
    params = _params()
    masters = mpfunc.init_master(params)
    state = opt.init(masters)
    mpfunc.apply_update_(masters, grads, state, opt, params=params)
    return masters, state, params


@pytest.mark.parametrize("impl", ["auto", "fused", "foreach"])
@pytest.mark.parametrize("dtype", [None, F32], ids=["param_dtype", "fp32"])
def test_a_negative_view_grad_is_read_as_its_values(impl: str, dtype: Any, native: Any) -> None:
    """Issue 20, item 5: a grad that is a negative view (``torch._neg_view``, or ``.imag``
    of a conjugated complex tensor) holds the negated values in memory. The native pass
    read it as positive (the master moved the wrong way) and torch's fused kernel refused
    it partway. Now it steps exactly as a plain tensor of the same values."""
    raw = {k: g if dtype is None else g.to(dtype) for k, g in _grads().items()}
    views = {k: torch._neg_view(g) for k, g in raw.items()}
    assert all(v.is_neg() for v in views.values())
    opt = mpfunc.adamw(lr=1e-2, impl=impl)
    want = _step(opt, {k: v.resolve_neg() for k, v in views.items()})
    before = _snapshot(views)
    assert_trees_bits_equal(_step(opt, views), want)
    _assert_unchanged(before)  # grads are only read


def test_a_negative_view_after_a_remembered_step_is_read_as_its_values(native: Any) -> None:
    """A memo key cannot tell a negative view from the tensor it views (same address,
    dtype, shape, strides): the grads are looked at on every call."""
    params, masters, grads, state, opt = _setup()
    ref_params, ref_masters, _, ref_state, _ = _setup()
    for _ in range(2):
        mpfunc.apply_update_(masters, grads, state, opt, params=params)
        mpfunc.apply_update_(ref_masters, grads, ref_state, opt, params=ref_params)
    views = {k: torch._neg_view(g) for k, g in grads.items()}
    mpfunc.apply_update_(masters, views, state, opt, params=params)
    resolved = {k: v.resolve_neg() for k, v in views.items()}
    mpfunc.apply_update_(ref_masters, resolved, ref_state, opt, params=ref_params)
    assert_trees_bits_equal((masters, state, params), (ref_masters, ref_state, ref_params))


def test_the_imag_of_a_conjugate_is_read_as_its_values(native: Any) -> None:
    """The everyday way to get a negative view: ``.imag`` of a conjugated tensor."""
    z = torch.complex(torch.randn(64), torch.randn(64)).conj()
    g = z.imag
    assert g.is_neg()
    opt = mpfunc.adamw(lr=1e-2)
    got, want = {"a": torch.zeros(64)}, {"a": torch.zeros(64)}
    mpfunc.apply_update_(got, {"a": g}, opt.init(got), opt)
    mpfunc.apply_update_(want, {"a": g.resolve_neg()}, opt.init(want), opt)
    assert_bits_equal(got["a"], want["a"])
    # The first Adam step moves each element by -lr * sign(g).
    assert torch.equal(torch.sign(got["a"]), -torch.sign(z.imag.resolve_neg()))


def test_grads_to_fp32_casts_a_negative_view_by_its_values(native: Any) -> None:
    """The native cast (large bf16 grads) read memory as it is too."""
    g = torch.randn(1 << 17).to(BF16)
    view = torch._neg_view(g)
    out = mpfunc.grads_to_fp32_({"g": view}, {"g": torch.empty(1 << 17)})
    assert torch.equal(out["g"], -g.float())
    back = {"p": torch.empty(1 << 17, dtype=BF16)}
    mpfunc.masters_to_model_({"p": torch._neg_view(g.float())}, back)
    assert torch.equal(back["p"], -g)


def test_a_negative_or_conjugate_view_to_write_is_refused(native: Any) -> None:
    """A view whose memory holds negated values cannot take an in-place step: refused
    before any write (torch's kernels refused it partway, the native one stored raw bits)."""
    params, masters, grads, state, opt = _setup()
    masters["c"] = torch._neg_view(masters["c"])
    regex = _at("apply_update_", "masters.c", _UPDATABLE) + ", got a negative view"
    _refused(ValueError, regex, mpfunc.apply_update_, masters, grads, state, opt, params=params)
    params, masters, grads, state, opt = _setup()
    state.exp_avg["c"] = torch._neg_view(state.exp_avg["c"])
    regex = _at("apply_update_", "state.exp_avg.c", "a tensor that can be updated")
    _refused(ValueError, regex, mpfunc.apply_update_, masters, grads, state, opt, params=params)
    out = mpfunc.init_grads(_params())
    out["c"] = torch._neg_view(out["c"])
    regex = _at("grads_to_fp32_", "out.c", _UPDATABLE)
    _refused(ValueError, regex, mpfunc.grads_to_fp32_, _grads(), out)
    z = torch.complex(torch.randn(40), torch.randn(40)).conj()
    assert z.is_conj()
    params, masters, grads, state, opt = _setup()
    regex = _at("apply_update_", "grads.c", "a floating-point grad")
    _refused(TypeError, regex, mpfunc.apply_update_, masters, {**grads, "c": z}, state, opt)

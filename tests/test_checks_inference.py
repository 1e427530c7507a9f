"""Inference tensors: refused where they would be written, before any write, also in a
second group and after a step remembered in inference mode; read where only read."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from support.entry_checks import (
    _at,
    _grads,
    _params,
    _refused,
    _setup,
)

import mpfunc
from tests.support.helpers import assert_trees_bits_equal
from tests.support.native import native_module


@pytest.fixture(scope="module")
def native() -> Any:
    return native_module()


def _inference(t: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return t.clone()


_NOT_IN_PLACE = (
    "a tensor that can be updated in place",
    "an inference tensor outside torch.inference_mode()",
)


@pytest.mark.parametrize("where", ["masters.c", "params.c", "state.step.c", "state.exp_avg_sq.c"])
def test_an_inference_tensor_in_the_second_group_is_refused_before_any_write(
    where: str, native: Any
) -> None:
    """Issue 20, item 3: with an inference tensor to write in the step's second native
    group (the fp16 grad), ``apply_update_`` updated the first group and its step counts,
    then raised. Now the step is refused before any write."""
    params, masters, grads, state, opt = _setup()
    if where.startswith("state."):
        field = getattr(state, where.split(".")[1])
        field["c"] = _inference(field["c"])
    else:
        tree = {"masters": masters, "params": params}[where.split(".")[0]]
        tree["c"] = _inference(tree["c"])
    regex = _at("apply_update_", where, _NOT_IN_PLACE[0]) + ", got " + re.escape(_NOT_IN_PLACE[1])
    _refused(ValueError, regex, mpfunc.apply_update_, masters, grads, state, opt, params=params)
    with torch.inference_mode():  # where inference tensors may be written, the step runs
        mpfunc.apply_update_(masters, grads, state, opt, params=params)
    assert all(int(s) == 1 for s in state.step.values())


def test_a_step_remembered_in_inference_mode_is_checked_again_outside(native: Any) -> None:
    """The memo of passed checks is keyed on inference mode too: a step that passed inside
    ``torch.inference_mode()`` is checked in full outside it, and refused there, instead of
    failing in its second group with the first written."""
    params, masters, grads, state, opt = _setup()
    masters["c"] = _inference(masters["c"])
    with torch.inference_mode():
        mpfunc.apply_update_(masters, grads, state, opt, params=params)
    regex = _at("apply_update_", "masters.c", _NOT_IN_PLACE[0])
    _refused(ValueError, regex, mpfunc.apply_update_, masters, grads, state, opt, params=params)


def test_the_pure_step_reads_inference_masters() -> None:
    """``apply_update`` writes copies, never its inputs: inference masters are fine."""
    params = _params()
    opt = mpfunc.adamw(lr=1e-2)
    masters = mpfunc.init_master(params)
    frozen = {k: _inference(m) for k, m in masters.items()}
    got = mpfunc.apply_update(frozen, _grads(), opt.init(frozen), opt)
    want = mpfunc.apply_update(masters, _grads(), opt.init(masters), opt)
    assert_trees_bits_equal(got, want)


def test_in_place_twins_refuse_inference_outputs() -> None:
    params = _params()
    out = mpfunc.init_grads(params)
    out["c"] = _inference(out["c"])
    regex = _at("grads_to_fp32_", "out.c", _NOT_IN_PLACE[0])
    _refused(ValueError, regex, mpfunc.grads_to_fp32_, _grads(), out)


@pytest.mark.parametrize("state_dtype", [None, torch.bfloat16, torch.uint8], ids=str)
@pytest.mark.parametrize("strategy", ["fp32", "kahan", "stochastic"])
def test_inference_grads_are_read_on_every_path(strategy: str, state_dtype: Any) -> None:
    """A grad is only read: one made in inference mode (an evaluation pass reused, a grad
    from a hook run under ``torch.inference_mode()``) steps as any other. The composed
    native pass once refused it from C++, after the group before it had stepped (the
    partial write of a refused step; found in review)."""
    runs = []
    for inference in (False, True):
        gen = torch.Generator().manual_seed(4)
        params = {
            "a": torch.randn(4, 40, generator=gen).to(torch.float16),
            "b": torch.randn(4, 40, generator=gen).to(torch.bfloat16),
        }
        if strategy == "stochastic":
            params["a"] = params["a"].bfloat16()
        masters = mpfunc.init_master(params, strategy=strategy)
        opt = mpfunc.adamw(lr=1e-2, state_dtype=state_dtype)
        state = opt.init(masters)
        for _ in range(2):
            grads = {k: torch.randn(4, 40, generator=gen).to(v.dtype) for k, v in params.items()}
            if inference:
                grads = {k: _inference(g) for k, g in grads.items()}
                assert all(g.is_inference() for g in grads.values())
            kw = {"params": params} if strategy == "fp32" else {}
            mpfunc.apply_update_(masters, grads, state, opt, **kw)
        runs.append((params, masters, state))
    assert_trees_bits_equal(runs[0], runs[1])

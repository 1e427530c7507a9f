"""Freed storage (``untyped_storage().resize_(0)``) in any tree is refused before the
first write, also after a remembered (memoized) step; checks name the leaf with
units."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from support.entry_checks import (
    BF16,
    F16,
    _at,
    _grads,
    _params,
    _refused,
    _setup,
)
from support.helpers import assert_unchanged, snapshot

import mpfunc
from mpfunc.core import _checks


def _free(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its storage freed, as FSDP frees unsharded params between uses."""
    t.untyped_storage().resize_(0)
    return t


_FREED = "a tensor whose storage holds its elements (80 bytes)"  # "c": 40 fp16 elements


@pytest.mark.parametrize(
    "where",
    ["grads.c", "masters.c", "params.c", "state.exp_avg.c", "state.step.c"],
)
def test_apply_update_refuses_a_freed_storage_before_any_write(where: str) -> None:
    """Issue 20, item 6: a tensor whose storage was freed (FSDP's
    ``untyped_storage().resize_(0)``) made ``apply_update_`` die with SIGSEGV. Now it is
    refused at the door, naming its path, and nothing is written."""
    params, masters, grads, state, opt = _setup()
    tree = {"grads": grads, "masters": masters, "params": params}
    if where.startswith("state."):
        field = where.split(".")[1]
        _free(getattr(state, field)["c"])
    else:
        _free(tree[where.split(".")[0]]["c"])
    if "step" in where:
        expected = "a tensor whose storage holds its elements (4 bytes)"
    else:
        expected = _FREED if where in ("grads.c", "params.c") else _FREED.replace("80", "160")
    got = r", got .* whose storage holds 0 bytes\. Its storage was freed \(untyped_storage"
    regex = _at("apply_update_", where, expected) + got
    _refused(ValueError, regex, mpfunc.apply_update_, masters, grads, state, opt, params=params)


@pytest.mark.parametrize("where", ["grads", "masters", "params", "state"])
def test_a_remembered_step_still_refuses_a_freed_storage(where: str) -> None:
    """A step that passed its checks is remembered by its trees' metadata and addresses;
    freeing a storage afterwards moves its address (to 0), so the next call checks in
    full and refuses it instead of running the kernels on freed memory."""
    params, masters, grads, state, opt = _setup()
    for _ in range(2):  # the second call is recalled from the memo
        mpfunc.apply_update_(masters, grads, state, opt, params=params)
    tree = {"grads": grads, "masters": masters, "params": params, "state": state.exp_avg}
    _free(tree[where]["c"])
    path = f"{where}.c" if where != "state" else "state.exp_avg.c"
    regex = _at("apply_update_", path, "a tensor whose storage holds its elements")
    _refused(ValueError, regex, mpfunc.apply_update_, masters, grads, state, opt, params=params)


def test_a_unit_buffer_and_stats_with_a_freed_storage_are_refused() -> None:
    params = _params()
    masters = mpfunc.init_master(params, strategy="kahan")
    opt = mpfunc.adamw(lr=1e-2)
    state = opt.init(masters)
    _free(masters["c"].compensation)
    regex = _at("apply_update_", "masters.c", "a tensor whose storage holds")
    _refused(ValueError, regex, mpfunc.apply_update_, masters, _grads(), state, opt)
    params, masters, grads, state, opt = _setup()
    stats = mpfunc.init_stats(masters)
    _free(stats["c"].ratio)
    regex = _at("apply_update_", "stats.c", "a tensor whose storage holds")
    step = (masters, grads, state, opt)
    _refused(ValueError, regex, mpfunc.apply_update_, *step, params=params, stats=stats)


def test_a_freed_view_offset_into_its_storage_is_refused() -> None:
    """A view that starts inside a storage too small for it (shrunk, not emptied)."""
    params, masters, grads, state, opt = _setup()
    flat = torch.zeros(200, dtype=F16)
    grads["c"] = flat[100:140]
    flat.untyped_storage().resize_(240)  # 120 elements: the view's last 20 are gone
    expected = "a tensor whose storage holds its elements (280 bytes)"
    regex = _at("apply_update_", "grads.c", expected) + r".* whose storage holds 240 bytes"
    # (Not _refused: its snapshot would read the view's last 20 elements, freed memory
    # whose bytes change under the test; everything the step could write is compared.)
    written = (masters, state, params)
    held = snapshot(written)
    with pytest.raises(ValueError, match=regex):
        mpfunc.apply_update_(masters, grads, state, opt, params=params)
    assert_unchanged(written, held)


def test_the_transforms_refuse_a_freed_storage(tmp_path: Any) -> None:
    """Every entry that reads or writes tensors checks their storage first: the casts, the
    finite check, clipping, accumulation, checkpoints (save, and the in-place loads)."""
    params, masters, grads, _, _ = _setup()
    _free(grads["c"])
    for fn, call in [
        ("grads_to_fp32", lambda: mpfunc.grads_to_fp32(grads)),
        ("grads_to_fp32_", lambda: mpfunc.grads_to_fp32_(grads, mpfunc.init_grads(params))),
        ("accumulate_grads_", lambda: mpfunc.accumulate_grads_(mpfunc.init_grads(params), grads)),
        ("clip_by_global_norm", lambda: mpfunc.clip_by_global_norm(grads, 1.0)),
    ]:
        _refused(ValueError, _at(fn, "grads.c", _FREED), call)
    _refused(ValueError, _at("all_finite", "tree.c", _FREED), mpfunc.all_finite, grads)
    freed = {**params, "c": _free(params["c"].clone())}
    regex = _at("masters_to_model_", "params.c", _FREED)
    _refused(ValueError, regex, mpfunc.masters_to_model_, masters, freed)
    _refused(ValueError, _at("save", "c", _FREED), mpfunc.save, tmp_path / "c.pt", grads)
    assert list(tmp_path.iterdir()) == []
    good = _grads()
    mpfunc.save(tmp_path / "g.pt", good)
    regex = r"^load_: .*'c': expected " + re.escape(_FREED)
    _refused(ValueError, regex, mpfunc.load_, tmp_path / "g.pt", grads)
    regex = _at("load_state_dict", "c", _FREED)
    _refused(ValueError, regex, mpfunc.load_state_dict, good, mpfunc.state_dict(grads))


def test_checks_name_the_leaf_with_units() -> None:
    """``check_storage`` names a unit by its path (its tensors are checked one by one)."""
    params = {k: p for k, p in _params().items() if p.dtype == BF16}
    masters = mpfunc.init_master(params, strategy="remainder")
    _free(masters["b"].remainder)
    side = _checks.Side("masters", masters, [masters[k] for k in sorted(masters)], units=True)
    with pytest.raises(ValueError, match=_at("f", "masters.b", "a tensor whose storage")):
        _checks.check_storage("f", side)

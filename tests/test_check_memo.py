"""The memo of passed checks (``_checks.recall``): reused only on identical inputs.

A training loop passes the same trees every step, so a call site (``grads_to_fp32_`` so
far) remembers that its checks passed, keyed on every value the checks read (structure,
and each leaf's dtype, shape, device, strides, storage offset and address), never on
object ids. The whole loop is exercised, so the calls without a memo guard the same.
Each test first makes a call pass and be remembered, then changes one thing the checks
care about, keeping the same Python objects where it can (a ``.data`` swap keeps the
tensor's id), and expects the checks to run again and raise, with nothing written. On
XLA nothing is remembered: the key would cost as much as the checks.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import pytest
import torch
from support.helpers import assert_unchanged, snapshot

import mpfunc
from mpfunc import _checks


def _setup(device: torch.device) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    shapes = {"a": (4, 3), "b": (3,), "c": (2, 2)}
    params = {k: torch.randn(s, generator=gen).bfloat16().to(device) for k, s in shapes.items()}
    masters = mpfunc.init_master(params)
    out = mpfunc.init_grads(params)
    grads = {k: torch.randn(s, generator=gen).bfloat16().to(device) for k, s in shapes.items()}
    opt = mpfunc.adamw(lr=1e-2)
    return {
        "params": params, "masters": masters, "out": out, "grads": grads, "opt": opt,
        "state": opt.init(masters),
    }  # fmt: skip


CALLS = ("grads_to_fp32_", "apply_update_", "masters_to_model_")


def _call(t: dict[str, Any], name: str) -> None:
    if name == "grads_to_fp32_":
        t["g32"] = mpfunc.grads_to_fp32_(t["grads"], t["out"])
    elif name == "apply_update_":
        mpfunc.apply_update_(t["masters"], t["g32"], t["state"], t["opt"])
    else:
        mpfunc.masters_to_model_(t["masters"], t["params"])


def _step(t: dict[str, Any]) -> None:
    for name in CALLS:
        _call(t, name)


def _count_checks(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []
    for name in ("check_pairs", "check_no_alias", "check_writable"):
        real = getattr(_checks, name)

        def spy(*args: Any, _real: Callable[..., Any] = real, _n: str = name, **kw: Any) -> Any:
            calls.append(_n)
            return _real(*args, **kw)

        monkeypatch.setattr(_checks, name, spy)
    return calls


def test_a_repeated_call_is_checked_once(monkeypatch: pytest.MonkeyPatch) -> None:
    _checks.clear_memo()
    t = _setup(torch.device("cpu"))
    calls = _count_checks(monkeypatch)
    _call(t, "grads_to_fp32_")
    assert {"check_pairs", "check_no_alias", "check_writable"} <= set(calls)
    calls.clear()
    for _ in range(3):
        _call(t, "grads_to_fp32_")
    assert calls == []


def _swap_dtype(t: dict[str, Any]) -> None:
    t["out"]["b"].data = t["out"]["b"].data.double()  # same object, same id


def _out_dtype(t: dict[str, Any]) -> None:
    t["out"]["b"].data = t["out"]["b"].data.half()


def _out_shape(t: dict[str, Any]) -> None:
    t["out"]["c"].data = torch.zeros(4)


def _out_layout(t: dict[str, Any]) -> None:
    t["out"]["a"].data = torch.zeros(1, 3).expand(4, 3)


def _swap_shape(t: dict[str, Any]) -> None:
    t["state"].exp_avg["c"].data = torch.zeros(4)


def _swap_layout(t: dict[str, Any]) -> None:
    # Same shape and dtype; now an expanded (stride-0) tensor, which a write would corrupt.
    t["masters"]["a"].data = torch.zeros(1, 3).expand(4, 3)


def _new_alias(t: dict[str, Any]) -> None:
    t["params"]["c"] = t["params"]["a"][:2, :2]  # a view of another leaf: one tensor twice


def _alias_by_data(t: dict[str, Any]) -> None:
    # The state's tensor object is kept; its memory becomes the master's.
    t["state"].exp_avg_sq["b"].data = t["masters"]["b"].data


def _reused_id(t: dict[str, Any]) -> None:
    # Drop a grad and put, in its place, a view of an out buffer that CPython hands the
    # freed object's id (it usually does at once; the alias must be caught either way).
    old = id(t["grads"]["c"])
    del t["grads"]["c"]
    gc.collect()
    views = [t["out"]["a"][:2, :2] for _ in range(256)]
    t["grads"]["c"] = next((v for v in views if id(v) == old), views[-1])


# (name, change, the call that must raise, error, message)
CHANGES: list[tuple[str, Callable[[dict[str, Any]], None], str, type[Exception], str]] = [
    ("dtype", _swap_dtype, "apply_update_", TypeError, r"at 'grads\.b': expected a grad no wider"),
    ("shape", _swap_shape, "apply_update_", ValueError,
     r"at 'state\.exp_avg\.c': expected shape \(2, 2\)"),
    ("layout", _swap_layout, "apply_update_", ValueError,
     r"at 'masters\.a': expected a tensor whose elements"),
    ("new-alias", _new_alias, "masters_to_model_", ValueError,
     r"at 'params\.a': expected a tensor that shares no memory with 'params\.c'"),
    ("alias-by-data", _alias_by_data, "apply_update_", ValueError, r"that shares no memory"),
    ("out-dtype", _out_dtype, "grads_to_fp32_", TypeError,
     r"at 'out\.b': expected a float32 or float64 tensor"),
    ("out-shape", _out_shape, "grads_to_fp32_", ValueError, r"at 'out\.c': expected shape"),
    ("out-layout", _out_layout, "grads_to_fp32_", ValueError,
     r"at 'out\.a': expected a tensor whose elements"),
    ("reused-id", _reused_id, "grads_to_fp32_", ValueError, r"that shares no memory"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("change", "call", "exc", "regex"), [c[1:] for c in CHANGES], ids=[c[0] for c in CHANGES]
)
def test_a_changed_leaf_is_checked_again(
    change: Callable[[dict[str, Any]], None], call: str, exc: type[Exception], regex: str
) -> None:
    _checks.clear_memo()
    t = _setup(torch.device("cpu"))
    _step(t)
    _step(t)  # remembered, and reused
    change(t)
    for name in CALLS[: CALLS.index(call)]:
        _call(t, name)
    snap = snapshot(t)
    with pytest.raises(exc, match=regex):
        _call(t, call)
    assert_unchanged(t, snap)


def test_a_changed_structure_is_checked_again() -> None:
    _checks.clear_memo()
    t = _setup(torch.device("cpu"))
    _step(t)
    t["grads"] = {"a": t["grads"]["a"], "b": t["grads"]["b"], "d": t["grads"]["c"]}
    with pytest.raises(ValueError, match="same tree structure"):
        _step(t)


def test_a_subclass_is_always_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only plain tensors and Parameters are remembered: a subclass may answer the
    attributes the key reads differently."""

    class Tagged(torch.Tensor):
        pass

    _checks.clear_memo()
    masters = {"w": torch.zeros(3).as_subclass(Tagged)}
    grads = {"w": torch.ones(3)}
    opt = mpfunc.sgd(lr=0.1)
    state = opt.init(masters)
    calls = _count_checks(monkeypatch)
    for _ in range(2):
        mpfunc.apply_update_(masters, grads, state, opt)
    assert calls.count("check_pairs") >= 2 * 2  # masters vs grads, state vs masters: twice


@pytest.mark.xla
def test_xla_trees_are_always_checked(xla_device: torch.device) -> None:
    import torch_xla

    _checks.clear_memo()
    t = _setup(xla_device)
    _step(t)
    _step(t)
    torch_xla.sync()
    assert len(_checks._memo) == 0
    t["state"].exp_avg["c"] = t["masters"]["c"]  # the master's own tensor: one tensor twice
    with pytest.raises(ValueError, match=r"that shares no memory"):
        _step(t)

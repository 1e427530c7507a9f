"""The memo of passed checks (``_checks.recall``): reused only on identical inputs.

A training loop passes the same trees every step, so a call site (``grads_to_fp32_``,
``apply_update_`` with its plan's per-leaf decisions) remembers that its checks passed,
keyed on every value the checks read (structure, and each leaf's dtype, shape, device,
strides, storage offset and address), never on object ids. The whole loop is exercised,
so the calls without a memo guard the same.
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
from support.helpers import assert_trees_bits_equal, assert_unchanged, snapshot

import mpfunc
from mpfunc.core import _cache, _checks


@pytest.fixture(autouse=True, params=["native", "python"])
def key_kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test with the packed C++ key (``_native.meta_key``) and with the Python one."""
    from mpfunc.backends import _native

    if request.param == "python":
        monkeypatch.setattr(_native, "key_function", lambda: None)
    elif not _native.available():
        pytest.skip("the native module does not build here")
    return str(request.param)


def test_leaf_keys_tell_apart_what_the_checks_read(key_kind: str) -> None:
    base = torch.zeros(4, 3)
    same = [base, None, base[1:]]
    key = _cache.leaf_keys(same)
    assert key is not None and key == _cache.leaf_keys([base, None, base[1:]])
    others = [
        [base, None, base[2:]],  # another address
        [base.t(), None, base[1:]],  # another layout, same address
        [base.view(3, 4), None, base[1:]],  # another shape
        [base.view(torch.int32), None, base[1:]],  # another dtype
        [torch.nn.Parameter(base), None, base[1:]],  # a Parameter
        [base, base, base[1:]],  # a None filled
        [base, None],  # one leaf fewer
    ]
    assert len({key, *(_cache.leaf_keys(o) for o in others)}) == len(others) + 1

    class Tagged(torch.Tensor):
        pass

    assert _cache.leaf_keys([base.as_subclass(Tagged)]) in (
        None,
        _cache.leaf_keys([base.as_subclass(Tagged)]),
    )
    assert _cache.leaf_keys([torch.zeros(3).to_sparse()]) is None
    assert _cache.leaf_keys([1.0]) is None


def _setup(device: torch.device) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    shapes = {"a": (4, 3), "b": (3,), "c": (2, 2)}
    params = {k: torch.randn(s, generator=gen).bfloat16().to(device) for k, s in shapes.items()}
    masters = mpfunc.init_master(params)
    out = mpfunc.init_grads(params)
    grads = {k: torch.randn(s, generator=gen).bfloat16().to(device) for k, s in shapes.items()}
    opt = mpfunc.adamw(lr=1e-2)
    return {
        "params": params,
        "masters": masters,
        "out": out,
        "grads": grads,
        "opt": opt,
        "state": opt.init(masters),
    }


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
    # (check_memory: apply_update_'s one memory check, whose common case decides aliasing
    # without calling check_no_alias.)
    calls: list[str] = []
    for name in ("check_pairs", "check_no_alias", "check_writable", "check_memory"):
        real = getattr(_checks, name)

        def spy(*args: Any, _real: Callable[..., Any] = real, _n: str = name, **kw: Any) -> Any:
            calls.append(_n)
            return _real(*args, **kw)

        monkeypatch.setattr(_checks, name, spy)
    return calls


def test_a_repeated_call_is_checked_once(monkeypatch: pytest.MonkeyPatch) -> None:
    _cache.clear_memo()
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
    (
        "shape",
        _swap_shape,
        "apply_update_",
        ValueError,
        r"at 'state\.exp_avg\.c': expected shape \(2, 2\)",
    ),
    (
        "layout",
        _swap_layout,
        "apply_update_",
        ValueError,
        r"at 'masters\.a': expected a tensor whose elements",
    ),
    (
        "new-alias",
        _new_alias,
        "masters_to_model_",
        ValueError,
        r"at 'params\.a': expected a tensor that shares no memory with 'params\.c'",
    ),
    ("alias-by-data", _alias_by_data, "apply_update_", ValueError, r"that shares no memory"),
    (
        "out-dtype",
        _out_dtype,
        "grads_to_fp32_",
        TypeError,
        r"at 'out\.b': expected a float32 or float64 tensor",
    ),
    ("out-shape", _out_shape, "grads_to_fp32_", ValueError, r"at 'out\.c': expected shape"),
    (
        "out-layout",
        _out_layout,
        "grads_to_fp32_",
        ValueError,
        r"at 'out\.a': expected a tensor whose elements",
    ),
    ("reused-id", _reused_id, "grads_to_fp32_", ValueError, r"that shares no memory"),
]


@pytest.mark.parametrize(
    ("change", "call", "exc", "regex"), [c[1:] for c in CHANGES], ids=[c[0] for c in CHANGES]
)
def test_a_changed_leaf_is_checked_again(
    change: Callable[[dict[str, Any]], None], call: str, exc: type[Exception], regex: str
) -> None:
    _cache.clear_memo()
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
    _cache.clear_memo()
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

    _cache.clear_memo()
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

    _cache.clear_memo()
    t = _setup(xla_device)
    _step(t)
    _step(t)
    torch_xla.sync()
    assert len(_cache._memo) == 0 and len(_cache._entries) == 0
    t["state"].exp_avg["c"] = t["masters"]["c"]  # the master's own tensor: one tensor twice
    with pytest.raises(ValueError, match=r"that shares no memory"):
        _step(t)


# --- apply_update_ in one pass: bf16 grads in, bf16 params out, the plan remembered --------


def _one_pass(**init: Any) -> dict[str, Any]:
    t = _setup(torch.device("cpu"))
    t["masters"] = mpfunc.init_master(t["params"], **init)
    t["state"] = t["opt"].init(t["masters"])
    return t


def _update(t: dict[str, Any], **kw: Any) -> None:
    mpfunc.apply_update_(t["masters"], t["grads"], t["state"], t["opt"], params=t["params"], **kw)


def _spy_plan(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    from mpfunc.backends import _plan

    calls = _count_checks(monkeypatch)
    real = _plan._decide

    def spy(*args: Any, **kw: Any) -> Any:
        calls.append("decide")
        return real(*args, **kw)

    monkeypatch.setattr(_plan, "_decide", spy)
    return calls


@pytest.mark.parametrize("strategy", ["fp32", "remainder"])
@pytest.mark.parametrize("extra", ["none", "scale", "skip"])
def test_a_repeated_step_is_checked_and_planned_once(
    monkeypatch: pytest.MonkeyPatch, strategy: str, extra: str
) -> None:
    """The second and later steps skip every check and the per-leaf planning, and write the
    same bits as steps checked and planned in full."""
    kw: dict[str, Any] = {
        "none": {},
        "scale": {"scale": torch.tensor(4.0)},
        "skip": {"skip": torch.tensor(False)},
    }[extra]
    _cache.clear_memo()
    t, ref = _one_pass(strategy=strategy), _one_pass(strategy=strategy)
    calls = _spy_plan(monkeypatch)
    _update(t, **kw)
    assert {"check_pairs", "check_memory", "check_writable", "decide"} <= set(calls)
    calls.clear()
    for _ in range(3):
        _update(t, **kw)
    assert calls == []
    with _cache.memo_off():
        for _ in range(4):
            _update(ref, **kw)
    assert calls.count("decide") == 4
    for name in ("masters", "state", "params"):
        assert_trees_bits_equal(t[name], ref[name])


def _param_shape(t: dict[str, Any]) -> None:
    t["params"]["c"].data = torch.zeros(4, dtype=torch.bfloat16)


def _param_aliases_grad(t: dict[str, Any]) -> None:
    t["params"]["b"].data = t["grads"]["b"].data  # same object, its memory now the grad's


def _step_dtype(t: dict[str, Any]) -> None:
    t["state"].step["a"].data = t["state"].step["a"].data.double()


def _moment_aliases_param(t: dict[str, Any]) -> None:
    t["state"].exp_avg["a"].data = t["masters"]["c"].data.new_zeros(4, 3)
    t["params"]["a"].data = t["state"].exp_avg["a"].data.bfloat16()  # a fresh copy: no alias
    t["state"].exp_avg_sq["c"].data = t["state"].exp_avg["a"].data[:2, :2]


def _grad_expanded(t: dict[str, Any]) -> None:
    t["masters"]["a"].data = t["masters"]["a"].data.t().contiguous().t()  # now transposed
    t["grads"]["b"].data = torch.zeros(1).expand(3)


def _new_param_tree(t: dict[str, Any]) -> None:
    t["params"] = {**t["params"], "a": t["masters"]["a"]}  # the master itself, as its param


ONE_PASS_CHANGES = [
    ("param-shape", _param_shape, ValueError, r"at 'params\.c': expected shape \(2, 2\)"),
    ("param-aliases-grad", _param_aliases_grad, ValueError, r"that shares no memory"),
    ("step-dtype", _step_dtype, TypeError, r"at 'state\.step\.a'"),
    ("moment-aliases-moment", _moment_aliases_param, ValueError, r"that shares no memory"),
    ("new-param-tree", _new_param_tree, ValueError, r"that shares no memory"),
]


@pytest.mark.parametrize(
    ("change", "exc", "regex"),
    [c[1:] for c in ONE_PASS_CHANGES],
    ids=[c[0] for c in ONE_PASS_CHANGES],
)
def test_a_changed_one_pass_input_is_checked_again(
    change: Callable[[dict[str, Any]], None], exc: type[Exception], regex: str
) -> None:
    _cache.clear_memo()
    t = _one_pass()
    _update(t)
    _update(t)  # remembered, and reused
    change(t)
    snap = snapshot(t)
    with pytest.raises(exc, match=regex):
        _update(t)
    assert_unchanged(t, snap)


def test_a_changed_layout_is_planned_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """Same shapes, dtypes and addresses but a master transposed in place of its layout:
    the plan's decision (native kernel or not) is made again, and the bits match."""
    _cache.clear_memo()
    t, ref = _one_pass(), _one_pass()
    _update(t)
    with _cache.memo_off():
        _update(ref)
    calls = _spy_plan(monkeypatch)
    for d in (t, ref):
        m = d["masters"]["a"]
        m.data = m.data.as_strided((4, 3), (1, 4))  # the same memory, column-major
    _update(t)
    assert "decide" in calls
    _update(t)
    with _cache.memo_off():
        _update(ref)
        _update(ref)
    for name in ("masters", "state", "params"):
        assert_trees_bits_equal(t[name], ref[name])


def test_another_optimizer_is_planned_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plan's memo is keyed on the rule and its hyperparameters and impl: the same trees
    with impl='foreach' (or other betas) are not handed the native kernel's plan."""
    from mpfunc.optim import _adam

    _cache.clear_memo()
    t = _one_pass()
    _update(t)
    calls = _spy_plan(monkeypatch)
    used: list[int] = []
    real = _adam._native_kernel
    monkeypatch.setattr(_adam, "_native_kernel", lambda g, h: (used.append(1), real(g, h)))
    for opt in (mpfunc.adamw(lr=1e-2, impl="foreach"), mpfunc.adamw(lr=1e-2, betas=(0.8, 0.9))):
        calls.clear()
        t["opt"] = opt
        _update(t)
        # Planned again (not recalled): the state's checks ran and the leaves were decided,
        # once. (The step's memory check follows the plan; which of its checks show
        # depends on check_memory's one-pass common case, taken where no DTensor type is
        # loaded in the process.)
        assert calls.count("decide") == 1, calls
        assert "check_pairs" in calls[: calls.index("decide")], calls
    assert len(used) <= 1  # foreach never took the native kernel


def test_the_memo_keeps_no_tensor_alive() -> None:
    import weakref

    _cache.clear_memo()
    t = _one_pass()
    _update(t)
    _update(t)
    refs = [weakref.ref(x) for tree in ("grads", "params", "masters") for x in t[tree].values()]
    refs += [weakref.ref(x) for x in t["state"].exp_avg.values()]
    del t
    gc.collect()
    assert all(r() is None for r in refs)


@pytest.mark.parametrize("strategy", ["fp32", "kahan"])
def test_masters_to_model_is_checked_once(monkeypatch: pytest.MonkeyPatch, strategy: str) -> None:
    _cache.clear_memo()
    t = _one_pass(strategy=strategy)
    _update(t)
    calls = _count_checks(monkeypatch)
    mpfunc.masters_to_model_(t["masters"], t["params"])
    assert "check_pairs" in calls
    calls.clear()
    for _ in range(2):
        mpfunc.masters_to_model_(t["masters"], t["params"])
    assert calls == []
    for q, x in zip(t["params"].values(), t["masters"].values()):
        assert torch.equal(q, _strategy_face(x).to(q.dtype))
    if strategy == "kahan":
        return  # a unit writes its own param: masters_to_model_ writes none of them
    t["params"]["b"].data = torch.zeros(1, dtype=torch.bfloat16).expand(3)  # stride 0, same id
    snap = snapshot(t)
    with pytest.raises(ValueError, match=r"at 'params\.b': expected a tensor whose elements"):
        mpfunc.masters_to_model_(t["masters"], t["params"])
    assert_unchanged(t, snap)


def _strategy_face(x: Any) -> torch.Tensor:
    from mpfunc.strategies import _strategy

    return _strategy.face(x)  # type: ignore[no-any-return]


def _partitioned() -> dict[str, Any]:
    t = _one_pass()
    t["opt"] = mpfunc.partition(
        {"decay": mpfunc.adamw(lr=1e-2, weight_decay=0.1), "flat": mpfunc.adam(lr=1e-2)},
        lambda path, m: "decay" if m.ndim == 2 else "flat",
    )
    t["state"] = t["opt"].init(t["masters"])
    return t


def test_a_repeated_partition_step_is_checked_once(monkeypatch: pytest.MonkeyPatch) -> None:
    _cache.clear_memo()
    t, ref = _partitioned(), _partitioned()
    calls = _spy_plan(monkeypatch)
    _update(t)
    assert calls.count("decide") == 2
    calls.clear()
    _update(t)
    _update(t)
    assert calls == []
    with _cache.memo_off():
        for _ in range(3):
            _update(ref)
    for name in ("masters", "params"):
        assert_trees_bits_equal(t[name], ref[name])
    for label in ("decay", "flat"):
        assert_trees_bits_equal(t["state"][label], ref["state"][label])
    # Across labels: a "flat" moment made to share the "decay" master's memory.
    t["state"]["flat"].exp_avg["b"].data = t["masters"]["a"].data[0]
    snap = snapshot(t)
    with pytest.raises(ValueError, match=r"that shares no memory"):
        _update(t)
    assert_unchanged(t, snap)

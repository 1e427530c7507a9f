"""Checks at the door (issue 20, items 3, 5, 6, 11): tensors that look like any other but
cannot be read or written as they are (a freed storage, an inference tensor, a negative
view), and a step that would train nothing. Each is refused, or resolved, before the
first write: no tensor's bits or ``_version`` change on refusal, and a remembered check
(``_checks``' memo) never lets one through. Also (item 8) a cached native library that
does not import: built again.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils import cpp_extension

import mpfunc
from mpfunc.backends import _native
from mpfunc.core import _checks
from tests.support.helpers import assert_bits_equal, assert_trees_bits_equal
from tests.support.native import native_module

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32


@pytest.fixture(scope="module")
def native() -> Any:
    return native_module()


def _params() -> dict[str, torch.Tensor]:
    """Two bf16 params and one fp16 param: with bf16 and fp16 grads, three leaves in two
    native groups (one per grad dtype), the fp16 one last."""
    gen = torch.Generator().manual_seed(0)
    return {
        "a": torch.randn(64, generator=gen).to(BF16),
        "b": torch.randn(8, 8, generator=gen).to(BF16),
        "c": torch.randn(40, generator=gen).to(F16),
    }


def _grads(seed: int = 1) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(p.shape, generator=gen).to(p.dtype) for k, p in _params().items()}


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def _holds(t: torch.Tensor) -> bool:
    return t.untyped_storage().nbytes() > 0 or t.numel() == 0


def _snapshot(obj: Any) -> list[tuple[torch.Tensor, torch.Tensor | None, int | None]]:
    """Each tensor with a copy of its values (none where its storage is freed) and its
    version (none for an inference tensor, which keeps no version counter)."""
    return [
        (t, t.detach().clone() if _holds(t) else None, None if t.is_inference() else t._version)
        for t in _tensors(obj)
    ]


def _assert_unchanged(snap: list[tuple[torch.Tensor, torch.Tensor | None, int | None]]) -> None:
    for t, before, version in snap:
        if version is not None:
            assert t._version == version, f"a {tuple(t.shape)} input was written in place"
        if before is None:
            assert not _holds(t)
        else:
            assert_bits_equal(t.detach().clone(), before)


def _refused(
    exc: type[Exception], regex: str, fn: Callable[..., Any], *args: Any, **kwargs: Any
) -> None:
    """``fn(*args, **kwargs)`` raises ``exc`` matching ``regex`` and writes nothing.

    A failure is reported as a plain message, from this hidden frame: pytest prints the
    arguments of the frames it shows, and the repr of a freed tensor would crash it."""
    __tracebackhide__ = True
    before = _snapshot((args, kwargs))
    try:
        fn(*args, **kwargs)
    except exc as e:
        message = str(e)
    except Exception as e:
        raise AssertionError(f"expected {exc.__name__}, got {type(e).__name__}: {e}") from None
    else:
        raise AssertionError(f"expected {exc.__name__}, nothing was raised") from None
    try:
        _assert_unchanged(before)
    except AssertionError as e:
        raise AssertionError(f"{e} (then refused with: {message})") from None
    if not re.search(regex, message):
        raise AssertionError(f"{message!r}\ndoes not match\n{regex!r}") from None


def _at(fn: str, path: str, expected: str) -> str:
    """The regex of mpfunc's message about one leaf, up to ``expected`` (literal text)."""
    return "^" + re.escape(f"{fn}: at {path!r}: expected {expected}")


def _free(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its storage freed, as FSDP frees unsharded params between uses."""
    t.untyped_storage().resize_(0)
    return t


def _setup(**kwargs: Any) -> tuple[Any, Any, Any, Any, Any]:
    params = _params()
    opt = mpfunc.adamw(lr=1e-2, **kwargs)
    masters = mpfunc.init_master(params)
    return params, masters, _grads(), opt.init(masters), opt


# --- item 3: MasterOptimizer.load_state_dict ---------------------------------------------------


def _model_params(frozen: bool) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(5)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(BF16)) for s in (6, (3, 4), 5)]
    if frozen:
        params[0].requires_grad_(False)
    return params


def test_a_refused_load_gives_a_frozen_param_no_master_or_state() -> None:
    """Issue 20, item 3: ``MasterOptimizer.load_state_dict`` made the master and state of a
    frozen param that has state in the dict, then refused a later entry's shape: the
    frozen param kept a master and a state. Now everything is checked first."""
    trained = _model_params(frozen=False)
    opt = mpfunc.MasterOptimizer(trained, lr=1e-2)
    for p in trained:
        p.grad = torch.ones_like(p)
    opt.step()
    sd = opt.state_dict()
    sd["state"][2] = {**sd["state"][2], "exp_avg": torch.zeros(7)}  # the last entry: wrong

    params = _model_params(frozen=True)
    fresh = mpfunc.MasterOptimizer(params, lr=1e-2)
    before = _snapshot([params, list(fresh.state.values())])
    with pytest.raises(ValueError, match=r"state\[2\] .*\['exp_avg'\]\": expected torch\.float32"):
        fresh.load_state_dict(sd)
    _assert_unchanged(before)
    assert params[0] not in fresh.state
    assert sorted(fresh.state_dict()["state"]) == [1, 2]

    sd["state"][2]["exp_avg"] = opt.state[trained[2]]["exp_avg"]  # the same dict, now right
    fresh.load_state_dict(sd)
    assert sorted(fresh.state_dict()["state"]) == [0, 1, 2]
    for name, t in opt.state[trained[0]].items():
        assert_bits_equal(fresh.state[params[0]][name], t)


# --- item 6: freed storage -----------------------------------------------------------------

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
    expected = "a tensor whose storage holds its elements (4 bytes)" if "step" in where else (
        _FREED if where in ("grads.c", "params.c") else _FREED.replace("80", "160")
    )  # fmt: skip
    got = r", got .* whose storage holds 0 bytes\. Its storage was freed \(untyped_storage"
    _refused(
        ValueError, _at("apply_update_", where, expected) + got,
        mpfunc.apply_update_, masters, grads, state, opt, params=params,
    )  # fmt: skip


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
    _refused(
        ValueError, _at("apply_update_", path, "a tensor whose storage holds its elements"),
        mpfunc.apply_update_, masters, grads, state, opt, params=params,
    )  # fmt: skip


def test_a_unit_buffer_and_stats_with_a_freed_storage_are_refused() -> None:
    params = _params()
    masters = mpfunc.init_master(params, strategy="kahan")
    opt = mpfunc.adamw(lr=1e-2)
    state = opt.init(masters)
    _free(masters["c"].compensation)
    _refused(
        ValueError, _at("apply_update_", "masters.c", "a tensor whose storage holds"),
        mpfunc.apply_update_, masters, _grads(), state, opt,
    )  # fmt: skip
    params, masters, grads, state, opt = _setup()
    stats = mpfunc.init_stats(masters)
    _free(stats["c"].ratio)
    _refused(
        ValueError, _at("apply_update_", "stats.c", "a tensor whose storage holds"),
        mpfunc.apply_update_, masters, grads, state, opt, params=params, stats=stats,
    )  # fmt: skip


def test_a_freed_view_offset_into_its_storage_is_refused() -> None:
    """A view that starts inside a storage too small for it (shrunk, not emptied)."""
    params, masters, grads, state, opt = _setup()
    flat = torch.zeros(200, dtype=F16)
    grads["c"] = flat[100:140]
    flat.untyped_storage().resize_(240)  # 120 elements: the view's last 20 are gone
    _refused(
        ValueError, _at("apply_update_", "grads.c", "a tensor whose storage holds its elements "
                        "(280 bytes)") + r".* whose storage holds 240 bytes",
        mpfunc.apply_update_, masters, grads, state, opt, params=params,
    )  # fmt: skip


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
    _refused(
        ValueError, _at("masters_to_model_", "params.c", _FREED),
        mpfunc.masters_to_model_, masters, {**params, "c": _free(params["c"].clone())},
    )  # fmt: skip
    _refused(ValueError, _at("save", "c", _FREED), mpfunc.save, tmp_path / "c.pt", grads)
    assert list(tmp_path.iterdir()) == []
    good = _grads()
    mpfunc.save(tmp_path / "g.pt", good)
    _refused(
        ValueError, r"^load_: .*'c': expected " + re.escape(_FREED), mpfunc.load_,
        tmp_path / "g.pt", grads,
    )  # fmt: skip
    _refused(
        ValueError, _at("load_state_dict", "c", _FREED),
        mpfunc.load_state_dict, good, mpfunc.state_dict(grads),
    )  # fmt: skip


def test_checks_name_the_leaf_with_units() -> None:
    """``check_storage`` names a unit by its path (its tensors are checked one by one)."""
    params = {k: p for k, p in _params().items() if p.dtype == BF16}
    masters = mpfunc.init_master(params, strategy="remainder")
    _free(masters["b"].remainder)
    side = _checks.Side("masters", masters, [masters[k] for k in sorted(masters)], units=True)
    with pytest.raises(ValueError, match=_at("f", "masters.b", "a tensor whose storage")):
        _checks.check_storage("f", side)


# --- item 3: inference tensors, partial writes -----------------------------------------------


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
    _refused(
        ValueError,
        _at("apply_update_", where, _NOT_IN_PLACE[0]) + ", got " + re.escape(_NOT_IN_PLACE[1]),
        mpfunc.apply_update_, masters, grads, state, opt, params=params,
    )  # fmt: skip
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
    _refused(
        ValueError, _at("apply_update_", "masters.c", _NOT_IN_PLACE[0]),
        mpfunc.apply_update_, masters, grads, state, opt, params=params,
    )  # fmt: skip


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
    _refused(
        ValueError, _at("grads_to_fp32_", "out.c", _NOT_IN_PLACE[0]),
        mpfunc.grads_to_fp32_, _grads(), out,
    )  # fmt: skip


# --- item 5: negative and conjugate views ----------------------------------------------------


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
    _refused(
        ValueError, _at("apply_update_", "masters.c", "a tensor that can be updated in place")
        + ", got a negative view",
        mpfunc.apply_update_, masters, grads, state, opt, params=params,
    )  # fmt: skip
    params, masters, grads, state, opt = _setup()
    state.exp_avg["c"] = torch._neg_view(state.exp_avg["c"])
    _refused(
        ValueError, _at("apply_update_", "state.exp_avg.c", "a tensor that can be updated"),
        mpfunc.apply_update_, masters, grads, state, opt, params=params,
    )  # fmt: skip
    out = mpfunc.init_grads(_params())
    out["c"] = torch._neg_view(out["c"])
    _refused(
        ValueError, _at("grads_to_fp32_", "out.c", "a tensor that can be updated in place"),
        mpfunc.grads_to_fp32_, _grads(), out,
    )  # fmt: skip
    z = torch.complex(torch.randn(40), torch.randn(40)).conj()
    assert z.is_conj()
    params, masters, grads, state, opt = _setup()
    _refused(
        TypeError, _at("apply_update_", "grads.c", "a floating-point grad"),
        mpfunc.apply_update_, masters, {**grads, "c": z}, state, opt,
    )  # fmt: skip


# --- item 11: no grad at all -----------------------------------------------------------------

_NO_GRAD = (
    r"^{fn}: grads: expected a grad for at least one master, got None for every master "
    r"\(3\), so nothing would be trained and no step counted\. Was loss\.backward\(\) called "
    r"before the step .*model\.state_dict\(\).*dict\(model\.named_parameters\(\)\)"
)


@pytest.mark.parametrize("fn", ["apply_update_", "apply_update"])
def test_all_none_grads_are_an_error_naming_the_likely_causes(fn: str) -> None:
    """Issue 20, item 11: with every grad ``None`` (backward forgotten, or grads read from
    ``model.state_dict()``'s detached tensors) a step trained nothing and counted nothing,
    silently. Now it raises, naming both causes; nothing is written."""
    params, masters, _, state, opt = _setup()
    none = {k: None for k in masters}
    kwargs = {"params": params} if fn == "apply_update_" else {}
    _refused(
        ValueError, _NO_GRAD.format(fn=fn), getattr(mpfunc, fn), masters, none, state, opt,
        **kwargs,
    )  # fmt: skip


def test_grads_read_from_a_state_dict_are_an_error() -> None:
    """The README's loop with ``model.state_dict()`` as the params tree: its tensors are
    detached, so after backward every grad read from them is ``None``."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.ReLU(), torch.nn.Linear(2, 1))
    params = dict(model.state_dict())
    masters = mpfunc.init_master(params)
    opt = mpfunc.adamw(lr=1e-2)
    state = opt.init(masters)
    model(torch.randn(4, 3)).sum().backward()
    grads = {k: p.grad for k, p in params.items()}
    _refused(
        ValueError, _NO_GRAD.format(fn="apply_update_").replace(r"\(3\)", r"\(4\)"),
        mpfunc.apply_update_, masters, grads, state, opt, params=params,
    )  # fmt: skip


def test_some_none_grads_still_step_the_others() -> None:
    params, masters, grads, state, opt = _setup()
    grads["a"] = grads["b"] = None  # type: ignore[assignment]
    mpfunc.apply_update_(masters, grads, state, opt, params=params)
    assert {k: int(s) for k, s in state.step.items()} == {"a": 0, "b": 0, "c": 1}


def test_masters_without_any_floating_leaf_need_no_grad() -> None:
    """A tree with no master at all (int buffers only) has nothing to train: no error."""
    params = {"n": torch.tensor(3)}
    masters = mpfunc.init_master(params)
    opt = mpfunc.adamw()
    mpfunc.apply_update_(masters, {"n": None}, opt.init(masters), opt, params=params)


def test_master_optimizer_step_without_grads_does_nothing() -> None:
    """``MasterOptimizer`` is a torch.optim.Optimizer: a step where no param has a
    ``.grad`` does nothing, as torch.optim's does."""
    model = torch.nn.Linear(3, 2).to(BF16)
    opt = mpfunc.MasterOptimizer(model.parameters(), lr=1e-2)
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert opt.state_dict()["state"] == {} or all(
        int(s["step"]) == 0 for s in opt.state_dict()["state"].values()
    )


# --- item 8: a cached native library that does not import ----------------------------------


@pytest.fixture
def empty_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A process where the native module is not loaded yet, building into ``tmp_path``."""
    if _native._why_not() is not None:
        pytest.skip(f"the native kernel cannot be built here: {_native._why_not()}")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(_native, "_module", None)
    monkeypatch.setattr(_native, "_error", None)
    monkeypatch.setattr(_native, "_warned", False)
    monkeypatch.setattr(_native, "_info", {})
    return tmp_path


@pytest.mark.parametrize(
    ("damage", "said"),
    [
        ("stub", "is not a library"),
        ("cut short", "is cut short"),
        ("another module", "does not import"),
    ],
)
def test_a_cached_library_that_does_not_import_is_built_again(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    native: Any,
    empty_cache: Path,
    damage: str,
    said: str,
) -> None:
    """Issue 20, item 8: a cached library that failed to import was imported again by
    torch's build, which found it up to date: every process warned and ran torch's kernels
    until the folder was deleted by hand. Now the library and the object files it was
    linked from are removed and the build runs again. A library cut short is not even
    imported (mapping it kills the process with SIGBUS)."""
    real = Path(native.__file__).read_bytes()
    name = "mpfunc_native_0123456789abcdef"
    monkeypatch.setattr(_native, "_build_name", lambda cflags: name)
    folder = empty_cache / name
    folder.mkdir()
    library = {"stub": real[:16], "cut short": real[: len(real) // 2], "another module": real}
    (folder / f"{name}.so").write_bytes(library[damage])  # the last: no PyInit_<name>
    (folder / "adam_mixed.o").write_bytes(b"\x7fELF")
    (folder / "build.ninja").write_text("# kept\n")
    seen: list[list[str]] = []
    built = types.ModuleType(name)

    def build(**kwargs: Any) -> types.ModuleType:  # torch's cpp_extension.load
        assert kwargs["build_directory"] == str(folder)
        seen.append(sorted(p.name for p in folder.iterdir()))
        return built

    monkeypatch.setattr(cpp_extension, "load", build)
    with caplog.at_level("WARNING", logger="mpfunc"):
        assert _native.load() is built
    assert seen == [["build.ninja"]]  # no library, no object file, no lock left
    assert _native.build_info()["build_s"] is not None
    assert any(said in r.getMessage() and "building it again" in r.getMessage()
               for r in caplog.records)  # fmt: skip


@pytest.mark.slow
def test_a_truncated_library_in_the_cache_is_rebuilt_for_real(
    native: Any, empty_cache: Path
) -> None:
    """The same with torch's build: a copy of this machine's build folder whose library is
    cut in half is compiled again in a fresh process, which then runs the native step."""
    built = Path(native.__file__).parent
    folder = empty_cache / built.name
    shutil.copytree(built, folder, ignore=shutil.ignore_patterns("lock"))
    so = folder / Path(native.__file__).name
    so.write_bytes(so.read_bytes()[: so.stat().st_size // 2])
    script = (
        "import warnings; warnings.simplefilter('error')\n"
        "from mpfunc.backends import _native\n"
        "_native.load()\n"
        "print(_native.build_info()['build_s'] is not None, _native.key_function() is not None)"
    )
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(empty_cache)}
    run = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=900
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == ["True", "True"], run.stdout + run.stderr[-3000:]
    assert "is cut short" in run.stderr and "building it again" in run.stderr
    assert so.stat().st_size > 0 and not (folder / "lock").exists()

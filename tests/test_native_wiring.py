"""The native CPU kernels inside mpfunc: which leaves ``_plan`` gives them, equivalence
through the public API, the kernel contract (``Group.model``, ``Group.scale``), the casts
of ``grads_to_fp32_``/``masters_to_model_``, and the fallback when they cannot build.

Skipped only where no toolchain can build the kernel; a failed build fails them.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mpfunc
from mpfunc.backends import _native
from mpfunc.core._optimizer import Group
from mpfunc.optim import _adam
from tests.support.helpers import assert_bits_equal, assert_trees_bits_equal
from tests.support.native import native_module


@pytest.fixture(scope="module")
def native() -> Any:
    return native_module()


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch, native: Any) -> Iterator[list[str]]:
    """Records each native kernel call (``adam`` groups and ``cast`` groups). The optimizer
    must be built inside the test: its rule takes the kernel when it is made."""
    seen: list[str] = []
    adam, cast = _adam._native_kernel, _native.cast_

    def adam_spy(group: Group, h: Any) -> None:
        seen.append("adam")
        adam(group, h)

    def cast_spy(dst: Any, src: Any) -> None:
        seen.append("cast")
        cast(dst, src)

    monkeypatch.setattr(_adam, "_native_kernel", adam_spy)
    monkeypatch.setattr(_native, "cast_", cast_spy)
    yield seen


# --- which leaves the plan gives the native kernel -----------------------------------------


def _layout(x: torch.Tensor, how: str) -> torch.Tensor:
    if how == "transposed":
        return x.t().contiguous().t()
    if how == "channels_last":
        return x.contiguous(memory_format=torch.channels_last)
    return x.contiguous()


def _leaf(shape: tuple[int, ...], how: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    m = _layout(torch.randn(shape, generator=gen), how)
    g = _layout(torch.randn(shape, generator=gen) * 1e-2, how)
    return m, g


@pytest.mark.parametrize(
    ("how", "shape"),
    [("contiguous", (5, 7)), ("transposed", (6, 4)), ("channels_last", (2, 3, 4, 5))],
)
def test_auto_picks_native_for_one_dense_layout(calls: list[str], how: str, shape: Any) -> None:
    m, g = _leaf(shape, how, 0)
    opt = mpfunc.adamw(lr=1e-2)
    state = opt.init({"w": m})
    mpfunc.apply_update_({"w": m}, {"w": g}, state, opt)
    assert calls == ["adam"]


def test_mixed_layouts_and_float64_take_torchs_kernels(calls: list[str]) -> None:
    m, _ = _leaf((2, 3, 4, 5), "channels_last", 1)
    g = torch.randn(2, 3, 4, 5)  # contiguous: pairs by index, never by memory position
    d = torch.randn(3, dtype=torch.float64)
    masters, grads = {"a": m, "d": d}, {"a": g, "d": torch.ones_like(d)}
    opt = mpfunc.adam()
    state = opt.init(masters)
    ref_m, ref_s = mpfunc.apply_update(masters, grads, state, mpfunc.adam(impl="fused"))
    mpfunc.apply_update_(masters, grads, state, opt)
    assert calls == []
    assert_trees_bits_equal(masters, ref_m)
    assert_trees_bits_equal(state, ref_s)


@pytest.mark.parametrize("impl", ["fused", "foreach", "reference"])
def test_explicit_impl_is_honoured(calls: list[str], impl: str) -> None:
    m, g = _leaf((9,), "contiguous", 2)
    opt = mpfunc.adam(impl=impl)  # type: ignore[arg-type]
    mpfunc.apply_update_({"w": m}, {"w": g}, opt.init({"w": m}), opt)
    assert calls == []


# --- equivalence through the public API ------------------------------------------------------

SHAPES = [(), (0,), (1,), (7,), (17,), (3, 5), (2, 3, 4), (64,), (2, 3, 4, 5), (300,)]


def _tree(draw: st.DrawFn, seed: int) -> tuple[dict[str, Any], dict[str, Any]]:
    masters, grads = {}, {}
    for i in range(draw(st.integers(1, 4))):
        shape = draw(st.sampled_from(SHAPES))
        fits = {"contiguous": True, "transposed": len(shape) == 2, "channels_last": len(shape) == 4}
        how = draw(st.sampled_from([k for k, ok in fits.items() if ok]))
        m, g = _leaf(shape, how, seed + i)
        masters[f"w{i}"], grads[f"w{i}"] = m, g if draw(st.integers(0, 7)) else None
        if i == 0:
            first = g
    if all(g is None for g in grads.values()):  # a step with no grad at all is an error
        grads["w0"] = first
    return masters, grads


@settings(max_examples=40)
@given(
    data=st.data(),
    decoupled=st.booleans(),
    amsgrad=st.booleans(),
    maximize=st.booleans(),
    weight_decay=st.sampled_from([0.0, 0.1]),
    lr=st.sampled_from(["float", "tensor", "schedule"]),
    skip=st.sampled_from([None, False, True]),
    steps=st.integers(1, 3),
    seed=st.integers(0, 2**20),
)
def test_auto_is_bit_identical_to_torchs_fused_kernel(
    native: Any,
    data: st.DataObject,
    decoupled: bool,
    amsgrad: bool,
    maximize: bool,
    weight_decay: float,
    lr: str,
    skip: bool | None,
    steps: int,
    seed: int,
) -> None:
    masters, grads = _tree(data.draw, seed)
    rate: Any = {"float": 3e-3, "tensor": torch.tensor(3e-3), "schedule": lambda t: 1e-2 / (1 + t)}[
        lr
    ]
    make = mpfunc.adamw if decoupled else mpfunc.adam
    kw = dict(lr=rate, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize)
    auto, fused = make(**kw), make(**kw, impl="fused")  # type: ignore[arg-type]
    flag = None if skip is None else torch.tensor(skip)
    a_m = {k: v.clone(memory_format=torch.preserve_format) for k, v in masters.items()}
    a_s = auto.init(a_m)
    f_m, f_s = masters, fused.init(masters)
    for _ in range(steps):
        mpfunc.apply_update_(a_m, grads, a_s, auto, flag)
        f_m, f_s = mpfunc.apply_update(f_m, grads, f_s, fused, flag)
    assert_trees_bits_equal(a_m, f_m)
    assert_trees_bits_equal(a_s, f_s)
    for k in masters:
        assert a_m[k].stride() == f_m[k].stride()


# --- the kernel contract: low-precision grads, scale, model --------------------------------------


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("model_dtype", [torch.bfloat16, torch.float16, None])
@pytest.mark.parametrize("skip", [None, False, True])
def test_kernel_contract_matches_the_three_calls(
    native: Any, grad_dtype: torch.dtype, model_dtype: torch.dtype | None, skip: bool | None
) -> None:
    """``Group.model`` and ``Group.scale`` with low-precision grads: bit for bit
    ``grads_to_fp32_(scale=)`` + ``apply_update_(impl="fused")`` + ``masters_to_model_``."""
    gen = torch.Generator().manual_seed(3)
    shapes = [(33,), (4, 8), (), (0,), (1000,)]
    masters = {f"w{i}": torch.randn(s, generator=gen) for i, s in enumerate(shapes)}
    scale = torch.tensor(1024.0)
    grads = {
        k: (torch.randn(m.shape, generator=gen) * 1024).to(grad_dtype) for k, m in masters.items()
    }
    model_type = model_dtype or torch.float32
    params = {k: m.to(model_type) for k, m in masters.items()}
    flag = None if skip is None else torch.tensor(skip)
    hyper = _adam.AdamHyper(0.9, 0.999, 1e-8, 0.01, decoupled=True, amsgrad=True, maximize=False)
    opt = mpfunc.adamw(lr=1e-3, amsgrad=True, impl="fused")

    ref_m = {k: v.clone() for k, v in masters.items()}
    ref_s = opt.init(ref_m)
    ref_p = {k: v.clone() for k, v in params.items()}
    got_m = {k: v.clone() for k, v in masters.items()}
    got_s = opt.init(got_m)
    got_p = {k: v.clone() for k, v in params.items()}
    for _ in range(2):
        g32 = mpfunc.grads_to_fp32_(
            grads, {k: torch.empty_like(m) for k, m in masters.items()}, scale=scale
        )
        mpfunc.apply_update_(ref_m, g32, ref_s, opt, flag)
        if model_dtype is not None:
            mpfunc.masters_to_model_(ref_m, ref_p)
        keys = list(masters)
        fields = ("step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")
        s = got_s._replace(**{f: [getattr(got_s, f)[k] for k in keys] for f in fields})
        group = Group(
            [got_m[k] for k in keys],
            [grads[k] for k in keys],
            s,
            1e-3,
            flag,
            model=[got_p[k] for k in keys] if model_dtype is not None else None,
            scale=scale,
        )
        _adam._native_kernel(group, hyper)
    assert_trees_bits_equal(got_m, ref_m)
    assert_trees_bits_equal(got_s, ref_s)
    assert_trees_bits_equal(got_p, ref_p)


@settings(max_examples=40)
@given(
    data=st.data(),
    low=st.sampled_from([torch.bfloat16, torch.float16]),
    grads_low=st.booleans(),
    scale=st.sampled_from([None, 1024.0, "tensor"]),
    decoupled=st.booleans(),
    amsgrad=st.booleans(),
    maximize=st.booleans(),
    skip=st.sampled_from([None, False, True]),
    steps=st.integers(1, 2),
    seed=st.integers(0, 2**20),
)
def test_single_pass_through_the_public_api(
    calls: list[str],
    data: st.DataObject,
    low: torch.dtype,
    grads_low: bool,
    scale: Any,
    decoupled: bool,
    amsgrad: bool,
    maximize: bool,
    skip: bool | None,
    steps: int,
    seed: int,
) -> None:
    """``apply_update_(masters, grads, state, opt, params=, scale=)`` runs the native kernel
    and gives, bit for bit, ``grads_to_fp32_(scale=)`` + torch's fused step +
    ``masters_to_model_``."""
    masters, g32 = _tree(data.draw, seed)
    params = {k: m.to(low) for k, m in masters.items()}
    masters = mpfunc.init_master(params)
    factor = 1024.0 if scale is not None else 1.0
    grads = {
        k: None if g is None else (g * factor).to(low if grads_low else torch.float32)
        for k, g in g32.items()
    }
    divisor = torch.tensor(1024.0) if scale == "tensor" else scale
    flag = None if skip is None else torch.tensor(skip)
    make = mpfunc.adamw if decoupled else mpfunc.adam
    kw = dict(lr=1e-2, weight_decay=0.1, amsgrad=amsgrad, maximize=maximize)
    auto, fused = make(**kw), make(**kw, impl="fused")  # type: ignore[arg-type]
    ref_m = {k: v.clone(memory_format=torch.preserve_format) for k, v in masters.items()}
    ref_p = {k: v.clone(memory_format=torch.preserve_format) for k, v in params.items()}
    ref_s, state = fused.init(ref_m), auto.init(masters)
    for _ in range(steps):
        mpfunc.apply_update_(masters, grads, state, auto, flag, params=params, scale=divisor)
        ref_g = mpfunc.grads_to_fp32(grads, scale=divisor)
        mpfunc.apply_update_(ref_m, ref_g, ref_s, fused, flag)
        mpfunc.masters_to_model_(ref_m, ref_p)
    assert_trees_bits_equal(masters, ref_m)
    assert_trees_bits_equal(state, ref_s)
    assert_trees_bits_equal(params, ref_p)
    if any(g is not None for g in grads.values()):
        assert "adam" in calls


# --- casts ------------------------------------------------------------------------------------


def _all_16_bit(dtype: torch.dtype) -> torch.Tensor:
    return torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)


def _f32_patterns(n: int, seed: int) -> torch.Tensor:
    """Random fp32 bit patterns, a sixteenth of them NaN with random payloads, a sixteenth
    exactly on a bf16 rounding tie."""
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(-(2**31), 2**31, (n,), generator=gen, dtype=torch.int64)
    which = torch.randint(0, 16, (n,), generator=gen)
    raw = torch.where(which == 0, (raw & 0x807FFFFF) | 0x7F800001, raw)  # NaN, any payload
    raw = torch.where(which == 1, (raw & ~0xFFFF) | 0x8000, raw)  # ties
    return raw.to(torch.int32).view(torch.float32)


LENGTHS = [1, 7, 8, 15, 16, 17, 31, 32, 33, 63, 65, 1000]


PAIRS = sorted(_native._CASTS, key=str)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("to", "of"), PAIRS, ids=[f"{o}->{t}" for t, o in PAIRS])
def test_cast_is_tensor_to_bit_for_bit(
    native: Any, threads: int, to: torch.dtype, of: torch.dtype
) -> None:
    """Every length around the vector widths, at several offsets in a block: bit for bit
    ``Tensor.to``, NaN payloads included for the pairs ``cast_agrees`` admits (the ones
    mpfunc casts natively), NaN positions for the others."""
    payload = _native.cast_agrees(to, of)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        src = _all_16_bit(of) if of.itemsize == 2 else _f32_patterns(1 << 17, threads)
        for n in LENGTHS:
            for off in (0, 1, 3, 8):
                srcs = [src[off + k * n : off + (k + 1) * n] for k in range(50)]
                dst = [torch.empty(n, dtype=to) for _ in srcs]
                _native.cast_(dst, srcs)
                for d, x in zip(dst, srcs):
                    assert_bits_equal(d, x.to(to), nan_payload=payload)
        # Large enough for several threads and streaming stores, at odd offsets.
        big = src.repeat(max(1, (1 << 22) // src.numel()) + 1)[: (1 << 22) + 77]
        holder = torch.empty(big.numel() + 5, dtype=to)
        _native.cast_([holder[5:]], [big])
        assert_bits_equal(holder[5:], big.to(to), nan_payload=payload)
    finally:
        torch.set_num_threads(before)


def test_bfloat16_casts_agree_with_torch(native: Any) -> None:
    """The casts a bf16 model needs always go native (torch writes their NaNs one way)."""
    assert _native.cast_agrees(torch.float32, torch.bfloat16)
    assert _native.cast_agrees(torch.bfloat16, torch.float32)


def test_transforms_use_the_native_cast(calls: list[str]) -> None:
    """Large CPU groups of one dense layout per pair go native; other pairs (a different
    layout, float64, small groups) through torch's copy, with the same bits."""
    n = _native.CAST_FROM_NUMEL
    gen = torch.Generator().manual_seed(0)
    grads = {
        "a": torch.randn(n, generator=gen).bfloat16(),
        "t": torch.randn(64, n // 64, generator=gen).bfloat16().t(),  # dense, transposed
    }
    out = {"a": torch.empty(n), "t": torch.empty(n // 64, 64)}  # "t" differs in layout
    mpfunc.grads_to_fp32_(grads, out)
    assert calls == ["cast"]
    for k in grads:
        assert_bits_equal(out[k], grads[k].float())
    masters = {"a": torch.randn(n, generator=gen), "b": torch.randn(n, generator=gen)}
    params = {"a": torch.empty(n, dtype=torch.bfloat16), "b": torch.empty(n, dtype=torch.float16)}
    calls.clear()
    mpfunc.masters_to_model_(masters, params)
    half = _native.cast_agrees(torch.float16, torch.float32)
    assert calls == ["cast", "cast"] if half else ["cast"]  # one call per dtype pair
    for k in masters:
        assert_bits_equal(params[k], masters[k].to(params[k].dtype))
    calls.clear()
    f64 = torch.float64
    mpfunc.grads_to_fp32_({"h": torch.ones(n, dtype=f64)}, {"h": torch.empty(n, dtype=f64)})
    mpfunc.masters_to_model_({"s": torch.ones(7)}, {"s": torch.empty(7, dtype=torch.bfloat16)})
    assert calls == []


# --- the fallback --------------------------------------------------------------------------------


@pytest.fixture
def unbuilt(monkeypatch: pytest.MonkeyPatch) -> Callable[[], None]:
    """A process where the kernel has not been loaded yet (restored afterwards)."""

    def reset() -> None:
        monkeypatch.setattr(_native, "_module", None)
        monkeypatch.setattr(_native, "_error", None)
        monkeypatch.setattr(_native, "_warned", False)

    reset()
    return reset


def _step(opt: Any) -> tuple[Any, Any]:
    m = {"w": torch.linspace(-1, 1, 40)}
    g = {"w": torch.linspace(1, -1, 40) * 1e-2}
    s = opt.init(m)
    mpfunc.apply_update_(m, g, s, opt)
    return m, s


def test_failed_build_warns_once_and_runs_torchs_kernels(
    monkeypatch: pytest.MonkeyPatch, unbuilt: Any
) -> None:
    def broken(name: str, cflags: list[str]) -> Any:
        raise RuntimeError("Error building extension 'mpfunc_native_x'")

    monkeypatch.setattr(_native, "_build", broken)
    with pytest.warns(_native.NativeFallbackWarning, match="build failed: Error building"):
        got = _step(mpfunc.adamw())
    ref = _step(mpfunc.adamw(impl="fused"))
    assert_trees_bits_equal(got, ref)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _step(mpfunc.adamw())
        mpfunc.grads_to_fp32_(
            {"g": torch.ones(1 << 17, dtype=torch.bfloat16)}, {"g": torch.empty(1 << 17)}
        )
    assert seen == []  # once per process
    with pytest.raises(_native.NativeBuildError):
        _native.load()


def test_disabled_by_environment_is_silent(monkeypatch: pytest.MonkeyPatch, unbuilt: Any) -> None:
    monkeypatch.setenv("MPFUNC_NATIVE", "0")
    got = _step(mpfunc.adamw())  # warnings are errors in this suite
    assert_trees_bits_equal(got, _step(mpfunc.adamw(impl="fused")))
    assert not _native.available()
    with pytest.raises(ImportError, match="disabled by MPFUNC_NATIVE=0") as info:
        _native.load()
    assert type(info.value) is _native.NativeUnavailable


def test_missing_compiler_warns(monkeypatch: pytest.MonkeyPatch, unbuilt: Any) -> None:
    monkeypatch.setenv("CXX", "no-such-compiler-mpfunc")
    with pytest.warns(_native.NativeFallbackWarning, match="no C.. compiler"):
        assert not _native.available()
    assert not _native.available()  # once


def test_no_ninja(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no ninja, no compiler
    monkeypatch.setattr(_native, "_NINJA_DIRS", (str(tmp_path),))
    monkeypatch.setenv("CXX", "/bin/sh")  # any program stands for the compiler here
    reason = _native._why_not()
    assert reason is not None and "ninja is not installed" in reason


def test_system_ninja_outside_path_is_found(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    fake = tmp_path / "bin" / "ninja"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho 1.11\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(_native, "_NINJA_DIRS", (str(fake.parent),))
    assert _native._find_ninja() == str(fake)
    assert os.environ["PATH"].split(os.pathsep)[0] == str(fake.parent)


def test_cache_folder(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setenv("MPFUNC_HOME", str(tmp_path))
    assert _native.cache_dir() == tmp_path / "native"
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    assert _native.cache_dir() == tmp_path / "ext"
    a = _native._build_name(_native._cflags())
    assert a == _native._build_name(_native._cflags())
    assert a != _native._build_name([*_native._cflags(), "-DX"])

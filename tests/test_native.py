"""The native one-pass CPU Adam/AdamW (mpfunc/backends/_native.py, backends/csrc/adam_mixed.cpp).

Its promise: for finite inputs, masters, moments and steps bit-identical to torch's fused
CPU kernel run on the fp32-upcast (and unscaled) grads, and params bit-identical to
``master.to(dtype)``: exactly what ``grads_to_fp32_`` + fused AdamW + ``masters_to_model_``
compute, in one pass over memory.

The tests skip only when no toolchain is there to build the kernel (no compiler, no
ninja, Windows, or ``MPFUNC_NATIVE=0``); a failed build fails them. How the kernel is
wired into mpfunc, and the fallback: ``tests/test_native_wiring.py``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any, NamedTuple, Optional

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mpfunc.backends import _native
from tests.support.error_table import assert_unchanged, snapshot, tensors
from tests.support.native import native_module


@pytest.fixture(scope="module")
def native() -> Any:
    return native_module()


# --- the reference: the three-call path -----------------------------------------------------


class Case(NamedTuple):
    masters: list[torch.Tensor]
    grads: list[torch.Tensor]
    exp_avg: list[torch.Tensor]
    exp_avg_sq: list[torch.Tensor]
    max_exp_avg_sq: Optional[list[torch.Tensor]]
    steps: list[torch.Tensor]
    params_out: Optional[list[torch.Tensor]]
    hyper: dict[str, Any]


def _clone(ts: Optional[list[torch.Tensor]]) -> Optional[list[torch.Tensor]]:
    return None if ts is None else [t.clone() for t in ts]


def clone_case(c: Case) -> Case:
    return c._replace(
        masters=_clone(c.masters),
        grads=_clone(c.grads),
        exp_avg=_clone(c.exp_avg),
        exp_avg_sq=_clone(c.exp_avg_sq),
        max_exp_avg_sq=_clone(c.max_exp_avg_sq),
        steps=_clone(c.steps),
        params_out=_clone(c.params_out),
    )


def reference_(c: Case) -> None:
    """``grads_to_fp32_`` (upcast, divide by the scale), steps += 1, torch's fused kernel,
    ``masters_to_model_``: the three calls the native kernel replaces."""
    h = c.hyper
    g32 = [g.float() if g.dtype != torch.float32 else g.clone() for g in c.grads]
    if h.get("grad_scale") is not None:
        torch._foreach_div_(g32, h["grad_scale"])
    torch._foreach_add_(c.steps, 1)
    kernel = torch._fused_adamw_ if h["decoupled"] else torch._fused_adam_
    kernel(
        c.masters,
        g32,
        c.exp_avg,
        c.exp_avg_sq,
        c.max_exp_avg_sq if h["amsgrad"] else [],
        c.steps,
        lr=h["lr"],
        beta1=h["beta1"],
        beta2=h["beta2"],
        weight_decay=h["weight_decay"],
        eps=h["eps"],
        amsgrad=h["amsgrad"],
        maximize=h["maximize"],
    )
    if c.params_out is not None:
        for o, p in zip(c.params_out, c.masters):
            o.copy_(p)


def native_(c: Case, **extra: Any) -> None:
    _native.adam_mixed_(
        c.masters,
        c.grads,
        c.exp_avg,
        c.exp_avg_sq,
        c.max_exp_avg_sq,
        c.steps,
        c.params_out,
        **{**c.hyper, **extra},
    )


def bits(t: torch.Tensor) -> torch.Tensor:
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.detach().contiguous().view(ints[t.element_size()])


def assert_bits_equal(a: Case, b: Case) -> None:
    for name in ("masters", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "steps", "params_out"):
        xs, ys = getattr(a, name), getattr(b, name)
        if xs is None:
            assert ys is None
            continue
        for i, (x, y) in enumerate(zip(xs, ys)):
            assert x.dtype == y.dtype and x.shape == y.shape, (name, i)
            if not torch.equal(bits(x), bits(y)):
                diff = (x.double() - y.double()).abs().max().item()
                n_diff = int((bits(x) != bits(y)).sum())
                raise AssertionError(
                    f"{name}[{i}] {tuple(x.shape)}: {n_diff} elements differ, max |diff| {diff:.3g}"
                )


def make_case(
    shapes: list[tuple[int, ...]],
    *,
    grad_dtype: torch.dtype = torch.bfloat16,
    out_dtype: Optional[torch.dtype] = torch.bfloat16,
    amsgrad: bool = False,
    seed: int = 0,
    steps: Optional[list[int]] = None,
    gscale: float = 1.0,
    pscale: float = 1.0,
    **hyper: Any,
) -> Case:
    gen = torch.Generator().manual_seed(seed)

    def randn(s: tuple[int, ...]) -> torch.Tensor:
        return torch.randn(s, generator=gen)

    scale = hyper.get("grad_scale")
    factor = gscale * (1.0 if scale is None else float(scale))
    # Keep fp16 grads finite: these tests are about finite arithmetic.
    grads = [(randn(s) * factor).clamp(-6e4, 6e4).to(grad_dtype) for s in shapes]
    masters = [randn(s) * pscale for s in shapes]
    exp_avg = [randn(s) * 0.1 * gscale for s in shapes]
    exp_avg_sq = [torch.rand(s, generator=gen) * gscale**2 for s in shapes]
    max_sq = None
    if amsgrad:
        # Half the elements above exp_avg_sq, so both branches of the max are taken.
        bump = torch.rand
        max_sq = [
            v + bump(v.shape, generator=gen) * gscale**2 * (bump(v.shape, generator=gen) > 0.5)
            for v in exp_avg_sq
        ]
    counts = steps if steps is not None else [0] * len(shapes)
    step_ts = [torch.tensor(float(k)) for k in counts]
    out = None if out_dtype is None else [m.to(out_dtype) for m in masters]
    full = dict(
        lr=1e-3,
        beta1=0.9,
        beta2=0.999,
        eps=1e-8,
        weight_decay=0.01,
        decoupled=True,
        amsgrad=amsgrad,
        maximize=False,
        grad_scale=None,
    )
    full.update(hyper)
    return Case(masters, grads, exp_avg, exp_avg_sq, max_sq, step_ts, out, full)


def round_params(c: Case) -> None:
    """The params hold their masters' rounding, as every step leaves them: the kernel
    reads them and refreshes a master whose param was written behind its back
    (test_param_writes.py), which the three-call reference path does not. A test that
    edits masters after make_case calls this."""
    for m, o in zip(c.masters, c.params_out or ()):
        o.copy_(m)


def check_against_reference(c: Case, steps: int = 1) -> None:
    ref, got = clone_case(c), clone_case(c)
    for _ in range(steps):
        reference_(ref)
        native_(got)
    assert_bits_equal(got, ref)


# --- bit-identity -----------------------------------------------------------------------

# Lengths around torch's vector width (8, 16) and the kernel's block (32 for AVX512),
# so that every split between vector body and scalar tail is reached.
SHAPES = [(), (0,), (1,), (7,), (8,), (9,), (15,), (16,), (17,), (31,), (33,)]
SHAPES += [(3, 5), (2, 3, 4), (64,), (100,), (257,)]


@settings(max_examples=300)
@given(
    shapes=st.lists(st.sampled_from(SHAPES), min_size=1, max_size=4),
    grad_dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
    out_dtype=st.sampled_from([None, torch.bfloat16, torch.float16, torch.float32]),
    decoupled=st.booleans(),
    amsgrad=st.booleans(),
    maximize=st.booleans(),
    weight_decay=st.sampled_from([0.0, 1e-2, 0.1, 1.5]),
    beta1=st.sampled_from([0.0, 0.3, 0.5, 0.9, 0.99]),
    beta2=st.sampled_from([0.0, 0.5, 0.9, 0.999, 0.9999]),
    eps=st.sampled_from([1e-8, 1e-6, 1e-3]),
    lr=st.sampled_from([1e-4, 1e-3, 0.1, 3.0]),
    lr_tensor=st.booleans(),
    grad_scale=st.sampled_from([None, 1.0, 1024.0, 3.0, 65536.0]),
    gscale=st.sampled_from([1e-6, 1e-2, 1.0, 30.0]),
    pscale=st.sampled_from([1e-3, 1.0, 1e3]),
    step_counts=st.lists(st.integers(0, 20_000), min_size=4, max_size=4),
    n_steps=st.integers(1, 3),
    seed=st.integers(0, 2**31 - 1),
)
def test_bit_identical_to_three_call_path(
    native: Any,
    shapes: list[tuple[int, ...]],
    grad_dtype: torch.dtype,
    out_dtype: Optional[torch.dtype],
    decoupled: bool,
    amsgrad: bool,
    maximize: bool,
    weight_decay: float,
    beta1: float,
    beta2: float,
    eps: float,
    lr: float,
    lr_tensor: bool,
    grad_scale: Optional[float],
    gscale: float,
    pscale: float,
    step_counts: list[int],
    n_steps: int,
    seed: int,
) -> None:
    c = make_case(
        shapes,
        grad_dtype=grad_dtype,
        out_dtype=out_dtype,
        amsgrad=amsgrad,
        seed=seed,
        steps=step_counts[: len(shapes)],
        gscale=gscale,
        pscale=pscale,
        lr=torch.tensor(lr) if lr_tensor else lr,
        beta1=beta1,
        beta2=beta2,
        eps=eps,
        weight_decay=weight_decay,
        decoupled=decoupled,
        maximize=maximize,
        grad_scale=None if grad_scale is None else torch.tensor(grad_scale),
    )
    check_against_reference(c, steps=n_steps)


@pytest.mark.parametrize("n", [1, 7, 8, 9, 15, 16, 17, 31, 33, 100])
def test_signed_zero_moments_at_beta1_zero(native: Any, n: int) -> None:
    """beta1 = 0 with -0 grads: the new first moment is a zero whose sign depends on the
    lerp form torch used for that element (scalar tail, its 8-wide vectorized copy, or
    the 16-wide loop). Found by hypothesis on fp16 grads that underflowed to -0."""
    c = make_case(
        [(n,)],
        grad_dtype=torch.float32,
        out_dtype=None,
        seed=n,
        lr=1e-4,
        beta1=0.0,
        beta2=0.0,
        weight_decay=0.0,
        decoupled=False,
    )
    c.grads[0].fill_(-0.0)
    c.exp_avg[0].copy_(-c.exp_avg[0].abs() - 1e-3)
    check_against_reference(c)


@pytest.mark.parametrize("threads", [1, 2])
def test_large_tensors_across_chunks_and_threads(native: Any, threads: int) -> None:
    """Leaves split into several work items (CHUNK elements each) on several threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        chunk = int(native.CHUNK)
        shapes = [(3 * chunk + 13,), (chunk,), (chunk - 3,), (5,), (2 * chunk + 40,)]
        for amsgrad in (False, True):
            c = make_case(shapes, amsgrad=amsgrad, seed=threads, steps=[3, 0, 7, 1, 100])
            check_against_reference(c, steps=2)
        # Threads split the elements, not the leaves: many tiny leaves around a huge one.
        shapes = [(7,)] * 40 + [(4 * chunk + 1,)] + [(0,), ()] * 20 + [(33,)] * 40
        check_against_reference(make_case(shapes, seed=threads), steps=2)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("grad_dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16, torch.float32, None])
def test_each_dtype_pair(native: Any, grad_dtype: torch.dtype, out_dtype: torch.dtype) -> None:
    c = make_case([(129,), (4, 8), ()], grad_dtype=grad_dtype, out_dtype=out_dtype)
    check_against_reference(c, steps=3)


@pytest.mark.parametrize("decoupled", [False, True])
def test_amsgrad_maximize_and_scale(native: Any, decoupled: bool) -> None:
    c = make_case(
        [(70,), (9,)],
        amsgrad=True,
        maximize=True,
        decoupled=decoupled,
        weight_decay=0.1,
        grad_scale=torch.tensor(512.0),
        steps=[5, 0],
    )
    check_against_reference(c, steps=4)


@pytest.mark.parametrize("beta1", [0.0, 0.3, 0.9])
@pytest.mark.parametrize("decoupled", [False, True])
def test_signed_zeros_in_every_loop_region(native: Any, beta1: float, decoupled: bool) -> None:
    """Zeros of both signs in grads, masters and moments, at lengths that end in each of
    torch's loops (vector, 8-wide epilogue, scalar tail): the sign of every zero matches.

    With beta1 == 0 torch's scalar lerp g - (g - m) * (1 - w) and its vector lerp
    g + (w - 1) * (g - m) differ in the sign of a zero result; each region keeps its own.
    """
    shapes = [(n,) for n in (7, 8, 15, 16, 23, 24, 31, 40, 47)]
    c = make_case(
        shapes,
        grad_dtype=torch.float32,
        beta1=beta1,
        decoupled=decoupled,
        weight_decay=0.0,
        amsgrad=True,
        steps=[1] * len(shapes),
    )
    for i, shape in enumerate(shapes):
        signs = torch.where(torch.arange(shape[0]) % 3 == 0, -1.0, 1.0)
        c.grads[i][::2] = (0.0 * signs)[::2]
        c.exp_avg[i][1::3] = (0.0 * signs)[1::3]
        c.masters[i][::4] = (0.0 * -signs)[::4]
    round_params(c)
    check_against_reference(c, steps=2)


def test_tensor_lr_equals_float_lr(native: Any) -> None:
    a = make_case([(40,)], lr=torch.tensor(3e-3))
    b = make_case([(40,)], lr=3e-3)
    native_(a)
    native_(b)
    assert_bits_equal(a, b)


def test_zero_size_and_zero_dim(native: Any) -> None:
    c = make_case([(0,), (), (0, 4), (1,)], steps=[2, 0, 9, 1])
    check_against_reference(c)
    assert [float(s) for s in c.steps] == [2.0, 0.0, 9.0, 1.0]  # c itself is untouched


def test_steps_increment_per_leaf(native: Any) -> None:
    c = make_case([(3,), (0,), ()], steps=[0, 4, 41])
    native_(c)
    assert [float(s) for s in c.steps] == [1.0, 5.0, 42.0]


def test_fp32_params_without_output(native: Any) -> None:
    """``params_out=None``: a plain fp32 step, as torch's fused AdamW on fp32 grads."""
    c = make_case([(50,), (3, 3)], grad_dtype=torch.float32, out_dtype=None)
    check_against_reference(c, steps=2)


# --- found_inf --------------------------------------------------------------------------------


@pytest.mark.parametrize("flag", [1.0, 2.0, float("inf"), float("nan")])
def test_found_inf_changes_nothing(native: Any, flag: float) -> None:
    c = make_case([(33,), ()], amsgrad=True, steps=[4, 0])
    snap = snapshot(list(c[:7]))
    native_(c, found_inf=torch.tensor(flag))
    for t, before, _ in snap:
        assert torch.equal(bits(t), bits(before))


def test_found_inf_zero_steps(native: Any) -> None:
    c = make_case([(33,)], amsgrad=True)
    ref = clone_case(c)
    native_(c, found_inf=torch.tensor(0.0))
    reference_(ref)
    assert_bits_equal(c, ref)


# --- layouts --------------------------------------------------------------------------------


def test_same_permuted_layout_is_updated_in_memory_order(native: Any) -> None:
    """All tensors of a leaf transposed alike: updated in place, as torch's kernel does."""

    def t(x: torch.Tensor) -> torch.Tensor:
        return x.reshape(9, 7).t()  # (7, 9), strides (1, 7): dense, not contiguous

    c = make_case([(63,)], amsgrad=True)
    c = c._replace(
        masters=[t(c.masters[0])],
        grads=[t(c.grads[0])],
        exp_avg=[t(c.exp_avg[0])],
        exp_avg_sq=[t(c.exp_avg_sq[0])],
        max_exp_avg_sq=[t(c.max_exp_avg_sq[0])],  # type: ignore[index]
        params_out=[t(c.params_out[0])],  # type: ignore[index]
    )
    assert not c.masters[0].is_contiguous()
    ptrs = [x.data_ptr() for x in (c.masters[0], c.exp_avg[0], c.params_out[0])]  # type: ignore[index]
    check_against_reference(c, steps=2)
    native_(c)
    assert ptrs == [x.data_ptr() for x in (c.masters[0], c.exp_avg[0], c.params_out[0])]  # type: ignore[index]


def test_mixed_layouts_pair_elements_by_logical_index(native: Any) -> None:
    """Different layouts within a leaf go through contiguous copies and are written back."""
    shape = (6, 10)
    c = make_case([shape], amsgrad=True, steps=[3])
    # Reference on contiguous tensors: logical order.
    ref = clone_case(c)
    reference_(ref)

    # The same values, in awkward layouts.
    def transposed(x: torch.Tensor) -> torch.Tensor:
        return x.t().contiguous().t()  # same values, column-major

    def strided(x: torch.Tensor) -> torch.Tensor:
        holder = torch.full((shape[0], shape[1] * 2), 7.0, dtype=x.dtype)
        holder[:, ::2] = x
        return holder[:, ::2]  # non-dense

    masters = [c.masters[0].clone()]
    grads = [transposed(c.grads[0])]
    exp_avg = [strided(c.exp_avg[0])]
    exp_avg_sq = [transposed(c.exp_avg_sq[0])]
    max_sq = [strided(c.max_exp_avg_sq[0])]  # type: ignore[index]
    out = [strided(c.masters[0].to(torch.bfloat16))]
    got = Case(masters, grads, exp_avg, exp_avg_sq, max_sq, _clone(c.steps) or [], out, c.hyper)
    native_(got)
    assert_bits_equal(got, ref)
    # The gaps of the strided views are untouched.
    for view, fill in ((exp_avg[0], 7.0), (max_sq[0], 7.0)):
        base = view._base
        assert base is not None
        assert torch.all(base[:, 1::2] == fill)


@pytest.mark.parametrize("offset", [1, 16, 32])
def test_params_out_at_any_alignment(native: Any, offset: int) -> None:
    """Params of large steps go out with streaming stores, which need aligned addresses;
    views at any offset still work (at 32 bytes off, an earlier build faulted)."""
    shapes = [(300,), ((1 << 22) + 77,)]  # over the streaming threshold in all
    c = make_case(shapes, seed=offset)
    bufs = [torch.full((offset + s[0],), 3.0, dtype=torch.bfloat16) for s in shapes]
    c = c._replace(params_out=[b[offset:] for b in bufs])
    round_params(c)
    ref = clone_case(c)
    reference_(ref)
    native_(c)  # on the offset views themselves
    assert_bits_equal(c, ref)
    for b in bufs:
        assert torch.all(b[:offset] == 3.0)


def test_dense_but_differently_permuted(native: Any) -> None:
    c = make_case([(4, 12)], steps=[1])
    ref = clone_case(c)
    reference_(ref)
    got = clone_case(c)
    got.exp_avg[0] = c.exp_avg[0].t().contiguous().t()  # dense, column-major
    native_(got)
    assert_bits_equal(got, ref)


# --- version counters, aliasing of reads -------------------------------------------------


def test_written_tensors_bump_their_version(native: Any) -> None:
    c = make_case([(5,)], amsgrad=True)
    written = [
        c.masters[0],
        c.exp_avg[0],
        c.exp_avg_sq[0],
        c.max_exp_avg_sq[0],
        c.steps[0],  # type: ignore[index]
        c.params_out[0],
    ]  # type: ignore[index]
    before = [t._version for t in written]
    grad_version = c.grads[0]._version
    native_(c)
    assert all(t._version > v for t, v in zip(written, before))
    assert c.grads[0]._version == grad_version


# --- non-finite inputs ------------------------------------------------------------------------


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("maximize", [False, True])
def test_non_finite_values(
    native: Any, grad_dtype: torch.dtype, amsgrad: bool, maximize: bool
) -> None:
    """NaN and inf land where the reference puts them; finite elements stay bit-identical.

    NaN payloads and signs are not promised: torch's own fp16 -> fp32 cast gives
    different NaN bits for a tensor's last elements than for the rest, and torch's
    build folds its maximize negation differently in exp_avg_sq's NaNs.
    """
    n = 203
    c = make_case([(n,)], grad_dtype=grad_dtype, amsgrad=amsgrad, maximize=maximize, steps=[2])
    g = c.grads[0].float()
    g[::5] = float("nan")
    g[1::7] = float("inf")
    g[2::11] = -float("inf")
    c.grads[0].copy_(g)
    c.masters[0][3::13] = float("inf")
    c.exp_avg[0][4::17] = float("nan")
    round_params(c)
    ref, got = clone_case(c), clone_case(c)
    reference_(ref)
    native_(got)
    for name in ("masters", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "params_out"):
        xs, ys = getattr(got, name), getattr(ref, name)
        if xs is None:
            continue
        x, y = xs[0], ys[0]
        assert torch.equal(x.isnan(), y.isnan()), name
        finite = ~x.isnan()
        assert torch.equal(bits(x[finite]), bits(y[finite])), name


# --- conversions ---------------------------------------------------------------------------------


def _all_16_bit(dtype: torch.dtype) -> torch.Tensor:
    return torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_widening_every_16_bit_pattern(native: Any, dtype: torch.dtype) -> None:
    # Four copies: torch's cast runs its vector loop over all but the last few elements,
    # and its scalar path writes fp16 NaNs differently; compare where it vectorizes.
    src = _all_16_bit(dtype).repeat(4)
    out = torch.empty(src.shape)
    native.convert_(src, out)
    n = 65536
    assert torch.equal(bits(out[:n]), bits(src[:n].float()))


def _specials32() -> torch.Tensor:
    words = """
        00000000 80000000 00000001 807FFFFF 00800000 7F7FFFFF FF7FFFFF 7F800000 FF800000
        7FC00000 FFC00000 7F800001 7FD12345 FF812345 3F808000 3F818000 BF808000 3F807FFF
        3F808001 00008000 33800000 477FF000 477FEFFF 477FF001 38800000 387FE000 33000000
        33000001 7F7F8000 7F7F7FFF 7F7FC000 47800000 C77FF000 337FFFFF
    """
    pats = [int(w, 16) for w in words.split()]
    return torch.tensor([p - (1 << 32) if p >= 1 << 31 else p for p in pats]).to(torch.int32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rounding_matches_tensor_to(native: Any, dtype: torch.dtype) -> None:
    """Round to nearest even, saturation, subnormals, ties and NaN, as ``Tensor.to``.

    (Every one of the 2**32 float32 patterns was checked once with a probe; this samples.)
    """
    gen = torch.Generator().manual_seed(5)
    rand = torch.randint(-(2**31), 2**31, (1 << 20,), generator=gen, dtype=torch.int64)
    ties = (rand & ~0xFFFF) | 0x8000  # exactly halfway for bfloat16
    raw = torch.cat([_specials32().repeat(40), rand.to(torch.int32), ties.to(torch.int32)])
    src = raw.view(torch.float32)
    out = torch.empty(src.shape, dtype=dtype)
    native.convert_(src, out)
    assert torch.equal(bits(out), bits(src.to(dtype)))


# --- checks before writes ---------------------------------------------------------------------

FN = "adam_mixed_"


def _msg(path: str, expected: str, got: str) -> str:
    return "^" + re.escape(f"{FN}: at {path!r}: expected {expected}, got {got}")


Bad = Callable[[Case], Case]


def _set(field: str, i: int, value: Callable[[Case], Any]) -> Bad:
    def change(c: Case) -> Case:
        lst = list(getattr(c, field))
        lst[i] = value(c)
        return c._replace(**{field: lst})

    return change


def _inference(t: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return t.clone()


def _hyper(**kw: Any) -> Bad:
    return lambda c: c._replace(hyper={**c.hyper, **kw})


ERRORS: list[tuple[str, Bad, type[Exception], str]] = [
    (
        "short grads",
        lambda c: c._replace(grads=c.grads[:1]),
        ValueError,
        _msg("grads", "a list of 2 tensors (one per master)", "a list of 1"),
    ),
    (
        "fp64 master",
        _set("masters", 1, lambda c: c.masters[1].double()),
        TypeError,
        _msg(
            "masters[1]",
            "a float32 strided CPU tensor",
            "torch.float64 tensor of shape (5,) on cpu",
        ),
    ),
    (
        "int grad",
        _set("grads", 0, lambda c: torch.zeros(3, dtype=torch.int32)),
        TypeError,
        _msg(
            "grads[0]",
            "a float32, bfloat16 or float16 strided CPU tensor",
            "torch.int32 tensor of shape (3,) on cpu",
        ),
    ),
    (
        "mixed grad dtypes",
        _set("grads", 1, lambda c: c.grads[1].half()),
        TypeError,
        _msg(
            "grads[1]",
            "the dtype of grads[0] (torch.bfloat16)",
            "torch.float16 tensor of shape (5,) on cpu",
        ),
    ),
    (
        "grad shape",
        _set("grads", 1, lambda c: c.grads[1][:4]),
        ValueError,
        _msg("grads[1]", "shape (5,) (the master's)", "shape (4,)"),
    ),
    (
        "meta exp_avg",
        _set("exp_avg", 0, lambda c: torch.empty(3, device="meta")),
        TypeError,
        _msg(
            "exp_avg[0]",
            "a float32 strided CPU tensor",
            "torch.float32 tensor of shape (3,) on meta",
        ),
    ),
    (
        "expanded exp_avg_sq",
        _set("exp_avg_sq", 1, lambda c: torch.zeros(1).expand(5)),
        ValueError,
        _msg(
            "exp_avg_sq[1]",
            "a tensor whose elements do not overlap",
            "an expanded or self-overlapping view of shape (5,)",
        ),
    ),
    (
        "int64 step",
        _set("steps", 1, lambda c: torch.tensor(3)),
        TypeError,
        _msg(
            "steps[1]", "a one-element float32 CPU tensor", "torch.int64 tensor of shape () on cpu"
        ),
    ),
    (
        "out dtypes differ",
        _set("params_out", 1, lambda c: torch.zeros(5, dtype=torch.half)),
        TypeError,
        _msg(
            "params_out[1]",
            "the dtype of params_out[0] (torch.bfloat16)",
            "torch.float16 tensor of shape (5,) on cpu",
        ),
    ),
    (
        "amsgrad without max",
        _hyper(amsgrad=True),
        ValueError,
        _msg("max_exp_avg_sq", "a list of 2 tensors (one per master)", "a list of 0"),
    ),
    (
        "max without amsgrad",
        lambda c: c._replace(max_exp_avg_sq=[torch.zeros(3)]),
        ValueError,
        _msg("max_exp_avg_sq", "an empty list (amsgrad=False)", "a list of 1"),
    ),
    (
        "two-element lr",
        _hyper(lr=torch.ones(2)),
        TypeError,
        _msg(
            "lr",
            "a one-element floating-point CPU tensor",
            "torch.float32 tensor of shape (2,) on cpu",
        ),
    ),
    (
        "inference master",
        _set("masters", 0, lambda c: _inference(c.masters[0])),
        ValueError,
        _msg(
            "masters[0]",
            "a tensor that can be updated in place",
            "an inference tensor outside torch.inference_mode()",
        ),
    ),
    (
        "int found_inf",
        _hyper(found_inf=torch.tensor(1)),
        TypeError,
        _msg(
            "found_inf",
            "a one-element floating-point or bool CPU tensor",
            "torch.int64 tensor of shape () on cpu",
        ),
    ),
]


@pytest.mark.parametrize(("name", "bad", "exc", "pattern"), ERRORS, ids=[e[0] for e in ERRORS])
def test_bad_input_raises_before_any_write(
    native: Any, name: str, bad: Bad, exc: type[Exception], pattern: str
) -> None:
    c = bad(make_case([(3,), (5,)], steps=[1, 2]))
    everything = [
        c.masters,
        c.grads,
        c.exp_avg,
        c.exp_avg_sq,
        c.max_exp_avg_sq,
        c.steps,
        c.params_out,
        c.hyper,
    ]
    # An expanded view cannot be read as bytes; its one-element base stands for it. An
    # inference tensor has no version to read (and nothing may write it).
    snap = snapshot(
        [
            t._base if 0 in t.stride() and t._base is not None else t
            for t in tensors(everything)
            if not t.is_inference()
        ]
    )
    with pytest.raises(exc, match=pattern):
        native_(c)
    assert_unchanged(snap)


# --- availability ---------------------------------------------------------------------------


def test_build_is_cached_and_reported(native: Any) -> None:
    info = _native.build_info()
    assert info["name"].startswith("mpfunc_native_")
    assert info["path"] and info["path"].endswith(".so")
    assert info["path"].startswith(str(_native.cache_dir()))
    assert "-ffp-contract=off" in info["cflags"]
    assert info["load_s"] > 0 and (info["cached"] or info["build_s"] > 0)
    assert _native.available()
    assert _native.load() is native  # once per process


def test_bias_correction_matches_torch_at_large_steps(native: Any) -> None:
    """Steps far along (beta**t underflows) and near 2**24 (float32 steps still exact)."""
    c = make_case([(20,), (20,)], steps=[10**6, 2**24 - 2], beta2=0.99999)
    check_against_reference(c, steps=1)
    assert math.isclose(float(c.steps[1]), 2**24 - 2)


def test_meta_key_sees_storage_size_inference_and_views(native: Any) -> None:
    """The memo key holds what a remembered check would otherwise miss: the storage's
    size (a storage freed and reallocated smaller at the same address), whether the
    tensor is an inference tensor, a negative view or a conjugate view."""
    import struct

    def tail(t: torch.Tensor) -> tuple[int, int]:
        nbytes, flags = struct.unpack("=qB", native.meta_key([t])[-9:])
        return nbytes, flags

    big = torch.zeros(128)
    assert tail(big[:64]) == (128 * 4, 0)
    with torch.inference_mode():
        inf = torch.zeros(64)
    assert tail(inf) == (64 * 4, 1)
    t = torch.zeros(64)
    neg = torch._neg_view(t)
    assert neg.data_ptr() == t.data_ptr() and tail(neg) == (64 * 4, 2)
    c = torch.zeros(8, dtype=torch.complex64)
    assert tail(c.conj()) == (8 * 8, 4)
    assert native.meta_key([c.conj()]) != native.meta_key([c])

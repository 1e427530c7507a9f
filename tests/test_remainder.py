"""The bf16 param + int16 remainder + tie bit encoding of fp32 masters
(``mpfunc.strategies._remainder``).

Checked against the specification in the module docstring, written here a second
way (Python/int64 arithmetic on the bit patterns): ``join(split(x))`` is ``x`` bit for
bit; the remainder is ``x``'s low half; the param equals ``x.to(torch.bfloat16)`` for
every non-NaN ``x``; a NaN keeps a NaN param with its sign (its top payload bits, or the
quiet NaN where the payload lies wholly in the low half); the tie bit is set exactly at
ties that rounded up and at those low-payload NaNs. Every property runs on the CPU and
on XLA; ``python -m bench.remainder`` covers all 2^32 patterns on the CPU.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from support.error_table import call, check_row, row
from support.helpers import assert_bits_equal, bits, settle
from support.strategies import SHAPES, bits_tensor

from mpfunc.strategies import _remainder

# --- the specification, a second time -------------------------------------------------------


def spec_split(x: int) -> tuple[int, int, int]:
    """The encoding of one fp32 pattern (uint32) as (param uint16, remainder uint16, tie)."""
    sign, high, low = x >> 31, (x >> 16) & 0x7FFF, x & 0xFFFF
    if high == 0x7F80 and low:  # a NaN with a low payload: the quiet NaN, tie bit set
        return sign << 15 | 0x7FC0, low, 1
    if high > 0x7F80:  # a NaN with payload in the high half: keep it
        return sign << 15 | high, low, 0
    up = low > 0x8000 or (low == 0x8000 and high % 2 == 1)  # nearest, ties to even
    return sign << 15 | (high + up), low, int(up and low == 0x8000)


def spec_split_tensor(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``spec_split`` over a CPU int32 tensor, in int64: expected (param, remainder, tie)
    as uint16 values (and 0/1) in int64."""
    u = x.to(torch.int64) & 0xFFFF_FFFF
    sign, high, low = u >> 31, (u >> 16) & 0x7FFF, u & 0xFFFF
    up = (low > 0x8000) | ((low == 0x8000) & (high % 2 == 1))
    mag = high + up.to(torch.int64)
    tie = (up & (low == 0x8000)).to(torch.int64)
    lownan = (high == 0x7F80) & (low != 0)
    mag = torch.where(lownan, torch.full_like(mag, 0x7FC0), mag)
    tie = torch.where(lownan, torch.ones_like(tie), tie)
    mag = torch.where(high > 0x7F80, high, mag)
    tie = torch.where(high > 0x7F80, torch.zeros_like(tie), tie)
    return sign << 15 | mag, low, tie


def u16(t: torch.Tensor) -> torch.Tensor:
    """A 16-bit tensor's bits as uint16 values in int64, on the CPU."""
    return bits(t).to(torch.int64) & 0xFFFF


def from_u32(values: list[int], device: torch.device | str = "cpu") -> torch.Tensor:
    raw = torch.tensor([v - (1 << 32) if v >= 1 << 31 else v for v in values], dtype=torch.int64)
    return raw.to(torch.int32).view(torch.float32).to(device)


def ties_of(ties: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Tie bytes -> 0/1 int64 per element, written here a second way (Python loops)."""
    if 0 in shape:
        return torch.zeros(shape, dtype=torch.int64)
    flat = ties.cpu().reshape(-1, ties.shape[-1] if ties.dim() else 1).tolist()
    n = shape[-1] if len(shape) else 1
    out = [[(row[j // 8] >> (j % 8)) & 1 for j in range(n)] for row in flat]
    return torch.tensor(out, dtype=torch.int64).reshape(shape)


def check_encoding(x: torch.Tensor) -> None:
    """Every promise for the fp32 tensor ``x`` (any device, any strides)."""
    param, rem, ties = _remainder.split(x)
    back = _remainder.join(param, rem, ties)
    assert param.dtype == torch.bfloat16 and rem.dtype == torch.int16
    assert ties.dtype == torch.uint8 and ties.shape == _remainder.tie_shape(x.shape)
    assert param.shape == x.shape == rem.shape == back.shape
    assert param.device == x.device == rem.device == back.device == ties.device
    xb = bits(x)
    assert torch.equal(bits(back), xb), "join(split(x)) lost bits"
    want_p, want_r, want_t = spec_split_tensor(xb)
    assert torch.equal(u16(param), want_p), "param differs from the specification"
    assert torch.equal(u16(rem), want_r), "remainder is not the low half"
    assert torch.equal(ties_of(ties, x.shape), want_t), "tie bits differ from the specification"
    # Against Tensor.to on the same device: equal wherever the master is not a NaN.
    rne = u16(x.to(torch.bfloat16))
    nan = torch.isnan(x.cpu())
    got = u16(param)
    assert torch.equal(got[~nan], rne[~nan]), "the param is not Tensor.to's"
    assert bool(((got[nan] & 0x7FFF) > 0x7F80).all()), "a NaN master without a NaN param"
    u = xb.to(torch.int64) & 0xFFFF_FFFF
    assert torch.equal(got >> 15, u >> 31), "the param lost the master's sign"


# --- explicit patterns ---------------------------------------------------------------------

# (fp32 pattern, expected param pattern, expected tie bit, what it is)
CASES = [
    (0x00000000, 0x0000, 0, "+0"),
    (0x80000000, 0x8000, 0, "-0"),
    (0x00000001, 0x0000, 0, "smallest subnormal"),
    (0x00007FFF, 0x0000, 0, "below the first tie"),
    (0x00008000, 0x0000, 0, "tie at 2**-134: to even, 0"),
    (0x80008000, 0x8000, 0, "its negative twin: -0"),
    (0x00018000, 0x0002, 1, "tie, odd high half: up"),
    (0x007FFFFF, 0x0080, 0, "largest subnormal rounds to the smallest normal"),
    (0x807FFFFF, 0x8080, 0, "negative largest subnormal"),
    (0x3F800000, 0x3F80, 0, "1.0"),
    (0x3F808000, 0x3F80, 0, "tie, even high half: down"),
    (0xBF808000, 0xBF80, 0, "negative tie, even high half"),
    (0x3F818000, 0x3F82, 1, "tie, odd high half: up"),
    (0x3F7F8000, 0x3F80, 1, "tie carried into the exponent"),
    (0x3F807FFF, 0x3F80, 0, "just below a tie"),
    (0x3F808001, 0x3F81, 0, "just above a tie"),
    (0x7F7E8000, 0x7F7E, 0, "the last even tie"),
    (0x7F7F7FFF, 0x7F7F, 0, "largest master with a finite param"),
    (0x7F7F8000, 0x7F80, 1, "odd tie at bf16's largest finite: inf, as Tensor.to"),
    (0x7F7FFFFF, 0x7F80, 0, "fp32's largest finite: inf param, exact master"),
    (0xFF7FFFFF, 0xFF80, 0, "its negative"),
    (0x7F800000, 0x7F80, 0, "+inf"),
    (0xFF800000, 0xFF80, 0, "-inf"),
    (0x7FC00000, 0x7FC0, 0, "canonical quiet NaN"),
    (0xFFC00000, 0xFFC0, 0, "negative quiet NaN"),
    (0x7FFFFFFF, 0x7FFF, 0, "all-ones NaN keeps its payload"),
    (0xFFFFFFFF, 0xFFFF, 0, "all-ones negative NaN"),
    (0x7F810000, 0x7F81, 0, "smallest NaN with a high payload"),
    (0x7FC08000, 0x7FC0, 0, "quiet NaN at a tie-like low half"),
    (0x7FA00000, 0x7FA0, 0, "signalling NaN"),
    (0x7F800001, 0x7FC0, 1, "NaN, payload in the low half: the quiet NaN, tie bit"),
    (0x7F807FFF, 0x7FC0, 1, "another of those"),
    (0x7F808000, 0x7FC0, 1, "another, low half 0x8000"),
    (0x7F80FFFF, 0x7FC0, 1, "the last of those"),
    (0xFF808000, 0xFFC0, 1, "its negative twin: -NaN"),
]


@pytest.mark.parametrize("x, want, tie, what", CASES, ids=[c[3] for c in CASES])
def test_each_special_pattern_on_cpu(x: int, want: int, tie: int, what: str) -> None:
    assert spec_split(x)[0::2] == (want, tie), "the test's own specification disagrees"
    param, rem, ties = _remainder.split(from_u32([x]))
    assert int(u16(param)[0]) == want
    assert int(u16(rem)[0]) == x & 0xFFFF
    assert int(ties[0]) == tie
    assert int(bits(_remainder.join(param, rem, ties))[0]) & 0xFFFF_FFFF == x


def test_special_patterns_on_every_device(device: torch.device) -> None:
    xs = [c[0] for c in CASES]
    x = from_u32(xs, device)
    param, rem, ties = _remainder.split(x)
    assert u16(param).tolist() == [c[1] for c in CASES]
    assert u16(rem).tolist() == [v & 0xFFFF for v in xs]
    assert ties_of(ties, x.shape).tolist() == [c[2] for c in CASES]
    check_encoding(x)


# High halves whose 65,536 low halves are swept whole: zero, the first subnormals, 1.0
# and its neighbour (even, odd), the top of the finite range, inf, the first and last NaN.
SWEEP_HIGHS = [0x0000, 0x0001, 0x3F80, 0x3F81, 0x7F7E, 0x7F7F, 0x7F80, 0x7F81, 0x7FFF]


def test_sweeps_every_low_half_at_the_boundaries(device: torch.device) -> None:
    """All 65,536 low halves under each boundary high half, both signs (1.2M patterns)."""
    low = torch.arange(0, 1 << 16, dtype=torch.int64)
    blocks = [(h << 16) + low for h in SWEEP_HIGHS]
    u = torch.cat(blocks + [b + (1 << 31) for b in blocks])
    x = (u - ((u >> 31) << 32)).to(torch.int32).view(torch.float32).to(device)
    check_encoding(x)


def test_why_a_tie_bit() -> None:
    """The count behind the tie bit: round-to-nearest-even sends 65,537 fp32 patterns to
    an even bf16 value (both ties) and 65,535 to an odd one, and a 16-bit remainder tells
    only 65,536 apart. So the two ties of an even value share a remainder (0x8000) and
    one more bit tells them apart."""
    for p in (0x3F80, 0x3F81):
        u = torch.arange((p - 1) << 16, (p + 1) << 16, dtype=torch.int64)
        rne = u.to(torch.int32).view(torch.float32).to(torch.bfloat16)
        n = int((bits(rne).to(torch.int64) == p).sum())
        assert n == (65537 if p % 2 == 0 else 65535)


# --- properties ----------------------------------------------------------------------------


@st.composite
def masters(draw: st.DrawFn) -> torch.Tensor:
    return bits_tensor(draw, draw(st.sampled_from(SHAPES)), torch.float32)


@given(x=masters())
@settings(max_examples=60)
def test_random_bits_round_trip_cpu(x: torch.Tensor) -> None:
    check_encoding(x)


@pytest.mark.xla
@given(x=masters())
@settings(max_examples=25)
def test_random_bits_round_trip_xla(xla_device: torch.device, x: torch.Tensor) -> None:
    check_encoding(x.to(xla_device))


def test_many_random_patterns(device: torch.device) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(-(2**31), 2**31 - 1, (1 << 16,), generator=gen, dtype=torch.int32)
    check_encoding(x.view(torch.float32).to(device))


def test_join_inverts_split_at_every_tie(device: torch.device) -> None:
    """Every high half with its exact tie (low half 0x8000), both signs: the triple
    split gives joins back to the master, and split(join) gives the triple back."""
    high = torch.arange(0, 1 << 16, dtype=torch.int64)
    u = (high << 16) | 0x8000
    x = (u - ((u >> 31) << 32)).to(torch.int32).view(torch.float32).to(device)
    p, r, t = _remainder.split(x)
    p2, r2, t2 = _remainder.split(_remainder.join(p, r, t))
    assert torch.equal(bits(p2), bits(p)) and torch.equal(r2.cpu(), r.cpu())
    assert torch.equal(t2.cpu(), t.cpu())


# --- layouts and the in-place forms ---------------------------------------------------------


def _layouts(device: torch.device) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(2)

    def raw(*shape: int) -> torch.Tensor:
        n = 1
        for s in shape:
            n *= s
        r = torch.randint(-(2**31), 2**31 - 1, (n,), generator=gen, dtype=torch.int32)
        return r.view(torch.float32).reshape(shape)

    out = [
        raw(5, 3).t(),  # transposed
        raw(2, 3, 4, 5).to(memory_format=torch.channels_last),
        raw(6, 10)[1:4, ::3],  # sliced with a step
        raw(7),
        raw(),
    ]
    return [t.to(device) for t in out]


def test_layouts_round_trip(device: torch.device) -> None:
    for x in _layouts(device):
        check_encoding(x)


def test_split_into_strided_outputs(device: torch.device) -> None:
    """Outputs that are views (a row of a bigger buffer, transposed, channels_last) get the
    pure results, the memory around them is left alone, and ``join_`` writes masters into
    such views. (Views with gaps, such as ``base[..., 0]``, are refused as outputs by
    ``_checks.check_writable``, like every in-place function's.)

    On XLA a bf16 *view* written with ``copy_`` has its NaN payloads canonicalized by
    torch_xla (see ``test_xla_bf16_view_writes_canonicalize_nan``): NaN params stay NaN
    with their sign, and everything else is exact."""
    xs = _layouts(device)
    params, rems, ties, bases = [], [], [], []
    for x in xs:
        base_p = torch.full((2, *x.shape), 7.0, dtype=torch.bfloat16, device=device)
        base_r = torch.full((2, *x.shape), 9, dtype=torch.int16, device=device)
        bases.append((base_p, base_r))
        params.append(base_p[1])
        rems.append(base_r[1])
        ties.append(
            torch.full(_remainder.tie_shape(x.shape), 0xFF, dtype=torch.uint8, device=device)
        )
    if device.type == "cpu":
        params[0] = torch.empty(5, 3, dtype=torch.bfloat16).t()  # transposed output
        params[1] = torch.empty_like(xs[1], dtype=torch.bfloat16)  # channels_last output
        assert params[1].is_contiguous(memory_format=torch.channels_last)
    _remainder.split_(xs, params, rems, ties)
    masters_out = [torch.full_like(x, 3.0) for x in xs]
    _remainder.join_(params, rems, ties, masters_out)
    exact = device.type == "cpu"
    for x, p, r, t, m, (bp, br) in zip(xs, params, rems, ties, masters_out, bases):
        want_p, want_r, want_t = _remainder.split(x)
        assert torch.equal(t.cpu(), want_t.cpu())
        assert_bits_equal(p, want_p, nan_payload=exact)
        assert torch.equal(u16(p) >> 15, u16(want_p) >> 15)
        assert torch.equal(bits(r), bits(want_r))
        assert_bits_equal(m, x, nan_payload=exact)
        assert_bits_equal(m[~torch.isnan(x)], x[~torch.isnan(x)])
        settle(bp)
        assert bool((bp[0].cpu() == 7.0).all()) and bool((br[0].cpu() == 9).all())


def test_in_place_forms_skip_none_and_take_models_params(device: torch.device) -> None:
    """``None`` slots line up and are skipped; a model's bf16 ``nn.Parameter`` (which
    requires grad) is written without autograd complaining."""
    x = from_u32([0x3F808000, 0x7FFFFFFF, 0x00000001], device)
    weight = torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16, device=device))
    rem = torch.zeros(3, dtype=torch.int16, device=device)
    tie = torch.zeros(1, dtype=torch.uint8, device=device)
    _remainder.split_([None, x], [None, weight], [None, rem], [None, tie])
    assert u16(weight).tolist() == [0x3F80, 0x7FFF, 0x0000]
    out = torch.zeros(3, device=device)
    _remainder.join_([weight, None], [rem, None], [tie, None], [out, None])
    assert torch.equal(bits(out), bits(x))
    _remainder.split_([], [], [], [])
    _remainder.join_([], [], [], [])


def test_empty_and_zero_d(device: torch.device) -> None:
    for shape in [(0,), ()]:
        x = torch.full(shape, -1.5, device=device)
        check_encoding(x)


# --- XLA: one node, no fallbacks, no host reads --------------------------------------------


@pytest.mark.xla
def test_xla_is_sync_free_and_compiles_once(xla_device: torch.device) -> None:
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.debug.metrics as met

    def count(name: str) -> int:
        data = met.metric_data(name)
        return 0 if data is None else int(data[0])

    shapes = [(7,), (3, 5)]
    ms = [torch.randn(s, device=xla_device) for s in shapes]
    ps = [torch.empty(s, dtype=torch.bfloat16, device=xla_device) for s in shapes]
    rs = [torch.empty(s, dtype=torch.int16, device=xla_device) for s in shapes]
    ts = [
        torch.empty(_remainder.tie_shape(s), dtype=torch.uint8, device=xla_device) for s in shapes
    ]
    torch_xla.sync()

    def step() -> None:
        for m in ms:
            m.add_(1.0)  # new masters every step
        _remainder.split_(ms, ps, rs, ts)
        _remainder.join_(ps, rs, ts, ms)
        torch_xla.sync()
        xm.wait_device_ops()

    step()
    step()
    met.clear_counters()
    compiles, executes = count("CompileTime"), count("ExecuteTime")
    to_host = count("TransferFromDeviceTime")
    for _ in range(3):
        step()
    assert count("CompileTime") == compiles, "a step compiled a new graph"
    assert count("ExecuteTime") - executes == 3, "expected one graph per step"
    assert count("TransferFromDeviceTime") == to_host, "a step read a tensor back"
    fallbacks = [n for n in met.counter_names() if n.startswith("aten::")]
    assert fallbacks == [], f"fell back to the CPU for {fallbacks}"


@pytest.mark.xla
def test_xla_view_dtype_falls_back(xla_device: torch.device) -> None:
    """Why the XLA path builds its own computation: torch_xla 2.9 runs ``view(dtype)`` on
    the host. If this starts failing, the eager path may serve XLA too."""
    import torch_xla
    import torch_xla.debug.metrics as met

    x = torch.randn(7, device=xla_device)
    torch_xla.sync()
    met.clear_counters()
    y = x.view(torch.int32) + 1
    torch_xla.sync()
    assert y.shape == (7,)
    assert any(n.startswith("aten::view") for n in met.counter_names())


@pytest.mark.xla
def test_xla_bf16_view_writes_canonicalize_nan(xla_device: torch.device) -> None:
    """torch_xla 2.9 on XLA:CPU: ``copy_`` of bf16 NaNs into a *view* gives the canonical
    quiet NaN (sign kept); into a whole tensor, and for fp32 and int16 views, the bits
    survive; finite values, subnormals and inf survive everywhere. So on XLA a NaN
    master whose param is a view comes back a NaN of the same sign with another payload.
    If this starts failing, the payloads survive and ``test_split_into_strided_outputs``
    can compare NaN payloads on XLA too."""
    vals = [0x0001, 0x8001, 0x7F80, 0x3F81, 0x7FFA, 0xFFFA]
    src = torch.tensor([v - 0x10000 if v >= 0x8000 else v for v in vals], dtype=torch.int16)
    s = src.view(torch.bfloat16).to(xla_device)
    base = torch.zeros(2, len(vals), dtype=torch.bfloat16, device=xla_device)
    base[1].copy_(s)
    whole = torch.zeros(len(vals), dtype=torch.bfloat16, device=xla_device)
    whole.copy_(s)
    assert u16(whole).tolist() == vals
    assert u16(base[1]).tolist() == [0x0001, 0x8001, 0x7F80, 0x3F81, 0x7FC0, 0xFFC0]


# --- errors --------------------------------------------------------------------------------


def _f32(shape: tuple[int, ...] = (1, 3)) -> torch.Tensor:
    return torch.zeros(shape)


def _bf16(shape: tuple[int, ...] = (1, 3)) -> torch.Tensor:
    return torch.zeros(shape, dtype=torch.bfloat16)


def _i16(shape: tuple[int, ...] = (1, 3)) -> torch.Tensor:
    return torch.zeros(shape, dtype=torch.int16)


def _u8(shape: tuple[int, ...] = (1, 1)) -> torch.Tensor:
    return torch.zeros(shape, dtype=torch.uint8)


def _aliased_outputs() -> Any:
    p = _bf16()
    return call(_remainder.split_, [_f32()], [p], [p.view(torch.int16)], [_u8()])


def _master_aliasing_remainder() -> Any:
    base = torch.zeros(1, 6, dtype=torch.int16)
    return call(_remainder.join_, [_bf16()], [base[:, :3]], [_u8()], [base.view(torch.float32)])


A = "split_: at "
J = "join_: at "
ERRORS = [
    row(
        "fp16 param",
        lambda: call(_remainder.split_, [_f32()], [_f32().half()], [_i16()], [_u8()]),
        TypeError,
        A + r"'params\.0': expected a torch\.bfloat16 param, got torch\.float16 tensor .*"
        r"fp16 has a 5-bit exponent.*<= 2\*\*-25 to 0.*>= 65520 to inf.*'fp32' strategy",
    ),
    row(
        "fp32 param",
        lambda: call(_remainder.split_, [_f32()], [_f32()], [_i16()], [_u8()]),
        TypeError,
        A + r"'params\.0': expected a torch\.bfloat16 param, got torch\.float32 .*exactly",
    ),
    row(
        "fp16 param to join",
        lambda: call(_remainder.join, _f32().half(), _i16(), _u8()),
        TypeError,
        r"join: at 'param': expected a torch\.bfloat16 param, got torch\.float16.*5-bit",
    ),
    row(
        "bf16 master",
        lambda: call(_remainder.split, _bf16()),
        TypeError,
        r"split: at 'master': expected a torch\.float32 master, got torch\.bfloat16",
    ),
    row(
        "fp64 master",
        lambda: call(_remainder.split_, [_f32().double()], [_bf16()], [_i16()], [_u8()]),
        TypeError,
        A + r"'masters\.0': expected a torch\.float32 master, got torch\.float64",
    ),
    row(
        "int32 remainder",
        lambda: call(_remainder.split_, [_f32()], [_bf16()], [_i16().int()], [_u8()]),
        TypeError,
        A + r"'remainders\.0': expected a torch\.int16 remainder, got torch\.int32",
    ),
    row(
        "remainder shape",
        lambda: call(_remainder.join_, [_bf16()], [_i16((3, 1))], [_u8()], [_f32()]),
        ValueError,
        J + r"'remainders\.0': expected shape \(1, 3\) \(the param's\), got shape \(3, 1\)",
    ),
    row(
        "master shape",
        lambda: call(_remainder.join_, [_bf16()], [_i16()], [_u8()], [_f32((3,))]),
        ValueError,
        J + r"'masters\.0': expected shape \(1, 3\) \(the param's\), got shape \(3,\)",
    ),
    row(
        "lengths",
        lambda: call(_remainder.split_, [_f32(), _f32()], [_bf16()], [_i16()], [_u8()]),
        ValueError,
        r"split_: params: expected 2 entries \(one per entry of masters\), got 1",
    ),
    row(
        "None against a tensor",
        lambda: call(_remainder.split_, [_f32()], [None], [_i16()], [_u8()]),
        TypeError,
        A + r"'params\.0': expected a torch\.bfloat16 param, got None",
    ),
    row(
        "a tensor, not a list",
        lambda: call(_remainder.split_, _f32(), [_bf16()], [_i16()], [_u8()]),
        TypeError,
        r"split_: masters: expected a list or tuple of tensors, got torch\.float32 tensor",
    ),
    row(
        "not a tensor",
        lambda: call(_remainder.join, [1.0], _i16(), _u8()),
        TypeError,
        r"join: param: expected a tensor, got list",
    ),
    row(
        "tie bytes of the wrong shape",
        lambda: call(
            _remainder.split_, [_f32((2, 9))], [_bf16((2, 9))], [_i16((2, 9))], [_u8((2, 1))]
        ),
        ValueError,
        A + r"'ties\.0': expected a torch\.uint8 tensor of shape \(2, 2\) on cpu \(the tie bits "
        r"of a tensor of shape \(2, 9\), 8 a byte along the last dim\), got torch\.uint8 tensor "
        r"of shape \(2, 1\)",
    ),
    row(
        "tie bytes of another dtype",
        lambda: call(_remainder.join, _bf16(), _i16(), _i16((1, 1))),
        ValueError,
        r"join: at 'ties': expected a torch\.uint8 tensor of shape \(1, 1\)",
    ),
    row(
        "outputs alias",
        _aliased_outputs,
        ValueError,
        A + r"'remainders\.0': expected a tensor that shares no memory with 'params\.0'",
    ),
    row(
        "master aliases a remainder",
        _master_aliasing_remainder,
        ValueError,
        J + r"'(masters|remainders)\.0': expected a tensor that shares no memory with "
        r"'(remainders|masters)\.0'",
    ),
]


@pytest.mark.parametrize("make, exc, regex", ERRORS)
def test_errors_leave_everything_unchanged(make: Any, exc: type[Exception], regex: str) -> None:
    check_row(make, exc, regex)


def test_expanded_output_is_refused_before_any_write() -> None:
    """(Not an error-table row: its snapshot cannot view an expanded tensor's bytes.)"""
    base = torch.zeros(1, dtype=torch.bfloat16)
    rem = torch.full((1, 3), 5, dtype=torch.int16)
    versions = (base._version, rem._version)
    with pytest.raises(ValueError, match=A + r"'params\.0': expected a tensor whose elements"):
        _remainder.split_([torch.ones(1, 3)], [base.expand(1, 3)], [rem], [_u8()])
    assert (base._version, rem._version) == versions
    assert bool((base == 0).all()) and bool((rem == 5).all())


def test_unsupported_hint_names_the_reason() -> None:
    assert "5-bit exponent" in _remainder.unsupported_hint(torch.float16)
    assert "'fp32' strategy" in _remainder.unsupported_hint(torch.float32)
    assert "bfloat16" in _remainder.unsupported_hint(torch.int8)

"""Blockwise 4-bit optimizer moments (``mpfunc.state_formats._quantize4``).

The promises, each tested on the CPU and on XLA where a device is involved:

* **Codes.** For a finite, normal ``x`` in a block with stored scale ``s``, let
  ``y = x / s`` (signed) or ``sqrt(x) / s`` (unsigned) and ``t = 2y / (1 + |y|)``. Rounded
  to nearest, the code ``k`` is ``round(L t)`` (``L`` = 7 signed, 14 unsigned), checked
  against a float64 reference written here; a positive second moment never gets code 0.
  The decoded value is one of the two levels around ``x`` (``x`` itself on a level), and
  exactly ``scale * level`` (squared when unsigned).
* **Packing.** Element ``2i`` is the low nibble of byte ``i``, ``2i + 1`` the high one;
  ``ceil(n / 2)`` bytes, ``int8`` for the signed map and ``uint8`` for the unsigned one.
* **Special values.** Zeros stay zero; subnormals read as zero; NaN and inf (and a
  negative second moment) mark their element only (NaN signed, ``+inf`` unsigned), and the
  rest of the block is quantized as if that element were 0.
* **Stochastic rounding** is unbiased in the value.
* **Devices.** Codes, scales and decoded values are bit-identical on the CPU and XLA:CPU.
* **Bad input** raises a clear error before anything is written; a leaf under one block is
  refused with a pointer to ``partition``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from support.helpers import assert_bits_equal, assert_unchanged, settle, snapshot
from support.trees import per_device, sync

from mpfunc.core import _checks, _rng, _tree
from mpfunc.state_formats import _quantize4 as Q

# Few shapes, so XLA compiles each graph once: exactly one block, one block and a tail
# (odd: a half-used last byte), several blocks with a tail, exact blocks.
SHAPES: list[tuple[int, ...]] = [(32,), (33,), (3, 17), (2, 3, 7), (4, 32), (2, 50)]
LAYOUTS = ["contiguous", "transposed", "sliced", "expanded", "channels_last"]
TINY = 2.0**-126
SLACK = 1e-5  # fp32 rounding of y and t, in code units


def moments(draw: st.DrawFn, shape: tuple[int, ...], signed: bool, specials: bool) -> torch.Tensor:
    """Values over a drawn number of decades (as Adam moments are), random signs when
    signed, and with ``specials`` a few zeros, subnormals, NaN, inf and huge values."""
    n = math.prod(shape)
    seed = draw(st.integers(0, 2**31 - 1))
    top = draw(st.integers(-30, 30))
    decades = draw(st.sampled_from([0.0, 1.0, 3.0, 8.0, 20.0]))
    g = torch.Generator().manual_seed(seed)
    mag = 10.0 ** (top - decades * torch.rand(n, generator=g, dtype=torch.float64))
    x = mag if not signed else mag * torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    x = x.float()
    if specials:
        pool = [0.0, -0.0, 1e-40, -1e-40, math.nan, math.inf, -math.inf, 3e38]
        if not signed:
            pool.append(-1.0)
        picks = draw(st.lists(st.tuples(st.integers(0, n - 1), st.sampled_from(pool)), max_size=4))
        for i, v in picks:
            x[i] = v
    return x.reshape(shape)


def laid_out(x: torch.Tensor, layout: str) -> torch.Tensor:
    """The same values as ``x`` in another memory layout (a view or a strided copy)."""
    if layout == "transposed":
        return x.t().contiguous().t() if x.dim() == 2 else x
    if layout == "sliced":
        wide = torch.zeros(*x.shape[:-1], 2 * x.shape[-1]) if x.dim() else x
        wide[..., ::2] = x
        return wide[..., ::2]
    if layout == "expanded" and x.dim() >= 1 and x.shape[0] > 1:
        return x  # expanded inputs are drawn in test_layouts_read_logical_order
    if layout == "channels_last" and x.dim() == 4:
        return x.contiguous(memory_format=torch.channels_last)
    return x


def levels(signed: bool) -> torch.Tensor:
    """Each code's level in float64, by code (signed: index = code + 7)."""
    L = 7 if signed else 14
    ks = torch.arange(-7, 8) if signed else torch.arange(15)
    t = ks.double() / L
    return t / (2 - t.abs())


def unpack(codes: torch.Tensor, n: int, signed: bool) -> torch.Tensor:
    """Codes per element, read byte by byte in Python: element 2i low nibble, 2i+1 high."""
    out = []
    for b in codes.cpu().tolist():
        b &= 0xFF
        out += [b & 15, b >> 4]
    k = torch.tensor(out[:n])
    return torch.where(k >= 8, k - 16, k) if signed else k


def check(x: torch.Tensor, q: Q.Q4State, out: torch.Tensor, signed: bool) -> None:
    """Every promise of the module docstring, element by element, in float64 on the CPU."""
    x = x.detach().cpu().reshape(-1).double()
    n = x.numel()
    assert q.codes.dtype == (torch.int8 if signed else torch.uint8)
    assert q.codes.shape == (Q.packed_bytes(n),) and q.scale.shape == (Q.blocks(n),)
    assert q.scale.dtype == torch.bfloat16
    k = unpack(q.codes, n, signed)
    if n % 2:  # the unused high nibble of the last byte is 0
        assert int(q.codes.cpu()[-1]) & 0xF0 == 0
    s_blocks = q.scale.cpu().double()
    s = s_blocks.repeat_interleave(Q.BLOCK)[:n]
    out = out.detach().cpu().reshape(-1).double()
    L = 7 if signed else 14
    mark = -8 if signed else 15
    finite = torch.isfinite(x)
    bad = ~finite if signed else ~finite | (x <= -TINY)
    tiny = ~bad & (x.abs() < TINY)
    normal = ~bad & ~tiny

    kept = torch.where(normal, x.abs(), 0.0)
    if not signed:
        kept = kept.float().sqrt().double()  # fp32 sqrt, as the module takes it
    padded = torch.nn.functional.pad(kept, (0, s_blocks.numel() * Q.BLOCK - n))
    want = padded.view(-1, Q.BLOCK).amax(dim=1).float().to(torch.bfloat16)
    assert torch.equal(q.scale.cpu(), want), (q.scale, want)

    assert bool((k[bad] == mark).all()), "a non-finite value did not get the mark"
    assert bool((k[~bad] != mark).all()), "a finite value got the mark"
    if signed:
        assert bool(out[bad].isnan().all()), "the signed mark did not decode to NaN"
    else:
        assert bool((out[bad] == math.inf).all()), "the unsigned mark did not decode to +inf"
    assert bool((k[tiny] == 0).all()) and bool((out[tiny] == 0).all()), "a subnormal is not 0"
    assert not bool(out[~bad].isnan().any()), "NaN spread to a finite element"

    xs, ks, ss, outs = x[normal], k[normal], s[normal], out[normal]
    y = (xs if signed else xs.sqrt()) / ss
    t = 2 * y / (1 + y.abs())
    want_k = torch.round(L * t).clamp(-L if signed else 0, L)
    near_tie = ((L * t - torch.floor(L * t)) - 0.5).abs() < SLACK * L
    if not signed:
        want_k = torch.where(want_k == 0, 1.0, want_k)  # positive: never code 0
    assert bool(((ks.double() == want_k) | near_tie).all()), "a code is not round(L t)"
    lv = levels(signed)[ks + (7 if signed else 0)]
    # Decoding is the level times the scale (squared when unsigned), flushed below TINY.
    want_out = (lv.float().double() * ss).float().double()
    if not signed:
        want_out = (want_out.float() ** 2).double()
    want_out = torch.where(want_out.abs() < TINY, 0.0, want_out)
    assert torch.equal(outs, want_out)
    # The decoded value is one of the two levels around x: within one level gap of it.
    yq = lv
    table = levels(signed)
    pos = torch.searchsorted(table, y.clamp(table[0], table[-1]).contiguous())
    lo = table[(pos - 1).clamp(0, len(table) - 1)]
    hi = table[pos.clamp(0, len(table) - 1)]
    first = ~torch.tensor(signed) & (ks == 1)  # below the first level, unsigned
    ok = ((yq >= lo - 1e-6) & (yq <= hi + 1e-6)) | first
    assert bool(ok.all()), "a value decoded beyond its neighbouring levels"
    if signed:
        assert bool((outs * xs >= 0).all()), "a decoded value changed sign"


# --- round trips and special values -----------------------------------------------------


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_round_trip(device: torch.device, signed: bool) -> None:
    """quantize4 -> dequantize4: codes, packing, scales and values as promised, for every
    shape and layout, with and without special values."""

    @per_device(device, 80, 15)
    @given(
        data=st.data(),
        shape=st.sampled_from(SHAPES),
        layout=st.sampled_from(LAYOUTS),
        specials=st.booleans(),
    )
    def run(data: st.DataObject, shape: tuple[int, ...], layout: str, specials: bool) -> None:
        x = laid_out(moments(data.draw, shape, signed, specials), layout)
        q = Q.quantize4(x.to(device), signed)
        out = Q.dequantize4(q, shape)
        sync(device)
        assert out.shape == shape and out.dtype == torch.float32 and out.is_contiguous()
        check(x, q, out, signed)

    run()


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_non_finite_stays_in_its_element(device: torch.device, signed: bool) -> None:
    """A NaN/inf/huge-overflowed (or negative second) moment marks only itself: the other
    elements get the codes they would get if it were 0, and the block's scale ignores it."""
    g = torch.Generator().manual_seed(0)
    x = torch.rand(2, 50, generator=g) * 1e-3
    if signed:
        x = x - 5e-4
    for bad in (math.nan, math.inf, -math.inf, *([] if signed else [-2.0])):
        y, zero = x.clone(), x.clone()
        y[1, 7], zero[1, 7] = bad, 0.0
        q, qz = Q.quantize4(y.to(device), signed), Q.quantize4(zero.to(device), signed)
        out = Q.dequantize4(q, (2, 50))
        sync(device)
        k, kz = unpack(q.codes, 100, signed), unpack(qz.codes, 100, signed)
        assert int(k[57]) == (-8 if signed else 15)
        mask = torch.ones(100, dtype=torch.bool)
        mask[57] = False
        assert torch.equal(k[mask], kz[mask])
        assert torch.equal(q.scale.cpu(), qz.scale.cpu())
        marked = out.cpu()[1, 7]
        assert bool(marked.isnan()) if signed else float(marked) == math.inf
        assert bool(out.cpu().reshape(-1)[mask].isfinite().all())


def test_zero_subnormal_and_huge_blocks(device: torch.device) -> None:
    """An all-zero block and a block of subnormals are zero blocks (codes 0, scale 0); the
    unsigned mark is +inf even there; the largest finite fp32 value keeps a finite scale;
    a tiny normal value beside a large one rounds to 0 signed and to code 1 unsigned."""
    for signed in (True, False):
        x = torch.zeros(96)
        x[32:64] = 1e-40  # subnormal
        x[64] = 3.4e38 if not signed else -3.4e38
        x[65] = 1e-30
        x[3] = math.inf
        q = Q.quantize4(x.to(device), signed)
        out = Q.dequantize4(q, (96,)).cpu()
        k = unpack(q.codes, 96, signed)
        assert q.scale.cpu()[:2].tolist() == [0.0, 0.0]
        assert bool(q.scale.cpu().isfinite().all())
        assert int(k[3]) == (-8 if signed else 15)
        assert bool(out[3].isnan()) if signed else float(out[3]) == math.inf
        rest = torch.cat([k[:3], k[4:64]])
        assert bool((rest == 0).all()) and bool((torch.cat([out[:3], out[4:64]]) == 0).all())
        # Above bf16's largest, a first moment's scale stays finite (bf16's largest) and so
        # does its value; a second moment's sqrt scale may round up past fp32's largest
        # when squared, and reads as an overflowed v (+inf, Adam's update 0 there).
        assert int(k[64]) == (-7 if signed else 14)
        if signed:
            assert float(out[64]) == pytest.approx(-3.4e38, rel=4e-3)
        else:
            assert float(out[64]) >= 3.39e38
        assert int(k[65]) == (0 if signed else 1)
        z = Q.zeros4((3, 32), signed, device)
        qz = Q.quantize4(torch.zeros(3, 32, device=device), signed)
        sync(device)
        assert torch.equal(z.codes.cpu(), qz.codes.cpu())
        assert torch.equal(z.scale.cpu(), qz.scale.cpu())


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_requantizing_a_decoded_state_is_exact(signed: bool) -> None:
    """quantize4(dequantize4(q)) == q: a state that goes through fp32 unchanged keeps its
    bits."""

    @settings(max_examples=60)
    @given(data=st.data(), shape=st.sampled_from(SHAPES))
    def run(data: st.DataObject, shape: tuple[int, ...]) -> None:
        x = moments(data.draw, shape, signed, specials=False)
        x = torch.where(x.abs() < 1e-25, 0.0, x)  # keep decoded values normal
        q = Q.quantize4(x, signed)
        again = Q.quantize4(Q.dequantize4(q, shape), signed)
        assert torch.equal(again.codes, q.codes) and torch.equal(again.scale, q.scale)

    run()


def test_packing_layout() -> None:
    """Codes go two a byte, element 2i in the low nibble: a ramp of known codes packs into
    known bytes (signed bytes as int8, two's complement)."""
    # Unsigned: sqrt(v) on the exact levels of codes 0..14 (scale 1 from the last one).
    lv = levels(False)
    ks = [k % 15 for k in range(33)]
    ks[32] = 14  # alone in the second block: its own largest
    v = torch.tensor([float(lv[k]) ** 2 for k in ks])
    q = Q.quantize4(v, False)
    assert unpack(q.codes, 33, False).tolist() == ks
    want = [ks[2 * i] | ((ks[2 * i + 1] if 2 * i + 1 < 33 else 0) << 4) for i in range(17)]
    assert q.codes.tolist() == want
    # Signed: -7..7 in order, then the mark.
    sl = levels(True)
    x = torch.tensor([float(sl[k + 7]) for k in range(-7, 8)] * 2 + [math.nan, 1.0])
    q = Q.quantize4(x, True)
    ks = unpack(q.codes, 32, True).tolist()
    assert ks == [*range(-7, 8), *range(-7, 8), -8, 7]
    b = [(ks[2 * i] & 15) | ((ks[2 * i + 1] & 15) << 4) for i in range(16)]
    assert q.codes.tolist() == [c - 256 if c > 127 else c for c in b]


def test_layouts_read_logical_order(device: torch.device) -> None:
    """A transposed, sliced, expanded or channels_last moment quantizes as its contiguous
    copy: element order is the logical, row-major one, whatever the strides."""
    g = torch.Generator().manual_seed(4)
    base = torch.randn(40, 6, generator=g)
    nchw = torch.randn(2, 3, 4, 5, generator=g)
    views = [
        base.t(),
        base[::2],
        base[:, 1:4],
        torch.randn(6, generator=g).expand(8, 6),
        nchw.contiguous(memory_format=torch.channels_last),
    ]
    for x in views:
        x = x.to(device)
        for signed in (True, False):
            xv = x if signed else x.abs()
            q, qc = Q.quantize4(xv, signed), Q.quantize4(xv.contiguous(), signed)
            buf = Q.zeros4(x.shape, signed, device)
            Q.quantize4_(xv, buf)
            sync(device)
            for other in (qc, buf):
                assert torch.equal(q.codes.cpu(), other.codes.cpu())
                assert torch.equal(q.scale.cpu(), other.scale.cpu())


def test_bytes_per_element() -> None:
    """Half a byte per element plus a 2-byte scale per 32: 0.5625 B for a large moment, so
    both Adam moments cost 1.125 B/param; what a state holds is what the count says."""
    assert Q.bytes_per_element(1 << 20) == 0.5625
    assert Q.bytes_per_element(33) == pytest.approx((17 + 4) / 33)
    assert Q.bytes_per_element(0) == 0.0
    x = torch.randn(101, 33)
    q = Q.quantize4(x, True)
    held = q.codes.numel() * q.codes.element_size() + q.scale.numel() * q.scale.element_size()
    assert held == Q.packed_bytes(x.numel()) + 2 * Q.blocks(x.numel())
    assert held / x.numel() == Q.bytes_per_element(x.numel())


@pytest.mark.parametrize("batch", [False, True], ids=["looped", "batched"])
def test_list_forms_match_one_call_per_tensor(device: torch.device, batch: bool) -> None:
    """quantize4_list_/dequantize4_list (looped, or as one concatenation, XLA's default)
    give the same bits as quantize4_/dequantize4 per tensor, odd tails included."""
    g = torch.Generator().manual_seed(11)
    shapes = [(3, 17), (32,), (2, 50), (33,)]
    for signed in (True, False):
        xs = [
            torch.randn(s, generator=g) * 10.0 ** torch.randint(-8, 3, s, generator=g)
            for s in shapes
        ]
        xs = [x if signed else x.square() for x in xs]
        xs[0][1, 2] = math.nan
        for noisy in (False, True):
            keys = [torch.tensor(i, dtype=torch.int32) for i in range(len(shapes))]
            ns = [_rng.uniform(k, s).to(device) if noisy else None for k, s in zip(keys, shapes)]
            dx = [x.to(device) for x in xs]
            one = [Q.zeros4(s, signed, device) for s in shapes]
            many = [Q.zeros4(s, signed, device) for s in shapes]
            for x, q, n in zip(dx, one, ns):
                Q.quantize4_(x, q, noise=n)
            Q.quantize4_list_(dx, many, noises=ns, batch=batch)
            outs = Q.dequantize4_list(many, shapes, batch=batch)
            sync(device)
            for a, b, o, s in zip(one, many, outs, shapes):
                assert torch.equal(a.codes.cpu(), b.codes.cpu())
                assert_bits_equal(a.scale.cpu(), b.scale.cpu())
                assert_bits_equal(Q.dequantize4(a, s).cpu(), o.cpu(), nan_payload=False)


# --- stochastic rounding -------------------------------------------------------------------


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_stochastic_rounding_is_unbiased(device: torch.device, signed: bool) -> None:
    """With noise (``_rng``'s counter hash), each element takes one of its two neighbouring
    codes, and the mean decoded value over draws is the value itself (5 standard errors)."""
    g = torch.Generator().manual_seed(6)
    row = torch.randn(Q.BLOCK, generator=g) * torch.logspace(-3, 0, Q.BLOCK)
    row = row if signed else row.square()
    draws = 4096
    x = row.repeat(draws, 1)  # every block holds the same row, so has the same scale
    noise = _rng.uniform(torch.tensor(12345, dtype=torch.int32), x.shape)
    q = Q.quantize4(x.to(device), signed, noise=noise.to(device))
    out = Q.dequantize4(q, x.shape).cpu().double()
    codes = unpack(q.codes, x.numel(), signed).view(x.shape)
    assert bool((codes.max(dim=0).values - codes.min(dim=0).values <= 1).all())
    lo, hi = out.min(dim=0).values, out.max(dim=0).values
    r = row.double()
    live = torch.ones_like(r, dtype=torch.bool)
    if not signed:
        # Below the first level a positive second moment always takes code 1 (biased up,
        # never 0): the one exception to unbiasedness.
        first = (float(q.scale[0]) * float(levels(False)[1])) ** 2
        live = r >= first
        assert bool((codes[:, ~live] == 1).all())
    assert bool((lo <= r)[live].all()) and bool((hi >= r)[live].all())
    spread = hi - lo
    err = (out.mean(dim=0) - r).abs()
    bound = 5 * spread / 2 / math.sqrt(draws) + 2**-20 * r.abs()
    assert bool((err <= bound)[live].all()), float((err / bound)[live].max())
    # Nearest rounding of the same row is biased where the EMA needs it not to be:
    # stochastic codes straddle it.
    assert bool((codes.max(dim=0).values > codes.min(dim=0).values).any())


# --- devices -------------------------------------------------------------------------------

CATALOG: list[tuple[int, ...]] = [(32,), (33,), (3, 17), (4, 32), (2, 3, 7), (5, 41)]


@pytest.mark.xla
@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_xla_bits_match_cpu(xla_device: torch.device, signed: bool) -> None:
    """Codes, scales and decoded values are the same bits on XLA:CPU and the CPU, to
    nearest and with stochastic rounding (draws from _rng on each device), specials in."""
    for i, shape in enumerate(CATALOG):
        g = torch.Generator().manual_seed(100 + i)
        n = math.prod(shape)
        x = torch.randn(n, generator=g) * 10.0 ** torch.randint(-30, 10, (n,), generator=g)
        x = x if signed else x.square()
        x[0] = math.nan
        x[n // 2] = 1e-40
        x[n - 1] = -math.inf if signed else -1.0
        x = x.reshape(shape)
        key = torch.tensor(7 * i - 3, dtype=torch.int32)
        for stochastic in (False, True):
            n_cpu = _rng.uniform(key, shape) if stochastic else None
            n_xla = _rng.uniform(key.to(xla_device), shape) if stochastic else None
            qc = Q.quantize4(x, signed, noise=n_cpu)
            qx = Q.quantize4(x.to(xla_device), signed, noise=n_xla)
            buf = Q.zeros4(shape, signed, xla_device)
            Q.quantize4_(x.to(xla_device), buf, noise=n_xla)
            oc, ox = Q.dequantize4(qc, shape), Q.dequantize4(qx, shape)
            settle(ox)
            for q in (qx, buf):
                assert torch.equal(qc.codes, q.codes.cpu()), (shape, stochastic)
                assert_bits_equal(qc.scale, q.scale.cpu())
            assert_bits_equal(oc, ox.cpu(), nan_payload=False)


@pytest.mark.xla
def test_xla_round_trip_is_one_graph_without_fallback(xla_device: torch.device) -> None:
    """An encode and decode of both moments, with stochastic draws, traces into one graph
    with no aten:: fallback and no read back to the host; a second step compiles nothing."""
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.debug.metrics as met

    def count(name: str) -> int:
        data = met.metric_data(name)
        return 0 if data is None else int(data[0])

    def fallbacks() -> dict[str, int]:
        return {n: int(met.counter_value(n)) for n in met.counter_names() if n.startswith("aten::")}

    shape = (40, 6)
    m = Q.zeros4(shape, True, xla_device)
    v = Q.zeros4(shape, False, xla_device)
    key = torch.tensor(3, dtype=torch.int32, device=xla_device)
    g = torch.Generator().manual_seed(1)
    grads = [torch.randn(shape, generator=g).to(xla_device) for _ in range(4)]
    torch_xla.sync()
    xm.wait_device_ops()
    before = fallbacks()

    def step(k: int) -> None:
        mm = Q.dequantize4(m, shape).lerp_(grads[k], 0.1)
        vv = Q.dequantize4(v, shape).mul_(0.99).addcmul_(grads[k], grads[k], value=0.01)
        Q.quantize4_(mm, m)
        Q.quantize4_(vv, v, noise=_rng.uniform(key, shape))
        _rng.advance([key])
        torch_xla.sync()
        xm.wait_device_ops()

    step(0)
    step(1)
    compiles, executes, to_host = (
        count("CompileTime"),
        count("ExecuteTime"),
        count("TransferFromDeviceTime"),
    )
    step(2)
    step(3)
    assert count("CompileTime") == compiles, "a step compiled a new graph"
    assert count("ExecuteTime") - executes == 2, "expected one graph per step"
    assert count("TransferFromDeviceTime") == to_host, "a step read a tensor back"
    assert fallbacks() == before, f"fell back to the CPU: {fallbacks()}"


# --- bad input -----------------------------------------------------------------------------


def _state(n: int, signed: bool = True) -> Q.Q4State:
    return Q.zeros4((n,), signed, "cpu")


ERRORS: list[tuple[str, Callable[[], Any], type[Exception], str]] = [
    ("bf16 input", lambda: (torch.zeros(40, dtype=torch.bfloat16), _state(40)),
     TypeError, "expected a torch.float32 tensor"),
    ("wrong size", lambda: (torch.zeros(41), _state(40)), ValueError, r"shape \(21,\)"),
    ("unpacked codes", lambda: (torch.zeros(40), Q.Q4State(torch.zeros(40, dtype=torch.int8),
     torch.zeros(2, dtype=torch.bfloat16))), ValueError, "packed codes of shape"),
    ("wrong scale dtype", lambda: (torch.zeros(40), Q.Q4State(torch.zeros(20, dtype=torch.int8),
     torch.zeros(2))), ValueError, "bfloat16 scales"),
    ("too few scales", lambda: (torch.zeros(40), Q.Q4State(torch.zeros(20, dtype=torch.uint8),
     torch.zeros(1, dtype=torch.bfloat16))), ValueError, r"shape \(2,\)"),
    ("float codes", lambda: (torch.zeros(40), Q.Q4State(torch.zeros(20),
     torch.zeros(2, dtype=torch.bfloat16))), TypeError, "torch.int8 .signed map."),
    ("not a state", lambda: (torch.zeros(40), (torch.zeros(20, dtype=torch.int8),
     torch.zeros(2, dtype=torch.bfloat16))), TypeError, "expected a Q4State"),
]  # fmt: skip


@pytest.mark.parametrize("row", ERRORS, ids=[r[0] for r in ERRORS])
def test_bad_inputs_write_nothing(row: tuple[str, Callable[[], Any], type[Exception], str]) -> None:
    _, make, exc, msg = row
    x, q = make()
    snap = snapshot([x, *q])
    with pytest.raises(exc, match=msg):
        Q.quantize4_(x, q)
    good_x, good_q = torch.ones(40), _state(40)
    snap_good = snapshot([good_x, *good_q])
    with pytest.raises(exc, match=msg):
        # The good pair comes first and must not be written either.
        Q.quantize4_list_([good_x, x], [good_q, q])
    assert_unchanged([x, *q], snap)
    assert_unchanged([good_x, *good_q], snap_good)


def test_bad_noise_writes_nothing() -> None:
    x, q = torch.ones(40), _state(40, signed=False)
    snap = snapshot([x, *q])
    for noise in (torch.zeros(41), torch.zeros(40, dtype=torch.float64), 0.5):
        with pytest.raises(ValueError, match=r"noise: expected None or a torch\.float32 tensor"):
            Q.quantize4_(x, q, noise=noise)  # type: ignore[arg-type]
    assert_unchanged([x, *q], snap)


@pytest.mark.parametrize("shape", [(), (3,), (31,), (0,), (5, 6)])
def test_a_leaf_under_one_block_is_refused_with_a_pointer_to_partition(
    shape: tuple[int, ...],
) -> None:
    """As with 8-bit moments: a 0-d temperature or a short bias gets a clear error that
    names it and points to ``partition``, from every entry that makes a state."""
    n = math.prod(shape)
    msg = (
        rf"at 'masters\.b': expected a leaf of at least 32 elements for 4-bit moments, "
        rf"got {n} elements\. Keep small leaves in fp32 state: mpfunc\.partition"
    )
    with pytest.raises(ValueError, match=msg):
        Q.zeros4(shape, True, "cpu", path="masters.b")
    with pytest.raises(ValueError, match=msg):
        Q.quantize4(torch.zeros(shape), False, path="masters.b")
    tree = {"a": torch.zeros(40), "b": torch.zeros(shape), "c": None}
    faces = _tree.flatten(tree)[0]
    side = _checks.Side("masters", tree, faces)
    with pytest.raises(ValueError, match=r"adamw: at 'masters\.b'.*partition"):
        Q.check_quantizable("adamw", side, faces)
    Q.check_quantizable("adamw", side, [faces[0], None, faces[2] if n >= 32 else None])

"""The one-node kernel's 8-bit and 4-bit codec (``_xla_kernels.Builder.encode``/``decode``
and ``_quantize4.encode_ops``/``decode_ops``) against the torch path on the CPU, bit for
bit, alone (the pair tests in test_xla_kernels.py check them inside whole steps).

The node's codec is written for XLA:CPU's code generator rather than op for op (table
values by division, the unsigned scale as the ``sqrt`` of the block's largest value,
nibbles packed through 16-bit bitcasts), so these tests hold it to the specification on
adversarial values: NaN, infinities, signed zeros, subnormals, the smallest normal, values
above bf16's largest (a scale clamp), negatives for the unsigned map, all-zero and
one-value blocks, a partial last block and a half-filled last byte; every code on decode,
with zero, subnormal, clamped and NaN scales. Shapes come from a small fixed catalog
(each is a compile).
"""

from __future__ import annotations

import math
from typing import Any

import optree
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mpfunc.backends import _xla_kernels
from mpfunc.state_formats import _quantize, _quantize4

SHAPES = ((41,), (4, 16), (3, 40))
F32 = torch.float32
SPECIAL = (
    math.nan, math.inf, -math.inf, 0.0, -0.0, 1e-45, -1e-45, 2.0**-126, -(2.0**-126),
    2.0**-127, 1.0, -1.0, 3.4e38, -3.4e38, 3.3895314e38, 1e-30, 65504.0,
)  # fmt: skip

_COMPUTATIONS: dict[tuple[Any, ...], Any] = {}


def _computation(key: tuple[Any, ...]) -> Any:
    """One cached builder computation per (forms, what, bits, signed, stochastic, shape)."""
    comp = _COMPUTATIONS.get(key)
    if comp is not None:
        return comp
    forms, what, bits, signed, stochastic, shape = key
    b = _xla_kernels.Builder("codec")
    b.cpu_forms = forms == "cpu"
    n = math.prod(shape)
    if what == "encode":
        x = b.param(shape, F32)
        noise = b.param(shape, F32) if stochastic else None
        if bits == 8:
            outs = list(b.encode(x, signed, noise, shape))
        else:
            outs = list(_quantize4.encode_ops(b, x, signed, noise, shape))
    elif bits == 8:
        codes = b.param(shape, torch.int8 if signed else torch.uint8)
        b._signed[id(codes)] = signed
        outs = [b.decode(codes, b.param((_quantize.blocks(n),), torch.bfloat16), shape)]
    else:
        codes = b.param((_quantize4.packed_bytes(n),), torch.int8 if signed else torch.uint8)
        scale = b.param((_quantize4.blocks(n),), torch.bfloat16)
        outs = [_quantize4.decode_ops(b, codes, scale, shape, signed)]
    comp = _COMPUTATIONS[key] = b.xb.Op.tuple(outs).build("codec")
    return comp


def _run(key: tuple[Any, ...], inputs: list[torch.Tensor], device: torch.device) -> list[Any]:
    comp = _computation(key)
    args = [t.to(device) for t in inputs]
    out = _xla_kernels._xlac()._xla_user_computation("xla::codec_test", args, comp)
    return [t.cpu() for t in out]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bits, any NaN equal to any NaN."""
    assert a.dtype == b.dtype and a.shape == b.shape
    if not a.is_floating_point():
        return torch.equal(a, b)
    nan = a.isnan()
    if not torch.equal(nan, b.isnan()):
        return False
    width = {torch.float32: torch.int32, torch.bfloat16: torch.int16}[a.dtype]
    return torch.equal(a[~nan].view(width), b[~nan].view(width))


@st.composite
def _values(draw: Any, n: int) -> torch.Tensor:
    """``n`` fp32 values: mostly random magnitudes over fp32's range, with special values,
    all-zero and one-value blocks mixed in."""
    exp = draw(st.lists(st.integers(-150, 127), min_size=n, max_size=n))
    mant = draw(st.lists(st.floats(-2.0, 2.0, width=32), min_size=n, max_size=n))
    x = torch.tensor(mant, dtype=torch.float64) * torch.tensor(exp, dtype=torch.float64).exp2()
    x = x.clamp(-3.4e38, 3.4e38).float()
    for i in draw(st.lists(st.integers(0, n - 1), max_size=n // 2)):
        x[i] = draw(st.sampled_from(SPECIAL))
    if draw(st.booleans()):  # an all-zero block, and a block with one nonzero value
        x[:32] = 0.0
        x[32:64] = 0.0
        x[min(40, n - 1)] = draw(st.sampled_from((1e-3, 7.0, 3.3e38, -2.5)))
    return x


# The node's forms for XLA:CPU (bitcast nibble packing) and for other devices and SPMD.
FORMS = ["cpu", "plain"]


@pytest.mark.parametrize("forms", FORMS)
@pytest.mark.parametrize("bits", [8, 4])
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_encode_is_the_torch_paths_bits(
    xla_device: torch.device, bits: int, forms: str, data: Any
) -> None:
    shape = data.draw(st.sampled_from(SHAPES))
    signed, stochastic = data.draw(st.booleans()), data.draw(st.booleans())
    n = math.prod(shape)
    x = data.draw(_values(n)).reshape(shape)
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 99)))
    noise = torch.rand(shape, generator=gen)
    if stochastic:  # draws at the boundaries too
        noise.view(-1)[:3] = torch.tensor([0.0, 0.5, 1.0 - 2.0**-24])
    inputs = [x, noise] if stochastic else [x]
    got = _run((forms, "encode", bits, signed, stochastic, shape), inputs, xla_device)
    quantize = _quantize.quantize if bits == 8 else _quantize4.quantize4
    want = quantize(x, signed, noise=noise if stochastic else None)
    assert _same(got[0], want.codes), (bits, signed, stochastic)
    assert _same(got[1], want.scale), (bits, signed, stochastic)


def _scales(draw: Any, nb: int) -> torch.Tensor:
    pick = (0.0, 1e-40, 2.0**-126, 1.0, 0.37, 3.3895314e38, math.nan, 5e-3)
    scale = torch.tensor([draw(st.sampled_from(pick)) for _ in range(nb)])
    scale[0] = draw(st.sampled_from((0.0, 1e-40)))  # the mark +inf times a zero scale
    return scale.bfloat16()


@pytest.mark.parametrize("forms", FORMS)
@pytest.mark.parametrize("bits", [8, 4])
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_decode_is_the_torch_paths_bits(
    xla_device: torch.device, bits: int, forms: str, data: Any
) -> None:
    """Every code value (the marks included) under zero, subnormal, clamped and NaN scales."""
    shape = data.draw(st.sampled_from(SHAPES))
    signed = data.draw(st.booleans())
    n = math.prod(shape)
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 99)))
    dtype = torch.int8 if signed else torch.uint8
    if bits == 8:
        start = data.draw(st.integers(0, 255))  # a run of consecutive codes from here
        codes = (start + torch.arange(n)) % 256
        codes[:4] = torch.tensor([0, 127, 128, 255])  # both marks and the extremes
        codes = codes.to(torch.uint8).view(dtype).reshape(shape)
        scale = _scales(data.draw, _quantize.blocks(n))
        want = _quantize.dequantize(_quantize.QState(codes, scale))
    else:
        codes = torch.randint(0, 256, (_quantize4.packed_bytes(n),), generator=gen)
        codes[:16] = torch.arange(16) * 17  # every nibble, low and high, in the first block
        codes[16:20] = torch.tensor([0x8F, 0xF8, 0x78, 0x87])  # the marks beside the extremes
        codes = codes.to(torch.uint8).view(dtype)
        scale = _scales(data.draw, _quantize4.blocks(n))
        want = _quantize4.dequantize4(_quantize4.Q4State(codes, scale), shape)
    (got,) = _run((forms, "decode", bits, signed, False, shape), [codes, scale], xla_device)
    assert _same(got, want), (bits, signed)


@pytest.mark.parametrize("state_dtype", [torch.uint8, torch.uint4], ids=["uint8", "uint4"])  # type: ignore[attr-defined]
@pytest.mark.parametrize("strategy", ["remainder", "kahan", "stochastic"])
def test_cpu_forms_change_no_result(
    xla_device: torch.device, monkeypatch: pytest.MonkeyPatch, strategy: str, state_dtype: Any
) -> None:
    """On XLA:CPU the node stores new encoded moments (and a remainder's or Kahan master)
    once between fusions (``Builder.barrier``), packs nibbles by bitcasts and steps the
    leaves of these pairs in turn (``Builder.in_turn``); with the plain forms, as it is
    built for a TPU, a GPU or SPMD, three AdamW steps give the same state, bit for bit, but
    for the last bit
    of an fp32 master (a remainder's low half: XLA:CPU contracts ``a * b + c`` where both
    land in one fusion, as test_xla_kernels.py states for every pair)."""
    import mpfunc
    from mpfunc.strategies import _remainder

    def run(device_type: str) -> list[torch.Tensor]:
        monkeypatch.setattr(_xla_kernels, "_device_type", lambda: device_type)
        _xla_kernels.clear_cache()
        gen = torch.Generator().manual_seed(3)
        # Two leaves: "b" waits for "a" on XLA:CPU (``Builder.in_turn``), through a
        # predicate on a's first element, here NaN at every step: b must not see it.
        a = torch.randn(4, 16, generator=gen)
        a[0, 0] = math.nan
        params = {
            "a": a.bfloat16().to(xla_device),
            "b": torch.randn(4, 16, generator=gen).bfloat16().to(xla_device),
        }
        masters = mpfunc.init_master(params, strategy=strategy)
        opt = mpfunc.adamw(1e-2, weight_decay=0.1, state_dtype=state_dtype)
        state = opt.init(masters)
        for _ in range(3):
            grads = {k: torch.randn(4, 16, generator=gen).bfloat16().to(xla_device) for k in params}
            mpfunc.apply_update_(masters, grads, state, opt)
        return [t.cpu() for t in _flat((masters, state))]

    try:
        with_barriers, without = run("CPU"), run("SPMD")
    finally:
        _xla_kernels.clear_cache()
    for i, (a, b) in enumerate(zip(with_barriers, without, strict=True)):
        if a.dtype == torch.int16:  # a remainder: the fp32 master it makes with its param
            a = _remainder.join(with_barriers[i - 1], a, with_barriers[i + 1])
            b = _remainder.join(without[i - 1], b, without[i + 1])
            nan = a.isnan()
            assert torch.equal(nan, b.isnan()) and bool(nan.any()) == (i < 4)
            a, b = a[~nan], b[~nan]
            assert float((a - b).abs().max()) <= 2.0**-22 * float(b.abs().max())
            continue
        assert _same(a, b), (i, a.dtype)


def _flat(tree: Any) -> list[torch.Tensor]:
    return [x for x in optree.tree_leaves(tree) if isinstance(x, torch.Tensor)]

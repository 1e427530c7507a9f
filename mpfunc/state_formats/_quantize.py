"""Blockwise 8-bit optimizer moments: companded linear codes with bf16 block scales.

The building blocks of ``state_dtype=torch.uint8``: a moment is cut into blocks of
``BLOCK`` = 32 consecutive elements (in logical, row-major order), each block keeps
its largest finite magnitude as a bfloat16 ``scale``, and every element keeps one
byte, a companded code relative to its block's scale:

* **signed** (first moments; codes ``int8``): ``y = x / s``, ``t = 2y / (1 + |y|)``,
  ``code = round(127 t)`` in ``[-127, 127]``; ``-128`` marks a non-finite value.
* **unsigned** (second moments; codes ``uint8``): ``y = sqrt(x) / s`` with ``s`` the
  block's largest ``sqrt(x)``, ``t = 2y / (1 + y)``, ``code = round(254 t)`` in
  ``[0, 254]``, and a positive ``x`` never gets code 0; ``255`` marks a non-finite
  or negative value and decodes to ``+inf``, whatever its block's scale.

Why ``+inf`` for the second moment's mark: a finite grad above about 1.8e19 overflows
``v`` to ``inf`` in fp32 and bf16 state alike, and Adam's update ``m / (sqrt(v) + eps)``
is then 0 there, so the master stays finite (torch.optim's behaviour). Read back as
NaN, the mark turned that into a NaN master on the next step. A NaN second moment
only ever comes with a NaN first moment (a NaN grad), whose mark still decodes to NaN,
so the update is NaN exactly where fp32 state gives NaN. (Checkpoints written before
this rule decode the same, but for such marks, which they only held beside a NaN first
moment or after an overflow.)

The code's dtype says which map it is, so a ``QState`` needs no flag beside its
tensors, and a checkpoint that keeps dtypes keeps the map.

Why this code (measured; the issue-10 helper's report has the tables). An fp32 AdamW
run of a small character LM (2 layers, d_model 64, beta2 = 0.999) fed its gradients to
8-bit moments on the side; after 1000 steps the Adam direction ``m / sqrt(v)`` rebuilt
from them was off by (RMS, relative):

* 20.8%: bitsandbytes' dynamic-tree map, 256-element fp32-scaled blocks (torchao's
  default layout);
*  4.4%: FlashOptim's code (softsign for ``m``, linear in ``sqrt(v)``), with the same
  32-element bf16-scaled blocks and stochastic rounding;
* 10.2%: this code, both moments rounded to nearest;
*  4.3%: this code, ``m`` to nearest and ``v`` rounded stochastically (recommended).

Small blocks matter more than the map (FlashOptim's code, nearest rounding, at step
300: 14.2% with 256-element blocks, 7.8% with 64, 5.5% with 32), and bf16 scales make
32-element blocks cost what fp32 scales cost at 64: 2 bytes per 32 elements, so both
moments together take 2.125 bytes per parameter. Softsign on ``sqrt(v)`` rather than a
linear code gives small second moments finer steps (4.2% against 5.5% at step 300).

Nearest rounding of the second moment drifts: an EMA step of ``1 - beta2`` = 0.1% is
far below half a code step, so a stored value that should move sticks, and the error
feeds back every step (the stored ``v`` was 12% low, weighted by update size, after
1000 steps). Stochastic rounding with draws from the caller (``noise``) is unbiased in
the value and removes the drift (-1.1%); on a noisy quadratic, nearest ``v`` ended 34-43%
above fp32 Adam's loss after 600 steps, stochastic ``v`` 1.6-5.9%. The first moment
(``beta1`` = 0.9) is best rounded to nearest: stochastic rounding only adds variance.

Every function is sync-free (no host read of a value), traces on XLA into plain
elementwise ops, one block reduction and 256-entry table gathers, with no ``aten::``
fallback, and gives the same bits on the CPU and on XLA:CPU (given the same noise).
Subnormal inputs and results read as zero on every device, because XLA:CPU flushes
them and the CPU does not.

See docs/design.md#the-8-bit-moment-codec.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch

from mpfunc.core import _tensors

__all__ = [
    "BLOCK",
    "SCALE_DTYPE",
    "QState",
    "adam_step_quantized_",
    "blocks",
    "bytes_per_element",
    "dequantize",
    "dequantize_list",
    "quantize",
    "quantize_",
    "quantize_list_",
    "zeros",
]

BLOCK = 32
SCALE_DTYPE = torch.bfloat16
SIGNED_DTYPE = torch.int8
UNSIGNED_DTYPE = torch.uint8
_S_LEVELS = 127  # signed codes -127..127
_U_LEVELS = 254  # unsigned codes 0..254
_S_NAN = -128
_U_NAN = 255
_TINY = 2.0**-126  # fp32's smallest normal
# bf16's largest finite value: a block's scale is clamped to it, so a moment above it (up to
# fp32's largest) does not round its scale to inf and the rest of its block to NaN.
BF16_MAX = float(torch.finfo(torch.bfloat16).max)


class QState(NamedTuple):
    """One quantized moment. Both fields are tensors, so it is a pytree node like any NamedTuple.

    ``codes``: ``int8`` (signed map) or ``uint8`` (unsigned map), the moment's own shape,
      contiguous; element ``i`` in row-major order belongs to block ``i // BLOCK``.
    ``scale``: ``bfloat16`` of shape ``(blocks(numel),)``: per block, the largest finite
      magnitude (signed) or the largest finite ``sqrt`` (unsigned), rounded to nearest.
    """

    codes: torch.Tensor
    scale: torch.Tensor


# A NamedTuple of two tensors: safe for torch.load(weights_only=True), torch's default since
# 2.6 and how HF's Trainer reloads an optimizer's state_dict on resume.
torch.serialization.add_safe_globals([QState])


def blocks(numel: int) -> int:
    """The number of blocks (and scales) of a moment with ``numel`` elements."""
    return -(-numel // BLOCK)


def bytes_per_element(numel: int) -> float:
    """Persistent bytes per element of one quantized moment: the code plus its share of scales."""
    if numel == 0:
        return 0.0
    return (numel + blocks(numel) * torch.finfo(SCALE_DTYPE).bits // 8) / numel


def _decode_table(signed: bool) -> list[float]:
    """Code -> companded-back magnitude, in float64 then rounded once to fp32 by the caller.

    Entry ``i`` decodes code ``i - 128`` (signed) or ``i`` (unsigned); the signed mark
    decodes to NaN, the unsigned one to ``+inf`` (see the module docstring). The inverse
    of ``t = 2y / (1 + |y|)`` is ``y = t / (2 - |t|)``.
    """
    if signed:
        table = [math.nan]
        for k in range(-_S_LEVELS, _S_LEVELS + 1):
            t = k / _S_LEVELS
            table.append(t / (2 - abs(t)))
        return table
    table = []
    for k in range(_U_LEVELS + 1):
        t = k / _U_LEVELS
        table.append(t / (2 - t))
    return [*table, math.inf]


_TABLE_CPU = {
    True: torch.tensor(_decode_table(True), dtype=torch.float64).float(),
    False: torch.tensor(_decode_table(False), dtype=torch.float64).float(),
}
# One copy of each table per device: moving 1 KiB per call would be a transfer per step.
_TABLES: dict[tuple[bool, torch.device], torch.Tensor] = {}


def _entry(k: torch.Tensor, levels: int) -> torch.Tensor:
    """The decode table's value of the float codes ``k`` (not the marks): ``k / (2L - |k|)``
    for a map with ``L`` levels a side, one fp32 division, which is the table's entry bit
    for bit (it is the correctly rounded quotient the float64 table rounds to;
    tests/test_native_composed.py checks every entry). As ``Builder.entry`` on XLA."""
    return k / (2.0 * levels - k.abs())


def _table(signed: bool, device: torch.device) -> torch.Tensor:
    key = (signed, device)
    t = _TABLES.get(key)
    if t is None:
        t = _TABLES[key] = _TABLE_CPU[signed].to(device)
    return t


def _is_signed(codes: torch.Tensor) -> bool:
    if codes.dtype == SIGNED_DTYPE:
        return True
    if codes.dtype == UNSIGNED_DTYPE:
        return False
    raise TypeError(
        f"QState.codes: expected torch.int8 (signed map) or torch.uint8 (unsigned map), got "
        f"{codes.dtype}"
    )


def _as_blocks(flat: torch.Tensor) -> torch.Tensor:
    """``flat`` (1-D) zero-padded to whole blocks and viewed as ``(blocks, BLOCK)``."""
    n = flat.numel()
    pad = blocks(n) * BLOCK - n
    if pad:  # a shape, not a value: no host read
        flat = torch.nn.functional.pad(flat, (0, pad))
    return flat.view(-1, BLOCK)


def _blocks_of(x: torch.Tensor | None) -> torch.Tensor | None:
    """A tensor's elements in row-major order, as zero-padded blocks (None stays None)."""
    return None if x is None else _as_blocks(x.reshape(-1))


def _store(code: torch.Tensor, scale: torch.Tensor, q: QState) -> None:
    """Writes ``_encode``'s blocks of one tensor into its state (padding dropped)."""
    q.codes.view(-1).copy_(code.view(-1)[: q.codes.numel()])
    q.scale.copy_(scale)


def sqrt_rn(x: torch.Tensor) -> torch.Tensor:
    """``sqrt(x)`` of fp32 ``x``, correctly rounded, as the native pass and XLA compute it.
    torch's CPU ``sqrt`` (2.9, this build) is 1 ulp off for about a fifth of fp32 inputs,
    which moved a stochastic second-moment code now and then (about one in a million per
    step): on the CPU it goes through float64, whose sqrt rounded to fp32 is exact
    (53 >= 2 * 24 + 2 bits). Elsewhere (XLA, CUDA) ``sqrt`` is correctly rounded."""
    if x.device.type == "cpu":
        return torch.sqrt(x.double()).float()
    return torch.sqrt(x)


def _flush(x: torch.Tensor) -> torch.Tensor:
    """Magnitudes below fp32's smallest normal read as 0 (NaN stays NaN).

    XLA:CPU flushes subnormals to zero in arithmetic and the CPU does not; flushing
    them explicitly, on every device, is what makes the two agree bit for bit.
    """
    return torch.where(x.abs() < _TINY, 0.0, x)


def _encode(
    xb: torch.Tensor, signed: bool, noise: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes (int32) and bf16 scales of fp32 blocks ``(blocks, BLOCK)``, by the rules above.

    The op order is fixed, every op is exact or IEEE correctly rounded, and subnormals
    are flushed on every device, so the CPU and XLA:CPU give the same bits. With
    ``noise`` (uniform in [0, 1), one draw per element), codes are rounded
    stochastically instead of to nearest; see ``quantize_``. Padding zeros get code 0.
    """
    ok = torch.isfinite(xb)
    if not signed:
        # A negative second moment is as wrong as a NaN one: it gets the NaN code. (A
        # negative subnormal reads as 0, as every subnormal does.)
        ok = ok & (xb > -_TINY)
    keep = ok & (xb.abs() >= _TINY)
    vals = torch.where(keep, xb, 0.0)
    if not signed:
        vals = sqrt_rn(vals)
    # The scale covers finite values only: a NaN or inf marks its own element, and its
    # block's other elements keep their precision.
    scale = vals.abs().amax(dim=1).clamp(max=BF16_MAX).to(SCALE_DTYPE)
    s = _tensors.widened(scale)
    # An all-zero block has scale 0; dividing by 1 instead keeps its codes 0 without a branch.
    y = _flush(vals / torch.where(s > 0, s, 1.0).unsqueeze(1))
    # Rounding the scale to bf16 can put |y| up to 2**-9 above 1 (2**-8 where the scale is
    # clamped to bf16's largest value); the clamps keep it on the top code.
    t = (y + y) / (y.abs() + 1.0)
    levels, low = (_S_LEVELS, -_S_LEVELS) if signed else (_U_LEVELS, 0)
    if noise is None:
        code = torch.round(t * levels).clamp(low, levels).to(torch.int32)
    else:
        code = _round_stochastic(y, t, signed, noise)
    if not signed:
        # A positive second moment never decodes to 0: Adam would divide by eps alone.
        code = torch.where(keep, torch.clamp(code, min=1), code)
    code = torch.where(ok, code, _S_NAN if signed else _U_NAN)
    return code, scale


def square(x: torch.Tensor) -> torch.Tensor:
    """``x * x`` of float32 ``x``, flushed (``_flush``): its own bits wherever it is zero
    or normal, as the squares of the stochastic decision below always are but for ``y``'s
    (whose flush that decision takes anyway). The select of the flush sits between the
    product and the subtraction that reads it, so that no compiler fuses the two into one
    multiply-add: XLA:CPU fused ``b * b - a * a`` into ``fma(b, b, -(a * a))`` and
    ``y * y - a * a`` likewise, which moved about one unsigned code in 2.5 million a step
    against the CPU's (found in review, 2026-12-05). A float64 product rounded to float32
    does not stop it: LLVM narrows it back to a float32 product, legitimately, then fuses."""
    return _flush(x * x)


def _round_stochastic(
    y: torch.Tensor, t: torch.Tensor, signed: bool, noise: torch.Tensor
) -> torch.Tensor:
    """Rounds up with the probability that makes the decoded value unbiased.

    Between the codes ``lo`` and ``lo + 1`` around ``t``, the decoded values (in the
    moment's own units: ``y`` signed, ``y**2`` unsigned) are ``a`` and ``b``; code
    ``lo + 1`` is taken when ``noise < (value - a) / (b - a)``, so the expected decoded
    moment is the moment itself. Unbiased in the value, not in ``t``: the compander is
    curved, and a rounding unbiased in ``t`` would inflate second moments step after step.
    """
    levels, low = (_S_LEVELS, -_S_LEVELS) if signed else (_U_LEVELS, 0)
    lo = torch.floor(t * levels).clamp(low, levels - 1)
    # The two table entries around t, each by the one fp32 division the table holds
    # (``_entry``, bit for bit): no table gather. Gathered, a compiled step's kernel failed
    # inductor's bounds check on the index after the step had written (found in review).
    a, b = _entry(lo, levels), _entry(lo + 1.0, levels)
    lo = lo.to(torch.int32)
    value = y
    if not signed:
        value, a, b = square(y), square(a), square(b)
    up = noise < (value - a) / (b - a)
    return lo + up.to(torch.int32)


def _check_float(fn: str, x: torch.Tensor) -> None:
    # fp32 only: the moments are computed in fp32, and reading fp64 would round (or
    # overflow) behind the caller's back.
    if not isinstance(x, torch.Tensor) or x.dtype != torch.float32:
        got = f"{x.dtype} tensor" if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"{fn}: expected a torch.float32 tensor, got {got}")


def quantize(x: torch.Tensor, signed: bool, *, noise: torch.Tensor | None = None) -> QState:
    """Quantizes a moment into fresh codes and scales.

    Args:
      x: a floating-point tensor of any shape and layout; read in row-major order.
      signed: ``True`` for first moments (any sign), ``False`` for second moments
        (non-negative; a negative value is treated as non-finite).
      noise: ``None`` to round to nearest, or uniform draws in [0, 1) shaped like ``x``
        for stochastic rounding; see ``quantize_``.

    Returns:
      A ``QState`` whose codes have ``x``'s shape (contiguous) and whose scales have
      ``blocks(x.numel())`` entries, on ``x``'s device.

    Raises:
      TypeError: ``x`` is not a floating-point tensor.
    """
    _check_float("quantize", x)
    _check_noise("quantize", x, noise)
    code, scale = _encode(_as_blocks(x.reshape(-1)), signed, _blocks_of(noise))
    dtype = SIGNED_DTYPE if signed else UNSIGNED_DTYPE
    codes = code.view(-1)[: x.numel()].to(dtype).view(x.shape)
    return QState(codes, scale)


def zeros(shape: Sequence[int] | torch.Size, signed: bool, device: torch.device | str) -> QState:
    """The quantized form of a zero moment: an optimizer's initial state."""
    n = math.prod(shape)
    dtype = SIGNED_DTYPE if signed else UNSIGNED_DTYPE
    return QState(
        torch.zeros(tuple(shape), dtype=dtype, device=device),
        torch.zeros(blocks(n), dtype=SCALE_DTYPE, device=device),
    )


def _check_noise(fn: str, x: torch.Tensor, noise: torch.Tensor | None) -> None:
    if noise is None:
        return
    if (
        not isinstance(noise, torch.Tensor)
        or noise.dtype != torch.float32
        or noise.shape != x.shape
        or noise.device != x.device
    ):
        got = (
            f"{noise.dtype} tensor of shape {tuple(noise.shape)} on {noise.device}"
            if isinstance(noise, torch.Tensor)
            else type(noise).__name__
        )
        raise ValueError(
            f"{fn}: noise: expected None or a torch.float32 tensor of shape {tuple(x.shape)} "
            f"on {x.device}, got {got}"
        )


def _check_pair(fn: str, x: torch.Tensor, q: QState) -> None:
    _check_float(fn, x)
    _is_signed(q.codes)
    if q.codes.shape != x.shape or not q.codes.is_contiguous():
        raise ValueError(
            f"{fn}: expected contiguous codes of the moment's shape {tuple(x.shape)}, got "
            f"shape {tuple(q.codes.shape)}"
        )
    if q.scale.dtype != SCALE_DTYPE or q.scale.shape != (blocks(x.numel()),):
        raise ValueError(
            f"{fn}: expected {SCALE_DTYPE} scales of shape ({blocks(x.numel())},), got "
            f"{q.scale.dtype} of shape {tuple(q.scale.shape)}"
        )
    if q.codes.device != x.device or q.scale.device != x.device:
        raise ValueError(
            f"{fn}: expected codes and scales on {x.device}, got {q.codes.device} and "
            f"{q.scale.device}"
        )


def quantize_(x: torch.Tensor, q: QState, *, noise: torch.Tensor | None = None) -> QState:
    """Quantizes ``x`` into ``q``'s existing codes and scales, in place; returns ``q``.

    The map (signed or unsigned) is the one ``q.codes``'s dtype names.

    Args:
      x: the fp32 (or other floating) moment, any layout, ``q.codes``'s shape.
      q: the state written.
      noise: ``None`` (round to nearest) or uniform draws in [0, 1), float32, shaped like
        ``x`` (e.g. ``torch.rand`` on the device, from the caller's seeded generator).
        With noise, each element takes one of its two neighbouring codes with the
        probability that makes the decoded moment unbiased, so an EMA update smaller than
        a code step still moves the state on average instead of sticking.

    Raises:
      TypeError, ValueError: ``x`` is not floating point, or ``q`` does not fit ``x``
        (shape, dtype, device); nothing is written then.
    """
    _check_pair("quantize_", x, q)
    _check_noise("quantize_", x, noise)
    code, scale = _encode(_as_blocks(x.reshape(-1)), _is_signed(q.codes), _blocks_of(noise))
    _store(code, scale, q)
    return q


def _decode(codes: torch.Tensor, scale: torch.Tensor, signed: bool) -> torch.Tensor:
    """fp32 blocks ``(blocks, BLOCK)`` from flat codes (any length up to whole blocks)."""
    # int32 indices: widening int8/uint8 to int64 costs torch's CPU several times more.
    idx = codes.to(torch.int32)
    if signed:
        idx = idx + 128
    vals = torch.index_select(_table(signed, codes.device), 0, idx)
    s = scale.to(torch.float32)
    if not signed:
        # The mark is +inf even in a block whose finite values are all 0 (scale 0, where
        # inf * 0 would be NaN). Only zero scales change: every other one is at least
        # 2**-63, and an all-zero block's finite codes are 0, so its values stay 0.
        s = s.clamp(min=_TINY)
    y = _as_blocks(vals) * s.unsqueeze(1)
    if not signed:
        y = y * y
    return _flush(y)


def dequantize(q: QState) -> torch.Tensor:
    """The fp32 moment a ``QState`` holds, in the codes' shape (contiguous).

    Signed: ``scale * T[code]``; unsigned: ``(scale * T[code]) ** 2``, where ``T`` decodes
    the compander (``t / (2 - |t|)`` at ``t = code / levels``). The signed mark gives NaN,
    the unsigned one ``+inf``.
    """
    signed = _is_signed(q.codes)
    y = _decode(q.codes.reshape(-1), q.scale, signed)
    return y.view(-1)[: q.codes.numel()].view(q.codes.shape)


def _batched(qs: Sequence[QState], batch: bool | None) -> bool:
    """Whether a list goes through one concatenated graph. By default on lazy devices
    (XLA), where each op is a traced node; only ever for one map on one device. Blocks
    never straddle two tensors, so the result is the same bits as one call per tensor."""
    if not qs:
        return False
    first = qs[0].codes
    if batch is None:
        batch = len(qs) > 1 and _tensors.is_lazy(first.device)
    return batch and all(
        q.codes.dtype == first.dtype and q.codes.device == first.device for q in qs
    )


def dequantize_list(qs: Sequence[QState], *, batch: bool | None = None) -> list[torch.Tensor]:
    """``dequantize`` of each state, as a list (the form a foreach kernel takes).

    ``batch`` (default: on XLA) decodes the whole list as one concatenation: a handful
    of traced ops per tensor instead of two dozen, with the same bits.
    """
    for q in qs:
        _is_signed(q.codes)
    if not _batched(qs, batch):
        return [dequantize(q) for q in qs]
    signed = _is_signed(qs[0].codes)
    codes = torch.cat([_as_blocks(q.codes.reshape(-1)).view(-1) for q in qs])
    y = _decode(codes, torch.cat([q.scale for q in qs]), signed).view(-1)
    sizes = [q.scale.numel() * BLOCK for q in qs]
    # Fresh tensors, not views of ``y``: kernels update their moments in place, and on XLA
    # an in-place write to one view of a base rewrites the base and re-slices every other
    # view from it, so k views made a graph quadratic in k (the 101-leaf seed model's
    # 8-bit step compiled in ~260 s and ran 11.5 s; NOTES.md).
    return [
        part[: q.codes.numel()].view(q.codes.shape).clone()
        for part, q in zip(torch.split(y, sizes), qs)
    ]


def quantize_list_(
    xs: Sequence[torch.Tensor],
    qs: Sequence[QState],
    *,
    noises: Sequence[torch.Tensor | None] | None = None,
    batch: bool | None = None,
) -> None:
    """``quantize_`` of each pair; every pair is checked before the first write.

    ``noises``: ``None``, or one ``noise`` (a tensor or ``None``) per pair. ``batch`` as in
    ``dequantize_list``; a batched list with noise needs noise for every pair.
    """
    if len(xs) != len(qs):
        raise ValueError(f"quantize_list_: expected as many states as tensors, got {len(qs)}")
    ns: Sequence[torch.Tensor | None] = [None] * len(xs) if noises is None else noises
    if len(ns) != len(xs):
        raise ValueError(f"quantize_list_: expected as many noises as tensors, got {len(ns)}")
    for x, q, n in zip(xs, qs, ns):
        _check_pair("quantize_list_", x, q)
        _check_noise("quantize_list_", x, n)
    mixed = any(n is None for n in ns) and any(n is not None for n in ns)
    if mixed or not _batched(qs, batch):
        for x, q, n in zip(xs, qs, ns):
            code, scale = _encode(_as_blocks(x.reshape(-1)), _is_signed(q.codes), _blocks_of(n))
            _store(code, scale, q)
        return
    xb = torch.cat([_as_blocks(x.reshape(-1)) for x in xs])
    nb = (
        None
        if ns[0] is None
        else torch.cat([_as_blocks(n.reshape(-1)) for n in ns if n is not None])
    )
    code, scale = _encode(xb, _is_signed(qs[0].codes), nb)
    counts = [q.scale.numel() for q in qs]
    for c, sc, q in zip(torch.split(code, counts), torch.split(scale, counts), qs):
        _store(c, sc, q)


def _ln(beta: float) -> float:
    return math.log(beta) if beta > 0 else -math.inf


def adam_step_quantized_(
    param: torch.Tensor,
    grad: torch.Tensor,
    m_q: QState,
    v_q: QState,
    step: torch.Tensor,
    lr: float | torch.Tensor,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    *,
    decoupled: bool = True,
    m_noise: torch.Tensor | None = None,
    v_noise: torch.Tensor | None = None,
) -> None:
    """One Adam(W) step of one tensor with 8-bit moments: dequantize, fp32 math, quantize.

    A demonstration of the kernel shape, op for op the math of ``mpfunc.optim._adam._reference``
    (with ``amsgrad`` and ``maximize`` off), so that the param it writes is bit-identical
    to that reference run on ``dequantize(m_q)``/``dequantize(v_q)``. In a ``Group``
    kernel the two ``dequantize`` calls become ``dequantize_list`` over the group's
    moments and the two ``quantize_`` calls ``quantize_list_``.

    Args:
      param: the fp32 tensor updated in place (a master).
      grad: its fp32 gradient.
      m_q, v_q: the first (signed) and second (unsigned) moments, updated in place.
      step: 0-d float32 step count, incremented in place.
      lr, betas, eps, weight_decay: as in ``mpfunc.adamw``; ``decoupled=False`` is ``adam``'s
        L2 form.
      m_noise, v_noise: ``None`` (round to nearest) or uniform draws for stochastic
        rounding, as in ``quantize_``. Recommended: ``v_noise=torch.rand_like(param)``
        from a seeded generator (on XLA, the device's RNG), ``m_noise=None``.
    """
    beta1, beta2 = betas
    m = dequantize(m_q)
    v = dequantize(v_q)
    step.add_(1)
    g = grad
    if weight_decay != 0:
        if decoupled:
            param.mul_(1 - lr * weight_decay)
        else:
            g = g.add(param, alpha=weight_decay)
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2)
    v.addcmul_(g, g, value=1 - beta2)
    c1 = torch.mul(step, _ln(beta1))
    c1.expm1_()
    c2 = torch.mul(step, _ln(beta2))
    c2.expm1_()
    c2.neg_()
    c2.sqrt_()
    c1.reciprocal_()
    c1.mul_(lr)
    denom = torch.sqrt(v)
    denom.div_(c2)
    denom.add_(eps)
    denom.div_(c1)
    param.addcdiv_(m, denom)
    quantize_(m, m_q, noise=m_noise)
    quantize_(v, v_q, noise=v_noise)

"""Blockwise 4-bit optimizer moments: companded codes packed two per byte, bf16 block scales.

The 4-bit sibling of ``_quantize`` (the 8-bit format), built by the same rules: a moment
is cut into blocks of ``BLOCK`` = 32 consecutive elements (in logical, row-major order),
each block keeps its largest finite magnitude as a bfloat16 ``scale``, and every element
keeps four bits, a companded code relative to its block's scale:

* **signed** (first moments): ``y = x / s``, ``t = 2y / (1 + |y|)``, ``code = round(7 t)``
  in ``[-7, 7]``, held as its 4-bit two's complement; ``-8`` (nibble ``0x8``) marks a
  non-finite value and decodes to NaN.
* **unsigned** (second moments): ``y = sqrt(x) / s`` with ``s`` the block's largest
  ``sqrt(x)``, ``t = 2y / (1 + y)``, ``code = round(14 t)`` in ``[0, 14]``, and a positive
  ``x`` never gets code 0; ``15`` marks a non-finite or negative value and decodes to
  ``+inf``, whatever its block's scale (why ``+inf``: ``_quantize``'s docstring).

**Packing.** Codes are packed two per byte in row-major element order: element ``2i`` in
the low nibble of byte ``i``, element ``2i + 1`` in the high nibble; an odd last element
leaves its byte's high nibble 0. ``Q4State.codes`` is the flat packed bytes,
``packed_bytes(numel) = ceil(numel / 2)`` of them, so a state does not hold its moment's
shape: ``dequantize4`` takes it. The bytes' dtype says which map they hold (``int8``
signed, ``uint8`` unsigned; the same bits, ``byte - 256`` above 127 as ``int8``), as in
the 8-bit format, so a checkpoint that keeps dtypes keeps the map.

**Bytes.** Half a byte per element plus 2 bytes of scale per 32 elements: 0.5625 B per
element per moment, 1.125 B/param for both Adam moments (8-bit: 2.125). With the
``"stochastic"`` master strategy (the bf16 param, 2 B, and a 4-byte key per leaf), Adam
holds 3.125 B/param plus 4 B per leaf: within the issue's 3.2 B/param.

**Why this code** (measured; ``bench/q4_design`` and its committed results in
``bench/results/q4_design``). The convergence benchmark's fp32 AdamW run (a character LM,
betas (0.9, 0.99)) fed its gradients to candidate 4-bit moments on the side, and Adam's
direction ``m / sqrt(v)`` rebuilt from them was compared with fp32's, after 800 steps from
scratch (``pre``) and after 300 fine-tuning steps at the benchmark's small rate
(``fine``), RMS relative:

* **Block size** (``m`` softsign to nearest, ``v`` companded ``sqrt`` stochastic): 32 /
  64 / 128 elements: 42.1% / 44.7% / 56.9% (pre), 42.1% / 45.1% / 58.9% (fine). With bf16
  scales, 32-element blocks cost 1.125 B/param for both moments, within the budget.
* **First moment** (to nearest, blocks of 32), ``m`` alone (pre): 22.8% softsign, 22.6% a
  15-level normal-quantile table, 26.6% linear, 39.3% powers of two. Softsign is as good
  as the table with a closed-form code (no search) and is the 8-bit format's compander.
* **Second moment rounding**: to nearest, ``v`` sticks and drifts, 94% high (sums) after
  800 steps (pre); stochastic: 3.9% low. Linear in ``v`` (not ``sqrt``) stays 21% high even
  rounded stochastically: every value below 1/14 of its block's largest is held at the
  first level so that it never decodes to 0.
* **Rank-1 normalization** of ``v`` (lpmm's: ``v / min(row max, column max)`` of a 2-d leaf,
  a zero-excluding linear code), stochastic: ``v`` off by 8.8% / 10.4% (pre / fine) where
  this code is off by 18.2% / 19.5%, and with the normal table for ``m`` the lowest
  direction error within the budget: 33.3% / 32.8%, against 42.1% / 42.1% for this code
  (the 8-bit format: 3.1% / 3.1%).
* **In the loop** (each candidate's moments used by AdamW on the 2-d leaves, three
  seeds; ``bench/results/q4_design/q4_loss_*.md``), the final validation loss does not
  follow the direction error. Gap to fp32 moments, mean over seeds 0-2 (worst seed),
  fine-tuning / from scratch: this code -0.12% (-0.11%) / -0.62% (-0.08%); ``v`` to
  nearest -0.06% (-0.05%) / -0.36% (+0.57%); the normal table for ``m`` -0.03% (-0.03%) /
  +0.25% (+1.76%); normal ``m`` and rank-1 ``v`` +0.02% (+0.03%) / -0.09% (+0.96%); this
  code with blocks of 128 -0.15% (-0.14%) / -0.80% (-0.29%). (An fp32 model there, not
  bf16 params with ``"stochastic"`` masters.)

The pick: blocks of 32 (the lowest direction error of each map, within the budget),
softsign ``m`` (as good as the best table, a closed-form code, the 8-bit compander), and
companded ``sqrt(v)`` rounded stochastically (unbiased; nearest drifts). Rank-1 ``v`` had
the lowest direction error but did not train better, needs each leaf's row and column
maxima of the *new* ``v`` before any of its codes (a second pass over the leaf, where this
code encodes each 32-element block on its own, as the native pass does at 8 bits), and
needs a blockwise code beside it for 1-d leaves. The direction error at 4 bits is large
for every candidate (8 bits: 3.1%); the issue's target is measured on the convergence
benchmark itself once the format is wired.

Every function is sync-free (no host read of a value), traces on XLA into plain
elementwise ops, one block reduction and 16-entry table gathers, with no ``aten::``
fallback, and gives the same bits on the CPU and on XLA:CPU (given the same noise).
Subnormal inputs and results read as zero on every device, because XLA:CPU flushes them
and the CPU does not. A leaf smaller than one block is refused (``ValueError`` pointing at
``partition``), as the 8-bit format refuses it.

Wired as the state format ``state_dtype=torch.uint4`` (``_uint4``): the torch path, and
on XLA the one-node kernels through ``decode_ops``/``encode_ops`` below (the same bits);
on the CPU the native pass (``csrc/adam_mixed.cpp``: ``FU4``, ``decode4``, ``encode4``, the
same operations in the same order, the same bits). See
docs/design.md#the-8-bit-moment-codec for the rules shared with the 8-bit format.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from mpfunc.core import _checks, _tensors
from mpfunc.state_formats import _quantize

__all__ = [
    "BLOCK",
    "SCALE_DTYPE",
    "Q4State",
    "blocks",
    "bytes_per_element",
    "check_quantizable",
    "dequantize4",
    "dequantize4_list",
    "packed_bytes",
    "quantize4",
    "quantize4_",
    "quantize4_list_",
    "zeros4",
]

BLOCK = 32
SCALE_DTYPE = torch.bfloat16
SIGNED_DTYPE = torch.int8
UNSIGNED_DTYPE = torch.uint8
_S_LEVELS = 7  # signed codes -7..7
_U_LEVELS = 14  # unsigned codes 0..14
_S_NAN = -8
_U_NAN = 15
_TINY = 2.0**-126  # fp32's smallest normal
_BF16_MAX = torch.finfo(torch.bfloat16).max


class Q4State(NamedTuple):
    """One 4-bit moment. Both fields are tensors, so it is a pytree node like any NamedTuple.

    ``codes``: ``int8`` (signed map) or ``uint8`` (unsigned map), flat, contiguous, of
      ``packed_bytes(numel)`` bytes; element ``2i`` is the low nibble of byte ``i``, element
      ``2i + 1`` its high nibble, and element ``j`` belongs to block ``j // BLOCK``.
    ``scale``: ``bfloat16`` of shape ``(blocks(numel),)``: per block, the largest finite
      magnitude (signed) or the largest finite ``sqrt`` (unsigned), rounded to nearest.
    """

    codes: torch.Tensor
    scale: torch.Tensor


# Safe for torch.load(weights_only=True), as QState (_quantize).
torch.serialization.add_safe_globals([Q4State])


def blocks(numel: int) -> int:
    """The number of blocks (and scales) of a moment with ``numel`` elements."""
    return -(-numel // BLOCK)


def packed_bytes(numel: int) -> int:
    """The number of code bytes of a moment with ``numel`` elements: two codes a byte."""
    return -(-numel // 2)


def bytes_per_element(numel: int) -> float:
    """Persistent bytes per element of one 4-bit moment: codes plus the scales' share."""
    if numel == 0:
        return 0.0
    return (packed_bytes(numel) + blocks(numel) * torch.finfo(SCALE_DTYPE).bits // 8) / numel


def _decode_table(signed: bool) -> list[float]:
    """Nibble -> companded-back magnitude, in float64 (rounded once to fp32 below).

    Entry ``n`` decodes nibble ``n``: the code ``n`` (unsigned), or ``n - 16`` above 7
    (signed); the signed mark decodes to NaN, the unsigned one to ``+inf``. The inverse of
    ``t = 2y / (1 + |y|)`` is ``y = t / (2 - |t|)``.
    """
    levels = _S_LEVELS if signed else _U_LEVELS
    table = []
    for n in range(16):
        k = n - 16 if signed and n >= 8 else n
        t = k / levels
        table.append(t / (2 - abs(t)))
    table[(_S_NAN & 15) if signed else _U_NAN] = math.nan if signed else math.inf
    return table


_TABLE_CPU = {s: torch.tensor(_decode_table(s), dtype=torch.float64).float() for s in (True, False)}
# One copy of each table per device: moving it per call would be a transfer per step.
_TABLES: dict[tuple[bool, torch.device], torch.Tensor] = {}


def _table(signed: bool, device: torch.device) -> torch.Tensor:
    key = (signed, device)
    t = _TABLES.get(key)
    if t is None:
        t = _TABLES[key] = _TABLE_CPU[signed].to(device)
    return t


def _is_signed(fn: str, codes: Any) -> bool:
    if isinstance(codes, torch.Tensor) and codes.dtype == SIGNED_DTYPE:
        return True
    if isinstance(codes, torch.Tensor) and codes.dtype == UNSIGNED_DTYPE:
        return False
    got = f"{codes.dtype} tensor" if isinstance(codes, torch.Tensor) else type(codes).__name__
    raise TypeError(
        f"{fn}: Q4State.codes: expected torch.int8 (signed map) or torch.uint8 (unsigned map) "
        f"packed codes, got {got}"
    )


def _as_blocks(flat: torch.Tensor) -> torch.Tensor:
    """``flat`` (1-D) zero-padded to whole blocks and viewed as ``(blocks, BLOCK)``."""
    n = flat.numel()
    pad = blocks(n) * BLOCK - n
    if pad:  # a shape, not a value: no host read
        flat = torch.nn.functional.pad(flat, (0, pad))
    return flat.view(-1, BLOCK)


def _flush(x: torch.Tensor) -> torch.Tensor:
    """Magnitudes below fp32's smallest normal read as 0 (NaN stays NaN): XLA:CPU flushes
    subnormals and the CPU does not, so both flush them explicitly."""
    return torch.where(x.abs() < _TINY, 0.0, x)


def _encode(
    xb: torch.Tensor, signed: bool, noise: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes (int32, ``-8..7`` signed, ``0..15`` unsigned) and bf16 scales of fp32 blocks.

    ``_quantize._encode``'s rules at 4 bits: a fixed op order of exact or correctly rounded
    ops with subnormals flushed, so the CPU and XLA:CPU agree; padding zeros get code 0.
    """
    ok = torch.isfinite(xb)
    if not signed:
        ok = ok & (xb > -_TINY)  # a negative second moment is as wrong as a NaN one
    keep = ok & (xb.abs() >= _TINY)
    vals = torch.where(keep, xb, 0.0)
    if not signed:
        vals = _quantize.sqrt_rn(vals)
    # Finite values only: a NaN or inf marks its own element; the block keeps its precision.
    # A finite fp32 magnitude above bf16's largest (within 0.4% of fp32's largest) would
    # round the scale to inf and the block to NaN: its scale is bf16's largest instead.
    scale = vals.abs().amax(dim=1).clamp(max=_BF16_MAX).to(SCALE_DTYPE)
    s = _tensors.widened(scale)
    # An all-zero block has scale 0; dividing by 1 keeps its codes 0 without a branch.
    y = _flush(vals / torch.where(s > 0, s, 1.0).unsqueeze(1))
    # The bf16 scale can put |y| up to 2**-9 above 1: the clamps keep it on the top code.
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


def _round_stochastic(
    y: torch.Tensor, t: torch.Tensor, signed: bool, noise: torch.Tensor
) -> torch.Tensor:
    """Rounds up with the probability that makes the decoded value unbiased (in the
    moment's own units: ``y`` signed, ``y**2`` unsigned), as ``_quantize`` does."""
    levels, low = (_S_LEVELS, -_S_LEVELS) if signed else (_U_LEVELS, 0)
    lo = torch.floor(t * levels).clamp(low, levels - 1).to(torch.int32)
    table = _table(signed, y.device)
    a = _gather(table, torch.bitwise_and(lo, 15))
    b = _gather(table, torch.bitwise_and(lo + 1, 15))
    value = y
    if not signed:
        value, a, b = _quantize.square(y), _quantize.square(a), _quantize.square(b)
    up = noise < (value - a) / (b - a)
    return lo + up.to(torch.int32)


def _gather(table: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return torch.index_select(table, 0, idx.reshape(-1)).view(idx.shape)


def _pack(code: torch.Tensor, n: int, signed: bool) -> torch.Tensor:
    """int32 codes ``(blocks, BLOCK)`` -> ``packed_bytes(n)`` bytes, low nibble first."""
    nib = torch.bitwise_and(code, 15).view(-1, 2)
    byte = nib[:, 0] + nib[:, 1] * 16  # 0..255; the high nibble of the padding is 0
    if signed:  # the same bits as int8: two's complement, without a dtype view
        byte = byte - torch.where(byte > 127, 256, 0)
    return byte[: packed_bytes(n)].to(SIGNED_DTYPE if signed else UNSIGNED_DTYPE)


def _unpack(codes: torch.Tensor) -> torch.Tensor:
    """Packed bytes -> nibbles (int32, 0..15), two per byte, low nibble first."""
    b = torch.bitwise_and(codes.to(torch.int32), 255)  # int8 bytes back to 0..255
    return torch.stack([torch.bitwise_and(b, 15), b >> 4], dim=1).view(-1)


def _too_small(fn: str, path: str, n: int) -> None:
    if n < BLOCK:
        _checks.fail(
            ValueError, fn, path, f"a leaf of at least {BLOCK} elements for 4-bit moments",
            f"{n} elements",
            "Keep small leaves in fp32 state: mpfunc.partition({'big': <an optimizer with "
            "4-bit moments>, 'small': mpfunc.adamw(...)}, labels) with labels from a function "
            "such as lambda path, p: 'big' if p.numel() >= 4096 else 'small'",
        )  # fmt: skip


def check_quantizable(fn: str, side: _checks.Side, faces: list[Any]) -> None:
    """4-bit moments need at least one whole block per leaf, as 8-bit ones do
    (``_state_format.check_quantizable``): a smaller leaf gets a clear error that
    points to ``partition``, before anything is written."""
    for i, f in enumerate(faces):
        if f is not None and f.numel() < BLOCK:
            _too_small(fn, side.path(i), f.numel())


def _check_float(fn: str, x: Any) -> None:
    # fp32 only: the moments are computed in fp32; fp64 would round behind the caller's back.
    if not isinstance(x, torch.Tensor) or x.dtype != torch.float32:
        got = f"{x.dtype} tensor" if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"{fn}: expected a torch.float32 tensor, got {got}")


def _check_noise(fn: str, x: torch.Tensor, noise: Any) -> None:
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


def _check_state(fn: str, q: Any, numel: int, device: torch.device) -> bool:
    """Checks that ``q`` holds a moment of ``numel`` elements on ``device``; its map."""
    if not isinstance(q, Q4State):
        raise TypeError(f"{fn}: expected a Q4State (made by zeros4), got {type(q).__name__}")
    signed = _is_signed(fn, q.codes)
    want = packed_bytes(numel)
    if q.codes.shape != (want,) or not q.codes.is_contiguous():
        raise ValueError(
            f"{fn}: expected contiguous packed codes of shape ({want},) for a moment of "
            f"{numel} elements, got shape {tuple(q.codes.shape)}"
        )
    n_blocks = blocks(numel)
    if (
        not isinstance(q.scale, torch.Tensor)
        or q.scale.dtype != SCALE_DTYPE
        or q.scale.shape != (n_blocks,)
        or not q.scale.is_contiguous()
    ):
        got = (
            f"{q.scale.dtype} of shape {tuple(q.scale.shape)}"
            if isinstance(q.scale, torch.Tensor)
            else type(q.scale).__name__
        )
        raise ValueError(
            f"{fn}: expected contiguous {SCALE_DTYPE} scales of shape ({n_blocks},), got {got}"
        )
    if q.codes.device != device or q.scale.device != device:
        raise ValueError(
            f"{fn}: expected codes and scales on {device}, got {q.codes.device} and "
            f"{q.scale.device}"
        )
    return signed


def quantize4(
    x: torch.Tensor, signed: bool, *, noise: torch.Tensor | None = None, path: str = "x"
) -> Q4State:
    """Quantizes a moment into fresh packed codes and scales.

    Args:
      x: a float32 tensor of any shape and layout with at least ``BLOCK`` elements; read
        in row-major order.
      signed: ``True`` for first moments (any sign), ``False`` for second moments
        (non-negative; a negative value is treated as non-finite).
      noise: ``None`` to round to nearest, or uniform draws in [0, 1), float32, shaped
        like ``x`` (``_rng.uniform`` of the leaf's key) for stochastic rounding.
      path: how the error names ``x``.

    Returns:
      A ``Q4State`` of ``packed_bytes(x.numel())`` code bytes and ``blocks(x.numel())``
      scales, on ``x``'s device.

    Raises:
      TypeError: ``x`` is not a float32 tensor.
      ValueError: ``x`` has fewer than ``BLOCK`` elements (use ``partition``), or the
        noise does not fit ``x``.
    """
    _check_float("quantize4", x)
    _too_small("quantize4", path, x.numel())
    _check_noise("quantize4", x, noise)
    nb = None if noise is None else _as_blocks(noise.reshape(-1))
    code, scale = _encode(_as_blocks(x.reshape(-1)), signed, nb)
    return Q4State(_pack(code, x.numel(), signed), scale)


def zeros4(
    shape: Sequence[int] | torch.Size, signed: bool, device: torch.device | str, *,
    path: str = "x",
) -> Q4State:  # fmt: skip
    """The 4-bit form of a zero moment of ``shape``: an optimizer's initial state.

    Raises:
      ValueError: the moment has fewer than ``BLOCK`` elements (use ``partition``).
    """
    n = math.prod(shape)
    _too_small("zeros4", path, n)
    return Q4State(
        torch.zeros(packed_bytes(n), dtype=SIGNED_DTYPE if signed else UNSIGNED_DTYPE,
                    device=device),
        torch.zeros(blocks(n), dtype=SCALE_DTYPE, device=device),
    )  # fmt: skip


def quantize4_(x: torch.Tensor, q: Q4State, *, noise: torch.Tensor | None = None) -> Q4State:
    """Quantizes ``x`` into ``q``'s existing codes and scales, in place; returns ``q``.

    The map (signed or unsigned) is the one ``q.codes``'s dtype names. Every argument is
    checked before the first write, so on an error ``q`` keeps every bit.

    Args:
      x: the float32 moment, any layout, with ``q``'s number of elements.
      q: the state written.
      noise: ``None`` (round to nearest) or uniform draws in [0, 1), float32, shaped like
        ``x``: each element then takes one of its two neighbouring codes with the
        probability that makes the decoded moment unbiased, so an EMA update smaller than
        a code step still moves the state on average instead of sticking.

    Raises:
      TypeError, ValueError: ``x`` is not float32, or ``q`` or ``noise`` does not fit it.
    """
    _check_float("quantize4_", x)
    signed = _check_state("quantize4_", q, x.numel(), x.device)
    _check_noise("quantize4_", x, noise)
    nb = None if noise is None else _as_blocks(noise.reshape(-1))
    code, scale = _encode(_as_blocks(x.reshape(-1)), signed, nb)
    q.codes.copy_(_pack(code, x.numel(), signed))
    q.scale.copy_(scale)
    return q


def dequantize4(q: Q4State, shape: Sequence[int] | torch.Size) -> torch.Tensor:
    """The fp32 moment a ``Q4State`` holds, as a contiguous tensor of ``shape``.

    Signed: ``scale * T[code]``; unsigned: ``(scale * T[code]) ** 2``, where ``T`` decodes
    the compander (``t / (2 - |t|)`` at ``t = code / levels``). The signed mark gives NaN,
    the unsigned one ``+inf``.

    Raises:
      TypeError, ValueError: ``q`` is not a 4-bit state of a moment of ``shape``.
    """
    n = math.prod(shape)
    signed = _check_state("dequantize4", q, n, q.codes.device)
    nib = _unpack(q.codes)
    vals = torch.index_select(_table(signed, q.codes.device), 0, nib)
    s = q.scale.to(torch.float32)
    if not signed:
        # The mark is +inf even in a block whose finite values are all 0 (scale 0, where
        # inf * 0 would be NaN); every other scale is at least 2**-63 already.
        s = s.clamp(min=_TINY)
    y = _as_blocks(vals) * s.unsqueeze(1)
    if not signed:
        y = y * y
    return _flush(y).view(-1)[:n].view(tuple(shape))


def _batched(qs: Sequence[Q4State], batch: bool | None) -> bool:
    """Whether a list goes through one concatenated graph: by default on XLA, where each
    op is a traced node; only for one map on one device. Blocks never straddle two
    tensors (each starts at a block boundary), so the bits equal one call per tensor."""
    if not qs:
        return False
    first = qs[0].codes
    if batch is None:
        batch = len(qs) > 1 and first.device.type == "xla"
    return batch and all(
        q.codes.dtype == first.dtype and q.codes.device == first.device for q in qs
    )


def _block_codes(q: Q4State) -> torch.Tensor:
    """A state's packed codes zero-padded to whole blocks (``BLOCK // 2`` bytes each)."""
    n = q.scale.numel() * BLOCK // 2
    c = q.codes
    return torch.nn.functional.pad(c, (0, n - c.numel())) if c.numel() < n else c


def dequantize4_list(
    qs: Sequence[Q4State], shapes: Sequence[Sequence[int] | torch.Size], *,
    batch: bool | None = None,
) -> list[torch.Tensor]:  # fmt: skip
    """``dequantize4`` of each state, as a list of fresh tensors (a foreach kernel's form).

    ``batch`` (default: on XLA) decodes the whole list as one concatenation, with the same
    bits. Every state is checked before anything is decoded.
    """
    if len(qs) != len(shapes):
        raise ValueError(f"dequantize4_list: expected one shape per state, got {len(shapes)}")
    for q, shape in zip(qs, shapes):
        _check_state("dequantize4_list", q, math.prod(shape), q.codes.device)
    if not _batched(qs, batch):
        return [dequantize4(q, s) for q, s in zip(qs, shapes)]
    signed = qs[0].codes.dtype == SIGNED_DTYPE
    device = qs[0].codes.device
    nib = _unpack(torch.cat([_block_codes(q) for q in qs]))
    vals = torch.index_select(_table(signed, device), 0, nib)
    s = torch.cat([q.scale for q in qs]).to(torch.float32)
    if not signed:
        s = s.clamp(min=_TINY)
    y = vals.view(-1, BLOCK) * s.unsqueeze(1)
    if not signed:
        y = y * y
    y = _flush(y).view(-1)
    sizes = [q.scale.numel() * BLOCK for q in qs]
    # Fresh tensors, not views of ``y``: on XLA, in-place writes to k views of one base
    # re-slice every view from it (a graph quadratic in k; see _quantize.dequantize_list).
    return [
        part[: math.prod(shape)].view(tuple(shape)).clone()
        for part, shape in zip(torch.split(y, sizes), shapes)
    ]


def quantize4_list_(
    xs: Sequence[torch.Tensor],
    qs: Sequence[Q4State],
    *,
    noises: Sequence[torch.Tensor | None] | None = None,
    batch: bool | None = None,
) -> None:
    """``quantize4_`` of each pair; every pair is checked before the first write.

    ``noises``: ``None``, or one ``noise`` (a tensor or ``None``) per pair. ``batch`` as in
    ``dequantize4_list``; a list with noise for some pairs only runs one call per pair.
    """
    if len(xs) != len(qs):
        raise ValueError(f"quantize4_list_: expected as many states as tensors, got {len(qs)}")
    ns: Sequence[torch.Tensor | None] = [None] * len(xs) if noises is None else noises
    if len(ns) != len(xs):
        raise ValueError(f"quantize4_list_: expected as many noises as tensors, got {len(ns)}")
    for x, q, n in zip(xs, qs, ns):
        _check_float("quantize4_list_", x)
        _check_state("quantize4_list_", q, x.numel(), x.device)
        _check_noise("quantize4_list_", x, n)
    mixed = any(n is None for n in ns) and any(n is not None for n in ns)
    if mixed or not _batched(qs, batch):
        for x, q, n in zip(xs, qs, ns):
            signed = q.codes.dtype == SIGNED_DTYPE
            nb = None if n is None else _as_blocks(n.reshape(-1))
            code, scale = _encode(_as_blocks(x.reshape(-1)), signed, nb)
            q.codes.copy_(_pack(code, x.numel(), signed))
            q.scale.copy_(scale)
        return
    signed = qs[0].codes.dtype == SIGNED_DTYPE
    xb = torch.cat([_as_blocks(x.reshape(-1)) for x in xs])
    nb = (
        None
        if ns[0] is None
        else torch.cat([_as_blocks(n.reshape(-1)) for n in ns if n is not None])
    )
    code, scale = _encode(xb, signed, nb)
    counts = [q.scale.numel() for q in qs]
    for c, sc, x, q in zip(torch.split(code, counts), torch.split(scale, counts), xs, qs):
        q.codes.copy_(_pack(c, x.numel(), signed))
        q.scale.copy_(sc)


# --- the codec as XLA builder ops (the one-node kernels, ``backends/_xla_kernels``) -----------
#
# ``decode_ops`` and ``encode_ops`` build this module's ``dequantize4`` and ``_encode`` +
# ``_pack`` of one leaf inside an ``xla_builder`` computation, op for op, so the node gives
# the torch path's bits. ``b`` is the node's builder helper (``_xla_kernels._B``): its
# ``xb``, ``builder``, constants (``f32``, ``s32``, ``const``), ``flush`` (this module's
# ``_flush``), ``entry`` (a decode table's value of a code, by one division), ``blocks``
# (values padded to whole blocks, as ``_as_blocks`` lays them out), ``codes`` (the
# companded block encoder both formats share, given the levels) and ``per_element``
# (a per-block value repeated for each element, blocks of 32).
# Operands are ``xla_builder.Op``s.


def decode_ops(b: Any, codes: Any, scale: Any, shape: Sequence[int], signed: bool) -> Any:
    """``dequantize4`` of one leaf: packed ``codes`` (``(packed_bytes(n),)``, s8 or u8) and
    bf16 ``scale`` (``(blocks(n),)``) -> its fp32 moment of ``shape``.

    On XLA:CPU (``b.cpu_forms``) the bytes are unpacked without a concatenation, which it
    compiles to a scalar loop: each byte widened to 16 bits as ``low | high << 8`` and
    bitcast to two bytes (little-endian: the low nibble first). Elsewhere (and under SPMD,
    whose partitioner all-gathers a bitcast that changes the shape) by a concatenation of
    the low and high nibbles."""
    n = math.prod(shape)
    n_bytes = packed_bytes(n)
    if b.cpu_forms:
        u16 = codes.bitcast("u8").cast("u16")
        pair = (u16 & b.const(15, "u16")) | ((u16 & b.const(0xF0, "u16")) * b.const(16, "u16"))
        nib = pair.bitcast("u8").reshape([2 * n_bytes])
    else:
        byte = codes.cast("s32") & b.s32(255)  # (_unpack) int8 bytes back to 0..255
        low = (byte & b.s32(15)).reshape([n_bytes, 1])
        high = b.shr(byte, 4).reshape([n_bytes, 1])
        nib = b.xb.Op.concat_in_dim([low, high], 1, builder=b.builder).reshape([2 * n_bytes])
    nib = nib.slice_in_dim(0, n, 0).cast("s32")
    if signed:
        k = (nib > b.s32(7)).select(nib - b.s32(16), nib)
        vals = b.entry(k, 2.0 * _S_LEVELS)
        vals = (k == b.s32(_S_NAN)).select(vals.scalar_like(math.nan), vals)
    else:
        vals = b.entry(nib, 2.0 * _U_LEVELS)
        vals = (nib == b.s32(_U_NAN)).select(vals.scalar_like(math.inf), vals)
    s = scale.cast("f32")
    if not signed:
        s = s.max(b.f32(_TINY))
    y = vals * b.per_element(s, n)
    if not signed:
        y = y * y
    return b.flush(y).reshape(list(shape))


def encode_ops(b: Any, x: Any, signed: bool, noise: Any, shape: Sequence[int]) -> tuple[Any, Any]:
    """``_encode`` and ``_pack`` of one leaf's fp32 values ``x`` (of ``shape``; ``noise``:
    ``None`` or fp32 draws of ``shape``): its packed codes (s8 signed, u8 unsigned) and
    bf16 block scales. Blocks are zero-padded, as ``_as_blocks`` pads them. The codes are
    the 8-bit encoder's (``Builder.codes``) with this format's levels, two a byte: on
    XLA:CPU (``b.cpu_forms``) packed by a bitcast of byte pairs to 16 bits (strided slices
    were 5x slower there), elsewhere by strided slices (SPMD's partitioner all-gathers the
    bitcast)."""
    n = math.prod(shape)
    nb = blocks(n)
    levels = _S_LEVELS if signed else _U_LEVELS
    draws = None if noise is None else b.blocks(noise, n)
    code, scale = b.codes(b.blocks(x, n), signed, levels, draws)
    # (_pack) two nibbles a byte, low nibble first; the padding's codes are 0.
    if b.cpu_forms:
        pair = (code & b.s32(15)).cast("u8").reshape([nb * BLOCK // 2, 2]).bitcast("u16")
        byte = (pair & b.const(15, "u16")) | ((pair / b.const(16, "u16")) & b.const(0xF0, "u16"))
        byte = byte.cast("u8").slice_in_dim(0, packed_bytes(n), 0)
        return (byte.bitcast("s8") if signed else byte), scale
    nib = (code & b.s32(15)).reshape([nb * BLOCK])
    byte = nib.slice_in_dim(0, nb * BLOCK, 0, stride=2)
    byte = byte + nib.slice_in_dim(1, nb * BLOCK, 0, stride=2) * b.s32(16)
    byte = byte.slice_in_dim(0, packed_bytes(n), 0)
    if signed:  # the same bits as int8, without relying on a narrowing convert's wrap
        byte = (byte > b.s32(127)).select(byte - b.s32(256), byte)
    return byte.cast("s8" if signed else "u8"), scale

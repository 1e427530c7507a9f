"""An fp32 master held exactly as its bf16 param, a 16-bit remainder and a tie bit.

bf16 is the top half of fp32 (same sign, same 8-bit exponent, 7 of the 23 mantissa
bits), so the 16 bits that rounding drops can be kept beside the param and the
master rebuilt bit for bit::

    param, remainder, ties = split(master)   # bf16, int16, uint8 bits; 2 + 2 + 1/8 bytes
    join(param, remainder, ties)              # the same 32 bits as master, always

**The encoding.** ``param`` is ``master.to(torch.bfloat16)``: round to nearest, ties to
even, for every master that is not a NaN (subnormals, +-0, +-inf and the overflow to
inf above bf16's largest finite included). ``remainder`` is the master's low 16 bits,
unchanged. The rounding went up exactly when the remainder's top bit is set, except at
an exact tie (low half ``0x8000``), where either neighbour is possible: the high half
``h`` rounds to ``h`` if even and to ``h + 1`` if odd, so an even param ``p`` stands for
``p`` or ``p - 1`` (the carry into the exponent at ``p - 1`` is plain integer arithmetic
on the magnitude bits). The **tie bit** says which: set where a tie rounded up. No 16-bit
remainder can do without it (each even bf16 value is the nearest-even rounding of 65,537
fp32 patterns; a remainder tells 65,536 apart).

**NaNs** keep a NaN param with the master's sign: its top 7 payload bits where the
payload reaches the high half, and the quiet NaN (``0x7FC0``) with the tie bit set for
the NaNs whose payload lies wholly in the low half (``0x7F800001..0x7F80FFFF`` and the
negatives), whose high half is that of inf. ``Tensor.to`` gives the canonical NaN
instead: the payload is the one difference.

**The tie bits' container** is a uint8 tensor of ``tie_shape(param.shape)``: packed along
the last dim, byte ``[..., j // 8]`` bit ``j % 8`` for element ``[..., j]`` (a row's last
byte padded with zeros); a 0-d param has one 0-d byte. Packing along the last dim keeps
every other dim as the param's, so a dim-0 split (FSDP2, SPMD) cuts the param and its
bits alike; splitting the last dim does so only in chunks of a multiple of 8 (FSDP2:
``sharding_problem`` refuses other splits; SPMD: ``_sharding.like_(..., packed=8)``
replicates the bits' last dim there). Bits are
set only at ties that rounded up and at the low-payload NaNs, so ``split`` writes one
canonical triple per master; ``join(*split(m))`` is ``m`` for all 2^32 patterns
(``python -m bench.remainder`` checks every one).

The param and its remainder and bits are one value: write the param only through
``split`` / ``split_`` (or a step). A param written by ``Tensor.to`` is the same param
wherever the master is not a NaN, so ``masters_to_model_`` of the joined master leaves
the triple valid. Pairs written by mpfunc before the tie bit (params rounded ties away
from zero) are read by ``join_ties_away`` (checkpoints; see ``checkpoint._state_dict``).

**fp16 params** cannot hold an exact fp32 master in 16 more bits (see
``unsupported_hint``).

On CPU and CUDA the bits are reinterpreted with ``Tensor.view(dtype)`` and rounded in
int32 arithmetic, op by op. On XLA ``view(dtype)`` is not lowered (torch_xla 2.9
runs ``aten::view_copy.dtype`` on the host), so a list of leaves becomes one XLA
computation (``BitcastConvert`` plus the same integer ops, the bits packed with slices
and shifts), built once per list of shapes and called with
``torch_xla._XLAC._xla_user_computation``: one node, no host transfer, no ``aten::``
fallback. (torch_xla 2.9 on XLA:CPU canonicalizes bf16 NaN payloads written into a
*view* with ``copy_``; a NaN param that is a view keeps its NaN-ness and sign but not
its payload there. Nothing else is changed.)

See docs/design.md#the-remainder-encoding.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, Optional

import torch

from mpfunc.core import _checks, _dtensor

__all__ = [
    "MASTER_DTYPE",
    "PARAM_DTYPE",
    "REMAINDER_DTYPE",
    "TIE_DTYPE",
    "clear_cache",
    "join",
    "join_",
    "join_ties_away",
    "pack_ties",
    "sharding_problem",
    "split",
    "split_",
    "tie_problem",
    "tie_shape",
    "unpack_ties",
    "unsupported_hint",
]

MASTER_DTYPE = torch.float32
PARAM_DTYPE = torch.bfloat16
REMAINDER_DTYPE = torch.int16

_INF_HIGH = 0x7F80  # bf16 inf's magnitude bits
_QNAN_HIGH = 0x7FC0  # the param of a NaN whose payload lies wholly in the low half
_SIGN32 = -(2**31)  # int32 0x80000000
TIE_DTYPE = torch.uint8


def tie_shape(shape: Sequence[int]) -> tuple[int, ...]:
    """The shape of the tie bits of a param of ``shape``: packed along the last dim, one
    byte per 8 elements of a row (``ceil(n / 8)``); a 0-d param has one 0-d byte."""
    shape = tuple(shape)
    if not shape:
        return ()
    return (*shape[:-1], (shape[-1] + 7) // 8)


def pack_ties(bits: torch.Tensor) -> torch.Tensor:
    """0/1 integers of a param's shape -> its uint8 tie bytes (``tie_shape``): element
    ``[..., j]`` is bit ``j % 8`` of byte ``[..., j // 8]``."""
    shape = tuple(bits.shape)
    row = bits.reshape(*shape[:-1], shape[-1]) if shape else bits.reshape(1)
    n = row.shape[-1]
    pad = (-n) % 8
    if pad:
        row = torch.nn.functional.pad(row, (0, pad))
    row = row.reshape(*row.shape[:-1], row.shape[-1] // 8, 8).to(torch.int32)  # no -1: 0 rows
    weights = torch.tensor([1 << j for j in range(8)], dtype=torch.int32, device=row.device)
    packed = (row * weights).sum(-1, dtype=torch.int32).to(TIE_DTYPE)
    return packed.reshape(tie_shape(shape))


def unpack_ties(ties: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """uint8 tie bytes -> 0/1 int32 values of the param's ``shape`` (``pack_ties``'s
    inverse; the padding bits of a row's last byte are dropped)."""
    shape = tuple(shape)
    row = ties.reshape(1) if not shape else ties
    shifts = torch.arange(8, dtype=torch.int32, device=ties.device)
    out = row.to(torch.int32).unsqueeze(-1).bitwise_right_shift(shifts).bitwise_and_(1)
    out = out.reshape(*row.shape[:-1], row.shape[-1] * 8)  # no -1: a param may have 0 rows
    n = shape[-1] if shape else 1
    return out[..., :n].reshape(shape)


def unsupported_hint(dtype: torch.dtype) -> str:
    """Why a param of ``dtype`` cannot hold its master with a remainder (for error messages).

    Args:
        dtype: the param's dtype (anything but bfloat16).

    Returns:
        One or two sentences naming the reason and what to use instead.
    """
    if dtype == torch.float16:
        return (
            "An exact fp32 master needs a bfloat16 param: fp16 has a 5-bit exponent, so "
            "rounding sends every fp32 master of magnitude <= 2**-25 to 0 (855,638,017 "
            "patterns per sign) and >= 65520 to inf (939,528,193), and a 16-bit remainder "
            "tells apart only 65,536 masters per param value. Use the 'fp32' strategy for "
            "fp16 params"
        )
    if dtype in (torch.float32, torch.float64):
        return (
            f"A {str(dtype).removeprefix('torch.')} param holds its value exactly already; "
            "the remainder strategy is for bfloat16 params. Use the 'fp32' strategy"
        )
    return "The remainder strategy needs floating-point bfloat16 params"


# --- CPU and CUDA: bit views and int32 arithmetic -----------------------------------------


def _split_bits(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """int32 bits of fp32 masters -> the param's int16 bits and the remainder, each as an
    int32 tensor of values in [-2**15, 2**15) (so that the cast to int16 is exact), and
    the tie bit (0 or 1, int32).

    Every op is int32 with int32 masks (``(v - k) >> 31`` is -1 where ``v < k``, else 0):
    ``torch.where``, ``masked_fill_`` and bool masks run 3-80x slower than a bitwise op on
    the CPU (torch 2.9)."""
    mag32 = torch.bitwise_and(b, 0x7FFF_FFFF)
    high = torch.bitwise_right_shift(mag32, 16)
    odd = torch.bitwise_and(high, 1)
    # Round to nearest even on the magnitude (no overflow up to 0x7F800000, inf).
    rounded = torch.add(mag32, odd).add_(0x7FFF).bitwise_right_shift_(16)
    nan = torch.rsub(mag32, 0x7F80_0000).bitwise_right_shift_(31)  # -1 where a NaN
    # NaNs whose payload lies wholly in the low half: the quiet NaN param, tie bit set.
    lownan = torch.bitwise_xor(high, _INF_HIGH).sub_(1).bitwise_right_shift_(31)
    lownan.bitwise_and_(nan)
    nanmag = lownan.bitwise_and(_QNAN_HIGH - _INF_HIGH).add_(high)
    mag = rounded.bitwise_and_(torch.bitwise_not(nan)).bitwise_or_(nanmag.bitwise_and_(nan))
    # The tie bit: an exact tie (low half 0x8000) that rounded up (high half odd), or
    # the low-payload NaNs.
    low = torch.bitwise_and(b, 0xFFFF)
    tie = low.bitwise_xor_(0x8000).sub_(1).bitwise_right_shift_(31).bitwise_and_(odd)
    tie.bitwise_and_(nan.bitwise_not_()).bitwise_or_(lownan.bitwise_and_(1))
    # The sign: bit 31 of b is bit 15 of b >> 16 with either kind of shift.
    param = mag.sub_(torch.bitwise_right_shift(b, 16).bitwise_and_(0x8000))
    remainder = torch.bitwise_left_shift(b, 16).bitwise_right_shift_(16)  # low half, signed
    return param, remainder, tie


def _join_bits(p: torch.Tensor, r: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The param's int16 bits, the remainder (widened to int32) and the tie bit (0 or 1,
    int32) -> the master's bits."""
    mag = torch.bitwise_and(p, 0x7FFF)
    low = torch.bitwise_and(r, 0xFFFF)
    finite = torch.sub(mag, _INF_HIGH + 1).bitwise_right_shift_(31)  # -1 unless a NaN
    # Undo the rounding: it went up where the remainder's top bit is set, except at an
    # exact tie (0x8000), where the tie bit says.
    tie_at = torch.bitwise_xor(low, 0x8000).sub_(1).bitwise_right_shift_(31)
    up = tie_at.bitwise_not_().bitwise_or_(t).bitwise_and_(torch.bitwise_right_shift(low, 15))
    # Nothing rounds up to a zero param: such a remainder is stale (the param was written,
    # e.g. zeroed by pruning), and the master is the param itself, +-0 (it would wrap to
    # NaN). ``keep`` is 0 there, else -1.
    keep = torch.sub(mag, 1).bitwise_right_shift_(31).bitwise_and_(up).neg_().bitwise_not_()
    low = low.bitwise_and_(keep)
    high = torch.sub(mag, up).bitwise_and_(finite).bitwise_and_(keep)
    # A NaN param kept its high half, or stands for a NaN of high half 0x7F80 (tie bit).
    nan_high = torch.rsub(mag, _INF_HIGH).bitwise_and_(torch.neg(t)).add_(mag)
    high.bitwise_or_(nan_high.bitwise_and_(finite.bitwise_not_()))
    return high.bitwise_left_shift_(16).bitwise_or_(low).bitwise_or_(p & _SIGN32)


def _join_bits_away(p: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """The master's bits from a pair written by mpfunc before tie bits (params rounded
    ties away from zero; a NaN with a low payload had an inf or zero param): reads
    old checkpoints."""
    mag = torch.bitwise_and(p, 0x7FFF)
    low = torch.bitwise_and(r, 0xFFFF)
    finite = torch.sub(mag, _INF_HIGH + 1).bitwise_right_shift_(31)  # -1 unless a NaN
    high = mag.sub_(finite.bitwise_and_(low).bitwise_right_shift_(15))
    # -1 only from a zero param with the top bit set: the low-payload NaNs, high 0x7F80.
    high.add_(torch.bitwise_right_shift(high, 31).bitwise_and_(_INF_HIGH + 1))
    return high.bitwise_left_shift_(16).bitwise_or_(low).bitwise_or_(p & _SIGN32)


def _split_eager(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    param, remainder, tie = _split_bits(master.view(torch.int32))
    return (
        param.to(torch.int16).view(PARAM_DTYPE),
        remainder.to(REMAINDER_DTYPE),
        pack_ties(tie),
    )


def _join_eager(param: torch.Tensor, remainder: torch.Tensor, ties: torch.Tensor) -> torch.Tensor:
    p = param.view(torch.int16).to(torch.int32)
    t = unpack_ties(ties, param.shape)
    return _join_bits(p, remainder.to(torch.int32), t).view(MASTER_DTYPE)


def join_ties_away(param: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """The fp32 master of a (param, remainder) pair written before tie bits (CPU; old
    checkpoints). Split it again to get the pair and tie bits of today's encoding."""
    p = param.view(torch.int16).to(torch.int32)
    return _join_bits_away(p, remainder.to(torch.int32)).view(MASTER_DTYPE)


# --- XLA: one computation per list of shapes ----------------------------------------------

_CACHE_SIZE = 64
_cache: dict[tuple[Any, ...], Any] = {}
_lock = threading.Lock()


def _xb() -> Any:
    import torch_xla.core.xla_builder as xb

    return xb


def _pack_ops(xb: Any, builder: Any, bits: Any, shape: tuple[int, ...]) -> Any:
    """``pack_ties`` as XLA ops: s32 0/1 values of ``shape`` -> u8 of ``tie_shape``."""
    rows, n = list(shape[:-1]), (shape[-1] if shape else 1)
    c = (n + 7) // 8
    x = bits.reshape([*rows, n])
    if 8 * c > n:
        zeros = xb.Op.scalar(builder, 0, dtype="s32").broadcast([*rows, 8 * c - n])
        x = xb.Op.concat_in_dim([x, zeros], len(rows))
    x = x.reshape([*rows, c, 8])
    last = len(rows) + 1
    acc = x.slice_in_dim(0, 1, last)
    for j in range(1, 8):
        acc = acc | (x.slice_in_dim(j, j + 1, last) << xb.Op.scalar(builder, j, dtype="s32"))
    return acc.reshape(list(tie_shape(shape))).cast("u8")


def _unpack_ops(xb: Any, builder: Any, ties: Any, shape: tuple[int, ...]) -> Any:
    """``unpack_ties`` as XLA ops: u8 of ``tie_shape`` -> s32 0/1 values of ``shape``.

    Each bit is read with a mask (``byte & 2**j``), not a shift: the builder's one right
    shift is misspelt (see ``_split_ops``), and a division by the per-bit power, which the
    first version used, is an integer division by a variable that XLA:CPU runs scalar: it
    made a ``"remainder"`` step 3x slower there (27.8 ms against 8.3 on one leaf of 3.3M
    elements)."""
    rows, n = list(shape[:-1]), (shape[-1] if shape else 1)
    c = (n + 7) // 8
    t = ties.cast("s32").reshape([*rows, c])
    full = [*rows, c, 8]
    t = t.broadcast_in_dim(full, list(range(len(rows) + 1)))
    one = xb.Op.scalar(builder, 1, dtype="s32")
    powers = one << xb.Op.iota(builder, xb.mkshape("s32", full), len(rows) + 1)
    zero = xb.Op.scalar(builder, 0, dtype="s32")
    out = ((t & powers) != zero).select(t.ones_like(), t.zeros_like()).reshape([*rows, 8 * c])
    if 8 * c > n:
        out = out.slice_in_dim(0, n, len(rows))
    return out.reshape(list(shape))


def _split_ops(xb: Any, builder: Any, master: Any, shape: tuple[int, ...]) -> tuple[Any, Any, Any]:
    """``_split_bits``'s function as XLA ops on one fp32 operand of ``shape``: (bf16 param,
    s16 remainder, u8 tie bytes). Selects instead of int masks (XLA fuses either); right
    shifts as divisions of non-negative values, since torch_xla 2.9's builder spells its
    only right shift "ShifRight", a name a fix would break. The tests compare the bits."""

    def k(v: int) -> Any:
        return xb.Op.scalar(builder, v, dtype="s32")

    b = master.bitcast("s32")
    mag32 = b & k(0x7FFF_FFFF)
    high = mag32 / k(1 << 16)
    low = b & k(0xFFFF)
    odd = high & k(1)
    rounded = (mag32 + odd + k(0x7FFF)) / k(1 << 16)
    nan = mag32 > k(0x7F80_0000)
    lownan = nan & (high == k(_INF_HIGH))
    mag = nan.select(lownan.select(high.scalar_like(_QNAN_HIGH), high), rounded)
    zero = odd.zeros_like()
    tie = nan.select(lownan.select(odd.ones_like(), zero), (low == k(0x8000)).select(odd, zero))
    param = (b < k(0)).select(mag - k(0x8000), mag)
    remainder = (low ^ k(0x8000)) - k(0x8000)
    ties = _pack_ops(xb, builder, tie, shape)
    return param.cast("s16").bitcast("bf16"), remainder.cast("s16"), ties


def _join_ops(
    xb: Any, builder: Any, param: Any, remainder: Any, ties: Any, shape: tuple[int, ...]
) -> Any:
    """``_join_bits``'s function as XLA ops: a bf16 param, an s16 remainder and the u8 tie
    bytes of ``shape`` -> the f32 master (written as ``_split_ops``)."""

    def k(v: int) -> Any:
        return xb.Op.scalar(builder, v, dtype="s32")

    p = param.bitcast("s16").cast("s32")
    t = _unpack_ops(xb, builder, ties, shape)
    low = remainder.cast("s32") & k(0xFFFF)
    mag = p & k(0x7FFF)
    roundbit = low / k(1 << 15)
    up = (low == k(0x8000)).select(t, roundbit)
    nan_high = (t == k(1)).select(mag.scalar_like(_INF_HIGH), mag)
    high = (mag > k(_INF_HIGH)).select(nan_high, mag - up)
    # A zero param whose remainder says it rounded up: stale, the master is +-0 (join).
    stale = (mag == k(0)) & (up == k(1))
    zero = mag.scalar_like(0)
    bits = (p & k(_SIGN32)) | (stale.select(zero, high) << k(16)) | stale.select(zero, low)
    return bits.bitcast("f32")


def _computation(kind: str, shapes: tuple[tuple[int, ...], ...]) -> Any:
    """The cached XLA computation of ``split`` or ``join`` over leaves of ``shapes``."""
    key = (kind, shapes)
    with _lock:
        comp = _cache.get(key)
    if comp is not None:
        return comp
    xb = _xb()
    builder = xb.create_builder(f"mpfunc_remainder_{kind}")
    outs: list[Any] = []
    n = 0

    def param(dtype: str, shape: tuple[int, ...]) -> Any:
        nonlocal n
        op = xb.mkparam(builder, n, xb.mkshape(dtype, shape))
        n += 1
        return op

    for shape in shapes:
        if kind == "split":
            outs.extend(_split_ops(xb, builder, param("f32", shape), shape))
        else:
            p = param("bf16", shape)
            r = param("s16", shape)
            outs.append(_join_ops(xb, builder, p, r, param("u8", tie_shape(shape)), shape))
    comp = xb.Op.tuple(outs).build(f"mpfunc_remainder_{kind}")
    with _lock:
        if len(_cache) >= _CACHE_SIZE:
            _cache.pop(next(iter(_cache)))
        _cache[key] = comp
    return comp


def _call_xla(kind: str, inputs: list[torch.Tensor], per_leaf: int) -> list[torch.Tensor]:
    """Runs the computation over ``inputs`` (``per_leaf`` tensors per leaf, leaf-major)."""
    import torch_xla

    xlac: Any = torch_xla._XLAC  # type: ignore[attr-defined]
    comp = _computation(kind, tuple(tuple(t.shape) for t in inputs[::per_leaf]))
    return list(xlac._xla_user_computation(f"xla::mpfunc_remainder_{kind}", inputs, comp))


def clear_cache() -> None:
    """Drops the cached XLA computations (tests; processes that change models often)."""
    with _lock:
        _cache.clear()


# --- checks -------------------------------------------------------------------------------


def _check_param_dtypes(fn: str, params: _checks.Side) -> None:
    for i, p in enumerate(params.leaves):
        if isinstance(p, torch.Tensor) and p.dtype != PARAM_DTYPE:
            _checks.fail(
                TypeError,
                fn,
                params.path(i),
                "a torch.bfloat16 param",
                _checks.describe(p),
                unsupported_hint(p.dtype),
            )


_MASTER = _checks.Like("the param's", (MASTER_DTYPE,), "a torch.float32 master")
_REMAINDER = _checks.Like("the param's", (REMAINDER_DTYPE,), "a torch.int16 remainder")


def _lengths(fn: str, ref: _checks.Side, others: Sequence[_checks.Side]) -> None:
    for side in others:
        if len(side.leaves) != len(ref.leaves):
            raise ValueError(
                f"{fn}: {side.name}: expected {len(ref.leaves)} entries (one per entry of "
                f"{ref.name}), got {len(side.leaves)}"
            )


def _side(fn: str, name: str, tensors: Any) -> _checks.Side:
    """A list of tensors (``None`` entries allowed: they pair with ``None``)."""
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, (list, tuple)):
        raise TypeError(
            f"{fn}: {name}: expected a list or tuple of tensors, got {_checks.describe(tensors)}"
        )
    side, _ = _checks.tensor_leaves(fn, name, list(tensors))
    return side


def tie_problem(ties: Any, like: torch.Tensor) -> str | None:
    """What is wrong with ``ties`` as the tie bytes of a param or master ``like``, or None.
    The tie bytes of a DTensor are a DTensor placed as it is, whose local shard packs the
    bits of ``like``'s local shard (``sharding_problem`` says where that holds)."""
    want = tie_shape(like.shape)
    if (
        isinstance(ties, torch.Tensor)
        and ties.layout is torch.strided
        and ties.dtype == TIE_DTYPE
        and tuple(ties.shape) == want
        and ties.device == like.device
    ):
        if not (_dtensor.is_dtensor(like) or _dtensor.is_dtensor(ties)):
            return None
        return _sharded_tie_problem(ties, like)
    return (
        f"expected a torch.uint8 tensor of shape {want} on {like.device} (the tie bits of a "
        f"tensor of shape {tuple(like.shape)}, 8 a byte along the last dim), got "
        f"{_checks.describe(ties)}"
    )


def _sharded_tie_problem(ties: Any, like: Any) -> str | None:
    if not _dtensor.is_dtensor(like):
        return f"a plain tensor, as its param (got {_dtensor.describe_sharding(ties)})"
    placed = "a plain tensor" if not _dtensor.is_dtensor(ties) else None
    placed = placed or _dtensor.placement_problem(like, ties)
    local = tie_shape(_dtensor.local(like).shape)
    if placed is None and tuple(_dtensor.local(ties).shape) == local:
        return None
    return (
        f"expected the tie bits sharded as their param: {placed or 'a DTensor'} with a local "
        f"shard of shape {local} (the bits of the param's local shard "
        f"{tuple(_dtensor.local(like).shape)}), got {_dtensor.describe_sharding(ties)}"
    )


def sharding_problem(param: Any) -> str | None:
    """Why the tie bits of the DTensor ``param`` cannot be sharded as ``param`` is, or
    ``None`` (always for a plain tensor).

    The bits are packed along the last dim, so every other dim of the tie bytes is the
    param's and a split of it (FSDP2's dim-0 shards of a matrix) cuts both alike. A split
    of the last dim (every split of a 1-d param) fits only where each shard starts at a
    multiple of 8 elements: then the same placements over the tie bytes give every rank
    exactly the bytes of its own elements, and the global tie tensor is the packing of the
    whole param (checkpoints reshard it like any tensor). Elsewhere a byte would hold bits
    of two ranks' elements: refused, not kept in a per-rank packing whose global form
    would mean nothing to a checkpoint loaded at another world size."""
    if not _dtensor.is_dtensor(param) or param.dim() == 0:
        return None
    last = param.dim() - 1
    n = int(param.shape[last])
    elems = _dtensor.extents(param, last)
    tbytes = _dtensor.extents(param, last, (n + 7) // 8)
    if elems is not None and tbytes is not None:
        if all(
            bn == -(-en // 8) and (en == 0 or (eo % 8 == 0 and bo == eo // 8))
            for (eo, en), (bo, bn) in zip(elems, tbytes)
        ):
            return None
        lengths = sorted({en for _, en in elems if en})
        split = f"split into shards of {' or '.join(map(str, lengths))} elements"
    else:
        split = "split by a placement other than Shard or Replicate"
    return (
        f"The tie bits pack 8 elements a byte along the last dim, which this DTensor's "
        f"placements {tuple(param._spec.placements)} {split} ({n} in all): a shard that "
        f"does not start at a multiple of 8 elements would share a tie byte with its "
        f"neighbour. Give this leaf the 'fp32' strategy (init_master's strategy= takes a "
        f"function (path, param) -> name), or shard it so that every shard holds a "
        f"multiple of 8 elements (FSDP2 on m ranks: ceil({n} / m) a multiple of 8)"
    )


def _check_ties(fn: str, ref: _checks.Side, ties: _checks.Side) -> None:
    for i, (r, t) in enumerate(zip(ref.leaves, ties.leaves)):
        if r is None and t is None:
            continue
        problem = "expected None (its pair is None)" if r is None else tie_problem(t, r)
        if problem is not None:
            raise ValueError(f"{fn}: at {ties.path(i)!r}: {problem}")


def _check_split(
    fn: str,
    masters: _checks.Side,
    outs: Optional[tuple[_checks.Side, _checks.Side, _checks.Side]],
) -> None:
    """Masters, and the outputs ``split_`` writes (``None`` for ``split``, which makes its own)."""
    _checks.check_leaf_dtypes(fn, masters, (MASTER_DTYPE,), "a torch.float32 master")
    if outs is None:
        return
    params, rems, ties = outs
    _lengths(fn, masters, outs)
    _check_param_dtypes(fn, params)
    like = _checks.Like("the master's", (PARAM_DTYPE,), "a torch.bfloat16 param")
    _checks.check_pairs(fn, masters, params, like)
    _checks.check_pairs(fn, masters, rems, _REMAINDER._replace(role="the master's"))
    _check_ties(fn, masters, ties)
    _checks.check_writable(fn, outs)
    _checks.check_no_alias(fn, outs, (masters,))


def _check_join(
    fn: str,
    params: _checks.Side,
    rems: _checks.Side,
    ties: _checks.Side,
    masters: Optional[_checks.Side],
) -> None:
    """Params, remainders and tie bits, and the masters ``join_`` writes (``None`` for
    ``join``)."""
    _lengths(fn, params, (rems, ties))
    _check_param_dtypes(fn, params)
    _checks.check_pairs(fn, params, rems, _REMAINDER)
    _check_ties(fn, params, ties)
    if masters is None:
        return
    _lengths(fn, params, (masters,))
    _checks.check_pairs(fn, params, masters, _MASTER)
    _checks.check_writable(fn, (masters,))
    _checks.check_no_alias(fn, (masters,), (params, rems, ties))


# --- the public forms ---------------------------------------------------------------------


def split(master: torch.Tensor, /) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The bf16 param, int16 remainder and uint8 tie bits that hold ``master`` exactly.

    Args:
        master: a float32 tensor (any shape and strides; CPU, CUDA or XLA).

    Returns:
        ``(param, remainder, ties)``: new tensors; the first two of ``master``'s shape,
        bfloat16 and int16; ``ties`` uint8 of ``tie_shape(master.shape)``. ``param``
        equals ``master.to(torch.bfloat16)`` for every non-NaN master;
        ``join(param, remainder, ties)`` has ``master``'s bits.

    Raises:
        TypeError: ``master`` is not a dense float32 tensor.
    """
    fn = "split"
    _check_split(fn, _single(fn, "master", master), None)
    if master.device.type == "xla":
        param, remainder, ties = _call_xla("split", [master], 1)
        return param, remainder, ties
    return _split_eager(master)


def join(param: torch.Tensor, remainder: torch.Tensor, ties: torch.Tensor, /) -> torch.Tensor:
    """The fp32 master that ``param``, ``remainder`` and ``ties`` hold (``split``'s inverse).

    Args:
        param: a bfloat16 tensor.
        remainder: an int16 tensor of ``param``'s shape, on its device.
        ties: a uint8 tensor of ``tie_shape(param.shape)``, on its device.

    Returns:
        A new float32 tensor; ``join(*split(m))`` has ``m``'s bits for every ``m``.

    Raises:
        TypeError: a wrong dtype (an fp16 param, with the reason) or a non-tensor.
        ValueError: shapes or devices differ.
    """
    fn = "join"
    ps = _single(fn, "param", param)
    _check_join(fn, ps, _single(fn, "remainder", remainder), _single(fn, "ties", ties), None)
    if param.device.type == "xla":
        return _call_xla("join", [param, remainder, ties], 3)[0]
    return _join_eager(param, remainder, ties)


def split_(
    masters: Sequence[Optional[torch.Tensor]],
    params: Sequence[Optional[torch.Tensor]],
    remainders: Sequence[Optional[torch.Tensor]],
    ties: Sequence[Optional[torch.Tensor]],
) -> None:
    """Writes ``split(masters[i])`` into ``params[i]``, ``remainders[i]`` and ``ties[i]``.

    Pairs go by index; any strides (transposed, channels_last, sliced views). ``None``
    entries must line up and are skipped. Every check runs before the first write. On XLA
    the whole list is one computation; no host sync anywhere.

    Args:
        masters: float32 tensors.
        params: bfloat16 tensors of the masters' shapes and devices (written).
        remainders: int16 tensors of the masters' shapes and devices (written).
        ties: uint8 tensors of ``tie_shape`` of the masters' shapes (written).

    Raises:
        TypeError: a wrong dtype (fp16 params, with the reason) or a non-tensor entry.
        ValueError: lengths, shapes or devices differ, an output is expanded, or outputs
            share memory with each other or with a master.
    """
    fn = "split_"
    ms, ps = _side(fn, "masters", masters), _side(fn, "params", params)
    rs, ts = _side(fn, "remainders", remainders), _side(fn, "ties", ties)
    _check_split(fn, ms, (ps, rs, ts))
    with torch.no_grad():
        for dev, idx in _by_device(ms.leaves).items():
            if dev.type == "xla":
                outs = _call_xla("split", [ms.leaves[i] for i in idx], 1)
                torch._foreach_copy_([ps.leaves[i] for i in idx], outs[0::3])
                torch._foreach_copy_([rs.leaves[i] for i in idx], outs[1::3])
                torch._foreach_copy_([ts.leaves[i] for i in idx], outs[2::3])
                continue
            for i in idx:
                param, remainder, tie = _split_bits(ms.leaves[i].view(torch.int32))
                # Through int views: a float copy_ may canonicalize NaN payloads.
                ps.leaves[i].view(torch.int16).copy_(param)
                rs.leaves[i].copy_(remainder)
                ts.leaves[i].copy_(pack_ties(tie))


def join_(
    params: Sequence[Optional[torch.Tensor]],
    remainders: Sequence[Optional[torch.Tensor]],
    ties: Sequence[Optional[torch.Tensor]],
    masters: Sequence[Optional[torch.Tensor]],
) -> None:
    """Writes ``join(params[i], remainders[i], ties[i])`` into ``masters[i]``, for every i.

    Args:
        params: bfloat16 tensors.
        remainders: int16 tensors of the params' shapes and devices.
        ties: uint8 tensors of ``tie_shape`` of the params' shapes, on their devices.
        masters: float32 tensors of the params' shapes and devices (written).

    Raises:
        TypeError: a wrong dtype (fp16 params, with the reason) or a non-tensor entry.
        ValueError: lengths, shapes or devices differ, a master is expanded, or a master
            shares memory with another tensor of the call.
    """
    fn = "join_"
    ps, rs = _side(fn, "params", params), _side(fn, "remainders", remainders)
    ts, ms = _side(fn, "ties", ties), _side(fn, "masters", masters)
    _check_join(fn, ps, rs, ts, ms)
    with torch.no_grad():
        for dev, idx in _by_device(ps.leaves).items():
            if dev.type == "xla":
                inputs = [t for i in idx for t in (ps.leaves[i], rs.leaves[i], ts.leaves[i])]
                torch._foreach_copy_([ms.leaves[i] for i in idx], _call_xla("join", inputs, 3))
                continue
            for i in idx:
                p = ps.leaves[i].view(torch.int16).to(torch.int32)
                t = unpack_ties(ts.leaves[i], ps.leaves[i].shape)
                bits = _join_bits(p, rs.leaves[i].to(torch.int32), t)
                ms.leaves[i].view(torch.int32).copy_(bits)


def _single(fn: str, name: str, t: object) -> _checks.Side:
    if not isinstance(t, torch.Tensor) or t.layout is not torch.strided:
        what = "a dense (strided) tensor" if isinstance(t, torch.Tensor) else "a tensor"
        raise TypeError(f"{fn}: {name}: expected {what}, got {_checks.describe(t)}")
    return _checks.Side(name, t, [t])


def _by_device(leaves: Sequence[Optional[torch.Tensor]]) -> dict[torch.device, list[int]]:
    groups: dict[torch.device, list[int]] = {}
    for i, t in enumerate(leaves):
        if t is not None:
            groups.setdefault(t.device, []).append(i)
    return groups

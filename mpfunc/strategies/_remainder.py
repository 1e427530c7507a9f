"""An fp32 master held exactly as its bf16 param plus a 16-bit remainder.

bf16 is the top half of fp32 (same sign, same 8-bit exponent, 7 of the 23 mantissa
bits), so the 16 bits that rounding drops can be kept beside the param and the
master rebuilt bit for bit::

    param, remainder = split(master)      # bf16, int16; 2 + 2 bytes
    join(param, remainder)                # the same 32 bits as master, always

**The encoding.** ``remainder`` is the master's low 16 bits, unchanged. ``param`` is
the master rounded to nearest with ties *away from zero* (IEEE roundTiesToAway),
computed on the magnitude bits; ``join`` undoes it: the rounding went up exactly
when the remainder's top bit is set. Two rules cover the fp32 NaNs (below). Every
one of the 2^32 patterns round-trips (``python -m bench.remainder`` checks all
of them), so ``split`` is a bijection and ``join`` accepts any pair.

**Where the param is not ``master.to(torch.bfloat16)``.** Only here:

* *Ties toward an even neighbour*: low 16 bits exactly ``0x8000`` and the high half
  even. Round-to-nearest-even rounds down to the even pattern; this param is the
  next pattern up, one bf16 ulp away. 16,320 patterns per sign, 2^-17 of random bits.
  No 16-bit remainder can avoid it: it tells apart 65,536 masters per param value,
  and each even nonzero finite bf16 value is the nearest-even rounding of 65,537
  (both ties), so one of them needs another param (at least 16,319 patterns per
  sign; this encoding also moves the tie at 2^-134 to keep a single rule). A loop
  that rounds its params with ``Tensor.to`` therefore differs from this one in the
  last bit of a few params per step, and its trajectory drifts from there.
* *NaNs*: a NaN param with the master's sign and top 7 payload bits (``Tensor.to``
  gives the canonical NaN) for every NaN whose payload reaches the high half. The
  NaNs whose payload lies wholly in the low 16 bits (``0x7F800001..0x7F80FFFF`` and
  the negatives) get inf (``..7FFF``) or zero (``0x7F808000..``), with their sign.
  Also forced: bf16 has 127 NaN patterns per sign, room for 127 * 65,536 masters,
  and fp32 has 128 * 65,536 - 1 NaNs. The 65,535 left over can only go where
  rounding leaves room: inf (0x7FFF free remainders) and zero (0x8000).

Finite masters above bf16's largest finite (``0x7F7F8000..0x7F7FFFFF``) get an inf
param, as with ``Tensor.to``, and the remainder still rebuilds them exactly;
subnormals, ±0 and ±inf get exactly ``Tensor.to``'s param.

The param and the remainder are a pair: write the param only through ``split`` /
``split_``. A param written by ``Tensor.to`` or ``masters_to_model_`` is one pattern
lower at the ties above, and ``join`` would then return a master 65,536 ulps lower.
Every pair is a valid encoding, so nothing can detect that afterwards.

**fp16 params** cannot hold an exact fp32 master in 16 more bits (see
``unsupported_hint``).

On CPU and CUDA the bits are reinterpreted with ``Tensor.view(dtype)`` and rounded in
int32 arithmetic, op by op. On XLA ``view(dtype)`` is not lowered (torch_xla 2.9
runs ``aten::view_copy.dtype`` on the host), so a list of leaves becomes one XLA
computation (``BitcastConvert`` plus the same integer ops), built once per list of
shapes and called with ``torch_xla._XLAC._xla_user_computation``: one node, no host
transfer, no ``aten::`` fallback. (torch_xla 2.9 on XLA:CPU canonicalizes bf16 NaN
payloads written into a *view* with ``copy_``; a NaN param that is a view keeps its
NaN-ness and sign but not its payload there. Nothing else is changed.)

See docs/design.md#the-remainder-encoding.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, Optional

import torch

from mpfunc.core import _checks

__all__ = [
    "MASTER_DTYPE",
    "PARAM_DTYPE",
    "REMAINDER_DTYPE",
    "clear_cache",
    "join",
    "join_",
    "split",
    "split_",
    "unsupported_hint",
]

MASTER_DTYPE = torch.float32
PARAM_DTYPE = torch.bfloat16
REMAINDER_DTYPE = torch.int16

# The master's magnitude bits shifted right by 15: its high half (15 bits) and the
# rounding bit (bit 15). At or above _G_TRUNC the master is a NaN with payload in the
# high half: the param keeps that half. _G_ZERO is a NaN whose payload lies in the low
# half with bit 15 set: the rounding would carry it into a NaN pattern that the NaNs
# above already fill, so its param is zero, which has room (see the module docstring).
_G_TRUNC = 0xFF02  # high half >= 0x7F81
_G_ZERO = 0xFF01  # high half == 0x7F80, rounding bit set
_INF_HIGH = 0x7F80  # bf16 inf's magnitude bits
_SIGN32 = -(2**31)  # int32 0x80000000


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


def _split_bits(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int32 bits of fp32 masters -> the param's int16 bits and the remainder, each as an
    int32 tensor of values in [-2**15, 2**15) (so that the cast to int16 is exact).

    Every op is int32 with int32 masks (``(v - k) >> 31`` is -1 where ``v < k``, else 0):
    ``torch.where``, ``masked_fill_`` and bool masks run 3-80x slower than a bitwise op on
    the CPU (torch 2.9)."""
    g = torch.bitwise_and(b, 0x7FFF_FFFF).bitwise_right_shift_(15)  # in [0, 0xFFFF]
    # The rounding bit, except for NaNs with a high payload (g >= _G_TRUNC): they keep it.
    up = torch.sub(g, _G_TRUNC).bitwise_right_shift_(31).bitwise_and_(g).bitwise_and_(1)
    # NaNs with a low payload and the rounding bit set (g == _G_ZERO) would carry into
    # 0x7F81, which the NaNs above fill already: their param is zero, which has room.
    keep = torch.bitwise_xor(g, _G_ZERO).sub_(1).bitwise_right_shift_(31).bitwise_not_()
    mag = g.bitwise_right_shift_(1).add_(up).bitwise_and_(keep)  # nearest, ties away
    # The sign: bit 31 of b is bit 15 of b >> 16 with either kind of shift.
    param = mag.sub_(torch.bitwise_right_shift(b, 16).bitwise_and_(0x8000))
    remainder = torch.bitwise_left_shift(b, 16).bitwise_right_shift_(16)  # low half, signed
    return param, remainder


def _join_bits(p: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """The param's int16 bits and the remainder, widened to int32 -> the master's bits."""
    mag = torch.bitwise_and(p, 0x7FFF)
    low = torch.bitwise_and(r, 0xFFFF)
    # Undo the rounding: it went up exactly when the remainder's top bit is set, unless
    # the param is a NaN (mag > _INF_HIGH), which kept its high half.
    finite = torch.sub(mag, _INF_HIGH + 1).bitwise_right_shift_(31)  # -1 unless a NaN
    high = mag.sub_(finite.bitwise_and_(low).bitwise_right_shift_(15))
    # -1 only from a zero param with the top bit set: the low-payload NaNs, high 0x7F80.
    high.add_(torch.bitwise_right_shift(high, 31).bitwise_and_(_INF_HIGH + 1))
    return high.bitwise_left_shift_(16).bitwise_or_(low).bitwise_or_(p & _SIGN32)


def _split_eager(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    param, remainder = _split_bits(master.view(torch.int32))
    return param.to(torch.int16).view(PARAM_DTYPE), remainder.to(REMAINDER_DTYPE)


def _join_eager(param: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    p = param.view(torch.int16).to(torch.int32)
    return _join_bits(p, remainder.to(torch.int32)).view(MASTER_DTYPE)


# --- XLA: one computation per list of shapes ----------------------------------------------

_CACHE_SIZE = 64
_cache: dict[tuple[Any, ...], Any] = {}
_lock = threading.Lock()


def _xb() -> Any:
    import torch_xla.core.xla_builder as xb

    return xb


def _split_ops(xb: Any, builder: Any, master: Any) -> tuple[Any, Any]:
    """``_split_bits``'s function as XLA ops on one fp32 operand: (bf16 param, s16
    remainder). Selects instead of int masks (XLA fuses either); right shifts as
    divisions of non-negative values, since torch_xla 2.9's builder spells its only
    right shift "ShifRight", a name a fix would break. The tests compare the bits."""

    def k(v: int) -> Any:
        return xb.Op.scalar(builder, v, dtype="s32")

    b = master.bitcast("s32")
    g = (b & k(0x7FFF_FFFF)) / k(1 << 15)
    high = g / k(2)
    mag = high + (g & k(1))
    mag = (g >= k(_G_TRUNC)).select(high, mag)
    mag = (g == k(_G_ZERO)).select(mag.zeros_like(), mag)
    param = (b < k(0)).select(mag - k(0x8000), mag)
    remainder = ((b & k(0xFFFF)) ^ k(0x8000)) - k(0x8000)
    return param.cast("s16").bitcast("bf16"), remainder.cast("s16")


def _join_ops(xb: Any, builder: Any, param: Any, remainder: Any) -> Any:
    """``_join_bits``'s function as XLA ops: a bf16 param and an s16 remainder -> the f32
    master (written as ``_split_ops``)."""

    def k(v: int) -> Any:
        return xb.Op.scalar(builder, v, dtype="s32")

    p = param.bitcast("s16").cast("s32")
    low = remainder.cast("s32") & k(0xFFFF)
    mag = p & k(0x7FFF)
    high = (mag > k(_INF_HIGH)).select(mag, mag - low / k(1 << 15))
    high = (high < k(0)).select(high.scalar_like(_INF_HIGH), high)
    bits = (p & k(_SIGN32)) | (high << k(16)) | low
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
            outs.extend(_split_ops(xb, builder, param("f32", shape)))
        else:
            p = param("bf16", shape)
            outs.append(_join_ops(xb, builder, p, param("s16", shape)))
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


def _check_split(
    fn: str, masters: _checks.Side, params: Optional[_checks.Side], rems: Optional[_checks.Side]
) -> None:
    """Masters, and the outputs ``split_`` writes (``None`` for ``split``, which makes its own)."""
    _checks.check_leaf_dtypes(fn, masters, (MASTER_DTYPE,), "a torch.float32 master")
    if params is None or rems is None:
        return
    _lengths(fn, masters, (params, rems))
    _check_param_dtypes(fn, params)
    like = _checks.Like("the master's", (PARAM_DTYPE,), "a torch.bfloat16 param")
    _checks.check_pairs(fn, masters, params, like)
    _checks.check_pairs(fn, masters, rems, _REMAINDER._replace(role="the master's"))
    _checks.check_writable(fn, (params, rems))
    _checks.check_no_alias(fn, (params, rems), (masters,))


def _check_join(
    fn: str, params: _checks.Side, rems: _checks.Side, masters: Optional[_checks.Side]
) -> None:
    """Params and remainders, and the masters ``join_`` writes (``None`` for ``join``)."""
    _lengths(fn, params, (rems,))
    _check_param_dtypes(fn, params)
    _checks.check_pairs(fn, params, rems, _REMAINDER)
    if masters is None:
        return
    _lengths(fn, params, (masters,))
    _checks.check_pairs(fn, params, masters, _MASTER)
    _checks.check_writable(fn, (masters,))
    _checks.check_no_alias(fn, (masters,), (params, rems))


# --- the public forms ---------------------------------------------------------------------


def split(master: torch.Tensor, /) -> tuple[torch.Tensor, torch.Tensor]:
    """The bf16 param and int16 remainder that hold ``master`` exactly.

    Args:
        master: a float32 tensor (any shape and strides; CPU, CUDA or XLA).

    Returns:
        ``(param, remainder)``: new tensors of ``master``'s shape, bfloat16 and int16.
        ``param`` equals ``master.to(torch.bfloat16)`` except at the ties and NaNs
        listed in the module docstring; ``join(param, remainder)`` has ``master``'s bits.

    Raises:
        TypeError: ``master`` is not a dense float32 tensor.
    """
    fn = "split"
    _check_split(fn, _single(fn, "master", master), None, None)
    if master.device.type == "xla":
        param, remainder = _call_xla("split", [master], 1)
        return param, remainder
    return _split_eager(master)


def join(param: torch.Tensor, remainder: torch.Tensor, /) -> torch.Tensor:
    """The fp32 master that ``param`` and ``remainder`` hold (the inverse of ``split``).

    Args:
        param: a bfloat16 tensor.
        remainder: an int16 tensor of ``param``'s shape, on its device.

    Returns:
        A new float32 tensor. Every pair is valid: ``split(join(p, r)) == (p, r)``.

    Raises:
        TypeError: a wrong dtype (an fp16 param, with the reason) or a non-tensor.
        ValueError: shapes or devices differ.
    """
    fn = "join"
    ps = _single(fn, "param", param)
    _check_join(fn, ps, _single(fn, "remainder", remainder), None)
    if param.device.type == "xla":
        return _call_xla("join", [param, remainder], 2)[0]
    return _join_eager(param, remainder)


def split_(
    masters: Sequence[Optional[torch.Tensor]],
    params: Sequence[Optional[torch.Tensor]],
    remainders: Sequence[Optional[torch.Tensor]],
) -> None:
    """Writes ``split(masters[i])`` into ``params[i]`` and ``remainders[i]``, for every i.

    Pairs go by index; any strides (transposed, channels_last, sliced views). ``None``
    entries must line up and are skipped. Every check runs before the first write. On XLA
    the whole list is one computation; no host sync anywhere.

    Args:
        masters: float32 tensors.
        params: bfloat16 tensors of the masters' shapes and devices (written).
        remainders: int16 tensors of the masters' shapes and devices (written).

    Raises:
        TypeError: a wrong dtype (fp16 params, with the reason) or a non-tensor entry.
        ValueError: lengths, shapes or devices differ, an output is expanded, or outputs
            share memory with each other or with a master.
    """
    fn = "split_"
    ms, ps = _side(fn, "masters", masters), _side(fn, "params", params)
    rs = _side(fn, "remainders", remainders)
    _check_split(fn, ms, ps, rs)
    with torch.no_grad():
        for dev, idx in _by_device(ms.leaves).items():
            if dev.type == "xla":
                outs = _call_xla("split", [ms.leaves[i] for i in idx], 1)
                torch._foreach_copy_([ps.leaves[i] for i in idx], outs[0::2])
                torch._foreach_copy_([rs.leaves[i] for i in idx], outs[1::2])
                continue
            for i in idx:
                param, remainder = _split_bits(ms.leaves[i].view(torch.int32))
                # Through int views: a float copy_ may canonicalize NaN payloads.
                ps.leaves[i].view(torch.int16).copy_(param)
                rs.leaves[i].copy_(remainder)


def join_(
    params: Sequence[Optional[torch.Tensor]],
    remainders: Sequence[Optional[torch.Tensor]],
    masters: Sequence[Optional[torch.Tensor]],
) -> None:
    """Writes ``join(params[i], remainders[i])`` into ``masters[i]``, for every i.

    Args:
        params: bfloat16 tensors.
        remainders: int16 tensors of the params' shapes and devices.
        masters: float32 tensors of the params' shapes and devices (written).

    Raises:
        TypeError: a wrong dtype (fp16 params, with the reason) or a non-tensor entry.
        ValueError: lengths, shapes or devices differ, a master is expanded, or a master
            shares memory with another tensor of the call.
    """
    fn = "join_"
    ps, rs = _side(fn, "params", params), _side(fn, "remainders", remainders)
    ms = _side(fn, "masters", masters)
    _check_join(fn, ps, rs, ms)
    with torch.no_grad():
        for dev, idx in _by_device(ps.leaves).items():
            if dev.type == "xla":
                inputs = [t for i in idx for t in (ps.leaves[i], rs.leaves[i])]
                torch._foreach_copy_([ms.leaves[i] for i in idx], _call_xla("join", inputs, 2))
                continue
            for i in idx:
                p = ps.leaves[i].view(torch.int16).to(torch.int32)
                bits = _join_bits(p, rs.leaves[i].to(torch.int32))
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

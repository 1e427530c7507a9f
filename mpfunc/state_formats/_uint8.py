"""8-bit moments, ``state_dtype=torch.uint8``: the blockwise codec of ``_quantize``.

Each moment is a ``QState(codes, scale)``: 32-element blocks with a bf16 absmax scale
and companded 8-bit codes in the master's shape (int8 for first moments, uint8 for
second moments), 2.125 bytes per element for both Adam moments together. Second moments
(``"square"`` fields) are rounded stochastically with draws keyed on the leaf's step
count (``_base.keys``), so a resumed run draws the same bits; first moments to nearest.
The native composed pass (format code 2) and the XLA node carry their own copies of the
codec, bit for bit.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from mpfunc.core import _checks
from mpfunc.state_formats import _quantize
from mpfunc.state_formats._base import (
    Problem,
    StateFormat,
    encoded_all_right,
    in_compute,
    store_codes,
    whole_blocks,
)
from mpfunc.state_formats._quantize import QState

__all__ = ["FORMAT", "QState"]


def _zeros(kind: str, dtype: torch.dtype, like: torch.Tensor) -> QState:
    return _quantize.zeros(like.shape, kind != "square", like.device)


def _zeros_list(kind: str, dtypes: list[torch.dtype | None], faces: list[Any]) -> list[Any]:
    """On the CPU, codes and scales (contiguous, as ``_quantize.zeros`` makes them) come
    from ``new_zeros`` of a prototype of their dtype: ``torch.zeros`` spends ~1 us more a
    tensor parsing its arguments, a second at 100,000 leaves."""
    code = _quantize.SIGNED_DTYPE if kind != "square" else _quantize.UNSIGNED_DTYPE
    codes = torch.zeros(0, dtype=code)
    scales = torch.zeros(0, dtype=_quantize.SCALE_DTYPE)
    blocks = _quantize.blocks
    return [
        None
        if f is None or d is None
        else QState(codes.new_zeros(f.shape), scales.new_zeros(blocks(f.numel())))
        if f.is_cpu
        else _zeros(kind, d, f)
        for f, d in zip(faces, dtypes)
    ]


def _problem(kind: str, x: Any, like: torch.Tensor, dtype: torch.dtype) -> Problem:
    Tensor = torch.Tensor
    if not (isinstance(x, QState) and isinstance(x.codes, Tensor) and isinstance(x.scale, Tensor)):
        return TypeError, "a QState (an 8-bit moment made by opt.init)", _checks.describe(x)
    want = torch.int8 if kind != "square" else torch.uint8
    c, s = x.codes, x.scale
    device = like.device
    if c.dtype != want or c.shape != like.shape or c.device != device:
        return (
            ValueError,
            f"codes {want} of shape {tuple(like.shape)} on {like.device}",
            f"{c.dtype} of shape {tuple(c.shape)} on {c.device}",
        )
    n = _quantize.blocks(math.prod(like.shape))
    if s.dtype != _quantize.SCALE_DTYPE or s.shape != (n,) or s.device != device:
        return (
            ValueError,
            f"scales {_quantize.SCALE_DTYPE} of shape ({n},) on {like.device}",
            f"{s.dtype} of shape {tuple(s.shape)} on {s.device}",
        )
    if not c.is_contiguous() or not s.is_contiguous():
        return ValueError, "contiguous codes and scales (as opt.init makes them)", "strided"
    return None


def _all_right(kind: str, xs: list[Any], likes: list[torch.Tensor]) -> bool:
    """``_problem`` of every ``(x, like)`` pair is ``None``: the common case in bulk."""
    want = torch.int8 if kind != "square" else torch.uint8
    bf16, blocks = _quantize.SCALE_DTYPE, _quantize.blocks
    expected = [(want, f.shape, f.device, bf16, (blocks(f.numel()),)) for f in likes]
    return encoded_all_right(QState, xs, expected)


def _check_init(fn: str, side: _checks.Side, faces: list[Any]) -> None:
    """A leaf needs at least one whole block (``_base.whole_blocks``)."""
    whole_blocks(fn, side, faces, _quantize.BLOCK, "torch.uint8")


def _load(xs: list[Any], compute: torch.dtype, likes: list[torch.Tensor]) -> list[torch.Tensor]:
    return in_compute(_quantize.dequantize_list(xs), compute) if xs else []


def _store(
    xs: list[Any],
    values: list[torch.Tensor],
    kind: str,
    skip: torch.Tensor | None,
    steps: list[torch.Tensor] | None,
    salts: list[int],
) -> None:
    # One batched encode for the whole list on XLA (a few ops per tensor, not dozens).
    store_codes(_quantize.quantize_list_, xs, values, kind, skip, steps, salts)


def _layout(x: Any, face: torch.Tensor) -> torch.Tensor:
    # Moments load as contiguous fp32 temporaries: their codes' layout stands in.
    return x.codes  # type: ignore[no-any-return]


FORMAT = StateFormat(
    name="uint8",
    key=torch.uint8,
    container=QState,
    zeros=_zeros,
    zeros_list=_zeros_list,
    problem=_problem,
    check_init=_check_init,
    load=_load,
    store=_store,
    layout=_layout,
    native=2,
    xla=True,
    salted=True,
    all_right=_all_right,
)

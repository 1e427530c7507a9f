"""4-bit moments, ``state_dtype=torch.uint4``: the blockwise codec of ``_quantize4``.

Each moment is a ``Q4State(codes, scale)``: 32-element blocks with a bf16 scale and
companded 4-bit codes packed two per byte in row-major element order (flat int8 bytes
for first moments, uint8 for second moments), 1.125 bytes per element for both Adam
moments together. A state does not keep its moment's shape: ``load`` reads it from the
leaf's master values. Second moments (``"square"`` fields) are rounded stochastically
with draws keyed on the leaf's step count and salt (``_base.keys``, as at 8 bits), so a
resumed run draws the same bits; first moments to nearest. Why this code: ``_quantize4``'s
docstring and ``bench/results/q4_design``.

On XLA the one-node kernels carry the codec (``xla=True``; ``_quantize4.decode_ops`` and
``encode_ops``, op for op the torch path's, the same bits). On the CPU the native
composed pass carries it too (format code 3: ``FU4``, one 32-element block in two AVX-512
registers, and the ``decode4``/``encode4`` tiles in ``csrc/adam_mixed.cpp``), bit for bit
the torch path's codes, scales, masters and params, for Adam/AdamW/amsgrad, SGD and Lion
over every master strategy.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from mpfunc.core import _checks
from mpfunc.parallel import _sharding
from mpfunc.state_formats import _quantize4
from mpfunc.state_formats._base import (
    Problem,
    StateFormat,
    encoded_all_right,
    in_compute,
    store_codes,
    whole_blocks,
)
from mpfunc.state_formats._quantize4 import Q4State

__all__ = ["FORMAT", "KEY", "Q4State"]

# The ``state_dtype`` that names this format: torch's 4-bit unsigned shell dtype (torch
# 2.3 and later, absent from its type stubs; no tensor of it is ever made, it is a name).
KEY: torch.dtype = torch.uint4  # type: ignore[attr-defined]


def _zeros(kind: str, dtype: torch.dtype, like: torch.Tensor) -> Q4State:
    z = _quantize4.zeros4(like.shape, kind != "square", like.device)
    # XLA SPMD: flat codes and scales in row-major element order follow a master split
    # along dim 0 alone (each device's rows are one flat range); otherwise replicated.
    _sharding.flat_like_(z.codes, like, 2)
    _sharding.flat_like_(z.scale, like, _quantize4.BLOCK)
    return z


def _zeros_list(kind: str, dtypes: list[torch.dtype | None], faces: list[Any]) -> list[Any]:
    return [None if f is None or d is None else _zeros(kind, d, f) for f, d in zip(faces, dtypes)]


def _problem(kind: str, x: Any, like: torch.Tensor, dtype: torch.dtype) -> Problem:
    Tensor = torch.Tensor
    if not (isinstance(x, Q4State) and isinstance(x.codes, Tensor) and isinstance(x.scale, Tensor)):
        return TypeError, "a Q4State (a 4-bit moment made by opt.init)", _checks.describe(x)
    want = _quantize4.SIGNED_DTYPE if kind != "square" else _quantize4.UNSIGNED_DTYPE
    c, s = x.codes, x.scale
    device = like.device
    numel = math.prod(like.shape)
    n_bytes = _quantize4.packed_bytes(numel)
    if c.dtype != want or c.shape != (n_bytes,) or c.device != device:
        return (
            ValueError,
            f"packed codes {want} of shape ({n_bytes},) on {like.device}",
            f"{c.dtype} of shape {tuple(c.shape)} on {c.device}",
        )
    n = _quantize4.blocks(numel)
    if s.dtype != _quantize4.SCALE_DTYPE or s.shape != (n,) or s.device != device:
        return (
            ValueError,
            f"scales {_quantize4.SCALE_DTYPE} of shape ({n},) on {like.device}",
            f"{s.dtype} of shape {tuple(s.shape)} on {s.device}",
        )
    if not c.is_contiguous() or not s.is_contiguous():
        return ValueError, "contiguous codes and scales (as opt.init makes them)", "strided"
    return None


def _all_right(kind: str, xs: list[Any], likes: list[torch.Tensor]) -> bool:
    """``_problem`` of every ``(x, like)`` pair is ``None``: the common case in bulk."""
    want = _quantize4.SIGNED_DTYPE if kind != "square" else _quantize4.UNSIGNED_DTYPE
    bf16, blocks, packed = _quantize4.SCALE_DTYPE, _quantize4.blocks, _quantize4.packed_bytes
    sizes = [math.prod(f.shape) for f in likes]
    expected = [(want, (packed(n),), f.device, bf16, (blocks(n),)) for f, n in zip(likes, sizes)]
    return encoded_all_right(Q4State, xs, expected)


def _check_init(fn: str, side: _checks.Side, faces: list[Any]) -> None:
    """A leaf needs at least one whole block (``_base.whole_blocks``)."""
    whole_blocks(fn, side, faces, _quantize4.BLOCK, "torch.uint4")


def _load(xs: list[Any], compute: torch.dtype, likes: list[torch.Tensor]) -> list[torch.Tensor]:
    if not xs:
        return []
    return in_compute(_quantize4.dequantize4_list(xs, [v.shape for v in likes]), compute)


def _store(
    xs: list[Any],
    values: list[torch.Tensor],
    kind: str,
    skip: torch.Tensor | None,
    steps: list[torch.Tensor] | None,
    salts: list[int],
) -> None:
    store_codes(_quantize4.quantize4_list_, xs, values, kind, skip, steps, salts)


def _layout(x: Any, face: torch.Tensor) -> torch.Tensor:
    # Moments load as contiguous fp32 temporaries of the face's shape.
    return torch.empty(face.shape, device="meta")


FORMAT = StateFormat(
    name="uint4",
    key=KEY,
    container=Q4State,
    zeros=_zeros,
    zeros_list=_zeros_list,
    problem=_problem,
    check_init=_check_init,
    load=_load,
    store=_store,
    layout=_layout,
    native=3,
    xla=True,
    salted=True,
    all_right=_all_right,
)

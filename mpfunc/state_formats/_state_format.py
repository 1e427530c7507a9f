"""How optimizer moments are stored: ``state_dtype`` of ``adam``/``adamw``/``sgd``/``lion``.

* ``None`` (default): like the master (float32; float64 for float64 masters).
* ``torch.float32``: float32 moments whatever the master.
* ``torch.bfloat16``: moments stored in bf16 (rounded to nearest even), computed in fp32:
  a step loads a chunk of them into fp32 temporaries and stores them back.
* ``torch.uint8``: moments quantized blockwise (``_quantize``: 32-element blocks with a
  bf16 absmax scale, companded 8-bit codes; a ``QState(codes, scale)`` per leaf, 2.125
  bytes per element for both Adam moments together). Second moments (``"square"``
  fields) are rounded stochastically with draws keyed on the leaf's step count
  (``_rng``), so a resumed run draws the same bits; first moments to nearest.

Every load/store is sync-free and runs on CPU, CUDA and XLA.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from mpfunc.core import _checks, _rng, _tree
from mpfunc.state_formats import _quantize
from mpfunc.state_formats._quantize import QState

__all__ = [
    "QState",
    "check_quantizable",
    "load",
    "problem",
    "store",
    "stored_dtype",
    "zeros",
    "zeros_list",
]

_tree.register_unit(QState)


def stored_dtype(compute: torch.dtype, state_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype a moment is stored in: ``state_dtype``, or the dtype it is computed in
    (``_plan._compute_dtype``) when that is ``None``."""
    return compute if state_dtype is None else state_dtype


def zeros(
    kind: str, compute: torch.dtype, like: torch.Tensor, state_dtype: torch.dtype | None
) -> Any:
    """A zero moment of field kind ``kind`` for a leaf shaped like ``like``."""
    dtype = stored_dtype(compute, state_dtype)
    if dtype == torch.uint8:
        return _quantize.zeros(like.shape, kind != "square", like.device)
    # The master's layout (channels_last, transposed): fused kernels pair by position.
    return torch.zeros_like(like, dtype=dtype, memory_format=torch.preserve_format)


def zeros_list(
    kind: str,
    computes: list[torch.dtype | None],
    faces: list[Any],
    state_dtype: torch.dtype | None,
) -> list[Any]:
    """``zeros`` of each face (``None`` where the face or its compute dtype is ``None``): a
    whole field at once. On the CPU, 8-bit codes and scales (contiguous, as
    ``_quantize.zeros`` makes them) come from ``new_zeros`` of a prototype of their dtype:
    ``torch.zeros`` spends ~1 us more a tensor parsing its arguments, a second at 100,000
    leaves. Float moments keep ``zeros``' ``zeros_like`` (the face's strides)."""
    if state_dtype != torch.uint8:
        return [
            None if f is None or c is None else zeros(kind, c, f, state_dtype)
            for f, c in zip(faces, computes)
        ]
    code = _quantize.SIGNED_DTYPE if kind != "square" else _quantize.UNSIGNED_DTYPE
    codes = torch.zeros(0, dtype=code)
    scales = torch.zeros(0, dtype=_quantize.SCALE_DTYPE)
    blocks = _quantize.blocks
    return [
        None
        if f is None or c is None
        else QState(codes.new_zeros(f.shape), scales.new_zeros(blocks(f.numel())))
        if f.is_cpu
        else zeros(kind, c, f, state_dtype)
        for f, c in zip(faces, computes)
    ]


def problem(
    kind: str, x: Any, like: torch.Tensor, dtype: torch.dtype
) -> tuple[type[Exception], str, str] | None:
    """What is wrong with a stored moment: (exception type, expected, got), or ``None``."""
    # Runs per leaf in a step that plans in full: each attribute read once, cheap tests first.
    if dtype == torch.uint8:
        Tensor = torch.Tensor
        if not (
            isinstance(x, QState) and isinstance(x.codes, Tensor) and isinstance(x.scale, Tensor)
        ):
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
    if not isinstance(x, torch.Tensor):
        return TypeError, "a tensor or None leaf", _checks.describe(x)
    if x.layout is not torch.strided:
        return TypeError, "a dense (strided) tensor", _checks.describe(x)
    if x.dtype != dtype:
        return TypeError, f"{dtype} (the state's dtype)", _checks.describe(x)
    if x.shape != like.shape:
        return ValueError, f"shape {tuple(like.shape)} (the master's)", f"shape {tuple(x.shape)}"
    if x.device != like.device:
        return ValueError, f"device {like.device} (the master's)", f"device {x.device}"
    return None


def check_quantizable(fn: str, side: _checks.Side, faces: list[Any]) -> None:
    """8-bit moments need at least one whole block per leaf: a smaller leaf (a 3-element
    bias, a 0-d temperature) would spend a bf16 scale on a handful of bytes and round
    its moments coarsely for no saving worth having. Such leaves get a clear error that
    points to ``partition``."""
    for i, f in enumerate(faces):
        if f is not None and f.numel() < _quantize.BLOCK:
            _checks.fail(
                ValueError,
                fn,
                side.path(i),
                f"a leaf of at least {_quantize.BLOCK} elements for state_dtype=torch.uint8",
                f"{f.numel()} elements",
                "Keep small leaves in fp32 state: mpfunc.partition({'big': mpfunc.adamw(..., "
                "state_dtype=torch.uint8), 'small': mpfunc.adamw(...)}, labels) with labels "
                "from a function such as lambda path, p: 'big' if p.numel() >= 4096 else 'small'",
            )


def load(xs: list[Any], compute: torch.dtype) -> list[torch.Tensor]:
    """Moments in ``compute`` dtype to run a kernel on: the stored tensors themselves when
    they already are (written in place), else fresh temporaries."""
    if not xs:
        return []
    if isinstance(xs[0], QState):
        return _quantize.dequantize_list(xs)
    if xs[0].dtype == compute:
        return xs
    return [x.to(compute) for x in xs]


def store(
    xs: list[Any],
    values: list[torch.Tensor],
    kind: str,
    skip: torch.Tensor | None,
    steps: list[torch.Tensor] | None,
    salts: list[int],
) -> None:
    """Writes computed moments back into their stored form (nothing to do where ``load``
    lent the stored tensors). Where ``skip`` is true every stored bit is kept."""
    if not xs or values[0] is xs[0]:
        return
    if isinstance(xs[0], QState):
        noises: list[torch.Tensor | None] | None = None
        if kind == "square" and steps is not None:
            noises = list(_rng.uniform_list(_keys(steps, salts), [v.shape for v in values]))
        old = [(q.codes.clone(), q.scale.clone()) for q in xs] if skip is not None else []
        # One batched encode for the whole list on XLA (a few ops per tensor, not dozens).
        _quantize.quantize_list_([v.contiguous() for v in values], xs, noises=noises)
        if skip is not None:
            codes = [torch.where(skip, c, q.codes) for (c, _), q in zip(old, xs)]
            scales = [torch.where(skip, s, q.scale) for (_, s), q in zip(old, xs)]
            torch._foreach_copy_([q.codes for q in xs], codes)
            torch._foreach_copy_([q.scale for q in xs], scales)
        return
    rounded = [v.to(x.dtype) for x, v in zip(xs, values)]
    if skip is not None:
        rounded = [torch.where(skip, x, r) for x, r in zip(xs, rounded)]
    torch._foreach_copy_(xs, rounded)


def _keys(steps: list[torch.Tensor], salts: list[int]) -> list[torch.Tensor]:
    """The draw key of each leaf at this step: its step count (exact in fp32 below 2**24)
    mixed with a per-leaf salt. A Python-int salt traces as a constant: no transfer. On XLA
    the keys are mixed as one stacked vector (a few traced ops per leaf, not a dozen)."""
    pre = [t.to(torch.int32).mul(_rng._GOLDEN).add_(_rng._wrap(s)) for t, s in zip(steps, salts)]
    if len(pre) > 1 and pre[0].device.type == "xla":
        return list(_rng._mix(torch.stack(pre)).unbind(0))
    return [_rng._mix(k) for k in pre]

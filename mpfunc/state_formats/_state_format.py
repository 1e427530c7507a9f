"""How optimizer moments are stored: ``state_dtype`` of ``adam``/``adamw``/``sgd``/``lion``.

* ``None`` (default): like the master (float32; float64 for float64 masters).
* ``torch.float32``: float32 moments whatever the master.
* ``torch.bfloat16``: moments stored in bf16 (rounded to nearest even), computed in fp32:
  a step loads a chunk of them into fp32 temporaries and stores them back.
* ``torch.uint8``: moments quantized blockwise (``_uint8``, the codec ``_quantize``:
  32-element blocks with a bf16 absmax scale, companded 8-bit codes; a
  ``QState(codes, scale)`` per leaf, 2.125 bytes per element for both Adam moments
  together). Second moments (``"square"`` fields) are rounded stochastically with draws
  keyed on the leaf's step count (``_rng``), so a resumed run draws the same bits; first
  moments to nearest.
* ``torch.uint4``: 4-bit moments (``_uint4``, the codec ``_quantize4``: 32-element blocks
  with a bf16 scale, companded 4-bit codes packed two per byte; a ``Q4State(codes,
  scale)`` per leaf, 1.125 bytes per element for both Adam moments), rounded as at 8 bits.
  The XLA node and the native CPU pass (format code 3) serve it, with the torch path's bits.

Every load/store is sync-free and runs on CPU, CUDA and XLA.

This module is the registry: one ``StateFormat`` (``_base``) per ``state_dtype``, each
defined in its own module. Adding a format: write ``_<name>.py`` defining a
``StateFormat`` (its container, zeros, checks, load/store, and what the native pass and
the XLA node do with it), import it here and list it in ``FORMATS`` below. The planner
and the back ends ask this registry; none of them names a format.
"""

from __future__ import annotations

from typing import Any

import torch

from mpfunc.core import _checks, _tree
from mpfunc.state_formats import _float, _uint4, _uint8
from mpfunc.state_formats._base import Problem, StateFormat, keys
from mpfunc.state_formats._quantize import QState

__all__ = [
    "FORMATS",
    "QState",
    "StateFormat",
    "check",
    "check_quantizable",
    "chosen",
    "load",
    "of_moment",
    "problem",
    "store",
    "stored_dtype",
    "zeros",
    "zeros_list",
]

# The formats, keyed by the ``state_dtype`` a user passes, in the order errors list them.
FORMATS: dict[torch.dtype, StateFormat] = {
    f.key: f
    for f in (
        _float.format_of(torch.float32, native=0, xla=True),
        _float.format_of(torch.bfloat16, native=1, xla=True),
        _uint8.FORMAT,
        _uint4.FORMAT,
    )
}
# ``state_dtype=None``: moments like the master, plain tensors of its compute dtype.
_LIKE_MASTER = FORMATS[torch.float32]
_BY_CONTAINER: dict[type, StateFormat] = {}
for _f in FORMATS.values():
    if _f.container is not None:
        _tree.register_unit(_f.container)
        _BY_CONTAINER[_f.container] = _f
CONTAINERS: tuple[type, ...] = tuple(_BY_CONTAINER)
_keys = keys  # (the draw keys, as the native and XLA back ends reproduce them)


def check(fn: str, dtype: object) -> torch.dtype | None:
    """``None`` (moments like the master) or a registered ``state_dtype``."""
    if dtype is None or (isinstance(dtype, torch.dtype) and dtype in FORMATS):
        return dtype
    names = ", ".join(str(d) for d in FORMATS)
    kind = ValueError if isinstance(dtype, torch.dtype) else TypeError
    raise kind(f"{fn}: state_dtype: expected None or one of {names}, got {dtype!r}")


def chosen(state_dtype: torch.dtype | None) -> StateFormat:
    """The format ``state_dtype`` names (``None``: plain tensors like the master)."""
    return _LIKE_MASTER if state_dtype is None else FORMATS[state_dtype]


def of_moment(x: Any) -> StateFormat | None:
    """The format a stored moment is in: by its container, else by its dtype (``None``
    for anything else, e.g. a float64 moment or a ``None`` leaf)."""
    f = _BY_CONTAINER.get(type(x))
    if f is not None:
        return f
    return FORMATS.get(x.dtype) if isinstance(x, torch.Tensor) else None


def stored_dtype(compute: torch.dtype, state_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype a moment is stored in: ``state_dtype``, or the dtype it is computed in
    (``_tensors.compute_dtype``) when that is ``None``."""
    return compute if state_dtype is None else state_dtype


def zeros(
    kind: str, compute: torch.dtype, like: torch.Tensor, state_dtype: torch.dtype | None
) -> Any:
    """A zero moment of field kind ``kind`` for a leaf shaped like ``like``."""
    return chosen(state_dtype).zeros(kind, stored_dtype(compute, state_dtype), like)


def zeros_list(
    kind: str,
    computes: list[torch.dtype | None],
    faces: list[Any],
    state_dtype: torch.dtype | None,
) -> list[Any]:
    """``zeros`` of each face (``None`` where the face or its compute dtype is ``None``): a
    whole field at once."""
    dtypes = [None if c is None else stored_dtype(c, state_dtype) for c in computes]
    return chosen(state_dtype).zeros_list(kind, dtypes, faces)


def problem(kind: str, x: Any, like: torch.Tensor, dtype: torch.dtype) -> Problem:
    """What is wrong with a stored moment of stored dtype ``dtype`` (a format's key, or a
    compute dtype): (exception type, expected, got), or ``None``."""
    return FORMATS.get(dtype, _LIKE_MASTER).problem(kind, x, like, dtype)


def check_quantizable(fn: str, side: _checks.Side, faces: list[Any]) -> None:
    """The 8-bit format's init check (``StateFormat.check_init``)."""
    _uint8.FORMAT.check_init(fn, side, faces)


def load(xs: list[Any], compute: torch.dtype, likes: list[torch.Tensor]) -> list[torch.Tensor]:
    """Moments in ``compute`` dtype to run a kernel on, each shaped like its ``likes``
    tensor (the leaf's master values): the stored tensors themselves when they already
    are (written in place), else fresh temporaries."""
    if not xs:
        return []
    f = of_moment(xs[0])
    return (_LIKE_MASTER if f is None else f).load(xs, compute, likes)


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
    f = of_moment(xs[0])
    (_LIKE_MASTER if f is None else f).store(xs, values, kind, skip, steps, salts)

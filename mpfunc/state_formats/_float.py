"""Moments stored as plain floating tensors: ``state_dtype`` ``None`` (like the master),
``torch.float32`` or ``torch.bfloat16``.

A moment is a tensor of the stored dtype in its master's shape and layout; a step loads
a chunk of them into fp32 temporaries (or lends them as they are where they already are
the compute dtype) and stores them back rounded to nearest even (``Tensor.to``). Another
float dtype is one line: ``format_of(dtype, native=None)`` in ``_state_format``'s list
(the foreach path on every device until the native pass and the XLA node serve it).
"""

from __future__ import annotations

from typing import Any

import torch

from mpfunc.core import _checks
from mpfunc.state_formats._base import Problem, StateFormat, in_compute

__all__ = ["format_of"]


def _zeros(kind: str, dtype: torch.dtype, like: torch.Tensor) -> torch.Tensor:
    # The master's layout (channels_last, transposed): fused kernels pair by position.
    return torch.zeros_like(like, dtype=dtype, memory_format=torch.preserve_format)


def _zeros_list(kind: str, dtypes: list[torch.dtype | None], faces: list[Any]) -> list[Any]:
    return [None if f is None or d is None else _zeros(kind, d, f) for f, d in zip(faces, dtypes)]


def _problem(kind: str, x: Any, like: torch.Tensor, dtype: torch.dtype) -> Problem:
    # Runs per leaf in a step that plans in full: cheap tests first.
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


def _check_init(fn: str, side: Any, faces: list[Any]) -> None:
    """Any leaf takes float moments."""


def _load(xs: list[Any], compute: torch.dtype, likes: list[torch.Tensor]) -> list[torch.Tensor]:
    return in_compute(xs, compute)


def _store(
    xs: list[Any],
    values: list[torch.Tensor],
    kind: str,
    skip: torch.Tensor | None,
    steps: list[torch.Tensor] | None,
    salts: list[int],
) -> None:
    rounded = [v.to(x.dtype) for x, v in zip(xs, values)]
    if skip is not None:
        rounded = [torch.where(skip, x, r) for x, r in zip(xs, rounded)]
    torch._foreach_copy_(xs, rounded)


def _layout(x: Any, face: torch.Tensor) -> torch.Tensor:
    return x  # type: ignore[no-any-return]


def format_of(dtype: torch.dtype, native: int | None, xla: bool = False) -> StateFormat:
    """The format of moments stored as ``dtype`` tensors (``native``: the composed CPU
    pass's code for it, ``None`` where that pass does not take it; ``xla``: whether the
    XLA node widens and narrows it, ``_xla_kernels._MOMENT_DTYPES``)."""
    return StateFormat(
        name=str(dtype).removeprefix("torch."),
        key=dtype,
        container=None,
        zeros=_zeros,
        zeros_list=_zeros_list,
        problem=_problem,
        check_init=_check_init,
        load=_load,
        store=_store,
        layout=_layout,
        native=native,
        xla=xla,
        salted=False,
    )

"""The ``"fp32"`` strategy: a float32 master beside every param (float64 for float64 params).

The master is a plain tensor: ``load`` hands the masters themselves to the kernel,
which writes them in place, and ``store`` has nothing to do.
"""

from __future__ import annotations

from typing import Any

import torch

from mpfunc.core import _tensors
from mpfunc.strategies._base import Strategy

__all__ = ["STRATEGY"]


def _why_not(p: torch.Tensor) -> str | None:
    return None


def _make(p: torch.Tensor, seed: int, index: int) -> torch.Tensor:
    return _tensors.fresh_copy(p, torch.float64 if p.dtype == torch.float64 else torch.float32)


def _load(masters: list[Any]) -> list[torch.Tensor]:
    return masters


def _store(masters: list[Any], values: list[torch.Tensor], skip: torch.Tensor | None) -> None:
    return None


def _check(master: Any) -> str | None:
    return None


STRATEGY = Strategy(
    name="fp32",
    unit=None,
    why_not=_why_not,
    make=_make,
    load=_load,
    store=_store,
    check=_check,
)

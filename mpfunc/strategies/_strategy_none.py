"""The ``"none"`` strategy: no master at all; plain low-precision training.

``RoundedMaster(param)``: a step loads the param in fp32, runs the optimizer, and
rounds the result back to nearest even (``Tensor.to``). Updates below half the
param's ulp are lost: the baseline the other strategies are measured against.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from mpfunc.strategies._base import Strategy

__all__ = ["STRATEGY", "RoundedMaster"]


class RoundedMaster(NamedTuple):
    """A master that is its ``param`` (the model's own tensor), nothing else."""

    param: torch.Tensor


# A NamedTuple of tensors: safe for torch.load(weights_only=True), torch's default since 2.6.
torch.serialization.add_safe_globals([RoundedMaster])


def _why_not(p: torch.Tensor) -> str | None:
    return None


def _make(p: torch.Tensor, seed: int, index: int) -> RoundedMaster:
    return RoundedMaster(p)


def _load(units: list[Any]) -> list[torch.Tensor]:
    out = []
    for u in units:
        wide = torch.float64 if u.param.dtype == torch.float64 else torch.float32
        out.append(u.param.to(wide, copy=True))
    return out


def _store(units: list[Any], values: list[torch.Tensor], skip: torch.Tensor | None) -> None:
    for u, x in zip(units, values):
        p = x.to(u.param.dtype)
        u.param.copy_(p if skip is None else torch.where(skip, u.param, p))


def _check(u: Any) -> str | None:
    return None if u.param.is_floating_point() else f"its param is {u.param.dtype}"


STRATEGY = Strategy(
    name="none",
    unit=RoundedMaster,
    why_not=_why_not,
    make=_make,
    load=_load,
    store=_store,
    check=_check,
)

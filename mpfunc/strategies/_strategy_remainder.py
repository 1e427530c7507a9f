"""The ``"remainder"`` strategy: the bf16 param plus a 16-bit remainder ARE the fp32 master.

``RemainderMaster(param, remainder)`` holds the model's own bfloat16 param and an int16
remainder; ``_remainder.join`` rebuilds the fp32 master bit for bit, and
``_remainder.split`` writes a new one back. 2 bytes per param beyond the param itself.

Masters and optimizer state are bit-identical to the ``"fp32"`` strategy's, step after
step, for a loop that rounds its params the same way. The param is the master rounded
to nearest with ties *away from zero*: it differs from ``Tensor.to`` (ties to even)
only at exact ties, 2**-17 of random bit patterns, and no 16-bit remainder can do
better (``_remainder``'s docstring has the count). Only bfloat16 params: an fp16 param
cannot hold an fp32 master in 16 more bits.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from mpfunc.core import _tensors
from mpfunc.parallel import _sharding
from mpfunc.strategies import _remainder
from mpfunc.strategies._base import Strategy, buffer_problem

__all__ = ["STRATEGY", "RemainderMaster"]


class RemainderMaster(NamedTuple):
    """An fp32 master kept as its bf16 ``param`` (the model's own tensor) and an int16
    ``remainder`` of the param's shape, layout and device."""

    param: torch.Tensor
    remainder: torch.Tensor


def _why_not(p: torch.Tensor) -> str | None:
    return None if p.dtype == torch.bfloat16 else _remainder.unsupported_hint(p.dtype)


def _make(p: torch.Tensor, seed: int, index: int) -> RemainderMaster:
    # A bf16 value is exactly an fp32 master whose low half is zero.
    r = torch.zeros_like(p, dtype=torch.int16, memory_format=torch.preserve_format)
    return RemainderMaster(p, _sharding.like_(r, p))  # the param's XLA SPMD sharding


def _load(units: list[Any]) -> list[torch.Tensor]:
    if not units:
        return []
    if _tensors.is_lazy(units[0].param.device):
        return _remainder._call_xla("join", [t for u in units for t in u], 2)
    return [_remainder._join_eager(u.param, u.remainder) for u in units]


def _store(units: list[Any], values: list[torch.Tensor], skip: torch.Tensor | None) -> None:
    if not units:
        return
    if _tensors.is_lazy(units[0].param.device):
        outs = _remainder._call_xla("split", values, 1)
        params, rems = outs[0::2], outs[1::2]
        if skip is not None:
            params = [torch.where(skip, u.param, p) for u, p in zip(units, params)]
            rems = [torch.where(skip, u.remainder, r) for u, r in zip(units, rems)]
        torch._foreach_copy_([u.param for u in units], params)
        torch._foreach_copy_([u.remainder for u in units], rems)
        return
    for u, v in zip(units, values):
        hi, lo = _remainder._split_bits(v.view(torch.int32))
        pbits, rbits = u.param.view(torch.int16), u.remainder
        if skip is not None:
            hi = torch.where(skip, pbits.to(torch.int32), hi)
            lo = torch.where(skip, rbits.to(torch.int32), lo)
        # Through an int view: a float copy_ may canonicalize NaN payloads.
        pbits.copy_(hi)
        rbits.copy_(lo)


def _check(u: Any) -> str | None:
    p, r = u.param, u.remainder
    if p.dtype != torch.bfloat16:
        return f"its param is {p.dtype}, not torch.bfloat16"
    return buffer_problem("remainder", r, torch.int16, p)


STRATEGY = Strategy(
    name="remainder",
    unit=RemainderMaster,
    why_not=_why_not,
    make=_make,
    load=_load,
    store=_store,
    check=_check,
)

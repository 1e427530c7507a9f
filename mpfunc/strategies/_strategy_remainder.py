"""The ``"remainder"`` strategy: the bf16 param, a 16-bit remainder and a tie bit ARE the
fp32 master.

``RemainderMaster(param, remainder, ties)`` holds the model's own bfloat16 param, an int16
remainder of its shape and its tie bits (uint8, 8 a byte along the last dim:
``_remainder.tie_shape``); ``_remainder.join`` rebuilds the fp32 master bit for bit, and
``_remainder.split`` writes a new one back. 2.125 bytes per param beyond the param itself.

The param is always ``master.to(torch.bfloat16)`` (round to nearest even; NaN payloads
aside), so a run with ``"remainder"`` masters is bit-identical to the same run with
``"fp32"`` masters: params, masters and state at every step. Only bfloat16 params: an fp16
param cannot hold an fp32 master in 16 more bits.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from mpfunc.core import _dtensor, _tensors
from mpfunc.parallel import _sharding
from mpfunc.strategies import _remainder
from mpfunc.strategies._base import Strategy, buffer_problem

__all__ = ["STRATEGY", "RemainderMaster"]


class RemainderMaster(NamedTuple):
    """An fp32 master kept as its bf16 ``param`` (the model's own tensor), an int16
    ``remainder`` of the param's shape, layout and device, and uint8 ``ties`` of shape
    ``_remainder.tie_shape(param.shape)`` (one bit per element, set only at an exact tie
    that rounded up)."""

    param: torch.Tensor
    remainder: torch.Tensor
    ties: torch.Tensor


# A NamedTuple of tensors: safe for torch.load(weights_only=True), torch's default since 2.6.
torch.serialization.add_safe_globals([RemainderMaster])


def _why_not(p: torch.Tensor) -> str | None:
    if p.dtype != torch.bfloat16:
        return _remainder.unsupported_hint(p.dtype)
    return _remainder.sharding_problem(p)


def _make(p: torch.Tensor, seed: int, index: int) -> RemainderMaster:
    # A bf16 value is exactly an fp32 master whose low half is zero (and no tie).
    r = torch.zeros_like(p, dtype=torch.int16, memory_format=torch.preserve_format)
    if _dtensor.is_dtensor(p):
        # Placed as the param, each rank's shard the bits of its own elements
        # (_remainder.sharding_problem, checked by why_not, says where that holds).
        local = _dtensor.local(p)
        t = _dtensor.wrap_as(
            p,
            local.new_zeros(_remainder.tie_shape(local.shape), dtype=_remainder.TIE_DTYPE),
            _remainder.tie_shape(p.shape),
        )
        return RemainderMaster(p, r, t)
    t = p.new_zeros(_remainder.tie_shape(p.shape), dtype=_remainder.TIE_DTYPE)
    # The param's XLA SPMD sharding (the tie bytes: the same split of every dim, the last
    # where each shard holds whole bytes; _sharding.like_).
    return RemainderMaster(p, _sharding.like_(r, p), _sharding.like_(t, p, packed=8))


def _load(units: list[Any]) -> list[torch.Tensor]:
    if not units:
        return []
    if _tensors.is_lazy(units[0].param.device):
        return _remainder._call_xla("join", [t for u in units for t in u], 3)
    return [_remainder._join_eager(*u) for u in units]


def _store(units: list[Any], values: list[torch.Tensor], skip: torch.Tensor | None) -> None:
    if not units:
        return
    if _tensors.is_lazy(units[0].param.device):
        outs = _remainder._call_xla("split", values, 1)
        for k in range(3):
            news = outs[k::3]
            if skip is not None:
                news = [torch.where(skip, u[k], n) for u, n in zip(units, news)]
            torch._foreach_copy_([u[k] for u in units], news)
        return
    for u, v in zip(units, values):
        hi, lo, tie = _remainder._split_bits(v.view(torch.int32))
        ties = _remainder.pack_ties(tie)
        pbits, rbits = u.param.view(torch.int16), u.remainder
        if skip is not None:
            hi = torch.where(skip, pbits.to(torch.int32), hi)
            lo = torch.where(skip, rbits.to(torch.int32), lo)
            ties = torch.where(skip, u.ties, ties)
        # Through an int view: a float copy_ may canonicalize NaN payloads.
        pbits.copy_(hi)
        rbits.copy_(lo)
        u.ties.copy_(ties)


def _check(u: Any) -> str | None:
    p, r = u.param, u.remainder
    if p.dtype != torch.bfloat16:
        return f"its param is {p.dtype}, not torch.bfloat16"
    problem = buffer_problem("remainder", r, torch.int16, p)
    if problem is not None:
        return problem
    problem = _remainder.tie_problem(u.ties, p)
    return None if problem is None else f"its ties: {problem}"


STRATEGY = Strategy(
    name="remainder",
    unit=RemainderMaster,
    why_not=_why_not,
    make=_make,
    load=_load,
    store=_store,
    check=_check,
)

"""The ``"kahan"`` strategy: a compensation buffer carries what rounding the param dropped.

``KahanMaster(param, compensation)``: the master is ``param + compensation``, both in
the param's dtype (bf16 or fp16), so 2 bytes per param beyond the param. A step loads
``x = float(param) + float(compensation)`` in fp32, runs the optimizer on ``x``, and
stores ``param = round(x)`` and ``compensation = round(x - param)`` (the difference is
exact in fp32). This is compensated (Kahan) summation into the param: an update far
below the param's ulp accumulates in the compensation until it moves the param, where
plain bf16 training would drop it. The master keeps about twice the param's mantissa
bits (16 for bf16), not fp32's 24: close to fp32 training, not bit-identical to it.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from mpfunc.core import _tensors
from mpfunc.parallel import _sharding
from mpfunc.strategies._base import Strategy, buffer_problem

__all__ = ["STRATEGY", "KahanMaster"]

_DTYPES = (torch.bfloat16, torch.float16)


class KahanMaster(NamedTuple):
    """A master kept as ``param`` (the model's own tensor) plus ``compensation``, a tensor
    of the param's dtype, shape, layout and device."""

    param: torch.Tensor
    compensation: torch.Tensor


# A NamedTuple of tensors: safe for torch.load(weights_only=True), torch's default since 2.6.
torch.serialization.add_safe_globals([KahanMaster])


def _why_not(p: torch.Tensor) -> str | None:
    if p.dtype in _DTYPES:
        return None
    return (
        f"Compensation is for bfloat16 and float16 params; a {p.dtype} param rounds "
        "nothing away. Use the 'fp32' strategy"
    )


def _make(p: torch.Tensor, seed: int, index: int) -> KahanMaster:
    # The param's XLA SPMD sharding too (zeros_like alone comes out replicated).
    c = torch.zeros_like(p, memory_format=torch.preserve_format)
    return KahanMaster(p, _sharding.like_(c, p))


# |x| * HALF_ULP[dtype] bounds half the ulp of a normal x of that dtype (its significand
# bits: 8 for bfloat16, 11 for float16).
HALF_ULP = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def _load(units: list[Any]) -> list[torch.Tensor]:
    """``param + compensation`` where the compensation can belong to this param, else the
    param alone (``-0.0`` added keeps either zero).

    A store leaves ``|compensation| <= ulp(param) / 2 <= |param| * HALF_ULP``, and a
    zero or subnormal param a zero compensation (the master is within half its spacing).
    Any other compensation is stale, left by a write to the param (pruning,
    ``nn.init.zeros_``, a re-init or surgery to smaller values): it was sized for the old
    value, up to half its ulp, and added to the written one it moved a param written
    from ~100 to 0.01 by up to 0.2 (found in review). Dropped, the master is the written
    value; a write to a value of the old magnitude keeps the old compensation, within
    half a step of the written value. The native pass and the XLA node apply the same
    rule (``kahan_comp``, ``Builder.load``)."""
    out = []
    for u in units:
        p, c = u.param.float(), u.compensation.float()
        stale = (p == 0) | (c.abs() > p.abs() * HALF_ULP[u.param.dtype])
        out.append(p.add_(torch.where(stale, -0.0, c)))
    return out


def _store(units: list[Any], values: list[torch.Tensor], skip: torch.Tensor | None) -> None:
    for u, x in zip(units, values):
        p = x.to(u.param.dtype)
        c = torch.sub(x, _tensors.widened(p)).to(u.compensation.dtype)
        if skip is not None:
            p = torch.where(skip, u.param, p)
            c = torch.where(skip, u.compensation, c)
        u.param.copy_(p)
        u.compensation.copy_(c)


def _check(u: Any) -> str | None:
    p, c = u.param, u.compensation
    if p.dtype not in _DTYPES:
        return f"its param is {p.dtype}, not bfloat16 or float16"
    return buffer_problem("compensation", c, p.dtype, p)


STRATEGY = Strategy(
    name="kahan",
    unit=KahanMaster,
    why_not=_why_not,
    make=_make,
    load=_load,
    store=_store,
    check=_check,
)

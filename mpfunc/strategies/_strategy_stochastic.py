"""The ``"stochastic"`` strategy: no master; the fp32 result is rounded stochastically.

``StochasticMaster(param, key)``: the model's own bfloat16 param and a 0-d int32 RNG key
on its device (4 bytes per leaf, not per element). A step loads the param in fp32, runs
the optimizer, and rounds each result ``x`` up to the next bf16 value with probability
(distance to the value below) / (gap between the two), down otherwise: unbiased,
``E[param] = x``, so updates far below the param's ulp still move it on average.

The rounding adds 16 random bits (``_rng``: a counter-based hash of the key and the
element's row-major index) to the fp32 bit pattern and truncates to the top 16, as
torchao's ``bf16_stochastic_round`` does; the key then advances. Same seed, same bits,
on every device and layout. NaN stays NaN, inf stays inf, and a value above bf16's
largest finite rounds up to inf with the same probability rule. On XLA the bit
operations are one computation per list of shapes (``BitcastConvert``; torch_xla 2.9
runs ``view(dtype)`` on the host), with no host sync.

See docs/design.md#the-stochastic-rng-and-rounding.
"""

from __future__ import annotations

import threading
from typing import Any, NamedTuple

import torch

from mpfunc.core import _rng, _tensors
from mpfunc.strategies._base import Strategy, buffer_problem

__all__ = ["STRATEGY", "StochasticMaster", "round_stochastic"]


class StochasticMaster(NamedTuple):
    """A master kept as its bf16 ``param`` (the model's own tensor) and ``key``, the 0-d
    int32 state of its random stream, on the param's device."""

    param: torch.Tensor
    key: torch.Tensor


# A NamedTuple of tensors: safe for torch.load(weights_only=True), torch's default since 2.6.
torch.serialization.add_safe_globals([StochasticMaster])


def _why_not(p: torch.Tensor) -> str | None:
    if p.dtype == torch.bfloat16:
        return None
    return (
        "Stochastic rounding by bit truncation needs bfloat16 params (the top half of "
        "fp32). Use 'kahan' for float16 params, or 'fp32'"
    )


def _make(p: torch.Tensor, seed: int, index: int) -> StochasticMaster:
    return StochasticMaster(p, _rng.key_for(seed, index, p.device))


def _load(units: list[Any]) -> list[torch.Tensor]:
    return [u.param.to(torch.float32) for u in units]


_cache: dict[tuple[tuple[int, ...], ...], Any] = {}
_lock = threading.Lock()


def _xla_round(values: list[torch.Tensor], noise: list[torch.Tensor]) -> list[torch.Tensor]:
    """``round_stochastic`` of each pair as one XLA computation."""
    import torch_xla
    import torch_xla.core.xla_builder

    xb: Any = torch_xla.core.xla_builder

    shapes = tuple(tuple(v.shape) for v in values)
    with _lock:
        comp = _cache.get(shapes)
    if comp is None:
        builder = xb.create_builder("mpfunc_round_stochastic")
        outs = []
        for i, shape in enumerate(shapes):
            x = xb.mkparam(builder, 2 * i, xb.mkshape("f32", shape))
            r = xb.mkparam(builder, 2 * i + 1, xb.mkshape("s32", shape))
            k = xb.Op.scalar(builder, 0xFFFF, dtype="s32")
            hi = xb.Op.scalar(builder, -65536, dtype="s32")
            t = ((x.bitcast("s32") + (r & k)) & hi).bitcast("f32")
            outs.append((x != x).select(x, t).cast("bf16"))
        comp = xb.Op.tuple(outs).build("mpfunc_round_stochastic")
        with _lock:
            _cache[shapes] = comp
    inputs = [t for pair in zip(values, noise) for t in pair]
    xlac: Any = torch_xla._XLAC  # type: ignore[attr-defined]
    return list(xlac._xla_user_computation("xla::mpfunc_round_stochastic", inputs, comp))


def round_stochastic(x: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """``x`` (fp32) rounded to bf16, up with probability (low 16 bits) / 2**16, using the
    low 16 bits of ``noise`` (int32 of ``x``'s shape) as the random draw (eager devices)."""
    t = x.view(torch.int32).add(noise.bitwise_and(0xFFFF)).bitwise_and_(-65536)
    return torch.where(torch.isnan(x), x, t.view(torch.float32)).to(torch.bfloat16)


def _store(units: list[Any], values: list[torch.Tensor], skip: torch.Tensor | None) -> None:
    if not units:
        return
    noise = _rng.bits_list([u.key for u in units], [u.param.shape for u in units])
    if _tensors.is_lazy(units[0].param.device):
        rounded = _xla_round(values, noise)
    else:
        rounded = [round_stochastic(v.contiguous(), n) for v, n in zip(values, noise)]
    keys = [u.key for u in units]
    old = [k.clone() for k in keys] if skip is not None else []
    _rng.advance(keys)
    if skip is not None:
        rounded = [torch.where(skip, u.param, p) for u, p in zip(units, rounded)]
        torch._foreach_copy_(keys, [torch.where(skip, o, k) for o, k in zip(old, keys)])
    torch._foreach_copy_([u.param for u in units], rounded)


def _check(u: Any) -> str | None:
    p, k = u.param, u.key
    if p.dtype != torch.bfloat16:
        return f"its param is {p.dtype}, not torch.bfloat16"
    return buffer_problem("key", k, torch.int32, p, scalar=True)


STRATEGY = Strategy(
    name="stochastic",
    unit=StochasticMaster,
    why_not=_why_not,
    make=_make,
    load=_load,
    store=_store,
    check=_check,
)

"""The protocol every master strategy implements (``Strategy``) and the wording of a unit
buffer's problem; the registry of strategies is ``_strategy``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

__all__ = ["Strategy", "buffer_problem"]


class Strategy(NamedTuple):
    """One master strategy. ``unit`` is ``None`` for ``"fp32"`` (the master is a tensor).

    ``why_not(param)``: ``None`` if the strategy applies to ``param``, else the reason
    (for the error). ``make(param, seed, index)``: the master of one param (index: its
    position in the tree, for RNG keys). ``load(units)``: fp32 values of a list of
    masters on one device (fresh tensors, or the masters themselves for ``"fp32"``).
    ``store(units, values, skip)``: writes the values back (any of the unit's tensors);
    where ``skip`` (0-d bool on the device) is true every one keeps its bits.
    ``check(unit)``: ``None`` if the unit's tensors fit together, else what is wrong.
    The exact fp32 master a unit holds is ``load([unit])[0]`` (``export``).
    """

    name: str
    unit: type | None
    why_not: Callable[[torch.Tensor], str | None]
    make: Callable[[torch.Tensor, int, int], Any]
    load: Callable[[list[Any]], list[torch.Tensor]]
    store: Callable[[list[Any], list[torch.Tensor], torch.Tensor | None], None]
    check: Callable[[Any], str | None]

    def export(self, leaf: Any) -> torch.Tensor:
        """The exact fp32 (or fp64) master that ``leaf`` holds, as a tensor."""
        return self.load([leaf])[0]


def buffer_problem(
    name: str, buf: torch.Tensor, dtype: torch.dtype, param: torch.Tensor, scalar: bool = False
) -> str | None:
    """What is wrong with a unit's buffer: not ``dtype``, or not shaped like (or, with
    ``scalar``, a 0-d tensor beside) its param on the param's device."""
    # (Per leaf of every check of masters: torch.Size compares with a tuple, no copies.)
    if (
        buf.dtype == dtype
        and buf.shape == (() if scalar else param.shape)
        and buf.device == param.device
    ):
        return None
    shape = () if scalar else tuple(param.shape)
    want = f"a 0-d {dtype}" if scalar else f"{dtype} {shape}"
    return (
        f"its {name} is {buf.dtype} {tuple(buf.shape)} on {buf.device}, not {want} on "
        f"{param.device} like its param"
    )

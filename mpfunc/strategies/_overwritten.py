"""Units whose param now shows another master: refused by ``masters_to_model_``.

A unit made by ``init_master`` (``"remainder"``, ``"kahan"``, ``"stochastic"``) holds the
model's own param as the high part of its master. The pure ``apply_update`` returns new
units with params of their own, and ``masters_to_model_(new_masters, params)`` copies
those into the model: the old units' params are then the new values, beside their old
buffers, so the old masters are gone. "Try a step, then roll back with
``masters_to_model_(old_masters, params)``" wrote nothing and raised nothing (each old
unit's param already is the model's, so there is nothing to copy).

This module remembers, weakly and only on that path, which model params such a copy
wrote (and their version just after) and when each unit's buffer was made; a unit made
before that copy, whose param is the copied-into param with no write since, is stale.
Nothing is kept while no unit's param was overwritten this way, so the ordinary loops
pay one emptiness test per call.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from mpfunc.core import _checks
from mpfunc.strategies import _strategy

__all__ = ["check_not_stale", "made", "overwrote"]

_SERIAL = itertools.count(1)
# A unit's buffer (its remainder, compensation or key) -> the serial when init_master made it.
_MADE: WeakIdKeyDictionary = WeakIdKeyDictionary()  # type: ignore[no-untyped-call]
# A model param into which masters_to_model_ copied another unit's param -> (the param's
# version just after, the serial of that copy).
_OVERWRITTEN: WeakIdKeyDictionary = WeakIdKeyDictionary()  # type: ignore[no-untyped-call]


def _buffer(unit: Any) -> torch.Tensor | None:
    """The tensor that tells one unit from another of the same param: the field after the
    param (``"none"``'s unit has none: its master is the param, nothing to roll back)."""
    return unit[1] if len(unit) > 1 and isinstance(unit[1], torch.Tensor) else None


def made(masters: Sequence[Any]) -> None:
    """Notes when ``init_master`` made each unit of ``masters``."""
    serial = next(_SERIAL)
    for m in masters:
        b = _buffer(m) if _strategy.is_unit(m) else None
        if b is not None:
            _MADE[b] = serial


def overwrote(masters: Sequence[Any], params: Sequence[Any]) -> None:
    """After ``masters_to_model_`` wrote ``params``: notes each param that a unit with a
    param of its own (from the pure ``apply_update``) was copied into."""
    serial = None
    for m, q in zip(masters, params):
        if q is not None and _strategy.is_unit(m) and m.param is not q:
            serial = serial or next(_SERIAL)
            _OVERWRITTEN[q] = (q._version, serial)


def check_not_stale(fn: str, masters: _checks.Side, params: _checks.Side) -> None:
    """Raises, naming the path, for a unit whose param is ``params``' own and shows another
    master since ``overwrote`` (no write to it since). Free while nothing was overwritten."""
    if not _OVERWRITTEN:
        return
    for i, (m, q) in enumerate(zip(masters.leaves, params.leaves)):
        if q is None or not _strategy.is_unit(m) or m.param is not q:
            continue
        held = _OVERWRITTEN.get(q)  # type: ignore[no-untyped-call]
        b = _buffer(m)
        if held is None or b is None or q._version != held[0]:
            continue
        born = _MADE.get(b)  # type: ignore[no-untyped-call]
        if born is not None and born < held[1]:
            name = _strategy.by_unit(m).name  # type: ignore[union-attr]
            _checks.fail(
                ValueError,
                fn,
                masters.path(i),
                f"a master whose value is still there (a {name!r} master keeps the model's "
                f"param itself as its high part)",
                "one whose param was overwritten since by masters_to_model_ with other masters "
                "(those of the pure apply_update, whose params are their own): this master's "
                "value is gone, and writing it would leave the model as it is",
                "To try a step and roll back, keep a copy first (old = copy.deepcopy(masters)), "
                "or step with apply_update_ and roll back from that copy; strategy='fp32' "
                "masters are separate tensors and roll back as they are",
            )

"""Update diagnostics: which updates bf16 rounding swallows, and how large updates are.

``init_stats(masters)`` makes a tree of ``UpdateStats`` (0-d fp32 tensors on each
leaf's device); ``apply_update_(..., stats=tree)`` fills it during the step, on the
device, with no host read, so ``stats`` can be passed every N steps and read whenever
convenient. Per leaf, with ``u`` the step's update in fp32 (new master minus old,
before any rounding) and ``p`` the model param:

* ``swallowed``: the fraction of elements with ``u != 0`` whose ``p`` did not change: updates
  that rounding swallowed this step (with ``"fp32"``/``"remainder"``/``"kahan"`` masters
  they are kept and reach ``p`` later; with ``"none"`` they are lost);
* ``unchanged``: the fraction of elements whose ``p`` did not change at all;
* ``ratio``: ``rms(u) / rms(old master)``, the update-to-weight RMS ratio.

``swallowed`` and ``unchanged`` need the param: they are NaN for ``"fp32"`` masters stepped
without ``params=``. A step that was skipped reports zero updates (``swallowed`` 0).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from mpfunc.core import _tree
from mpfunc.strategies import _strategy

__all__ = ["UpdateStats", "init_stats", "record"]


class UpdateStats(NamedTuple):
    """One leaf's statistics of the last step that received ``stats``; 0-d float32 each."""

    swallowed: torch.Tensor
    unchanged: torch.Tensor
    ratio: torch.Tensor


# A NamedTuple of tensors: safe for torch.load(weights_only=True), torch's default since 2.6.
torch.serialization.add_safe_globals([UpdateStats])


_tree.register_unit(UpdateStats)


def init_stats(masters: Any) -> Any:
    """A tree of ``UpdateStats`` (NaN until a step fills them) shaped like ``masters``.

    Example::

      stats = mpfunc.init_stats(masters)
      mpfunc.apply_update_(masters, grads, state, opt, params=params, stats=stats)
      print({k: s.swallowed.item() for k, s in stats.items()})   # reads after the step
    """
    side, spec = _strategy.master_leaves("init_stats", "masters", masters)

    def make(m: Any) -> UpdateStats:
        d = _strategy.face(m).device
        return UpdateStats(*(torch.full((), float("nan"), device=d) for _ in range(3)))

    return _tree.unflatten(spec, [None if m is None else make(m) for m in side.leaves])


def _mean(x: torch.Tensor) -> torch.Tensor:
    return (
        x.to(torch.float32).mean() if x.numel() else torch.full((), float("nan"), device=x.device)
    )


def record(
    stats: list[UpdateStats | None],
    old: list[torch.Tensor],
    new: list[torch.Tensor],
    before: list[torch.Tensor] | None,
    now: list[torch.Tensor] | None,
) -> None:
    """Fills each leaf's ``UpdateStats`` from its fp32 values before and after the step and
    its param before and after (``None``: not known)."""
    for i, s in enumerate(stats):
        if s is None:
            continue
        u = new[i].to(torch.float32) - old[i].to(torch.float32)
        rms_u = _mean(u * u).sqrt()
        o = old[i].to(torch.float32)
        s.ratio.copy_(rms_u / _mean(o * o).sqrt())
        if before is None or now is None:
            s.swallowed.fill_(float("nan"))
            s.unchanged.fill_(float("nan"))
            continue
        same = now[i] == before[i]
        s.unchanged.copy_(_mean(same))
        # Of the elements that had an update, those whose param did not move (none
        # updated, as in a skipped step: 0 of 0, read as 0).
        updated = u != 0
        s.swallowed.copy_((same & updated).sum() / updated.sum().clamp(min=1))

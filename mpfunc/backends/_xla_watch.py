"""Signals that an XLA loop waits for the host, or never runs its graph.

torch_xla traces every op into a pending graph and runs it at ``torch_xla.sync()``. Two
mistakes make a loop slow with no error at all; each is noticed here from torch_xla's
own bookkeeping, without reading a tensor's value, and warned about once with its fix:

* an lr schedule that reads its step count back to the host (``min``, ``math.*``,
  ``float()``, a branch on the count): every step then waits for the device and runs as
  more than one graph. Noticed from torch_xla's count of device-to-host transfers,
  taken before and after the schedule's call (``host_reads``, ``check_schedule``).
* a loop without ``torch_xla.sync()``: every step appends its computation to one pending
  graph, which each host read (``loss.item()``) compiles and runs whole. Noticed when a
  step finds its first written master still the very pending computation that the
  previous step left, with no sync in between (``step_begins``, ``step_ends``).

Off the XLA device each entry point returns after one device-type test.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from mpfunc.core import _checks
from mpfunc.core._compile import compiling

__all__ = [
    "PENDING_STEPS",
    "HostReadWarning",
    "PendingGraphWarning",
    "check_schedule",
    "host_reads",
    "step_begins",
    "step_ends",
]

# Steps in a row that add to one pending graph before the warning: a loop that syncs
# every few steps on purpose (a short test that syncs once at its end) stays quiet; a
# forgotten sync is named at the eleventh step, while the graph is still small.
PENDING_STEPS = 10


class HostReadWarning(RuntimeWarning):
    """An lr schedule reads its step count back to the host on XLA, or ignores it."""


class PendingGraphWarning(RuntimeWarning):
    """XLA steps keep adding to one pending graph: ``torch_xla.sync()`` is missing."""


def _xlac() -> Any:
    xla = sys.modules.get("torch_xla")
    return None if xla is None else xla._XLAC


# --- lr schedules -------------------------------------------------------------------------


def host_reads() -> int:
    """How many device-to-host transfers torch_xla has made so far (a counter read)."""
    xlac = _xlac()
    data = None if xlac is None else xlac._xla_metric_data("TransferFromDeviceTime")
    return 0 if data is None else int(data[0])


_SCHEDULES: set[int] = set()  # ids of the schedules warned about (a reused id stays quiet)


def check_schedule(schedule: Any, value: object, device: torch.device, read: bool) -> None:
    """Warns once per schedule that, called with an XLA step count, read the count back to
    the host (``read``: the transfer count moved during the call) or returned a host
    value (it ignores the count, so each new value is a new graph constant)."""
    on_device = isinstance(value, torch.Tensor) and value.device == device
    if (on_device and not read) or id(schedule) in _SCHEDULES:
        return
    _SCHEDULES.add(id(schedule))
    name = getattr(schedule, "__qualname__", type(schedule).__name__)
    what = f"lr schedule {name} returned {_checks.describe(value)} for a step count on XLA"
    if read:
        what += (
            ", and read the count back to the host to compute it: every step waits for the "
            "device and runs as more than one graph (Python's min/max, math.*, float(), "
            ".item() and branches on the count read it)."
        )
    else:
        what += (
            ": it ignores the count (then each new value compiles a new graph) or reads it "
            "back to the host."
        )
    warnings.warn(
        f"{what} Compute the lr from the count with torch ops so that it stays on the "
        "device: torch.clamp or torch.minimum for min/max, as in "
        "1e-3 * torch.clamp((step + 1) / 10, max=1.0); torch.cos; torch.where for a branch. "
        "Or pass a 0-d lr tensor and fill_() it.",
        HostReadWarning,
        stacklevel=3,
    )


# --- pending graphs -----------------------------------------------------------------------

# The master's torch_xla tensor id (never reused in a process, kept across mpfunc's steps)
# and torch_xla's id of the pending computation a step left in it (its IR node and output
# index) -> the steps chained in it so far; a few chains at a time (one per optimizer in a
# loop). A computation's id is a node's address, which a later node may reuse once this one
# is freed, also another master's (a test making new trees without a sync): the tensor id
# keeps their chains apart. Every sync (torch_xla's MarkStep count moved) runs every
# pending computation, so the ids noted before it are dropped.
_ENDS: dict[str, int] = {}
_KEEP = 16
_marks: Any = None  # torch_xla's MarkStep count when _ENDS was last written
_warned = False


def step_begins(fn: str, faces: Sequence[Any], grads: Sequence[Any]) -> tuple[int, str, int] | None:
    """At a step's start: notes the first master it will write (one with a grad) and
    warns, once per process, when that master is still the pending computation that the
    last ``PENDING_STEPS`` steps left in it. Returns what ``step_ends`` needs (``None``
    off XLA)."""
    global _warned
    i = next(
        (i for i, (f, g) in enumerate(zip(faces, grads)) if f is not None and g is not None), None
    )
    if i is None or faces[i].device.type != "xla" or compiling():
        return None
    xlac = _xlac()
    if xlac._xla_counter_value("MarkStep") != _marks:
        _ENDS.clear()  # synced since: nothing is pending from before
    uid = _chain_key(xlac, faces[i])
    run = _ENDS.pop(uid, 0)
    if run >= PENDING_STEPS and not _warned:
        _warned = True
        warnings.warn(
            f"{fn}: the masters are still the pending computation of the last {run} steps: "
            "torch_xla has run none of them, so each step adds its whole computation to one "
            "graph that keeps growing (every host read, such as loss.item(), compiles and "
            "runs all of it again, and the step slows down as it grows). Call "
            "torch_xla.sync() once per step, after the optimizer step (torch_xla's "
            "MpDeviceLoader and torch_xla.compile call it for you).",
            PendingGraphWarning,
            stacklevel=4,
        )
    return i, uid, run


def _chain_key(xlac: Any, master: Any) -> str:
    """The master's tensor id and its pending computation's id (see ``_ENDS``)."""
    return f"{xlac._xla_get_tensor_id(master)}:{xlac._unique_id_for_ir_and_data(master)}"


def step_ends(begun: tuple[int, str, int] | None, faces: Sequence[Any]) -> None:
    """At a step's end: records the pending computation the step left in the master
    ``step_begins`` noted (in ``faces``, the masters after the step)."""
    global _marks
    if begun is None:
        return
    i, uid, run = begun
    xlac = _xlac()
    now = _chain_key(xlac, faces[i])
    if now == uid:
        return  # not written (a kernel that skips it): no chain to follow
    _ENDS[now] = run + 1
    _marks = xlac._xla_counter_value("MarkStep")
    while len(_ENDS) > _KEEP:
        del _ENDS[next(iter(_ENDS))]

"""What a training step holds in memory: persistent bytes, and the measured peak with
activations apart.

*Persistent bytes* are counted from the tensors an optimizer keeps from one step to the
next (params, masters and their buffers, optimizer state with its scales and step
counters): the distinct storages behind them, so a tensor held twice counts once, and
tensor subclasses (torchao's low-bit state) are opened into the plain tensors they hold.

*Peak training memory* is measured on one profiled step (``measure_step``): the persistent
bytes, plus the highest running total, during the step, of the allocations and frees that
the torch profiler records (from a lead-in step on, so that grads left by the step before
count until freed), counting those that are not activations. Which allocations are
activations comes from torch's memory profiler (``torch.profiler._memory_profiler``,
private): its categories ACTIVATION, AUTOGRAD_DETAIL (grads of activations) and INPUT are
left apart; GRADIENT, PARAMETER and OPTIMIZER_STATE are counted; a TEMPORARY, or an
allocation it could not tie to a tensor (an extension's scratch buffer), is left apart
when an op around it reads an activation or a tensor already left apart (a forward or
backward op's work space), and counted otherwise (an optimizer's temporaries). Tensors
held between steps are counted from the tensors themselves, never from the profiler,
which sees a tensor only when a profiled op reads it (a C++ extension's arguments are
invisible to it). Limits: ``bench/README.md``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, NamedTuple

import torch


def tensors(tree: Any) -> Iterator[torch.Tensor]:
    """Every plain tensor in a tree of dicts, lists and tuples (NamedTuples included); a
    tensor subclass that flattens (``__tensor_flatten__``) yields the tensors inside it, and
    any other object the tensors among its attributes."""
    if isinstance(tree, torch.Tensor):
        flatten = getattr(type(tree), "__tensor_flatten__", None)
        if flatten is not None and type(tree) not in (torch.Tensor, torch.nn.Parameter):
            names, _ = tree.__tensor_flatten__()  # type: ignore[attr-defined]
            for name in names:
                yield from tensors(getattr(tree, name))
        else:
            yield tree
    elif isinstance(tree, Mapping):
        for v in tree.values():
            yield from tensors(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from tensors(v)
    elif hasattr(tree, "__dict__") and not isinstance(tree, (type, torch.nn.Module)):
        # A state object that keeps its tensors as attributes (FlashOptim's
        # _MaybeQuantizedTensor: _data, or _quantized and _scales): its own tensors, one level.
        for v in vars(tree).values():
            if isinstance(v, torch.Tensor):
                yield from tensors(v)


def _storages(trees: Iterable[Any]) -> dict[tuple[Any, ...], int]:
    """(device, data pointer, bytes) -> bytes of each distinct storage behind ``trees``; a
    tensor without a storage (XLA) counts its own bytes, keyed by identity."""
    seen: dict[tuple[Any, ...], int] = {}
    for t in (t for tree in trees for t in tensors(tree)):
        try:
            s = t.untyped_storage()
            seen[(t.device, s.data_ptr(), s.nbytes())] = s.nbytes()
        except (RuntimeError, NotImplementedError):
            seen[(t.device, "id", id(t))] = t.numel() * t.element_size()
    return seen


def persistent_bytes(*trees: Any) -> int:
    """Bytes of the distinct storages behind every tensor of ``trees``: a tensor held
    twice (a strategy's master keeps the model's own param) counts once."""
    return sum(_storages(trees).values())


class StepMemory(NamedTuple):
    """One step's memory, in bytes (``measure_step``)."""

    persistent: int  # held between steps: params, masters, optimizer state
    peak: int  # the step's peak of persistent + grads + the step's other non-activation bytes
    activations: int  # the step's peak of activation-side bytes alone (apart from ``peak``)
    total: int  # the step's peak of everything the profiler saw allocated, plus what was held

    def per_param(self, n: int) -> dict[str, float]:
        return {k: v / n for k, v in self._asdict().items()}


MARK = "bench:measured-step"


def measure_step(step: Callable[[], Any], held: Iterable[Any], device: str = "cpu") -> StepMemory:
    """Runs ``step()`` twice under the torch profiler and measures the second on ``device``.

    The first step is a lead-in: the profiler records no free of a block allocated before
    it started, so what the measured step frees (the grads of the step before, a state
    the optimizer replaces) must have been allocated under it.

    Args:
        step: one training step (forward, backward, optimizer step; grads released or not).
        held: the trees the optimizer keeps between steps (params, masters, state),
            read before the steps.
        device: ``"cpu"`` or ``"cuda"`` (where the profiler records allocations).
    """
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile, record_function
    from torch.profiler import _memory_profiler as mp

    kept = _storages(held)
    kept_ptrs = {(k[1], k[0].type) for k in kept if k[1] != "id"}
    activities = [ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(
        activities=activities, profile_memory=True, record_shapes=True, with_stack=True
    ) as prof:
        step()
        with record_function(MARK):
            step()
    memory = prof._memory_profile()
    cats: dict[Any, set[Any]] = {}
    for (key, _), cat in memory._category_snapshot().items():
        cats.setdefault(key, set()).add(cat)
    ours = {mp.Category.GRADIENT, mp.Category.PARAMETER, mp.Category.OPTIMIZER_STATE}
    apart = {mp.Category.ACTIVATION, mp.Category.AUTOGRAD_DETAIL, mp.Category.INPUT}
    derived: set[Any] = set()  # allocations found to be activation side

    def reads_activation(event: Any) -> bool:
        """Whether an op around ``event`` reads an activation, or a tensor made from one."""
        op = event.parent
        while op is not None:
            if op.typed[0] == _EventType.TorchOp:
                for t in _flat_inputs(op.typed[1]):
                    k = mp.TensorKey.from_tensor(t)
                    if k is not None and (k in derived or cats.get(k, set()) & apart):
                        return True
            op = op.parent
        return False

    def is_activation(event: Any, key: Any) -> bool:
        got = cats.get(key, set()) if key is not None else set()
        if got & ours:
            return False
        side = bool(got & apart) or reads_activation(event)
        if side and key is not None:
            derived.add(key)
        return side

    nodes = memory._op_tree.sorted_nodes
    mark = next(e for e in nodes if e.name == MARK)
    live: dict[Any, tuple[bool, int]] = {}  # allocation -> (activation side, bytes)
    counted = acts = peak = act_peak = total_peak = 0
    for event in nodes:
        if event.start_time_ns > mark.end_time_ns:
            break
        if event.typed[0] != _EventType.Allocation or event.typed[1].device.type != device:
            continue
        fields = event.typed[1]
        ident = (fields.ptr, fields.device.type)
        if fields.alloc_size > 0:
            if ident in kept_ptrs:  # a held tensor made in the lead-in: counted as held
                continue
            side = is_activation(event, mp.TensorKey.from_allocation(fields))
            live[ident] = (side, fields.alloc_size)
            acts += fields.alloc_size if side else 0
            counted += 0 if side else fields.alloc_size
        elif ident in live:
            side, size = live.pop(ident)
            acts -= size if side else 0
            counted -= 0 if side else size
        if event.start_time_ns >= mark.start_time_ns:
            peak = max(peak, counted)
            act_peak = max(act_peak, acts)
            total_peak = max(total_peak, counted + acts)
    held_bytes = sum(kept.values())
    return StepMemory(held_bytes, held_bytes + peak, act_peak, held_bytes + total_peak)


def _flat_inputs(op: Any) -> Iterator[Any]:
    from torch._C._profiler import _TensorMetadata

    for i in op.inputs:
        if isinstance(i, _TensorMetadata):
            yield i
        elif isinstance(i, list):
            yield from (t for t in i if isinstance(t, _TensorMetadata))

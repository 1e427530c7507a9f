"""What an mpfunc optimizer is, and the checks every optimizer shares.

An optimizer is a pair of functions, in the spirit of optax: ``init`` builds a
state tree from the masters, and ``prepare`` checks a state against a step's
inputs and returns the function that writes the step in place. Checking and
writing are split so that nothing is written until every check (of every
sub-optimizer of a ``partition``) has passed. ``apply_update`` (pure) and
``apply_update_`` (in place) are the entry points users call.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Union

import torch
from optree import PyTreeSpec

from mpfunc import _checks, _grouping, _tree

__all__ = [
    "LR",
    "Optimizer",
    "StepInput",
    "check_choice",
    "check_lr",
    "check_nonneg",
    "check_unit_interval",
    "guarded",
    "lr_for",
    "state_field_leaves",
]

LR = Union[float, torch.Tensor]
# What a user may pass as lr: a float, a 0-d tensor, or a schedule of the step count.
LRArg = Union[float, torch.Tensor, Callable[[torch.Tensor], Union[float, torch.Tensor]]]


class StepInput(NamedTuple):
    """What ``apply_update`` hands an optimizer after checking masters against grads:
    both trees flattened once, and each master's (shape, dtype, device) signature."""

    masters: Any
    m_leaves: list[torch.Tensor | None]
    m_spec: PyTreeSpec
    g_leaves: list[torch.Tensor | None]
    signature: list[tuple[Any, ...] | None]
    skip: torch.Tensor | None = None  # 0-d bool: when true, the step changes nothing


def signature(t: object) -> tuple[Any, ...] | None:
    """(shape, dtype, device) of a tensor, for bulk comparison; ``None`` for ``None``."""
    if isinstance(t, torch.Tensor):
        return (t.shape, t.dtype, t.device)
    return None if t is None else (type(t),)


class Optimizer(NamedTuple):
    """An optimizer over master trees: ``init(masters) -> state`` and an in-place step.

    ``prepare(step_input, state, fn)`` checks ``state`` against the step's masters
    (errors name ``fn``, the caller) and returns a function of no arguments that
    then updates masters and state in place. Leaves whose grad is ``None`` are
    skipped, as torch.optim skips parameters without ``.grad``. Build one with
    ``mpfunc.sgd``, ``mpfunc.adam``, ``mpfunc.adamw``, ``mpfunc.partition`` or
    ``mpfunc.torch_optimizer``; call it through ``apply_update``/``apply_update_``.
    """

    init: Callable[[Any], Any]
    prepare: Callable[[StepInput, Any, str], Callable[[], None]]
    # False when the state is not a tree of tensors (torch.optim interop): such an
    # optimizer cannot be copied, so only apply_update_ accepts it.
    functional: bool = True
    name: str = "optimizer"


def check_lr(fn: str, lr: object) -> LRArg:
    """A learning rate is a float >= 0, a 0-d floating tensor (read at every step), or
    a schedule: a function of the 0-d step count returning either.

    A tensor's value is not checked: reading it would wait on the device.
    """
    if callable(lr) and not isinstance(lr, torch.Tensor):
        return lr
    if isinstance(lr, torch.Tensor):
        if lr.ndim != 0 or not lr.is_floating_point():
            raise TypeError(
                f"{fn}: lr: expected a float or a 0-d floating-point tensor, got "
                f"{_checks.describe(lr)}"
            )
        return lr
    return check_nonneg(fn, "lr", lr)


def check_nonneg(fn: str, name: str, value: object) -> float:
    """A finite float >= 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{fn}: {name}: expected a float >= 0, got {type(value).__name__}")
    value = float(value)
    if not (value >= 0.0 and math.isfinite(value)):
        raise ValueError(f"{fn}: {name}: expected a finite float >= 0, got {value}")
    return value


def check_unit_interval(fn: str, name: str, value: object) -> float:
    """A float in [0, 1)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{fn}: {name}: expected a float in [0, 1), got {type(value).__name__}")
    value = float(value)
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{fn}: {name}: expected a float in [0, 1), got {value}")
    return value


def check_choice(fn: str, name: str, value: object, choices: Sequence[str]) -> str:
    if value not in choices:
        raise ValueError(f"{fn}: {name}: expected one of {', '.join(choices)}, got {value!r}")
    return str(value)


def lr_for(lr: LRArg, device: torch.device, count: torch.Tensor | None, cache: dict[Any, LR]) -> LR:
    """``lr`` for one device group: a float as is; a tensor moved (once per step) to the
    device; a schedule called with the group's step count (steps already taken)."""
    if isinstance(lr, torch.Tensor):
        if device not in cache:
            cache[device] = lr.to(device=device, dtype=torch.float32, non_blocking=True)
        return cache[device]
    if callable(lr):
        assert count is not None
        # A copy, so that a schedule returning the count itself is not moved by the
        # step's increment.
        value = lr(count.detach().clone())
        if isinstance(value, torch.Tensor):
            return value.to(device=device, dtype=torch.float32)
        return float(value)
    return lr


def skip_on(skip: torch.Tensor | None, device: torch.device, cache: dict[Any, Any]) -> Any:
    """``skip`` on one device (moved once per step), or ``None``."""
    if skip is None:
        return None
    key = ("skip", device)
    if key not in cache:
        cache[key] = skip.to(device=device, non_blocking=True)
    return cache[key]


def guarded(
    skip: torch.Tensor | None,
    written: Sequence[torch.Tensor],
    kernel: Callable[..., None],
    *args: Any,
) -> None:
    """Runs ``kernel(*args)`` (which writes ``written`` in place) so that when ``skip`` is true on
    the device, every written tensor keeps its exact old bits. No host read: the old
    values are kept and chosen back with ``torch.where``. The copies are bounded by the
    foreach chunk size on eager devices; on XLA the select is part of the graph."""
    if skip is None:
        kernel(*args)
        return
    old = [t.clone() for t in written]
    kernel(*args)
    for t, o in zip(written, old):
        t.copy_(torch.where(skip, o, t))


def state_field_leaves(
    fn: str, field: str, tree: Any, step: StepInput, kind: str
) -> list[torch.Tensor | None]:
    """Flattens one state field and checks it against the masters.

    ``kind`` is ``"moment"`` (same shape, dtype and device as the master) or
    ``"step"`` (a 0-d float32 tensor on the master's device). The field must have
    the masters' structure, with ``None`` exactly where the master is ``None``.
    """

    def path(i: int) -> str:
        return _tree.leaf_path(tree, i, f"state.{field}")

    masters, m_leaves, m_spec = step.masters, step.m_leaves, step.m_spec
    leaves, spec = _tree.flatten(tree)
    if spec != m_spec:
        where = _checks._first_difference(masters, tree, "masters", f"state.{field}")
        raise ValueError(
            f"{fn}: state.{field} must have the masters' tree structure: {where}; expected "
            f"{m_spec}, got {spec}. Was this state made by opt.init() for these masters?"
        )
    # The common case in one comparison of signature lists; the loop below only
    # runs to name the culprit.
    if kind == "moment":
        if [signature(s) for s in leaves] == step.signature:
            return leaves
    elif [signature(s) for s in leaves] == [
        None if sig is None else (_SCALAR, torch.float32, sig[2]) for sig in step.signature
    ]:
        return leaves
    for i, (s, m) in enumerate(zip(leaves, m_leaves)):
        if m is None:
            if s is not None:
                _checks.fail(
                    ValueError,
                    fn,
                    _tree.leaf_path(tree, i, f"state.{field}"),
                    "None (this leaf has no master)",
                    _checks.describe(s),
                )
            continue
        if not isinstance(s, torch.Tensor):
            _checks.fail(TypeError, fn, path(i), "a tensor", _checks.describe(s))
        if kind == "step":
            if s.shape != () or s.dtype != torch.float32:
                _checks.fail(
                    ValueError, fn, path(i), "a 0-d float32 step count", _checks.describe(s)
                )
        elif s.shape != m.shape or s.dtype != m.dtype:
            _checks.fail(
                ValueError,
                fn,
                path(i),
                f"{m.dtype} of shape {tuple(m.shape)} (the master's)",
                _checks.describe(s),
                "Was this state made by opt.init() for these masters?",
            )
        if s.device != m.device:
            _checks.fail(ValueError, fn, path(i), f"device {m.device}", f"device {s.device}")
    return leaves


_SCALAR = torch.Size([])


def zeros_like_masters(masters: Any) -> Any:
    """A moment tree: zeros shaped like each master, ``None`` where it is ``None``."""
    leaves, spec = _tree.flatten(masters)
    return _tree.unflatten(
        spec,
        [
            None if m is None else torch.zeros_like(m, memory_format=torch.preserve_format)
            for m in leaves
        ],
    )


def steps_like_masters(masters: Any) -> Any:
    """A step tree: a 0-d float32 zero on each master's device, as torch.optim keeps it."""
    leaves, spec = _tree.flatten(masters)
    return _tree.unflatten(
        spec,
        [
            None if m is None else torch.zeros((), dtype=torch.float32, device=m.device)
            for m in leaves
        ],
    )


def groups_with_grads(
    m_leaves: Sequence[torch.Tensor | None], g_leaves: Sequence[torch.Tensor | None]
) -> dict[tuple[object, ...], list[int]]:
    """Positions with both a master and a grad, grouped by the master's (device, dtype)."""
    keys: list[tuple[object, ...] | None] = [
        None if (m is None or g is None) else (m.device, m.dtype)
        for m, g in zip(m_leaves, g_leaves)
    ]
    return _grouping.group_indices(keys)


class Work(NamedTuple):
    """One kernel call of a step: implementation, lr and skip on its device, positions."""

    impl: str
    lr: LR
    skip: torch.Tensor | None
    idx: list[int]


def plan(
    fn: str,
    impl: str,
    lr: LRArg,
    step: StepInput,
    steps: Sequence[torch.Tensor | None],
    has_fused: bool,
) -> list[Work]:
    """The step's work list: one entry per kernel call.

    Leaves with a master and a grad are grouped by the master's (device, dtype);
    foreach groups on eager devices are split into bounded runs. A schedule is
    evaluated once per group, from the step count of the group's first leaf.
    """
    masters, m_leaves, g_leaves = step.masters, step.m_leaves, step.g_leaves
    cache: dict[Any, Any] = {}
    work: list[Work] = []
    for (device, dtype), idx in groups_with_grads(m_leaves, g_leaves).items():
        assert isinstance(device, torch.device) and isinstance(dtype, torch.dtype)
        try:
            chosen = _grouping.resolve_impl(impl, device, dtype, has_fused)
        except ValueError as e:
            raise ValueError(
                f"{fn}: at {_tree.leaf_path(masters, idx[0], 'masters')!r}: {e}"
            ) from None
        lr_d = lr_for(lr, device, steps[idx[0]], cache)
        skip_d = skip_on(step.skip, device, cache)
        runs = _grouping.chunks(idx, m_leaves, device) if chosen == "foreach" else [idx]
        work.extend(Work(chosen, lr_d, skip_d, run) for run in runs)
    return work


def pick(seq: Sequence[Any], idx: Sequence[int]) -> list[Any]:
    return [seq[i] for i in idx]

"""Which kernel runs on which leaves: the one module that decides.

torch's multi-tensor kernels take lists whose tensors share one device and one
dtype. A step's leaves are grouped by (device, dtype, implementation), and each
group becomes one or more kernel calls (``Work``):

* ``auto`` picks ``xla`` on XLA devices where the rule has an XLA kernel and the leaf's
  master and state are float32 tensors (``xla_applies``): the whole group's update is
  then one cached XLA computation, one traced node instead of about 16 per leaf. It
  picks ``fused`` where the rule has a fused kernel, torch has one for the device and
  dtype, and the leaf's tensors (master, grad, state) are dense with equal strides;
  otherwise ``foreach`` (on XLA: float64 masters, state in another dtype, master
  strategies other than fp32, and lazy devices other than torch_xla's). torch's fused
  kernels pair elements by memory position, so a channels_last master with a
  contiguous grad would mix elements silently: such leaves take the foreach path,
  which pairs by index.
  An explicit ``impl="fused"`` falls back the same way, leaf by leaf. An explicit
  ``impl="xla"`` raises, naming the leaf, where ``xla_applies`` does not hold.
* ``foreach`` groups on eager devices are split into bounded runs, so the
  temporaries a foreach chain allocates stay a constant, not a model's worth.
  Lazy devices (XLA) trace one graph, fuse the temporaries away, and are not split.

``elementwise`` turns a ``Rule`` into an ``Optimizer`` whose ``plan`` does all of
the above after checking the state; nothing is written while planning.
"""

from __future__ import annotations

import typing
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Literal

import torch

from mpfunc import _checks, _tree
from mpfunc._checks import LR, Like, LRArg
from mpfunc._optimizer import Group, Optimizer, Rule, Step, Work

__all__ = [
    "FOREACH_CHUNK_NUMEL",
    "IMPLS",
    "Impl",
    "chunks",
    "copy_grouped_",
    "elementwise",
    "fields_from",
    "fresh_copy",
    "fused_supported",
    "group_indices",
    "is_lazy",
    "pick",
    "xla_applies",
]

Impl = Literal["auto", "fused", "foreach", "reference", "xla"]
IMPLS: tuple[str, ...] = typing.get_args(Impl)

# One foreach call on an eager device touches at most this many elements, so the
# temporaries it allocates (e.g. Adam's denominator) stay below ~64 MiB in fp32.
FOREACH_CHUNK_NUMEL = 1 << 24

_FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _fused_devices() -> tuple[str, ...]:
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

        return tuple(_get_fused_kernels_supported_devices())
    except ImportError:  # pragma: no cover - older torch
        return ("cuda", "cpu")


_FUSED_DEVICES = _fused_devices()


def is_lazy(device: torch.device) -> bool:
    """True for devices that trace graphs (XLA), where every op becomes a graph node."""
    return device.type in ("xla", "lazy")


def fused_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch has a fused optimizer kernel for this device and dtype."""
    return device.type in _FUSED_DEVICES and dtype in _FUSED_DTYPES


def xla_applies(master: object, state: Sequence[torch.Tensor | None]) -> bool:
    """Whether a leaf can take a rule's ``"xla"`` kernel: a float32 master tensor on a
    torch_xla device, with float32 state (moments; step counts are always float32)."""
    f32 = torch.float32
    return (
        isinstance(master, torch.Tensor)
        and bool(master.is_xla)  # type: ignore[attr-defined]
        and master.dtype == f32
        and all(t is None or t.dtype == f32 for t in state)
    )


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill a block of memory with no gaps and no overlap, in
    some order of dimensions (contiguous, channels_last, transposed, ...)."""
    if t.is_contiguous():
        return True
    dims = sorted((s, n) for n, s in zip(t.shape, t.stride()) if n != 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


def _same_layout(tensors: Sequence[torch.Tensor | None]) -> bool:
    """All present tensors are dense with one stride: pairing by memory position is then
    pairing by index, which is what torch's fused kernels assume."""
    first = tensors[0]
    assert first is not None
    stride = first.stride()
    return _dense(first) and all(t is None or t.stride() == stride for t in tensors[1:])


def group_indices(
    keys: Sequence[tuple[object, ...] | None],
) -> dict[tuple[object, ...], list[int]]:
    """Groups positions by key, in first-seen order; ``None`` keys are left out."""
    groups: dict[tuple[object, ...], list[int]] = {}
    for i, key in enumerate(keys):
        if key is not None:
            groups.setdefault(key, []).append(i)
    return groups


def chunks(
    idx: list[int], tensors: Sequence[torch.Tensor | None], device: torch.device
) -> Iterator[list[int]]:
    """Splits ``idx`` into runs of at most ``FOREACH_CHUNK_NUMEL`` elements (one run on lazy
    devices). A single tensor larger than the limit forms a run of its own."""
    if is_lazy(device):
        yield idx
        return
    run: list[int] = []
    total = 0
    for i in idx:
        t = tensors[i]
        n = t.numel() if t is not None else 0
        if run and total + n > FOREACH_CHUNK_NUMEL:
            yield run
            run, total = [], 0
        run.append(i)
        total += n
    if run:
        yield run


def pick(seq: Sequence[Any], idx: Sequence[int]) -> list[Any]:
    return [seq[i] for i in idx]


def fresh_copy(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A detached copy of ``t`` in ``dtype`` and ``t``'s layout, in a buffer of its own on
    every device.

    On XLA, ``copy_`` and ``.to(copy=True)`` of an unchanged dtype leave the copy holding
    the source's device data; the first in-place write of either then donates that
    buffer, and reading the other fails ("Trying to access XLA data ... while an async
    operation is in flight"). ``clone`` and a dtype conversion trace a real node.
    """
    t = t.detach()
    if t.dtype == dtype:
        return t.clone(memory_format=torch.preserve_format)
    return t.to(dtype=dtype, copy=True)


def copy_grouped_(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> None:
    """``dst[i].copy_(src[i])`` for all i, one foreach call per (device, dtype, dtype) group.

    ``copy_`` rounds to nearest even exactly as ``Tensor.to`` does, and pairs elements
    by index whatever the two layouts are. On XLA a same-dtype pair copies from a view,
    so that ``dst`` never shares ``src``'s device buffer (see ``fresh_copy``).
    """
    keys: list[tuple[object, ...] | None] = [(d.device, d.dtype, s.dtype) for d, s in zip(dst, src)]
    with torch.no_grad():
        for (device, to, of), idx in group_indices(keys).items():
            sources = pick(src, idx)
            if to == of and isinstance(device, torch.device) and is_lazy(device):
                # torch_xla turns copy_ from a tensor's own data into sharing that data,
                # and even from a clone of it; from a view it traces a node, so dst gets
                # a buffer of its own at the next sync (exact: a view changes no bit).
                sources = [s.view_as(s) for s in sources]
            torch._foreach_copy_(pick(dst, idx), sources)


# --- elementwise optimizers ---------------------------------------------------------------


def _lr_on(lr: LRArg, device: torch.device, count: torch.Tensor, cache: dict[Any, Any]) -> LR:
    """``lr`` for one group: a float as is; a tensor moved (once per step) to the device;
    a schedule called with the step count of the group's first leaf (steps taken)."""
    if isinstance(lr, torch.Tensor):
        if device not in cache:
            cache[device] = lr.to(device=device, dtype=torch.float32, non_blocking=True)
        return typing.cast(torch.Tensor, cache[device])
    if callable(lr):
        # A copy, so that a schedule returning the count itself is not moved by the
        # step's increment.
        value = lr(count.detach().clone())
        if isinstance(value, torch.Tensor):
            return value.to(device=device, dtype=torch.float32)
        return float(value)
    return lr


def _skip_on(skip: torch.Tensor | None, device: torch.device, cache: dict[Any, Any]) -> Any:
    if skip is None:
        return None
    key = ("skip", device)
    if key not in cache:
        cache[key] = skip.to(device=device, non_blocking=True)
    return cache[key]


_STEP = Like("the master's", dtypes=(torch.float32,), what="float32 step count", scalar=True)
_MOMENT = Like("the master's", hint="Was this state made by opt.init() for these masters?")


def _state_fields(
    fn: str, rule: Rule, hyper: Any, step: Step, state: Any
) -> dict[str, list[torch.Tensor | None]]:
    """Each field the hyperparameters use, flattened and checked against the masters: its
    structure, each leaf against its master, and that nothing the step writes overlaps
    itself or another leaf. Remembered (``_checks.recall``) for the next step."""
    if not isinstance(state, rule.state_type):
        raise TypeError(
            f"{fn}: {step.state_name}: expected the {rule.state_type.__name__} made by "
            f"{rule.name}(...).init(masters), got {_checks.describe(state)}"
        )
    kinds = rule.fields(hyper)
    used: list[tuple[str, Any]] = []
    for name in rule.state_type._fields:  # type: ignore[attr-defined]
        value = getattr(state, name)
        if kinds.get(name) is not None:
            used.append((f"{step.state_name}.{name}", value))
        elif value is not None:
            raise ValueError(
                f"{fn}: {step.state_name}.{name}: expected None (these hyperparameters use no "
                f"{name}), got {_checks.describe(value)}"
            )
    tag = ("plan", fn, rule.name, tuple(kinds.items()), step.spec)
    memo = _checks.recall(tag, used, also=[step.masters, step.grads])
    if not memo.hit:
        for (where, value), side, spec in zip(used, memo.sides, memo.specs):
            _checks.check_dense(fn, side)
            _checks.check_same_structure(
                fn, "masters", step.masters.tree, step.spec, where, value, spec,
                "Was this state made by opt.init() for these masters?",
            )  # fmt: skip
            kind = kinds[where.rsplit(".", 1)[1]]
            _checks.check_pairs(fn, step.masters, side, _STEP if kind == "step" else _MOMENT)
        _checks.check_writable(fn, memo.sides)
        _checks.check_no_alias(fn, written=[step.masters, *memo.sides], read=[step.grads])
        memo.passed()
    return {where.rsplit(".", 1)[1]: side.leaves for (where, _), side in zip(used, memo.sides)}


def _plan_elementwise(
    fn: str, rule: Rule, hyper: Any, impl: str, lr: LRArg, step: Step, state: Any
) -> list[Work]:
    fields = _state_fields(fn, rule, hyper, step, state)
    moments = [f for name, f in fields.items() if name != "step"]
    masters, grads = step.masters.leaves, step.grads.leaves
    has_fused = "fused" in rule.kernels
    if impl == "fused" and not has_fused:
        raise ValueError(
            f"{fn}: impl='fused': {rule.name} has no fused kernel; use 'auto' or 'foreach'"
        )
    has_xla = "xla" in rule.kernels
    if impl == "xla" and not has_xla:
        raise ValueError(
            f"{fn}: impl='xla': {rule.name} has no XLA kernel; use 'auto' or 'foreach'"
        )
    keys: list[tuple[object, ...] | None] = []
    for i, (m, g) in enumerate(zip(masters, grads)):
        if m is None or g is None:
            keys.append(None)
            continue
        chosen = "foreach" if impl == "auto" else impl
        if impl in ("auto", "xla") and has_xla and xla_applies(m, [f[i] for f in moments]):
            chosen = "xla"
        elif impl == "xla":
            raise ValueError(
                f"{fn}: at {step.masters.path(i)!r}: impl='xla': expected a float32 master "
                f"(and float32 state) on an XLA device, got {_checks.describe(m)}. Use "
                "impl='auto' or 'foreach'."
            )
        elif (
            impl in ("auto", "fused")
            and has_fused
            and fused_supported(m.device, m.dtype)
            and _same_layout([m, g, *(f[i] for f in moments)])
        ):
            chosen = "fused"
        elif impl == "fused" and not fused_supported(m.device, m.dtype):
            raise ValueError(
                f"{fn}: at {step.masters.path(i)!r}: impl='fused': expected a device and dtype "
                f"with a fused torch kernel ({', '.join(_FUSED_DEVICES)}; "
                f"{', '.join(str(d) for d in _FUSED_DTYPES)}), got {m.dtype} on {m.device}. "
                "Use impl='auto' or 'foreach'."
            )
        elif impl == "fused":
            chosen = "foreach"  # layouts differ: pair by index, never by memory position
        keys.append((m.device, m.dtype, chosen))
    steps = fields.get("step")
    cache: dict[Any, Any] = {}
    work: list[Work] = []
    state_type: Any = rule.state_type
    for (device, _, kernel_name), idx in group_indices(keys).items():
        assert isinstance(device, torch.device) and isinstance(kernel_name, str)
        if steps is not None:
            count = steps[idx[0]]
            assert count is not None
            lr_d = _lr_on(lr, device, count, cache)
        else:
            lr_d = _lr_on(lr, device, torch.zeros(()), cache)
        skip_d = _skip_on(step.skip, device, cache)
        runs = [idx] if kernel_name == "fused" else list(chunks(idx, masters, device))
        for run in runs:
            sliced = {name: pick(f, run) for name, f in fields.items()}
            group_state = state_type(**{n: sliced.get(n) for n in state_type._fields})
            group = Group(pick(masters, run), pick(grads, run), group_state, lr_d, skip_d)
            work.append(Work(rule.kernels[kernel_name], group, hyper))
    return work


def _like_masters(masters: Any, make: Any) -> Any:
    leaves, spec = _tree.flatten(masters)
    return _tree.unflatten(spec, [None if m is None else make(m) for m in leaves])


def _zeros(m: torch.Tensor) -> torch.Tensor:
    # The master's layout (channels_last, transposed): fused kernels pair by position.
    return torch.zeros_like(m, memory_format=torch.preserve_format)


def _count(m: torch.Tensor) -> torch.Tensor:
    # A 0-d float32 step count on the master's device, as torch.optim keeps it.
    return torch.zeros((), dtype=torch.float32, device=m.device)


def elementwise(rule: Rule, hyper: Any, impl: str, lr: LRArg) -> Optimizer:
    """The ``Optimizer`` for an elementwise ``rule`` with these hyperparameters."""
    kinds = rule.fields(hyper)

    def init(masters: Any) -> Any:
        _checks.tensor_leaves(f"{rule.name}.init", "masters", masters)
        state: dict[str, Any] = {}
        for name in rule.state_type._fields:  # type: ignore[attr-defined]
            kind = kinds.get(name)
            state[name] = None if kind is None else _like_masters(
                masters, _count if kind == "step" else _zeros
            )  # fmt: skip
        return rule.state_type(**state)

    def plan(step: Step, state: Any, fn: str) -> list[Work]:
        return _plan_elementwise(fn, rule, hyper, impl, lr, step, state)

    return Optimizer(init=init, plan=plan, functional=True, name=rule.name)


def fields_from(**kinds: str | None) -> Mapping[str, str]:
    """``fields_from(step="step", momentum_buffer=None)`` -> the used fields only."""
    return {k: v for k, v in kinds.items() if v is not None}

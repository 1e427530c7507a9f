"""Which kernel runs on which leaves: the one module that decides.

torch's multi-tensor kernels take lists whose tensors share one device and one
dtype. A step's leaves are grouped by (device, dtype, implementation), and each
group becomes one or more kernel calls (``Work``):

* ``auto`` picks ``xla`` on XLA devices where the rule has an XLA kernel and the leaf
  has a float32 master or a ``"none"``/``"kahan"``/``"remainder"``/``"stochastic"``
  unit with float32, bf16 or 8-bit state (``xla_applies``), and no diagnostics are
  asked for: the whole group's step (the strategy's load and store, grads widened and
  unscaled, moments decoded and encoded, params written) is then one cached XLA
  computation, one traced node instead of dozens per leaf. Elsewhere on XLA (float64
  masters, ``stats=``, lazy devices other than torch_xla's) the foreach path remains.
* ``auto`` picks ``native`` on the CPU where the rule has one (mpfunc's own kernel,
  ``_native``: the whole mixed step in one pass), no stats are asked for, the kernel
  builds here, and the leaf fits it: a float32 master with float32 state, or any master
  strategy with float32, bf16 or 8-bit state (``_composed_fits``: the composed pass),
  the leaf's tensors (master or unit, grad, state, model param) dense with equal strides,
  and contiguous where draws or 8-bit blocks follow the element index; else ``fused``
  where the rule has a fused kernel, torch has one for the device and dtype, and the
  layouts are as for ``native``; otherwise ``foreach``. torch's fused kernels pair elements
  by memory position, so a channels_last master with a contiguous grad would mix
  elements silently: such leaves take the foreach path, which pairs by index.
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
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any, Literal, NamedTuple

import torch

from mpfunc.backends import _diagnostics, _native, _xla_kernels, _xla_watch
from mpfunc.core import _cache, _checks, _dtensor, _gc, _optimizer, _tree
from mpfunc.core._checks import LR, Like, LRArg, Side
from mpfunc.core._compile import compiling
from mpfunc.core._optimizer import Group, Kernel, Optimizer, Rule, Step, Work
from mpfunc.core._tensors import (
    FOREACH_CHUNK_NUMEL,
    chunks,
    compute_dtype,
    fresh_copy,
    group_indices,
    is_lazy,
    pick,
)
from mpfunc.parallel import _sharding
from mpfunc.state_formats import _state_format
from mpfunc.strategies import _strategy, _strategy_fp32

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

_FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _fused_devices() -> tuple[str, ...]:
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

        return tuple(_get_fused_kernels_supported_devices())
    except ImportError:  # pragma: no cover - older torch
        return ("cuda", "cpu")


_FUSED_DEVICES = _fused_devices()


def fused_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch has a fused optimizer kernel for this device and dtype."""
    return device.type in _FUSED_DEVICES and dtype in _FUSED_DTYPES


def xla_applies(master: object, state: Sequence[object]) -> bool:
    """Whether a leaf can take a rule's ``"xla"`` kernel: on a torch_xla device, a plain
    float32 master tensor or a unit of a strategy the node loads and stores itself (its
    param of a dtype it takes: ``_xla_kernels.PARAM_DTYPES``), with state tensors all
    one state format the node serves (``StateFormat.xla``: float32, bfloat16, 8-bit
    ``QState``s, 4-bit ``Q4State``s; step counts are always float32)."""
    s = _strategy.by_unit(master)
    face = master if s is None else master.param  # type: ignore[attr-defined]
    if not isinstance(face, torch.Tensor) or not face.is_xla:  # type: ignore[attr-defined]
        return False
    if face.dtype not in _xla_kernels.PARAM_DTYPES.get("fp32" if s is None else s.name, ()):
        return False
    moments = [t for t in state if t is not None]
    if not moments:
        return True
    fmt = _state_format.of_moment(moments[0])
    if fmt is None or not fmt.xla:
        return False
    of = _state_format.of_moment
    return all(of(t) is fmt for t in moments)


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
    pairing by index, which is what torch's fused kernels assume. A dim of size 1 is never
    stepped along, so its stride does not count (a (1, 40) param stored transposed has
    strides (1, 1), its grad (40, 1)), as in the native pass's check."""
    first = tensors[0]
    assert first is not None
    stride = first.stride()
    if not _dense(first):
        return False
    if all(t is None or t.stride() == stride for t in tensors[1:]):
        return True
    moving = [d for d, n in enumerate(first.shape) if n != 1]
    return all(
        t is None or [t.stride(d) for d in moving] == [stride[d] for d in moving]
        for t in tensors[1:]
    )


def copy_grouped_(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> None:
    """``dst[i].copy_(src[i])`` for all i, one foreach call per (device, dtype, dtype) group.

    ``copy_`` rounds to nearest even exactly as ``Tensor.to`` does, and pairs elements
    by index whatever the two layouts are. On XLA a same-dtype pair copies from a view,
    so that ``dst`` never shares ``src``'s device buffer (see ``fresh_copy``).
    """
    dst, src = _dtensor.locals_(dst), _dtensor.locals_(src)  # DTensors: shard by shard
    keys: list[tuple[object, ...] | None] = [(d.device, d.dtype, s.dtype) for d, s in zip(dst, src)]
    # Under XLA SPMD, copy_ hands dst the source's sharding: keep dst's own.
    with torch.no_grad(), _sharding.kept(dst):
        for (device, to, of), idx in group_indices(keys).items():
            targets, sources = pick(dst, idx), pick(src, idx)
            assert isinstance(device, torch.device)
            if device.type == "cpu":
                targets, sources = _native_cast_(to, of, targets, sources)
                if not targets:
                    continue
            if to == of and isinstance(device, torch.device) and is_lazy(device):
                # torch_xla turns copy_ from a tensor's own data into sharing that data,
                # and even from a clone of it; from a view it traces a node, so dst gets
                # a buffer of its own at the next sync (exact: a view changes no bit).
                sources = [s.view_as(s) for s in sources]
            torch._foreach_copy_(targets, sources)


def _native_cast_(
    to: Any, of: Any, dst: list[torch.Tensor], src: list[torch.Tensor]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """On the CPU, casts the pairs that share one dense layout with mpfunc's native kernel
    (one parallel pass with streaming stores, bit for bit ``Tensor.to``) where the dtypes
    and sizes make it worth it and it builds; returns the pairs left to ``_foreach_copy_``."""
    if compiling():  # (an extension op with no fake kernel; inductor fuses the copies)
        return dst, src
    # A negative view (torch._neg_view) holds the negated values: the kernel reads memory
    # as it is, torch's copy_ reads the values.
    fits = [_same_layout([d, s]) and not s.is_neg() for d, s in zip(dst, src)]
    numel = sum(d.numel() for d, ok in zip(dst, fits) if ok)
    if not _native.casts(to, of, numel) or not _native.cast_agrees(to, of):
        return dst, src
    _native.cast_([d for d, ok in zip(dst, fits) if ok], [s for s, ok in zip(src, fits) if ok])
    return [d for d, ok in zip(dst, fits) if not ok], [s for s, ok in zip(src, fits) if not ok]


_NATIVE_IO = (torch.float32, torch.bfloat16, torch.float16)


def _native_fits(
    rule: Rule, m: Any, g: torch.Tensor, stored: list[Any], param: torch.Tensor | None
) -> bool:
    """Whether the rule's ``native`` kernel can take this leaf whole: on the CPU, a float32
    master tensor and float32 state, a grad and model param of the kernel's dtypes, all
    of one dense layout (it walks memory in order, as torch's fused kernels do). Runs
    per leaf per step: cheap tests first, each tensor attribute read once."""
    if "native" not in rule.kernels or not isinstance(m, torch.Tensor):
        return False
    if not m.is_cpu or m.dtype != torch.float32:
        return False
    if g.dtype not in _NATIVE_IO or (param is not None and param.dtype not in _NATIVE_IO):
        return False
    stride = m.stride()
    for x in stored:
        if not isinstance(x, torch.Tensor) or x.dtype != torch.float32 or x.stride() != stride:
            return False
    if g.stride() != stride or (param is not None and param.stride() != stride):
        return False
    return m.is_contiguous() or _dense(m)


_PARAM_DTYPES = {
    "remainder": (torch.bfloat16,),
    "stochastic": (torch.bfloat16,),
    "kahan": (torch.bfloat16, torch.float16),
    "none": (torch.bfloat16, torch.float16),
}


def _composed_fits(
    rule: Rule, s: Any, m: Any, g: torch.Tensor, stored: list[Any], param: torch.Tensor | None
) -> int | None:
    """The native state-format code (``StateFormat.native``) if the rule's ``native``
    kernel can take this leaf of a master strategy other than plain fp32-with-fp32-state,
    else ``None``: on the CPU, a strategy and param dtype it knows, moments all of one
    format the pass takes (or none: code 0), a grad and model param of its dtypes; the
    leaf's tensors dense with one stride, and contiguous where draws (``"stochastic"``) or a
    container's blocks (8-bit codes and scales) follow the element index (a
    ``"remainder"``'s tie bits: contiguous, any dense param of at most 8 dims)."""
    if "native" not in rule.kernels:
        return None
    f = m if s is None else m.param
    if not isinstance(f, torch.Tensor) or not f.is_cpu or g.dtype not in _NATIVE_IO:
        return None
    if f.numel() == 0:
        # Nothing to compute (its step count still counts, on the torch path), and
        # ``is_contiguous`` holds for any strides of an empty tensor, which the pass's own
        # check would refuse after other groups had written.
        return None
    if s is None:
        if f.dtype != torch.float32:
            return None
        aux = None
    else:
        if param is not None or f.dtype not in _PARAM_DTYPES.get(s.name, ()):
            return None
        aux = m[1] if len(m) > 1 and s.name != "stochastic" else None
    if param is not None and param.dtype not in _NATIVE_IO:
        return None
    # Runs per leaf in a step that plans in full: loops, not generators (100,000 leaves).
    first = stored[0] if stored else None
    blocked = False
    if first is None:  # no state (SGD without momentum)
        fmt = 0
        tensors = [f, g, aux, param]
    else:
        of = _state_format.of_moment
        kind = of(first)
        if kind is None or kind.native is None:
            return None
        for x in stored:
            if of(x) is not kind:
                return None
        fmt = kind.native
        blocked = kind.container is not None
        tensors = [f, g, aux, param] if blocked else [f, g, aux, param, *stored]
    if s is None and fmt == 0:
        return None  # the fp32 kernel's own case (_native_fits)
    # A remainder's tie bits follow the param's logical layout (any dense one; found
    # through its sizes and strides), in a contiguous tensor of their own.
    if (
        s is not None
        and s.name == "remainder"
        and (f.dim() > _TIE_DIMS or not m[2].is_contiguous())
    ):
        return None
    if blocked or (s is not None and s.name == "stochastic"):
        for t in tensors:
            if t is not None and not t.is_contiguous():
                return None
        return fmt
    return fmt if _same_layout(tensors) else None


_TIE_DIMS = 8  # the native pass's kTieDims


# --- elementwise optimizers ---------------------------------------------------------------


def _schedule_count(steps: Sequence[Any] | None, device: torch.device) -> torch.Tensor:
    """The step count a schedule reads on ``device``: the largest among the leaves stepping
    there (``steps``: theirs), so a leaf whose grad was often ``None`` (fewer steps) or that
    was added later (0) follows the others' schedule instead of setting it; steps taken
    before this one. Each leaf's own count when it steps alone (the step inside backward).
    On the device, no host read; 0 for an optimizer without step counts."""
    if steps is None:
        return torch.zeros((), device=device)
    local = _dtensor.locals_(steps)
    if len(local) == 1:
        return typing.cast(torch.Tensor, local[0].clone())
    with torch.no_grad():  # step counts take no grad: no detach per leaf
        return torch.stack(local).max()


def _lr_on(
    fn: str,
    lr: LRArg,
    device: torch.device,
    dtype: torch.dtype,
    steps: Mapping[torch.device, list[Any]] | None,
    cache: dict[Any, Any],
) -> LR:
    """``lr`` for one group of ``dtype`` masters: a float as is; a tensor moved (once per
    step) to the device, in float64 for float64 masters (as a float lr is read) and
    float32 otherwise; a schedule called (once per step and device) with
    ``_schedule_count`` of ``steps``, the stepping leaves' counts by device, its value
    checked before anything is written."""
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    if isinstance(lr, torch.Tensor):
        if (device, wide) not in cache:
            cache[device, wide] = lr.to(device=device, dtype=wide, non_blocking=True)
        return typing.cast(torch.Tensor, cache[device, wide])
    if callable(lr):
        key = ("schedule", device)
        if key not in cache:
            counts = None if steps is None else steps[device]
            cache[key] = _call_schedule(fn, lr, device, _schedule_count(counts, device))
        value = cache[key]
        if isinstance(value, torch.Tensor) and value.dtype != wide:
            if (key, wide) not in cache:
                cache[key, wide] = value.to(wide)
            return typing.cast(torch.Tensor, cache[key, wide])
        return typing.cast(LR, value)
    return lr


def _call_schedule(fn: str, lr: Any, device: torch.device, count: torch.Tensor) -> LR:
    """``lr(count)`` on ``device``: a float >= 0, or a 0-d floating tensor there (float32,
    or float64 as returned: float64 masters read it so). ``count`` is a copy, so a
    schedule returning the count itself is not moved by the step's increment. On XLA,
    torch_xla's transfer count around the call tells whether the schedule read the count
    back to the host."""
    lazy = is_lazy(device)
    reads = _xla_watch.host_reads() if lazy else 0
    value = lr(count)
    if lazy:
        _xla_watch.check_schedule(lr, value, device, _xla_watch.host_reads() != reads)
    name = getattr(lr, "__qualname__", type(lr).__name__)
    if isinstance(value, torch.Tensor):
        if value.ndim != 0 or not value.is_floating_point():
            raise TypeError(
                f"{fn}: lr: expected the schedule {name} to return a float or a 0-d "
                f"floating-point tensor, got {_checks.describe(value)}"
            )
        keep = torch.float64 if value.dtype == torch.float64 else torch.float32
        return value.to(device=device, dtype=keep)
    return _checks.real(fn, f"lr (the schedule {name}'s value)", value, ge=0.0)


def _skip_on(skip: torch.Tensor | None, device: torch.device, cache: dict[Any, Any]) -> Any:
    if skip is None:
        return None
    key = ("skip", device)
    if key not in cache:
        cache[key] = skip.to(device=device, non_blocking=True)
    return cache[key]


_STEP = Like("the master's", dtypes=(torch.float32,), what="float32 step count", scalar=True)
_HINT = "Was this state made by opt.init() for these masters?"
_MOMENT = Like("the master's", hint=_HINT)

# A mixed step (a master strategy, low-precision grads, params written, a state dtype)
# loads at most this many elements of fp32 temporaries per kernel call on eager
# devices: a few MiB that stay in cache between loading, stepping and storing. A leaf
# larger than this is a chunk of its own.
MIXED_CHUNK_NUMEL = 1 << 18


def _flat_fields(
    fn: str, rule: Rule, kinds: Mapping[str, str], step: Step, state: Any
) -> dict[str, tuple[list[Any], Any]]:
    """Each field the hyperparameters use (``kinds``: ``rule.fields(hyper)``), flattened
    once with units (8-bit moments) as leaves: ``(leaves, spec)``. The state's type and
    its unused fields (``None``) are checked here; the used fields by ``_state_fields``."""
    if not isinstance(state, rule.state_type):
        raise TypeError(
            f"{fn}: {step.state_name}: expected the {rule.state_type.__name__} made by "
            f"{rule.name}(...).init(masters), got {_checks.describe(state)}"
        )
    out: dict[str, tuple[list[Any], Any]] = {}
    for name in rule.state_type._fields:  # type: ignore[attr-defined]
        value = getattr(state, name)
        if kinds.get(name) is None:
            if value is not None:
                raise ValueError(
                    f"{fn}: {step.state_name}.{name}: expected None (these hyperparameters use no "
                    f"{name}), got {_checks.describe(value)}"
                )
            continue
        out[name] = _tree.flatten(value, units=True)
    return out


def _state_fields(
    fn: str,
    kinds: Mapping[str, str],
    step: Step,
    state: Any,
    state_dtype: torch.dtype | None,
    flat: dict[str, tuple[list[Any], Any]],
) -> None:
    """Checks each used field's leaves (``flat``, from ``_flat_fields``) against the
    masters."""
    faces = step.faces if step.faces is not None else step.masters.leaves
    ref = Side(step.masters.name, step.masters.tree, faces, units=True)
    for name, (leaves, spec) in flat.items():
        value = getattr(state, name)
        kind = kinds[name]
        where = f"{step.state_name}.{name}"
        side = Side(where, value, leaves, units=True)
        _checks.check_same_structure(
            fn, "masters", step.masters.tree, step.spec, where, value, spec, _HINT
        )
        if kind == "step":
            _checks.check_tensor_or_none(fn, where, value, leaves)
            _checks.check_pairs(fn, ref, side, _STEP)
        elif _state_format.chosen(state_dtype).container is None and not any(step.kinds or ()):
            # Every master a tensor, moments like it: the one pair check.
            _checks.check_tensor_or_none(fn, where, value, leaves)
            _checks.check_pairs(
                fn,
                ref,
                side,
                _MOMENT
                if state_dtype is None
                else _MOMENT._replace(dtypes=(state_dtype,), what=str(state_dtype)),
            )
        elif _all_right(kind, faces, leaves, state_dtype):
            continue
        else:
            problem = _state_format.problem
            wants: dict[torch.dtype, torch.dtype] = {}  # by face dtype
            for i, (f, x) in enumerate(zip(faces, leaves)):
                if f is None:
                    if x is not None:
                        none = "None (this leaf has no master)"
                        _checks.fail(ValueError, fn, side.path(i), none, _checks.describe(x))
                    continue
                if x is None:
                    _checks.fail(TypeError, fn, side.path(i), "a tensor", "None", _HINT)
                want = wants.get(f.dtype)
                if want is None:
                    want = _state_format.stored_dtype(compute_dtype(f.dtype), state_dtype)
                    wants[f.dtype] = want
                why = problem(kind, x, f, want)
                if why is not None:
                    _checks.fail(why[0], fn, side.path(i), why[1], why[2], _HINT)


def _all_right(
    kind: str, faces: list[Any], leaves: list[Any], state_dtype: torch.dtype | None
) -> bool:
    """A field of an encoded format (``StateFormat.all_right``) right at every leaf, read in
    bulk: ``None`` exactly where the face is, the rest as the format wants. ``False``: ask
    each leaf (``_state_fields``' loop names the first at fault)."""
    fmt = _state_format.chosen(state_dtype)
    if fmt.all_right is None or len(faces) != len(leaves):
        return False
    if [f is None for f in faces] != [x is None for x in leaves]:
        return False
    present = [i for i, f in enumerate(faces) if f is not None]
    if len(present) == len(faces):
        return fmt.all_right(kind, leaves, faces)
    return fmt.all_right(kind, [leaves[i] for i in present], [faces[i] for i in present])


class Mixed(NamedTuple):
    """One chunk of a mixed step: what ``_run_mixed`` loads, steps and stores."""

    kernel: Kernel
    strategy: Any
    masters: list[Any]
    grads: list[torch.Tensor]
    fields: dict[str, list[Any]]
    kinds: Mapping[str, str]
    state_type: Any
    model: list[torch.Tensor] | None
    lr: LR
    skip: torch.Tensor | None
    scale: torch.Tensor | None
    compute: torch.dtype
    salts: list[int]
    stats: list[Any] | None


def _upcast(g: torch.Tensor, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``g`` in ``dtype``, laid out like ``like`` (the master's values), so that a fused
    kernel pairs it by position; the copy pairs by index whatever ``g``'s layout."""
    out = torch.empty_like(like, dtype=dtype, memory_format=torch.preserve_format)
    return out.copy_(g)


_INT_OF_SIZE = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def refresh_from_params_(
    masters: Sequence[torch.Tensor], params: Sequence[torch.Tensor], skip: torch.Tensor | None
) -> None:
    """The param is the truth: each "fp32" master whose param no longer equals the master
    rounded to the param's dtype (written behind the step's back: ``p.data.fill_(7)``,
    ``p.data = t``, weight surgery, an EMA swap) takes the param's value, elementwise, on
    the device. A skipped step keeps every master's bits (the next step refreshes). The
    native and XLA kernels do the same inside their single pass."""
    for m, p in zip(masters, params):
        r = m.to(p.dtype)
        # Compared as bits, not values: a compiler that keeps ``r`` in fp32 (inductor's
        # default, which elides a downcast followed by an upcast) would see every master
        # differ from its param and overwrite it with the param's rounding. A bitcast
        # needs the rounded bits. (Not on XLA, which rounds every convert, and where
        # torch_xla 2.9 runs ``view(dtype)`` on the host.) Both NaN counts as the same, and
        # so do +0 and -0, as the native and XLA kernels compare values: a param written
        # from +0 to -0 keeps its master.
        if is_lazy(p.device):
            same = r == p
        else:
            ints = _INT_OF_SIZE[p.element_size()]
            ri, pi = r.view(ints), p.view(ints)
            magnitude = (1 << (8 * p.element_size() - 1)) - 1
            same = (ri == pi) | (((ri | pi) & magnitude) == 0)
        same = same | (r.isnan() & p.isnan())
        if skip is not None:
            same = same | skip
        m.copy_(torch.where(same, m, p.to(m.dtype)))


def _run_mixed(mx: Mixed, hyper: Any) -> None:
    """Load fp32 values (masters, grads upcast and unscaled, moments), run the kernel on
    them, store them back (strategy, state format, rounded params), in one chunk."""
    values = mx.strategy.load(mx.masters)
    if mx.strategy.unit is None and mx.model is not None:
        refresh_from_params_(values, mx.model, mx.skip)
    grads = [
        g if g.dtype == mx.compute else _upcast(g, v, mx.compute) for g, v in zip(mx.grads, values)
    ]
    if mx.scale is not None:
        # Out of place: the caller's grads are only read. Same bits as grads_to_fp32_'s
        # in-place division of its fp32 copies.
        grads = list(torch._foreach_div(grads, mx.scale))
    state = {}
    for name, kind in mx.kinds.items():
        xs = mx.fields[name]
        state[name] = xs if kind == "step" else _state_format.load(xs, mx.compute, values)
    # For stats: the values and the params before the step (a unit's own param, or the
    # model params the step writes; none when it writes no param).
    watched = [u.param for u in mx.masters] if mx.strategy.unit else mx.model
    old = [v.clone() for v in values] if mx.stats is not None else None
    before = [p.clone() for p in watched] if mx.stats is not None and watched else None
    group_state = mx.state_type(**{n: state.get(n) for n in mx.state_type._fields})
    mx.kernel(Group(values, grads, group_state, mx.lr, mx.skip), hyper)
    for name, kind in mx.kinds.items():
        if kind != "step":
            steps = mx.fields.get("step")
            _state_format.store(mx.fields[name], state[name], kind, mx.skip, steps, mx.salts)
    mx.strategy.store(mx.masters, values, mx.skip)
    if mx.model is not None:
        rounded = [v.to(p.dtype) for p, v in zip(mx.model, values)]
        if mx.skip is not None:
            rounded = [torch.where(mx.skip, p, r) for p, r in zip(mx.model, rounded)]
        torch._foreach_copy_(mx.model, rounded)
    if mx.stats is not None and old is not None:
        _diagnostics.record(mx.stats, old, values, before, watched if before else None)


def _plan_elementwise(
    fn: str,
    rule: Rule,
    hyper: Any,
    kinds_of: Mapping[str, str],
    impl: str,
    lr: LRArg,
    state_dtype: torch.dtype | None,
    step: Step,
    state: Any,
) -> list[Work]:
    # A repeated step (step.memo: its checked inputs are identical to a past call's) with a
    # state of identical structure and leaf metadata: the checks below passed and the
    # per-leaf decisions were these groups. Only index lists and kernel names are kept.
    # (``_native.loaded()``, not ``available()``: a key never builds the native module; a
    # first plan that builds it is stored under "not loaded" and planned once more.)
    memo_key: Any = None
    groups: list[tuple[tuple[object, ...], list[int]]] | None = None
    parts: list[Any] = []
    # Each field flattened once, units (8-bit moments) as leaves: what the kernels take,
    # and optree's cheap walk (it opens a NamedTuple node for ~3 us, 100,000 of them a field).
    flat = _flat_fields(fn, rule, kinds_of, step, state)
    fields = {name: leaves for name, (leaves, _) in flat.items()}
    if step.memo is not None:
        # The key: each field's spec, the type of each leaf (a unit's class: the spec
        # holds none), and the metadata of every tensor, units opened.
        parts = [_cache.leaf_keys(_tree.opened(f)) for f in fields.values()]
        if all(p is not None for p in parts):
            memo_key = (
                fn, step.state_name, rule.name, rule.state_type, tuple(rule.kernels.items()),
                tuple(kinds_of.items()), hyper, impl, state_dtype, step.skip is None,
                step.scale is None, step.stats is None, _native.loaded(),
                tuple(spec for _, spec in flat.values()),
                tuple(tuple(map(type, f)) for f in fields.values()), tuple(parts),
            )  # fmt: skip
            try:
                groups = step.memo.get(memo_key)
            except TypeError:  # an unhashable hyperparameter: plan in full
                memo_key = groups = None
    if groups is None:
        _state_fields(fn, kinds_of, step, state, state_dtype, flat)
    moments = [f for name, f in fields.items() if name != "step"]
    if step.sweep is not None:
        # The state's storage, writability and aliasing (with everything the step writes
        # and reads) are checked once for the whole call, after every plan (Sweep.run).
        sides = [
            Side(f"{step.state_name}.{n}", getattr(state, n), f, units=True)
            for n, f in fields.items()
        ]
        step.sweep.add(sides, checked=groups is None)
    masters, grads = step.masters.leaves, step.grads.leaves
    faces = step.faces if step.faces is not None else masters
    strategies = step.kinds if step.kinds is not None else [None] * len(masters)
    model = step.model.leaves if step.model is not None else None
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
    if groups is None:
        groups = _decide(fn, rule, hyper, impl, step, moments, model)
        if memo_key is not None and step.sweep is not None:
            step.sweep.keep(partial(step.memo.put, memo_key, groups, parts))
    steps = fields.get("step")
    # What a schedule reads: the step counts of the leaves that step (those in a group).
    stepping: dict[torch.device, list[Any]] | None = None
    if steps is not None and callable(lr) and not isinstance(lr, torch.Tensor):
        stepping = {}
        for key, idx in groups:
            on = typing.cast(torch.device, key[0])
            stepping.setdefault(on, []).extend([steps[i] for i in idx])
    cache: dict[Any, Any] = {}
    work: list[Work] = []
    state_type: Any = rule.state_type
    for key, idx in groups:
        device, dtype, kernel_name = key[0], key[1], key[2]
        assert isinstance(device, torch.device) and isinstance(kernel_name, str)
        assert isinstance(dtype, torch.dtype)
        lr_d = _lr_on(fn, lr, device, dtype, stepping, cache)
        skip_d = _skip_on(step.skip, device, cache)
        if kernel_name in ("native", "xla"):  # the whole step, all leaves in one call
            sliced = {name: pick(f, idx) for name, f in fields.items()}
            group = Group(
                pick(masters, idx), pick(grads, idx),
                state_type(**{n: sliced.get(n) for n in state_type._fields}), lr_d, skip_d,
                model=None if key[4] is None or model is None else pick(model, idx),
                scale=None if step.scale is None else _scale_on(step.scale, device, cache),
                salts=idx,
            )  # fmt: skip
            work.append(Work(rule.kernels[kernel_name], group, hyper))
            continue
        if len(key) == 3:  # direct: the masters are the kernel's own tensors
            runs = [idx] if kernel_name == "fused" else list(chunks(idx, masters, device))
            for run in runs:
                sliced = {name: pick(f, run) for name, f in fields.items()}
                group_state = state_type(**{n: sliced.get(n) for n in state_type._fields})
                group = Group(pick(masters, run), pick(grads, run), group_state, lr_d, skip_d)
                work.append(Work(rule.kernels[kernel_name], group, hyper))
            continue
        s = strategies[idx[0]]
        strategy = _strategy_fp32.STRATEGY if s is None else s
        scale_d = None if step.scale is None else _scale_on(step.scale, device, cache)
        for run in chunks(idx, faces, device, MIXED_CHUNK_NUMEL):
            mx = Mixed(
                kernel=rule.kernels[kernel_name], strategy=strategy,
                masters=pick(masters, run), grads=pick(grads, run),
                fields={name: pick(f, run) for name, f in fields.items()},
                kinds={n: k for n, k in kinds_of.items() if n in fields},
                state_type=state_type,
                model=None if model is None or model[run[0]] is None else pick(model, run),
                lr=lr_d, skip=skip_d, scale=scale_d, compute=dtype, salts=list(run),
                stats=None if step.stats is None else pick(step.stats, run),
            )  # fmt: skip
            work.append(Work(_run_mixed, mx, hyper))
    return work


def _decide(
    fn: str,
    rule: Rule,
    hyper: Any,
    impl: str,
    step: Step,
    moments: list[list[Any]],
    model: list[Any] | None,
) -> list[tuple[tuple[object, ...], list[int]]]:
    """Per leaf, which kernel takes it: the groups of leaf positions, each with its key
    ``(device, compute dtype, kernel name, ...)``. Reads only metadata (dtypes, devices,
    strides, shapes), never values, so a memo of identical metadata may keep the result."""
    masters, grads = step.masters.leaves, step.grads.leaves
    faces = step.faces if step.faces is not None else masters
    strategies = step.kinds if step.kinds is not None else [None] * len(masters)
    has_fused = "fused" in rule.kernels
    has_xla = "xla" in rule.kernels
    # torch's fused kernels have no functional form for torch.compile (no fake kernel for a
    # tensor lr; functionalization refuses the float-lr one): when traced, the foreach
    # chain runs instead, and inductor fuses it into loops of its own.
    traced = compiling()
    keys: list[tuple[object, ...] | None] = []
    for i, (m, g) in enumerate(zip(masters, grads)):
        if m is None or g is None:
            keys.append(None)
            continue
        f = faces[i]
        s = strategies[i]
        plain = s is None or s.unit is None
        compute = compute_dtype(f.dtype)
        stored = [mf[i] for mf in moments]
        if (
            impl in ("auto", "xla")
            and has_xla
            and not traced
            and step.stats is None
            and xla_applies(m, stored)
        ):
            # The whole step in one node: grads and model params of any float dtypes (each
            # converted on its own), so the key says only whether there are model params,
            # and one strategy and state dtype per node.
            has_model = model is not None and model[i] is not None
            name = "fp32" if s is None else s.name
            held = _state_format.of_moment(stored[0]).key if stored else None  # type: ignore[union-attr]
            keys.append((f.device, compute, "xla", None, True if has_model else None, name, held))
            continue
        if impl == "xla":
            raise ValueError(
                f"{fn}: at {step.masters.path(i)!r}: impl='xla': expected a float32 master "
                f"(or a master of strategy 'none', 'kahan', 'remainder' or 'stochastic'), "
                f"float32, bfloat16, 8-bit or 4-bit state, no stats, on an XLA device, got "
                f"{_checks.describe(f)}. Use impl='auto' or 'foreach'."
            )
        direct = (
            plain
            and g.dtype == f.dtype
            and (model is None or model[i] is None)
            and step.scale is None
            and step.stats is None
            and all(isinstance(x, torch.Tensor) and x.dtype == compute for x in stored)
        )
        if impl == "fused" and not fused_supported(f.device, compute):
            raise ValueError(
                f"{fn}: at {step.masters.path(i)!r}: impl='fused': expected a device and dtype "
                f"with a fused torch kernel ({', '.join(_FUSED_DEVICES)}; "
                f"{', '.join(str(d) for d in _FUSED_DTYPES)}), got {compute} on {f.device}. "
                "Use impl='auto' or 'foreach'."
            )
        param = None if model is None else model[i]
        if impl == "auto" and not traced and step.stats is None:
            fmt = _composed_fits(rule, s, m, g, stored, param)
            if fmt is not None and _native.serves(rule.kernels["native"], hyper):
                # One strategy, state format, grad dtype and model dtype per call.
                keys.append((
                    f.device, compute, "native", g.dtype, None if param is None else param.dtype,
                    "fp32" if s is None else s.name, fmt,
                ))  # fmt: skip
                continue
        if (
            impl == "auto"
            and plain
            and not traced  # (an extension op with no fake kernel)
            and step.stats is None  # the native kernel keeps no old values to compare
            and _native_fits(rule, m, g, stored, param)
            and _native.serves(rule.kernels["native"], hyper)
        ):
            # One grad dtype and one model dtype per call (converted in its loads/stores).
            keys.append(
                (f.device, compute, "native", g.dtype, None if param is None else param.dtype)
            )
            continue
        # A grad narrower than the step is upcast into a temporary laid out like the master
        # (_run_mixed), so only a full-precision grad's own layout counts.
        # A unit's values are loaded into temporaries: dense in the param's layout where
        # the param is dense, else dense with its strides' order (empty_like's
        # preserve_format, as every strategy's load makes them): a column of a column-major
        # buffer loads column-major, not contiguous. Taken as contiguous, it met
        # contiguous 8/4-bit temporaries and torch's fused kernel paired elements by
        # memory position: scrambled moments, no error (found in review).
        lay = f if plain or _dense(f) else torch.empty_like(f, device="meta")
        # Encoded moments load as contiguous fp32 temporaries: their format says which
        # tensor's layout stands in (8-bit: the codes').
        tensors = [
            t if isinstance(t, torch.Tensor) else _state_format.of_moment(t).layout(t, f)  # type: ignore[union-attr]
            for t in (lay, g if g.dtype == compute else None, *stored)
            if t is not None
        ]
        chosen = "foreach" if impl == "auto" else impl
        if (
            impl in ("auto", "fused")
            and has_fused
            and not traced
            and fused_supported(f.device, compute)
            and all(isinstance(x, (torch.Tensor, *_state_format.CONTAINERS)) for x in stored)
            and _same_layout(tensors)
        ):
            chosen = "fused"
        elif impl == "fused":
            chosen = "foreach"  # layouts differ: pair by index, never by memory position
        if direct:
            keys.append((f.device, compute, chosen))
        else:
            name = "fp32" if s is None else s.name
            mdtype = None if model is None or model[i] is None else model[i].dtype
            keys.append((f.device, compute, chosen, name, g.dtype, mdtype))
    return list(group_indices(keys).items())


def _scale_on(scale: torch.Tensor, device: torch.device, cache: dict[Any, Any]) -> Any:
    key = ("scale", device)
    if key not in cache:
        cache[key] = scale.to(device=device, dtype=torch.float32, non_blocking=True)
    return cache[key]


def _counts(faces: list[Any]) -> list[Any]:
    """A 0-d float32 step count on each face's device (``None`` stays ``None``), as
    torch.optim keeps it; on the CPU from one prototype (``new_zeros``: ~1 us less a leaf
    than ``torch.zeros``'s argument parsing)."""
    proto = torch.zeros((), dtype=torch.float32)
    return [
        None if f is None
        else proto.new_zeros(()) if f.is_cpu
        else torch.zeros((), dtype=torch.float32, device=f.device)
        for f in faces
    ]  # fmt: skip


def _zeros(
    kind: str, computes: list[Any], faces: list[Any], state_dtype: torch.dtype | None
) -> list[Any]:
    """One field's zero moments (``None`` where a face is ``None``)."""
    # The master's layout (channels_last, transposed): fused kernels pair by position.
    zs = _state_format.zeros_list(kind, computes, faces, state_dtype)
    # Its XLA SPMD sharding too (zeros_like alone comes out replicated): each tensor of
    # the face's shape (a moment, 8-bit codes; not the per-block scales). SPMD is asked
    # about once per field, not per leaf.
    if _sharding.active():
        for z, face in zip(zs, faces):
            if z is not None:
                for t in _tree.flatten(z)[0]:
                    _sharding.like_(t, face)
    return zs


def elementwise(
    rule: Rule, hyper: Any, impl: str, lr: LRArg, state_dtype: torch.dtype | None = None
) -> Optimizer:
    """The ``Optimizer`` for an elementwise ``rule`` with these hyperparameters."""
    _optimizer.made_by_factory(rule.name)
    kinds = rule.fields(hyper)

    @_gc.without_gc  # a few objects per leaf: no full collections over 100,000 leaves
    def init(masters: Any) -> Any:
        side, spec = _strategy.master_leaves(f"{rule.name}.init", "masters", masters)
        faces = [_strategy.face(m) for m in side.leaves]
        _state_format.chosen(state_dtype).check_init(f"{rule.name}.init", side, faces)
        state: dict[str, Any] = {}
        computes = [None if f is None else compute_dtype(f.dtype) for f in faces]
        for name in rule.state_type._fields:  # type: ignore[attr-defined]
            kind = kinds.get(name)
            if kind is None:
                state[name] = None
                continue
            if kind == "step":
                leaves = _counts(faces)
            else:
                leaves = _zeros(kind, computes, faces, state_dtype)
            state[name] = _tree.unflatten(spec, leaves)
        return rule.state_type(**state)

    def plan(step: Step, state: Any, fn: str) -> list[Work]:
        return _plan_elementwise(fn, rule, hyper, kinds, impl, lr, state_dtype, step, state)

    return Optimizer(init=init, plan=plan, functional=True, name=rule.name)


def fields_from(**kinds: str | None) -> Mapping[str, str]:
    """``fields_from(step="step", momentum_buffer=None)`` -> the used fields only."""
    return {k: v for k, v in kinds.items() if v is not None}

"""``apply_update`` and ``apply_update_``: one optimizer step on the masters.

The whole step is one sequence, readable top to bottom:

1. **check** the masters against the grads (``_check``): structure, dtypes, shapes,
   devices, layouts, ``skip``;
2. **plan** (``opt.plan``): the optimizer checks its state's structure, dtypes and
   shapes and returns its kernel calls, grouped by device, dtype and implementation
   (``_plan``);
3. **check memory** once (``Sweep.run``): the state's storage and writability, and no
   two of the step's tensors (masters, params, grads, state) sharing memory where one
   is written;
4. **run** every kernel call.

Nothing is written before step 4, so a bad input leaves every tensor as it was. On a
repeated call with identical inputs (``_cache``) steps 1 to 3 are remembered.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from mpfunc.backends import _xla_watch
from mpfunc.backends._diagnostics import UpdateStats
from mpfunc.core import _cache, _checks, _dtensor, _gc, _rng, _tensors, _tree
from mpfunc.core._checks import Like
from mpfunc.core._compile import compiling
from mpfunc.core._optimizer import Optimizer, Step, Work
from mpfunc.parallel import _sharding
from mpfunc.strategies import _strategy, _strategy_stochastic
from mpfunc.transforms import _loss_scale
from mpfunc.transforms._loss_scale import ScaleArg

__all__ = ["apply_update", "apply_update_"]

# A grad may be None: that leaf is skipped, as torch.optim skips params without .grad.
_GRADS = Like(
    "the master's",
    dtypes=_checks.FLOAT_DTYPES,
    what="a floating-point grad",
    optional=True,
    hint="Pass the grads of these masters' params",
    none_why=(
        "this leaf has no master: init_master gives none to non-floating params, and to "
        "frozen ones (requires_grad=False) under trainable_only=True"
    ),
)
_PARAMS = Like(
    "the master's",
    dtypes=_checks.FLOAT_DTYPES,
    what="a floating-point param",
    spare=True,
    hint="params= takes the model's params, the tree init_master was given",
)


def _check(
    fn: str,
    masters: Any,
    grads: Any,
    opt: object,
    skip: object,
    params: Any = None,
    scale: object = None,
    stats: Any = None,
    *,
    in_place: bool,
) -> Step:
    if not isinstance(opt, Optimizer):
        raise TypeError(
            f"{fn}: opt: expected an mpfunc Optimizer (from an optimizer factory such as "
            f"mpfunc.adamw(...), or partition/torch_optimizer), got {_checks.describe(opt)}"
        )
    skip = _checks.zero_d_bool(fn, "skip", skip, "e.g. ~mpfunc.all_finite(g32)")
    # Each tree flattened once per call (units kept whole), for the memo key and the checks.
    flat = _flatten_trees(masters, grads, params, stats)
    # A repeated step on the same trees (same structure and leaf metadata, addresses
    # included) passed these checks before: they are skipped (_cache.memo_entry).
    key, parts, entry = _recall(fn, flat)
    if entry is not None and entry.info is not None:
        divisor = None if scale is None else _loss_scale.scale_value(fn, scale)
        step = _recalled(entry, flat, masters, grads, skip, params, divisor, stats)
        return _resolved(_with_sweep(step, full=False))
    step = _with_sweep(
        _check_all(fn, masters, grads, skip, params, scale, stats, in_place, flat), full=True
    )
    assert step.sweep is not None
    entry = _cache.memo_candidate(key, parts)
    if entry is not None:
        kinds = step.kinds or [None] * len(step.masters.leaves)
        plain = all(k is None for k in kinds)
        entry.info = (plain, all(x is not None for x in step.masters.leaves), kinds)
        # Remembered once the step's memory check passed too (Sweep.run).
        step.sweep.keep(partial(_cache.memo_keep, key, entry))
        step = step._replace(memo=entry)
    return _resolved(step)


def _with_sweep(step: Step, *, full: bool) -> Step:
    """The step with its one memory check (``Sweep``): the masters (units opened there)
    and the params it writes, the grads it reads; each plan adds its state. The grads are
    the caller's, before ``_resolved`` copies a negative view."""
    written = [step.masters] if step.model is None else [step.masters, step.model]
    return step._replace(sweep=_checks.Sweep(written, [step.grads], full=full))


# Per tree of a step (masters, grads, params, stats): its leaves and spec, units (a
# strategy's master, a leaf's UpdateStats) kept whole; ``([], None)`` for an absent tree.
Flat = list[tuple[list[Any], Any]]


def _flatten_trees(masters: Any, grads: Any, params: Any, stats: Any) -> Flat:
    return [
        _tree.flatten(masters, units=True),
        _tree.flatten(grads),
        ([], None) if params is None else _tree.flatten(params),
        ([], None) if stats is None else _tree.flatten(stats, units=True),
    ]


def _resolved(step: Step) -> Step:
    """The step with each grad that is a negative view (``torch._neg_view``, ``.imag`` of a
    conjugated tensor: its memory holds the negated values) replaced by a copy holding its
    values. mpfunc's native kernel reads memory as it is, torch's fused kernels refuse such
    a grad partway through a step, and torch 2.9's ``copy_`` of an fp16 one into fp32 (the
    mixed path's upcast) drops its sign. A memo key cannot tell a negative view from the
    tensor it views, so this runs at every call: one attribute read per grad. A step with
    such a grad plans in full (a remembered plan was made for the original's layout)."""
    leaves = step.grads.leaves
    if compiling() or not any([g is not None and g.is_neg() for g in leaves]):
        return step
    grads = [g.resolve_neg() if g is not None and g.is_neg() else g for g in leaves]
    return step._replace(grads=step.grads._replace(leaves=grads), memo=None)


def _recall(fn: str, flat: Flat) -> tuple[Any, list[Any], _cache.MemoEntry | None]:
    """The memo key of a step's trees and its entry if these checks passed before; a
    ``None`` key where the trees may not be remembered. The key holds each tree's spec (units
    as leaves), the exact type of each master and stats leaf (a unit's class: the spec holds
    none) and the metadata of every tensor, units opened (``_cache.leaf_keys``: C++, no
    Python per tensor). ``parts``: the leaf keys per tree."""
    if not _cache.memo_enabled():
        return None, [], None
    parts: list[Any] = []
    for i, (leaves, _) in enumerate(flat):
        k = _cache.leaf_keys(_tree.opened(leaves) if i in (0, 3) else leaves) if leaves else ()
        if k is None:
            return None, [], None
        parts.append(k)
    types = (tuple(map(type, flat[0][0])), tuple(map(type, flat[3][0])))
    key, entry = _cache.memo_entry((fn, *(spec for _, spec in flat), types), tuple(parts))
    return key, parts, entry


def _recalled(
    entry: _cache.MemoEntry,
    flat: Flat,
    masters: Any,
    grads: Any,
    skip: torch.Tensor | None,
    params: Any,
    divisor: torch.Tensor | None,
    stats: Any,
) -> Step:
    """The ``Step`` that ``_check_all`` returned for identical inputs, rebuilt without
    checking (``entry.info``: every master a plain tensor, so the trees hold no unit; no
    master ``None``)."""
    plain, full, kinds = entry.info
    leaves, m_spec = flat[0]
    # Each master's strategy is remembered (the key holds each leaf's type); a face is the
    # master or its unit's param.
    faces = leaves if plain else [x if k is None else x.param for x, k in zip(leaves, kinds)]
    m = _checks.Side("masters", masters, leaves, units=True)
    g = _checks.Side("grads", grads, flat[1][0])
    model = None
    if params is not None:
        p = _checks.Side("params", params, flat[2][0])
        model = (
            p
            if plain and full
            else p._replace(
                leaves=[
                    q if k is None and x is not None else None
                    for x, q, k in zip(leaves, p.leaves, kinds)
                ]
            )
        )
    stat_leaves = None if stats is None else flat[3][0]
    return Step(
        m,
        m_spec,
        g,
        skip,
        faces=faces,
        kinds=kinds,
        model=model,
        scale=divisor,
        stats=stat_leaves,
        memo=entry,
    )


def _is_stat(t: object, master: Any) -> bool:
    """A 0-d float32 tensor on the master's device: what a step writes a statistic into."""
    return (
        isinstance(t, torch.Tensor)
        and t.ndim == 0
        and t.dtype == torch.float32
        and t.device == _strategy.face(master).device
    )


def _check_all(
    fn: str,
    masters: Any,
    grads: Any,
    skip: torch.Tensor | None,
    params: Any,
    scale: object,
    stats: Any,
    in_place: bool,
    flat: Flat,
) -> Step:
    m, m_spec = _strategy.master_leaves(fn, "masters", masters, flat[0])
    g, g_spec = _checks.tensor_leaves(fn, "grads", grads, flat[1])
    _checks.check_same_structure(fn, "masters", masters, m_spec, "grads", grads, g_spec)
    faces = [_strategy.face(x) for x in m.leaves]
    kinds = [_strategy.by_unit(x) for x in m.leaves]
    ref = m._replace(leaves=faces)
    _checks.check_pairs(fn, ref, g, _GRADS)
    for i, (f, x) in enumerate(zip(faces, g.leaves)):
        # A grad no wider than the step computes in: upcasting it inside is exact.
        if x is None:
            continue
        width = _tensors.compute_dtype(f.dtype).itemsize
        if x.itemsize > width:
            _checks.fail(
                TypeError,
                fn,
                g.path(i),
                f"a grad no wider than its {width * 8}-bit master",
                _checks.describe(x),
                "Cast grads to the master's dtype",
            )
    _check_some_grad(fn, m, g)
    model = None
    if params is not None:
        p, p_spec = _checks.tensor_leaves(fn, "params", params, flat[2])
        _checks.check_same_structure(fn, "masters", masters, m_spec, "params", params, p_spec)
        _checks.check_pairs(fn, ref, p, _PARAMS)
        for i, (x, q, k) in enumerate(zip(m.leaves, p.leaves, kinds)):
            if k is not None and q is not None and not _same_tensor(q, x.param):
                _checks.fail(
                    ValueError,
                    fn,
                    p.path(i),
                    f"the param this {type(x).__name__} keeps",
                    _checks.describe(q),
                    "A master strategy writes its own param: pass the "
                    "params init_master was given, or leave params=None",
                )
        # Only the params of "fp32" masters are written here; the units write their own.
        model = p._replace(
            leaves=[
                q if k is None and x is not None else None
                for x, q, k in zip(m.leaves, p.leaves, kinds)
            ]
        )
    divisor = None if scale is None else _loss_scale.scale_value(fn, scale)
    stat_leaves = None
    if stats is not None:
        stat_leaves, s_spec = flat[3]
        _checks.check_same_structure(fn, "masters", masters, m_spec, "stats", stats, s_spec)
        for i, (x, st) in enumerate(zip(m.leaves, stat_leaves)):
            if (
                (x is None) != (st is None)
                or not (st is None or isinstance(st, UpdateStats))
                or (st is not None and not all(_is_stat(t, x) for t in st))
            ):
                side = _checks.Side("stats", stats, stat_leaves, units=True)
                _checks.fail(
                    TypeError,
                    fn,
                    side.path(i),
                    "the UpdateStats of init_stats(masters) (0-d float32 tensors on the "
                    "master's device)",
                    _checks.describe(st) if not isinstance(st, UpdateStats) else
                    "UpdateStats(" + ", ".join(_checks.describe(t) for t in st) + ")",
                )  # fmt: skip
        _checks.check_storage(fn, _checks.Side("stats", stats, stat_leaves, units=True))
    sides = _checks.tensor_sides(m)
    _checks.check_writable(fn, sides if model is None else [*sides, model], in_place=in_place)
    # Aliasing among all of the step's tensors, state included, is checked once, after
    # the plan checked the state (Sweep.run).
    return Step(
        m, m_spec, g, skip, faces=faces, kinds=kinds, model=model, scale=divisor, stats=stat_leaves
    )


def _check_some_grad(fn: str, masters: _checks.Side, grads: _checks.Side) -> None:
    """At least one master has a grad. A ``None`` grad skips its leaf (a param that took no
    gradient this step), but ``None`` everywhere trains nothing and counts no step: a
    mistake, never a step."""
    have = [g is not None for m, g in zip(masters.leaves, grads.leaves) if m is not None]
    if have and not any(have):
        raise ValueError(
            f"{fn}: grads: expected a grad for at least one master, got None for every master "
            f"({len(have)}), so nothing would be trained and no step counted. Was "
            f"loss.backward() called before the step (and zero_grad(set_to_none=True) not "
            f"after it)? Were the params taken from model.state_dict()? Its tensors are "
            f"detached copies whose .grad stays None: use dict(model.named_parameters()) "
            f"for init_master and each param's .grad for the grads"
        )


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """One tensor, or two views of the same elements (``p`` and ``p.detach()``). Under
    ``torch.compile``, where storages cannot be traced, only the one tensor."""
    if a is b:
        return True
    if compiling():
        return False
    return (
        a.device == b.device
        and a.dtype == b.dtype
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.untyped_storage()._cdata == b.untyped_storage()._cdata
        and a.storage_offset() == b.storage_offset()
    )


def _run(work: list[Work]) -> None:
    with torch.no_grad():
        for w in work:
            # DTensor leaves (FSDP2): the kernels run on the local shards.
            w.kernel(_dtensor.local_group(w.group), w.hyper)


def _copy(tree: Any) -> Any:
    # Detached: the pure form never extends an autograd graph (a master that requires
    # grad would otherwise grow a chain of one node per step).
    return _tree.map_tensors(lambda t: t.detach().clone(memory_format=torch.preserve_format), tree)


@_gc.without_gc
def apply_update(
    masters: Any, grads: Any, state: Any, opt: Optimizer, skip: torch.Tensor | None = None
) -> tuple[Any, Any]:
    """One optimizer step, returning new masters and state; the inputs are not modified.

    Leaves whose grad is ``None`` keep their values (torch.optim skips them too); a grad
    that is a negative view is read by its values. The transforms are not
    differentiable: results are detached.

    Args:
      masters: the fp32 master tree.
      grads: grads of the masters' structure and dtypes (from ``grads_to_fp32``), or ``None``.
      state: the optimizer state, from ``opt.init(masters)`` or a previous step.
      opt: an ``Optimizer`` such as ``mpfunc.adamw(...)``.
      skip: ``None``, or a 0-d bool tensor; where it is true (decided on the device,
        never read by the host) masters, state and step counts come out bit-identical.
        Pass ``~mpfunc.all_finite(g32)`` so non-finite grads never reach the masters.

    Returns:
      ``(new_masters, new_state)``, fresh tensors sharing nothing with the inputs.

    Raises:
      TypeError: ``opt`` is not an Optimizer or is in-place only (``torch_optimizer``), a
        leaf is not a dense tensor or ``None``, a grad's dtype is not its master's, or
        ``skip`` is not a 0-d bool tensor.
      ValueError: the trees differ in structure, a shape or device differs, two leaves
        share memory, a tensor's storage was freed, ``state`` does not belong to these
        masters, or every grad is ``None`` (nothing would be trained: a forgotten
        ``backward``, or grads read from ``model.state_dict()``'s detached tensors).
    """
    fn = "apply_update"
    step = _check(fn, masters, grads, opt, skip, in_place=False)
    # The inputs' memory check (masters and grads: a tied master would still lose an
    # update); the state is only read, and its copies below share memory with nothing.
    assert step.sweep is not None
    step.sweep.run(fn)
    if not opt.functional:
        raise TypeError(
            f"{fn}: opt: {opt.name} updates its tensors in place and cannot be copied; "
            "use apply_update_"
        )
    # The copies are planned (checked) and written; the inputs are only read. A bad
    # state raises from the plan with the same paths, before any kernel runs.
    new_masters, new_state = _copy(masters), _copy(state)
    leaves = _tree.flatten(new_masters, units=True)[0]
    m = step.masters._replace(tree=new_masters, leaves=leaves)
    faces = [_strategy.face(x) for x in leaves]
    begun = _xla_watch.step_begins(fn, step.faces or [], step.grads.leaves)
    # Fresh copies every call: nothing to remember for their plan.
    planned = step._replace(masters=m, faces=faces, memo=None, sweep=None)
    if _sharding.active():
        with _sharding.kept(_sharding.tensors(new_masters, new_state)):
            _run_streams(planned, opt.plan(planned, new_state, fn))
    else:
        _run_streams(planned, opt.plan(planned, new_state, fn))
    _xla_watch.step_ends(begun, faces)
    return new_masters, new_state


@_gc.without_gc
def apply_update_(
    masters: Any,
    grads: Any,
    state: Any,
    opt: Optimizer,
    skip: torch.Tensor | None = None,
    *,
    params: Any = None,
    scale: ScaleArg = None,
    stats: Any = None,
) -> tuple[Any, Any]:
    """One optimizer step, in place: masters, state (and ``params``) are overwritten.

    Every check runs before the first write, so a bad input leaves everything as it
    was. This is the whole mixed-precision update in one call: low-precision grads in,
    rounded params out, with no fp32 grad tree::

      mpfunc.apply_update_(masters, grads_bf16, state, opt, params=params, scale=ls)

    Grads narrower than their masters are upcast (and divided by ``scale``) a bounded
    chunk at a time inside the step, and with ``params`` each new ``"fp32"`` master is
    rounded into its param (round to nearest even, as ``Tensor.to``); masters kept by
    another strategy write their own param. The results are bit-identical to the three
    calls ``grads_to_fp32_`` (with ``scale``), ``apply_update_``, ``masters_to_model_``.
    On CPU and CUDA, Adam/AdamW use torch's fused kernels where the layouts allow;
    elsewhere the foreach path runs in chunks, so temporaries stay bounded.

    Args:
      masters: a tree from ``init_master`` (any strategy), updated in place.
      grads: grads of the masters' structure, in the params' dtype or the masters'
        (no wider than the master), or ``None`` to skip a leaf.
      state: the optimizer state, updated in place.
      opt: an ``Optimizer``.
      skip: as in ``apply_update``; where true, params keep their bits too.
      params: ``None``, or the model's params (the tree ``init_master`` was given),
        written in place.
      scale: ``None``, a loss-scale state, a float or a 0-d tensor: the grads are
        divided by it in fp32 (as ``grads_to_fp32(..., scale=)``).
      stats: ``None``, or a tree from ``init_stats(masters)`` to fill with this step's
        ``UpdateStats`` (lost updates, update-to-weight ratio), on the device.

    Returns:
      ``(masters, state)``, the same objects, for symmetry with ``apply_update``.

    Raises:
      TypeError, ValueError: as ``apply_update``; also a grad wider than its master,
        ``params`` that are not the masters' params, a bad ``scale``, or a tensor to
        write that cannot be written in place (an inference tensor outside
        ``torch.inference_mode()``, a negative or conjugate view).
    """
    prepared_update_("apply_update_", masters, grads, state, opt, skip, params, scale, stats)()
    return masters, state


def prepared_update_(
    fn: str,
    masters: Any,
    grads: Any,
    state: Any,
    opt: Optimizer,
    skip: torch.Tensor | None = None,
    params: Any = None,
    scale: ScaleArg = None,
    stats: Any = None,
) -> Callable[[], None]:
    """``apply_update_``'s checks and plan, every one, with nothing written; returns the
    call that runs the step (once, before anything else writes to these trees' structure
    or dtypes; values may change in between). For a caller with writes of its own that
    must wait until the step is known to be accepted: ``MasterOptimizer.step`` refreshes
    masters from params written outside only then (a refused step had written them)."""
    step = _check(fn, masters, grads, opt, skip, params, scale, stats, in_place=True)
    work = opt.plan(step, state, fn)
    # The call's one memory check, over the masters, params, grads and every plan's state,
    # before the first write (none when every check was remembered).
    assert step.sweep is not None
    step.sweep.run(fn)

    def run() -> None:
        # Without a torch_xla.sync() between steps, XLA graphs grow: noticed (_xla_watch).
        begun = _xla_watch.step_begins(fn, step.faces or [], step.grads.leaves)
        # Under XLA SPMD every written tensor keeps its sharding (see _sharding.kept).
        # Outside it no context manager or generator is made: torch 2.11's dynamo broke
        # the graph on them and then failed in its own codegen (torch.compile of the step).
        if _sharding.active():
            with _sharding.kept(_sharding.tensors(masters, state, params, stats)):
                _run_streams(step, work)
        else:
            _run_streams(step, work)
        _xla_watch.step_ends(begun, step.faces or [])

    return run


# An odd int32 constant (MurmurHash3's c2) that spreads shard indices over the key space.
_SHARD_SALT = 0x1B873593


def _run_streams(step: Step, work: list[Work]) -> None:
    """``_run(work)``, with independent draws on each shard of a ``"stochastic"`` DTensor
    master (FSDP2).

    A leaf's draws hash the element's index within the tensor the kernel sees, which for a
    DTensor is the local shard: every rank drew the same bits for its element ``i``, so the
    rounding of the ranks' shards was correlated. For the step, each sharded key is offset
    by its shard's index (from the mesh coordinates of the dims that shard it; ranks
    holding the same shard draw alike), and afterwards set to what the step does to a key
    (advanced unless skipped), so the stored stream is the unsharded one's. The draws are
    independent across shards, not those of a single-process run."""
    salted = _salted_keys(step)
    if not salted:
        _run(work)
        return
    keys = [k for k, _ in salted]
    held = [k.clone() for k in keys]
    for k, salt in salted:
        k.add_(salt)
    try:
        _run(work)
    finally:
        skip = step.skip
        for k, old, new in zip(keys, held, _rng.next_keys(held)):
            k.copy_(new if skip is None else torch.where(skip.to(k.device), old, new))


def _salted_keys(step: Step) -> list[tuple[torch.Tensor, int]]:
    if compiling():
        return []  # (DTensor steps are not traced)
    cls = _dtensor.dtensor_type()
    if cls is None or _strategy_stochastic.STRATEGY not in (step.kinds or ()):
        return []
    out = []
    for x, k, g in zip(step.masters.leaves, step.kinds or (), step.grads.leaves):
        if k is not _strategy_stochastic.STRATEGY or g is None or not isinstance(x.param, cls):
            continue
        index = _dtensor.shard_index(x.param)
        if index:
            out.append((_dtensor.local(x.key), _rng.wrap(index * _SHARD_SALT)))
    return out

"""The step inside backward: each leaf steps from its param's post-accumulate-grad hook.

``loss.backward()`` completes the grads one param at a time. A hook registered with
``Tensor.register_post_accumulate_grad_hook`` runs as soon as a param's grad is complete;
there the leaf is stepped alone (``apply_update_`` on one-leaf trees: the same checks,
strategies, state formats, kernels and back ends as the whole step) and its grad freed:
``param.grad`` becomes a ``ConsumedGrad`` (no memory; reading its values raises, naming
the param, so a ``torch.nn.utils.clip_grad_norm_`` after the backward is an error and not
a clip of nothing) until the step ends, then ``None``. The full grad tree never exists:
the grads alive at any time are the ones autograd is still summing, and at most one
finished grad.

A leaf stepped alone gives the bits the whole step gives it, because every optimizer here
is elementwise: each leaf's update reads only its own master, grad, state and step count.
The one thing that depends on the leaf's place in the tree, the salt of the 8-bit second
moment's stochastic rounding, is restored by ``_salted`` (a one-leaf tree puts every leaf
at place 0). A partition (labels) or a ``torch_optimizer`` is stepped over the whole tree
with every other grad ``None`` (the same bits; its Python checks then cost one pass over
the tree per leaf).

What cannot work leaf by leaf is refused: a global-norm clip and a dynamic loss scale
need every grad before any leaf steps, and gradient accumulation needs grads that outlive
the backward. A second backward before the step's end (``end_step()``, or the
``MasterOptimizer``'s ``step()``) would step a leaf twice: it raises in the hook, before
that leaf is written again.

Reentrant activation checkpointing (``torch.utils.checkpoint(..., use_reentrant=True)``)
runs each segment's backward as a backward of its own, nested in the outer one: a param's
hook then fires once per segment that used it, each time with a partial grad, and no
hook tells the last from the others. A hook that fires inside a nested backward therefore
does not step: that leaf keeps its grad, which completes with the outer backward, and
steps at the step's end (``end_step()``, ``step()``) with the same bits as the ordinary
step, saving no grad memory (a warning says so, once). ``use_reentrant=False``, torch's
recommended form, has no nested backward and keeps the savings.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch

from mpfunc.core import _checks, _consumed_grad, _tree
from mpfunc.core._consumed_grad import ConsumedGrad
from mpfunc.core._optimizer import Optimizer, Step, Work
from mpfunc.strategies import _strategy
from mpfunc.transforms import _loss_scale
from mpfunc.transforms._apply_update import apply_update_

__all__ = ["StepInBackward", "step_in_backward"]

_FN = "step_in_backward"

# Why each whole-tree feature is refused, and what to do instead (one wording for both APIs).
WHOLE_TREE = _consumed_grad.WHOLE_TREE
_SECOND_BACKWARD = _consumed_grad.SECOND_BACKWARD


def _salted(opt: Optimizer, place: int) -> Optimizer:
    """``opt`` stepping a one-leaf tree whose leaf sits at ``place`` in the whole tree: the
    salts of the 8-bit moments' draws (each leaf's place) are moved there."""
    if place == 0:
        return opt
    inner = opt.plan

    def plan(step: Step, state: Any, fn: str) -> list[Work]:
        return [_moved(w, place) for w in inner(step, state, fn)]

    return opt._replace(plan=plan)


def _moved(work: Work, place: int) -> Work:
    salts = getattr(work.group, "salts", None)
    if not salts:
        return work
    return work._replace(group=work.group._replace(salts=[place + s for s in salts]))


def one_leaf_state(state: Any, leaves: list[list[Any] | None], j: int) -> Any:
    """An elementwise state NamedTuple over leaf ``j`` alone: each used field a one-item
    list holding leaf ``j``'s own tensor (or 8-bit unit), which the step writes in place.
    ``leaves``: each field's flat leaves (``None`` for an unused field)."""
    return type(state)(*[None if f is None else [f[j]] for f in leaves])


# Every live set of hooks: a clip over grads they freed is refused (``refuse_clip``).
_LIVE: weakref.WeakSet[Hooks] = weakref.WeakSet()


def refuse_clip(fn: str, leaves: list[Any]) -> None:
    """Raises when ``fn`` (a global-norm clip) gets grads the step inside backward used and
    freed (``ConsumedGrad``), or only ``None`` grads while its hooks have stepped leaves in
    this step (grads set to ``None`` by hand): clipping then would silently clip nothing."""
    consumed = ConsumedGrad in set(map(type, leaves))
    if consumed or (
        leaves
        and all(g is None for g in leaves)
        and any(h.handles and h.stepped for h in list(_LIVE))
    ):
        got = "ConsumedGrad leaves" if consumed else "None for every leaf"
        raise ValueError(
            f"{fn}: grads: expected grads, got {got}: the step inside backward "
            f"(step_in_backward) has already stepped and freed them. A global-norm clip "
            f"needs the norm of every grad before any leaf steps, but {WHOLE_TREE}. Clip "
            "without step_in_backward (the ordinary step), or train without the clip"
        )


_NESTED = (
    "{where}: a grad arrived inside a nested backward (reentrant activation checkpointing, "
    "torch.utils.checkpoint(..., use_reentrant=True)), where a param's grad completes only "
    "when the outer backward ends: the leaves whose grads arrive there step at {end} instead, "
    "bit for bit as inside backward, but with no grad memory saved. Use "
    "use_reentrant=False to step them inside backward"
)


class Hooks:
    """Post-accumulate-grad hooks on a list of params, calling ``fire(j, param)``.

    ``strong``: the hooks keep ``fire``'s owner alive (the functional handle: a hook the
    user let go of must keep stepping, as torch's hooks do). Otherwise they hold it
    weakly, and the hooks are removed when the owner (a ``MasterOptimizer``) is
    collected. ``stepped``: the leaves stepped since the step began.
    """

    def __init__(self, fire: Callable[[int, torch.Tensor], None], *, strong: bool) -> None:
        self._fire: Callable[[], Callable[[int, torch.Tensor], None] | None]
        self._strong = strong
        if strong:
            self._fire = lambda: fire
        else:
            self._fire = weakref.WeakMethod(fire)
        self.handles: list[Any] = []
        self.stepped: set[int] = set()
        # Leaves whose grads arrived in a nested backward: they step at the step's end.
        self.deferred: set[int] = set()
        self.warned = False
        # Set by the owner: (where, j -> leaf name, how the step ends), for messages.
        self.names: tuple[str, Callable[[int], str], str] = ("step_in_backward", str, "the end")
        self.begun = False  # the step's once-per-step work is done
        self.values: list[tuple[Any, ...]] | None = None  # the groups' values it read
        # The params whose .grad holds a ConsumedGrad until the step ends (weakly).
        self.consumed: list[weakref.ref[torch.Tensor]] = []
        # Removes the hooks when this object is collected (it holds no param, and the
        # hooks hold it weakly): never a hook left stepping for a dead optimizer, nor a
        # ConsumedGrad left for the next backward to add to.
        self._finalizer = weakref.finalize(self, _remove, self.handles, self.consumed)
        _LIVE.add(self)

    def watch(self, j: int, p: torch.Tensor) -> None:
        # Strong: the param's hook keeps these hooks (and their owner) alive; weak: they
        # live as long as their owner.
        ref = (lambda: self) if self._strong else weakref.ref(self)

        def hook(param: torch.Tensor) -> None:
            hooks = ref()
            fire = None if hooks is None else hooks._fire()
            if fire is None:
                return
            assert hooks is not None
            if j in hooks.deferred:
                return  # its grad completes when the outer backward ends
            if _consumed_grad.in_nested_backward():
                hooks.defer(j)
                return
            fire(j, param)

        self.handles.append(p.register_post_accumulate_grad_hook(hook))  # type: ignore[no-untyped-call]

    def defer(self, j: int) -> None:
        """Leaf ``j``'s grad arrived in a nested backward: it steps at the step's end."""
        where, leaf, end = self.names
        if j in self.stepped:
            why = _consumed_grad.NESTED_AFTER
            raise RuntimeError(why.format(where=where, leaf=leaf(j), end=end))
        self.deferred.add(j)
        if not self.warned:
            self.warned = True
            warnings.warn(_NESTED.format(where=where, end=end), RuntimeWarning, stacklevel=3)

    def remove(self) -> None:
        _remove(self.handles)
        self.end()

    @property
    def removed(self) -> bool:
        return not self.handles

    def consume(self, p: torch.Tensor, where: str, leaf: str, end: str) -> None:
        """Frees ``p``'s grad, its leaf stepped: ``p.grad`` becomes a ``ConsumedGrad`` (no
        memory; reading it raises, naming ``leaf``) until ``end()``."""
        p.grad = ConsumedGrad(p, where, leaf, end)
        self.consumed.append(weakref.ref(p))

    def end(self) -> None:
        self.stepped = set()
        self.deferred = set()
        self.begun = False
        self.values = None
        _release(self.consumed)


def _release(consumed: list[weakref.ref[torch.Tensor]]) -> None:
    """Sets each consumed grad back to ``None`` (a grad the user replaced is kept)."""
    for ref in consumed:
        p = ref()
        if p is not None and isinstance(p.grad, ConsumedGrad):
            p.grad = None
    consumed.clear()


def _remove(handles: list[Any], consumed: list[weakref.ref[torch.Tensor]] | None = None) -> None:
    for h in handles:
        h.remove()
    handles.clear()
    if consumed is not None:
        _release(consumed)


def check_param(fn: str, path: str, p: torch.Tensor) -> None:
    """A param whose grad a hook can see: a leaf tensor (autograd accumulates only into
    leaves). Raises naming ``path`` otherwise."""
    if not isinstance(p, torch.Tensor) or p.grad_fn is not None:
        _checks.fail(
            ValueError, fn, path, "a leaf tensor (a model's parameter)", _checks.describe(p),
            "The step inside backward hooks the params autograd accumulates grads into",
        )  # fmt: skip


def check_no_grad(fn: str, path: str, p: torch.Tensor) -> None:
    """No grad waiting in ``p.grad``: the next backward would add to it, and the hook would
    step the sum."""
    if isinstance(p.grad, ConsumedGrad):
        _checks.fail(
            ValueError, fn, path, "a param without a .grad (from optimizer.zero_grad())",
            f"the grad freed by a step inside backward that has not ended ({p.grad.leaf})",
            f"Its leaf already stepped in that step: call {p.grad.end} (or close() that "
            "optimizer, remove() that handle) first",
        )  # fmt: skip
    if p.grad is not None:
        _checks.fail(
            ValueError, fn, path, "a param without a .grad (from optimizer.zero_grad())",
            f"a grad: {_checks.describe(p.grad)}",
            "The step inside backward steps each grad as it completes; a grad left from "
            "before would be added to the next one. Call zero_grad(set_to_none=True) first",
        )  # fmt: skip


def refuse_data_parallel(fn: str, params: list[Any]) -> None:
    """Raises in a process group of more than one rank, or with XLA params in a run of
    more than one XLA process (``xmp.spawn``, whose ``xm.optimizer_step`` reduces the grads
    without a torch.distributed group): DDP, FSDP, torch_xla's and mpfunc's own reductions
    average the grads after they accumulate, and the hooks would step each leaf with this
    rank's grad alone (replicas would silently drift apart)."""
    dist = torch.distributed
    ranks = None
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        ranks = f"a process group of {dist.get_world_size()} ranks"
    elif any(getattr(p, "is_xla", False) for p in params):  # the XLA runtime is up
        import torch_xla.runtime as xr

        if xr.world_size() > 1:
            ranks = f"an XLA run of {xr.world_size()} processes"
    if ranks is not None:
        raise RuntimeError(
            f"{fn}: expected a single process, got {ranks}: data parallel training reduces "
            f"the grads across ranks after they accumulate, but {WHOLE_TREE}, so each rank "
            "would step with its own grads. Use the ordinary step for data parallel training"
        )


def refuse_dynamic_scale(fn: str, scale: object) -> None:
    if isinstance(scale, _loss_scale.DynamicLossScale):
        raise TypeError(
            f"{fn}: scale: expected None, a float, a 0-d tensor or a StaticLossScale, got a "
            f"DynamicLossScale: its overflow check (all_finite over every grad) spans the "
            f"whole tree, but {WHOLE_TREE}. Train bf16 without a loss scale, use a static "
            "scale, or use apply_update_ with the dynamic one"
        )


class StepInBackward:
    """The handle of ``step_in_backward``: its hooks step the leaves during each backward.

    ``end_step()`` closes a step (each leaf steps at most once between two calls: a second
    grad raises, as gradient accumulation and ``retain_graph`` backwards would step a leaf
    twice). ``remove()`` (or leaving a ``with`` block) takes the hooks off the params;
    until then they stay, as torch's hooks do, even if this handle is dropped.
    """

    def __init__(
        self,
        params: list[torch.Tensor | None],
        paths: list[str],
        params_tree: Any,
        masters: Any,
        state: Any,
        opt: Optimizer,
        scale: Any,
        stats: Any,
    ) -> None:
        self._params = params
        self._paths = paths
        self._params_tree = params_tree
        self._all: list[Any] = _tree.flatten(params_tree)[0]
        self._masters_tree, self._state, self._opt = masters, state, opt
        self._scale, self._stats_tree = scale, stats
        self._masters = _tree.flatten(masters, units=True)[0]
        self._spec = _tree.flatten(params_tree)[1]
        self._stats = None if stats is None else _tree.flatten(stats, units=True)[0]
        # An elementwise optimizer's state is a NamedTuple of trees: each leaf steps on its
        # own one-leaf trees. A partition's (a dict by label) or torch.optim's state steps
        # over the whole trees, every other grad None.
        self._alone = opt.functional and isinstance(state, tuple) and hasattr(state, "_fields")
        self._fields: list[list[Any] | None] = []
        if self._alone:
            self._fields = [None if f is None else _tree.flatten(f, units=True)[0] for f in state]
        self._hooks = Hooks(self._fire, strong=True)
        self._hooks.names = (_FN, paths.__getitem__, "handle.end_step()")
        for j, p in enumerate(params):
            if p is not None:
                self._hooks.watch(j, p)

    def _fire(self, j: int, p: torch.Tensor) -> None:
        if j in self._hooks.stepped:
            raise RuntimeError(_SECOND_BACKWARD.format(
                where=_FN, leaf=self._paths[j], end="handle.end_step()"
            ))  # fmt: skip
        grad = p.grad
        if self._alone:
            stats = None if self._stats is None else [self._stats[j]]
            apply_update_(
                [self._masters[j]], [grad], one_leaf_state(self._state, self._fields, j),
                _salted(self._opt, j), params=[p], scale=self._scale, stats=stats,
            )  # fmt: skip
        else:
            grads = _tree.unflatten(self._spec, [grad if k == j else None
                                                 for k in range(len(self._params))])  # fmt: skip
            apply_update_(
                self._masters_tree, grads, self._state, self._opt,
                params=self._params_tree, scale=self._scale,
                stats=self._stats_tree,
            )  # fmt: skip
        # The point: this grad's memory is free before the next one completes.
        self._hooks.consume(p, _FN, self._paths[j], "handle.end_step()")
        self._hooks.stepped.add(j)

    def end_step(self) -> None:
        """Ends a step: each leaf may step once more (at the next backward).

        Raises:
          ValueError: a param that was frozen when the hooks were made holds a grad now: it
            has no hook, so nothing would step it and the next backward would add to it.
        """
        for j in sorted(self._hooks.deferred):  # grads complete only after the backward
            p = self._params[j]
            self._hooks.deferred.discard(j)
            if p is not None and p.grad is not None:
                self._fire(j, p)
        self._hooks.end()
        for j, (x, q) in enumerate(zip(self._masters, self._all)):
            if x is not None and q is not None and self._params[j] is None and q.grad is not None:
                raise ValueError(
                    f"{_FN}: {self._paths[j]}: expected no grad (it required none when the "
                    f"hooks were made, so it has no hook), got one. Call handle.remove() and "
                    f"step_in_backward(...) again after changing requires_grad"
                )

    def remove(self) -> None:
        """Takes every hook off the params (idempotent)."""
        self._hooks.remove()

    @property
    def removed(self) -> bool:
        return self._hooks.removed

    def __enter__(self) -> StepInBackward:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def step_in_backward(
    params: Any,
    masters: Any,
    state: Any,
    opt: Optimizer,
    *,
    scale: Any = None,
    stats: Any = None,
) -> StepInBackward:
    """Steps each leaf inside ``loss.backward()``, as soon as its grad is complete, then
    frees that grad, so the full grad tree never exists::

      masters = mpfunc.init_master(params, strategy="kahan")
      state = opt.init(masters)
      with mpfunc.step_in_backward(params, masters, state, opt) as handle:
          for x, y in loader:
              loss_fn(model(x), y).backward()   # steps masters, state and params
              handle.end_step()

    Each leaf's step is ``apply_update_(masters, grads, state, opt, params=params,
    scale=scale, stats=stats)`` restricted to that leaf: the same bits as the whole step
    after the backward. A param that receives no grad does not step.

    Args:
      params: the model's params (the tree ``init_master`` was given): leaf tensors.
      masters, state, opt: as ``apply_update_`` takes them; written in place by the hooks.
      scale: ``None``, a float, a 0-d tensor or a ``StaticLossScale``: the grads are divided
        by it. A ``DynamicLossScale`` is refused (its overflow check needs every grad).
      stats: ``None`` or a tree from ``init_stats(masters)``, filled leaf by leaf.

    Returns:
      A ``StepInBackward`` handle: ``end_step()`` after each step's backward (a second
      backward before it raises: accumulation would step a leaf twice), ``remove()``.

    Raises:
      TypeError, ValueError: as ``apply_update_`` for the trees; a param that is not a
        leaf tensor, or that holds a ``.grad`` already; a ``DynamicLossScale``.
      RuntimeError (from ``backward``): a leaf's second grad before ``end_step()``.
    """
    fn = _FN
    if not isinstance(opt, Optimizer):
        raise TypeError(f"{fn}: opt: expected an mpfunc Optimizer, got {_checks.describe(opt)}")
    refuse_data_parallel(fn, _tree.flatten(params)[0])
    refuse_dynamic_scale(fn, scale)
    _loss_scale.scale_value(fn, scale)
    m, m_spec = _strategy.master_leaves(fn, "masters", masters)
    p, p_spec = _checks.tensor_leaves(fn, "params", params)
    _checks.check_same_structure(fn, "masters", masters, m_spec, "params", params, p_spec)
    if stats is not None:
        s_spec = _tree.flatten(stats, units=True)[1]
        _checks.check_same_structure(fn, "masters", masters, m_spec, "stats", stats, s_spec)
    if isinstance(state, tuple) and hasattr(state, "_fields"):
        for name, field in zip(state._fields, state):
            if field is not None:
                f_spec = _tree.flatten(field, units=True)[1]
                _checks.check_same_structure(fn, "masters", masters, m_spec,
                                             f"state.{name}", field, f_spec)  # fmt: skip
    watched: list[torch.Tensor | None] = []
    paths = _tree.leaf_paths(params, "params")
    for i, (x, q) in enumerate(zip(m.leaves, p.leaves)):
        if x is None or q is None or not q.requires_grad:
            watched.append(None)  # no master, or no grad will come: never steps
            continue
        check_param(fn, paths[i], q)
        check_no_grad(fn, paths[i], q)
        watched.append(q)
    if opt.functional:
        # Each leaf steps on its own one-leaf trees, so no step's memory check sees two
        # leaves' tensors together: aliasing across leaves (one leaf's moment in another's
        # master, one tensor under two names) is checked here, once, over the whole trees.
        # Params are written for "fp32" masters only (a unit holds its param).
        plain = [x is not None and _strategy.by_unit(x) is None for x in m.leaves]
        model = p._replace(leaves=[q if k else None for q, k in zip(p.leaves, plain)])
        s, _ = _checks.tensor_leaves(fn, "state", state)
        _checks.check_no_alias(fn, written=[*_checks.tensor_sides(m), model, s])
    return StepInBackward(watched, paths, params, masters, state, opt, scale, stats)


# --- MasterOptimizer(step_in_backward=True) --------------------------------------------------
# The optimizer's own bookkeeping (groups, live state, versions) is the ordinary step's,
# run once per step at the first hook; each hook then steps one leaf with its group's own
# optimizer, and ``step()`` only ends the step.

_OPT = "MasterOptimizer(step_in_backward=True)"


def optimizer_hooks(opt: Any) -> Hooks:
    """Hooks on every param of ``opt`` that can take a grad, held weakly by them."""
    refuse_data_parallel(_OPT, opt._params)
    hooks = Hooks(opt._step_leaf, strong=False)
    hooks.names = (_OPT, opt._names.__getitem__, "opt.step()")
    for j in range(len(opt._params)):
        watch_optimizer_param(opt, hooks, j)
    return hooks


def check_optimizer_param(where: str, p: torch.Tensor) -> bool:
    """Whether param ``p`` gets a hook, after refusing one whose grads no hook can see;
    ``add_param_group`` calls it before the group is taken in."""
    if not p.is_floating_point() or not p.requires_grad:
        # No master ever, or frozen (torch hooks only params that require grad): a grad it
        # gets after an unfreeze is stepped by step(), after the backward.
        return False
    check_param(_OPT, where, p)
    check_no_grad(_OPT, where, p)
    return True


def watch_optimizer_param(opt: Any, hooks: Hooks, j: int) -> None:
    p = opt._params[j]
    if check_optimizer_param(opt._names[j], p):
        hooks.watch(j, p)


def optimizer_leaf(opt: Any, j: int, p: torch.Tensor) -> None:
    """Steps param ``j`` of ``opt`` alone, from its hook; frees its grad."""
    hooks: Hooks = opt._in_backward
    if j in hooks.stepped:
        raise RuntimeError(_SECOND_BACKWARD.format(
            where=_OPT, leaf=opt._names[j], end="opt.step()"
        ))  # fmt: skip
    if not hooks.begun:  # once per step, what the ordinary step does before its update
        opt._optimizer()  # the groups' current values (an lr a scheduler just set)
        opt._take_up(_OPT)
        opt._round_written_masters()
        opt._resync()
        hooks.begun = True
        hooks.values = opt._group_values()
    if opt._masters[j] is None:
        opt._adopt(j, fn=_OPT)  # frozen when added, trained now: state made as at a first step
    label = opt._labels[j]
    sub = opt._built[label][1]
    state = opt._states[label]
    master = opt._masters[j]
    apply_update_(
        [master], [p.grad], one_leaf_state(state, list(state), j), _salted(sub, j),
        params=[p],
    )  # fmt: skip
    hooks.consume(p, _OPT, opt._names[j], "opt.step()")
    opt._versions[j] = p._version
    opt._master_versions[j] = master._version if isinstance(master, torch.Tensor) else -1
    hooks.stepped.add(j)


def optimizer_step(opt: Any, skip: torch.Tensor | None) -> None:
    """``step()`` of an optimizer whose leaves stepped inside backward: refuses what needed
    the whole tree, steps any grad that arrived without a backward (set by hand), and ends
    the step."""
    hooks: Hooks = opt._in_backward
    stepped = bool(hooks.stepped)
    if getattr(opt, "grad_scale", None) is not None or getattr(opt, "found_inf", None) is not None:
        hooks.end()
        opt.grad_scale = opt.found_inf = None
        raise RuntimeError(
            f"{_OPT}.step: called by torch.amp.GradScaler, whose inf check spans every grad, "
            f"but {WHOLE_TREE}: the leaves already stepped with the scaled grads. Drop the "
            "GradScaler (train bf16 without one) or build the optimizer without "
            "step_in_backward"
        )
    if skip is not None:
        hooks.end()
        raise ValueError(
            f"{_OPT}.step: skip: expected None, got {_checks.describe(skip)}: "
            f"{WHOLE_TREE}{', and they have stepped' if stepped else ''}. Decide a skip "
            "before the backward, or build the optimizer without step_in_backward"
        )
    hooks.deferred.clear()  # their grads are complete now: they step below
    late = [j for j, p in enumerate(opt._params) if p.grad is not None and j not in hooks.stepped]
    # The groups whose leaves stepped in the backward, with the values of that time.
    early = {opt._group_of[j] for j in hooks.stepped}
    for j in late:  # a grad written by hand, from a nested backward, or outside the hooks' reach
        if opt._params[j].is_floating_point():
            optimizer_leaf(opt, j, opt._params[j])
    used = hooks.values
    hooks.end()
    if used is None:
        return
    # A value set between the backward and step() (a warm-up written there, a scheduler
    # stepped before the optimizer): the ordinary step would use it. (A group added since
    # stepped its leaves above, with its own values.)
    changed = [
        (i, k, a, b)
        for i, (g_old, g_new) in enumerate(zip(used, opt._group_values()))
        if i in early
        for k, a, b in zip(opt._keys, g_old, g_new)
        if a != b
    ]
    if changed:
        i, k, old, new = changed[0]
        raise RuntimeError(
            f"{_OPT}.step: param_groups[{i}][{k!r}] changed after the backward began "
            f"({old!r} -> {new!r}), but {WHOLE_TREE}: this step used {old!r}. Set the "
            "values before the backward (scheduler.step() after opt.step(), as torch "
            "expects), or build the optimizer without step_in_backward"
        )

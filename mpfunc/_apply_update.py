"""``apply_update`` and ``apply_update_``: one optimizer step on the masters.

The whole step is one sequence, readable top to bottom:

1. **check** the masters against the grads (``_check``): structure, dtypes, shapes,
   devices, layouts, aliasing, ``skip``;
2. **plan** (``opt.plan``): the optimizer checks its state and returns its kernel
   calls, grouped by device, dtype and implementation (``_plan``);
3. **run** every kernel call.

Nothing is written before step 3, so a bad input leaves every tensor as it was.
"""

from __future__ import annotations

from typing import Any

import torch

from mpfunc import _checks, _gc, _tree
from mpfunc._checks import Like
from mpfunc._optimizer import Optimizer, Step, Work

__all__ = ["apply_update", "apply_update_"]

_MASTERS = Like("", dtypes=_checks.MASTER_DTYPES)
# A grad may be None: that leaf is skipped, as torch.optim skips params without .grad.
_GRADS = Like(
    "the master's", optional=True, hint="Cast grads with grads_to_fp32 first",
    none_why="this leaf has no master: init_master gives none to non-floating params",
)  # fmt: skip


def _check(fn: str, masters: Any, grads: Any, opt: object, skip: object) -> Step:
    if not isinstance(opt, Optimizer):
        raise TypeError(
            f"{fn}: opt: expected an mpfunc Optimizer (mpfunc.sgd/adam/adamw/lion/partition/"
            f"torch_optimizer), got {_checks.describe(opt)}"
        )
    skip = _checks.zero_d_bool(fn, "skip", skip, "e.g. ~mpfunc.all_finite(g32)")
    memo = _checks.recall(("apply_update", fn), [("masters", masters), ("grads", grads)])
    (m, g), (m_spec, g_spec) = memo.sides, memo.specs
    if not memo.hit:
        _checks.check_dense(fn, m)
        _checks.check_dense(fn, g)
        _checks.check_same_structure(fn, "masters", masters, m_spec, "grads", grads, g_spec)
        _checks.check_leaf_dtypes(fn, m, _checks.MASTER_DTYPES, "a float32 or float64 master")
        _checks.check_pairs(fn, m, g, _GRADS)
        _checks.check_writable(fn, [m])
        _checks.check_no_alias(fn, written=[m], read=[g])
        memo.passed()
    return Step(m, m_spec, g, skip)


def _run(work: list[Work]) -> None:
    with torch.no_grad():
        for w in work:
            w.kernel(w.group, w.hyper)


def _copy(tree: Any) -> Any:
    # Detached: the pure form never extends an autograd graph (a master that requires
    # grad would otherwise grow a chain of one node per step).
    return _tree.map_tensors(lambda t: t.detach().clone(memory_format=torch.preserve_format), tree)


@_gc.without_gc
def apply_update(
    masters: Any, grads: Any, state: Any, opt: Optimizer, skip: torch.Tensor | None = None
) -> tuple[Any, Any]:
    """One optimizer step, returning new masters and state; the inputs are not modified.

    Leaves whose grad is ``None`` keep their values (torch.optim skips them too). The
    transforms are not differentiable: results are detached.

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
        share memory, or ``state`` does not belong to these masters.
    """
    fn = "apply_update"
    step = _check(fn, masters, grads, opt, skip)
    if not opt.functional:
        raise TypeError(
            f"{fn}: opt: {opt.name} updates its tensors in place and cannot be copied; "
            "use apply_update_"
        )
    # The copies are planned (checked) and written; the inputs are only read. A bad
    # state raises from the plan with the same paths, before any kernel runs.
    new_masters, new_state = _copy(masters), _copy(state)
    m = step.masters._replace(tree=new_masters, leaves=_tree.flatten(new_masters)[0])
    _run(opt.plan(step._replace(masters=m), new_state, fn))
    return new_masters, new_state


@_gc.without_gc
def apply_update_(
    masters: Any, grads: Any, state: Any, opt: Optimizer, skip: torch.Tensor | None = None
) -> tuple[Any, Any]:
    """One optimizer step, in place: masters and state tensors are overwritten.

    Every check runs before the first write, so a bad input leaves everything as it
    was. On CPU and CUDA, Adam/AdamW use torch's fused kernels where the layouts allow
    and allocate nothing; elsewhere the foreach path runs in chunks, so temporaries stay
    bounded.

    Args:
      masters: the fp32 master tree, updated in place.
      grads: grads of the masters' structure and dtypes, or ``None`` to skip a leaf.
      state: the optimizer state, updated in place.
      opt: an ``Optimizer``.
      skip: as in ``apply_update``.

    Returns:
      ``(masters, state)``, the same objects, for symmetry with ``apply_update``.

    Raises:
      TypeError, ValueError: as ``apply_update``.
    """
    fn = "apply_update_"
    step = _check(fn, masters, grads, opt, skip)
    _run(opt.plan(step, state, fn))
    return masters, state

"""``apply_update`` and ``apply_update_``: one optimizer step on the masters."""

from __future__ import annotations

from typing import Any

import torch

from mpfunc import _checks, _dtypes, _tree
from mpfunc._optimizer import Optimizer, StepInput, signature

__all__ = ["apply_update", "apply_update_"]


def _check_skip(fn: str, skip: object) -> torch.Tensor | None:
    if skip is None:
        return None
    if not isinstance(skip, torch.Tensor) or skip.ndim != 0 or skip.dtype != torch.bool:
        raise TypeError(
            f"{fn}: skip: expected None or a 0-d bool tensor (e.g. ~mpfunc.all_finite(g32)), "
            f"got {_checks.describe(skip)}"
        )
    return skip


def _check(fn: str, masters: Any, g32: Any, opt: object, skip: object) -> StepInput:
    """Checks masters against grads (structure, types, dtypes, shapes, devices) and
    returns both flattened, for the optimizer to use without flattening again."""
    if not isinstance(opt, Optimizer):
        raise TypeError(
            f"{fn}: opt: expected an mpfunc Optimizer (mpfunc.sgd/adam/adamw/torch_optimizer), "
            f"got {_checks.describe(opt)}"
        )
    m_leaves, m_spec = _tree.flatten(masters)
    g_leaves, g_spec = _tree.flatten(g32)
    _checks.check_same_structure(fn, "masters", masters, m_spec, "grads", g32, g_spec)
    m_sig = [signature(m) for m in m_leaves]
    # The common case in one pass over signatures; the loop below only names the culprit.
    ok = all(
        (ms is None and g is None)
        or (
            ms is not None
            and len(ms) == 3
            and ms[1] in _dtypes.MASTER_DTYPES
            and (g is None or signature(g) == ms)
        )
        for ms, g in zip(m_sig, g_leaves)
    )
    if not ok:
        _explain(fn, masters, g32, m_leaves, g_leaves)
    return StepInput(masters, m_leaves, m_spec, g_leaves, m_sig, _check_skip(fn, skip))


def _explain(fn: str, masters: Any, g32: Any, m_leaves: list[Any], g_leaves: list[Any]) -> None:
    """Raises the error for the first leaf at fault."""
    _checks.check_tensor_or_none(fn, "masters", masters, m_leaves)
    _checks.check_tensor_or_none(fn, "grads", g32, g_leaves)
    path = _tree.leaf_path
    for i, (m, g) in enumerate(zip(m_leaves, g_leaves)):
        if m is None:
            if g is not None:
                _checks.fail(
                    ValueError, fn, path(g32, i, "grads"),
                    "None (this leaf has no master: init_master gives none to non-floating "
                    "params)", _checks.describe(g),
                )  # fmt: skip
            continue
        if m.dtype not in _dtypes.MASTER_DTYPES:
            _checks.fail(
                TypeError, fn, path(masters, i, "masters"), "a float32 or float64 master",
                _checks.describe(m),
            )  # fmt: skip
        if g is None:
            continue
        if g.dtype != m.dtype:
            _checks.fail(
                TypeError, fn, path(g32, i, "grads"), f"{m.dtype} (the master's dtype)",
                _checks.describe(g), "Cast grads with grads_to_fp32 first.",
            )  # fmt: skip
        if g.shape != m.shape:
            _checks.fail(
                ValueError, fn, path(g32, i, "grads"), f"shape {tuple(m.shape)} (the master's)",
                f"shape {tuple(g.shape)}",
            )  # fmt: skip
        if g.device != m.device:
            _checks.fail(
                ValueError, fn, path(g32, i, "grads"), f"device {m.device} (the master's)",
                f"device {g.device}",
            )  # fmt: skip


def _clone(tree: Any) -> Any:
    return _tree.map_tensors(torch.Tensor.clone, tree)


@_tree.without_gc
def apply_update(
    masters: Any, g32: Any, state: Any, opt: Optimizer, skip: torch.Tensor | None = None
) -> tuple[Any, Any]:
    """One optimizer step, returning new masters and state; the inputs are not modified.

    Leaves whose grad is ``None`` keep their values (torch.optim skips them too).

    Args:
      masters: the fp32 master tree.
      g32: grads of the masters' structure and dtypes (from ``grads_to_fp32``), or ``None``.
      state: the optimizer state, from ``opt.init(masters)`` or a previous step.
      opt: an ``Optimizer`` such as ``mpfunc.adamw(...)``.
      skip: ``None``, or a 0-d bool tensor; where it is true (decided on the device,
        never read by the host) masters, state and step counts come out bit-identical.
        Pass ``~mpfunc.all_finite(g32)`` so non-finite grads never reach the masters.

    Returns:
      ``(new_masters, new_state)``, fresh tensors sharing nothing with the inputs.

    Raises:
      TypeError: ``opt`` is not an Optimizer or is in-place only (``torch_optimizer``), a
        leaf is not a tensor or ``None``, a grad's dtype is not its master's, or ``skip``
        is not a 0-d bool tensor.
      ValueError: the trees differ in structure, a shape or device differs, or ``state``
        does not belong to these masters.
    """
    fn = "apply_update"
    step = _check(fn, masters, g32, opt, skip)
    if not opt.functional:
        raise TypeError(
            f"{fn}: opt: {opt.name} updates its tensors in place and cannot be copied; "
            "use apply_update_"
        )
    # The copies are checked, then written; the inputs are only read.
    new_masters, new_state = _clone(masters), _clone(state)
    m_leaves, _ = _tree.flatten(new_masters)
    step = step._replace(masters=new_masters, m_leaves=m_leaves)
    with torch.no_grad():
        opt.prepare(step, new_state, fn)()
    return new_masters, new_state


@_tree.without_gc
def apply_update_(
    masters: Any, g32: Any, state: Any, opt: Optimizer, skip: torch.Tensor | None = None
) -> tuple[Any, Any]:
    """One optimizer step, in place: masters and state tensors are overwritten.

    Every check runs before the first write, so a bad input leaves everything as it
    was. On CPU and CUDA, Adam/AdamW use torch's fused kernels and allocate nothing;
    elsewhere the foreach path runs in chunks, so temporaries stay bounded.

    Args:
      masters: the fp32 master tree, updated in place.
      g32: grads of the masters' structure and dtypes, or ``None`` to skip a leaf.
      state: the optimizer state, updated in place.
      opt: an ``Optimizer``.
      skip: as in ``apply_update``.

    Returns:
      ``(masters, state)``, the same objects, for symmetry with ``apply_update``.

    Raises:
      TypeError, ValueError: as ``apply_update``.
    """
    fn = "apply_update_"
    step = _check(fn, masters, g32, opt, skip)
    with torch.no_grad():
        commit = opt.prepare(step, state, fn)  # every check passes before any write
        commit()
    return masters, state

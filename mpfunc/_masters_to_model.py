"""``masters_to_model`` and ``masters_to_model_``: round masters to the model's dtypes."""

from __future__ import annotations

from typing import Any

import torch

from mpfunc import _checks, _gc, _plan, _tree
from mpfunc._checks import Like, Side

__all__ = ["masters_to_model", "masters_to_model_"]

_PARAMS = Like("the master's", dtypes=_checks.FLOAT_DTYPES,
               what="a floating-point parameter for this master", spare=True)  # fmt: skip


def _check(fn: str, masters: Any, params: Any) -> tuple[Side, Side, Any]:
    (m_leaves, m_spec), (p_leaves, p_spec) = _tree.flatten(masters), _tree.flatten(params)
    m, p = Side("masters", masters, m_leaves), Side("params", params, p_leaves)
    _check_sides(fn, m, p, [m_spec, p_spec])
    return m, p, p_spec


def _check_sides(fn: str, m: Side, p: Side, specs: list[Any]) -> None:
    _checks.check_dense(fn, m)
    _checks.check_dense(fn, p)
    _checks.check_same_structure(fn, "masters", m.tree, specs[0], "params", p.tree, specs[1])
    _checks.check_leaf_dtypes(fn, m, _checks.MASTER_DTYPES, "a float32 or float64 master")
    _checks.check_pairs(fn, m, p, _PARAMS)


@_gc.without_gc
def masters_to_model(masters: Any, params: Any) -> Any:
    """Returns new parameters: each master rounded to its parameter's dtype.

    Rounding is round-to-nearest-even, bit for bit what ``master.to(param.dtype)``
    gives. Where the master is ``None`` (non-floating leaves), the parameter is
    passed through as is. The result shares no storage with ``masters`` and is
    detached: the transforms are not differentiable.

    Args:
      masters: a tree from ``init_master``/``apply_update``.
      params: the model's parameter tree; it supplies each leaf's target dtype.

    Returns:
      A tree of ``params``' structure with fresh, detached tensors, suitable for
      ``torch.func.functional_call``.

    Raises:
      TypeError: a master is not float32/float64 or its parameter is not floating point.
      ValueError: the trees differ in structure, or a shape or device differs.
    """
    m, p, spec = _check("masters_to_model", masters, params)
    with torch.no_grad():
        out = [q if t is None else _plan.fresh_copy(t, q.dtype) for t, q in zip(m.leaves, p.leaves)]
    return _tree.unflatten(spec, out)


@_gc.without_gc
def masters_to_model_(masters: Any, params: Any) -> Any:
    """Writes each master, rounded to its parameter's dtype, into the parameter itself.

    This is how the model trains: the model's own tensors (``nn.Parameter`` too)
    receive the new values, one foreach copy per (device, dtype) group, element by
    element whatever the layouts, with no allocation. Parameters whose master is
    ``None`` are not touched.

    Args:
      masters: a tree from ``init_master``/``apply_update``.
      params: the model's parameter tree, written in place.

    Returns:
      ``params``, for chaining.

    Raises:
      TypeError: a master is not float32/float64 or its parameter is not floating point.
      ValueError: the trees differ in structure, a shape or device differs, a parameter
        is expanded, or two leaves share memory (one tensor under two names).
      Nothing is written unless every check passes.
    """
    fn = "masters_to_model_"
    memo = _checks.recall(fn, [("masters", masters), ("params", params)])
    m, p = memo.sides
    if not memo.hit:
        _check_sides(fn, m, p, memo.specs)
        written = p.where_present(m.leaves)
        _checks.check_writable(fn, [written])
        _checks.check_no_alias(fn, written=[written], read=[m])
        memo.passed()
    pairs = [(q, t) for t, q in zip(m.leaves, p.leaves) if t is not None]
    _plan.copy_grouped_([q for q, _ in pairs], [t for _, t in pairs])
    return params

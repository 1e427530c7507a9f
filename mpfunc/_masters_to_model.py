"""``masters_to_model`` and ``masters_to_model_``: round masters to the model's dtypes."""

from __future__ import annotations

from typing import Any

import torch

from mpfunc import _checks, _dtypes, _grouping, _tree

__all__ = ["masters_to_model", "masters_to_model_"]


def _check(fn: str, masters: Any, params: Any) -> tuple[list[Any], list[Any], Any]:
    m_leaves, m_spec = _tree.flatten(masters)
    p_leaves, p_spec = _tree.flatten(params)
    _checks.check_same_structure(fn, "masters", masters, m_spec, "params", params, p_spec)
    _checks.check_tensor_or_none(fn, "masters", masters, m_leaves)
    _checks.check_tensor_or_none(fn, "params", params, p_leaves)
    for i, (m, p) in enumerate(zip(m_leaves, p_leaves)):
        if m is None:
            continue
        if m.dtype not in _dtypes.MASTER_DTYPES:
            _checks.fail(
                TypeError,
                fn,
                _tree.leaf_path(masters, i, "masters"),
                "a float32 or float64 master",
                _checks.describe(m),
            )
        if p is None or not _dtypes.is_floating(p):
            _checks.fail(
                TypeError,
                fn,
                _tree.leaf_path(params, i, "params"),
                "a floating-point parameter for this master",
                _checks.describe(p),
            )
        if p.shape != m.shape:
            _checks.fail(
                ValueError,
                fn,
                _tree.leaf_path(params, i, "params"),
                f"shape {tuple(m.shape)} (the master's)",
                f"shape {tuple(p.shape)}",
            )
        if p.device != m.device:
            _checks.fail(
                ValueError,
                fn,
                _tree.leaf_path(params, i, "params"),
                f"device {m.device} (the master's)",
                f"device {p.device}",
            )
    return m_leaves, p_leaves, p_spec


@_tree.without_gc
def masters_to_model(masters: Any, params: Any) -> Any:
    """Returns new parameters: each master rounded to its parameter's dtype.

    Rounding is round-to-nearest-even, bit for bit what ``master.to(param.dtype)``
    gives. Where the master is ``None`` (non-floating leaves), the parameter is
    passed through as is. The result shares no storage with ``masters``.

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
    m_leaves, p_leaves, spec = _check("masters_to_model", masters, params)
    with torch.no_grad():
        out = [
            p if m is None else m.to(dtype=p.dtype, copy=True) for m, p in zip(m_leaves, p_leaves)
        ]
    return _tree.unflatten(spec, out)


@_tree.without_gc
def masters_to_model_(masters: Any, params: Any) -> Any:
    """Writes each master, rounded to its parameter's dtype, into the parameter itself.

    This is how the model trains: the model's own tensors (``nn.Parameter`` too)
    receive the new values, one foreach copy per (device, dtype) group, with no
    allocation. Parameters whose master is ``None`` are not touched.

    Args:
      masters: a tree from ``init_master``/``apply_update``.
      params: the model's parameter tree, written in place.

    Returns:
      ``params``, for chaining.

    Raises:
      TypeError: a master is not float32/float64 or its parameter is not floating point.
      ValueError: the trees differ in structure, or a shape or device differs.
      Nothing is written unless every check passes.
    """
    m_leaves, p_leaves, _ = _check("masters_to_model_", masters, params)
    pairs = [(p, m) for m, p in zip(m_leaves, p_leaves) if m is not None]
    _grouping.copy_grouped_([p for p, _ in pairs], [m for _, m in pairs])
    return params

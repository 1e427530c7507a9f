"""``masters_to_model`` and ``masters_to_model_``: round masters to the model's dtypes."""

from __future__ import annotations

from typing import Any

import torch

from mpfunc.backends import _plan
from mpfunc.core import _cache, _checks, _compile, _gc, _tensors, _tree
from mpfunc.core._checks import Like, Side
from mpfunc.parallel import _sharding
from mpfunc.strategies import _overwritten, _strategy

__all__ = ["masters_to_model", "masters_to_model_"]

_PARAMS = Like(
    "the master's",
    dtypes=_checks.FLOAT_DTYPES,
    what="a floating-point parameter for this master",
    spare=True,
)


def _sources(masters: list[Any], params: list[Any]) -> list[Any]:
    """Per leaf, the tensor to round into the param in place: the master, a unit's param,
    or ``None`` where a unit's param IS the param (the step wrote it: nothing to copy)."""
    return [
        None if _strategy.is_unit(x) and x.param is q else _strategy.face(x)
        for x, q in zip(masters, params)
    ]


def _check(
    fn: str, masters: Any, params: Any, in_place: bool
) -> tuple[Side, Side, Any, bool, Side]:
    """Masters (a unit stands for its param: it holds the rounded master already) and
    params, checked; returns the masters as the tensors to round from, whether no
    master is a unit, and the masters as given (units whole)."""
    m, m_spec = _strategy.master_leaves(fn, "masters", masters)
    p, p_spec = _checks.tensor_leaves(fn, "params", params)
    _checks.check_same_structure(fn, "masters", masters, m_spec, "params", params, p_spec)
    plain = not any(_strategy.is_unit(x) for x in m.leaves)
    _checks.check_pairs(fn, m._replace(leaves=[_strategy.face(x) for x in m.leaves]), p, _PARAMS)
    given = m
    if in_place:
        m = m._replace(leaves=_sources(m.leaves, p.leaves))
    else:
        m = m._replace(leaves=[_strategy.face(x) for x in m.leaves])
    return m, p, p_spec, plain, given


def _recall(
    fn: str, masters: Any, params: Any
) -> tuple[Any, list[tuple[list[Any], Any, Any]], _cache.MemoEntry | None]:
    """The memo key of both trees (units opened) and its entry if these checks passed."""
    if not _cache.memo_enabled():
        return None, [], None
    flat = []
    for tree in (masters, params):
        leaves, spec = _tree.flatten(tree)
        k = _cache.leaf_keys(leaves)
        if k is None:
            return None, [], None
        flat.append((leaves, spec, k))
    key, entry = _cache.memo_entry((fn, flat[0][1], flat[1][1]), (flat[0][2], flat[1][2]))
    return key, flat, entry


def _recalled(
    plain: bool, flat: list[tuple[list[Any], Any, Any]], masters: Any, params: Any
) -> tuple[Side, Side, Side]:
    """What ``_check(..., in_place=True)`` returned for identical inputs, without checking
    (``plain``: no master is a unit, so the flat leaves are the masters' leaves), and the
    masters as given (units whole)."""
    p = Side("params", params, flat[1][0])
    if plain:
        m = Side("masters", masters, flat[0][0], units=True)
        return m, p, m
    given = Side("masters", masters, _tree.flatten(masters, units=True)[0], units=True)
    return given._replace(leaves=_sources(given.leaves, p.leaves)), p, given


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
    m, p, spec, _, _ = _check("masters_to_model", masters, params, in_place=False)
    with torch.no_grad():
        # Each new param has its param's XLA SPMD sharding, not its master's (ZeRO-1).
        out = [
            q if t is None else _sharding.like_(_tensors.fresh_copy(t, q.dtype), q)
            for t, q in zip(m.leaves, p.leaves)
        ]
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
    # A repeated call on the same trees (structure, each leaf's metadata and address, units
    # opened) passed these checks before: they are skipped (see _cache.memo_entry).
    key, flat, entry = _recall(fn, masters, params)
    if entry is not None and entry.info is not None:
        plain = entry.info
        m, p, given = _recalled(plain, flat, masters, params)
    else:
        m, p, _, plain, given = _check(fn, masters, params, in_place=True)
        written = p.where_present(m.leaves)
        _checks.check_writable(fn, [written])
        _checks.check_no_alias(fn, written=[written], read=[m])
        entry = _cache.memo_passed(key, [k for _, _, k in flat])
        if entry is not None:
            entry.info = plain
    # A unit whose param shows another master: its value is gone. (Not under torch.compile,
    # whose dynamo does not trace into torch's weak dictionaries; an eager call checks.)
    watch = not plain and not _compile.compiling()
    if watch:
        _overwritten.check_not_stale(fn, given, p)
    pairs = [(q, t) for t, q in zip(m.leaves, p.leaves) if t is not None]
    _plan.copy_grouped_([q for q, _ in pairs], [t for _, t in pairs])
    if watch:
        _overwritten.overwrote(given.leaves, p.leaves)
    return params

"""How mpfunc reads trees. Every other module flattens through here.

The rules, fixed in one place:

* A tree is anything optree flattens: dicts (keys
  sorted), lists, tuples, NamedTuples, and nested mixes of those.
* ``None`` is a leaf (``none_is_leaf=True``). It marks "no tensor here" and keeps
  its slot, so a grad tree with ``None`` for an unused parameter still lines up
  leaf for leaf with the parameter tree.
* Every other leaf must be a ``torch.Tensor``.
* mpfunc's own state classes (loss scales) are nodes, registered in optree's
  ``"mpfunc"`` namespace; flatten with ``namespace="mpfunc"`` to see into them.
* A leaf's path is its keys joined with dots, ``"layers.0.weight"``, the form
  that ``model.named_parameters()`` uses. Paths are built only for error
  messages, so the hot path never pays for them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import optree
import torch
from optree import PyTreeSpec

__all__ = [
    "NAMESPACE",
    "flatten",
    "format_path",
    "leaf_path",
    "leaf_paths",
    "map_tensors",
    "register_dataclass",
    "register_unit",
    "unflatten",
]

_NONE_IS_LEAF = True
# mpfunc's own node types (loss-scale states) are registered in this namespace;
# every flatten in mpfunc looks there too, so they are nodes, not opaque leaves.
NAMESPACE = "mpfunc"


def map_tensors(fn: Any, tree: Any) -> Any:
    """Applies ``fn`` to every tensor leaf; other leaves (``None``) are kept."""
    return optree.tree_map(
        lambda t: fn(t) if isinstance(t, torch.Tensor) else t,
        tree,
        none_is_leaf=_NONE_IS_LEAF,
        namespace=NAMESPACE,
    )


# NamedTuples that stand for ONE leaf of a master or state tree although they hold several
# tensors: a master kept as its param plus a remainder, a quantized moment (codes and
# scales). Trees of them are ordinary pytrees (their tensors are leaves: checkpoints and
# shardings see every tensor); mpfunc's transforms flatten with ``units=True`` so that each
# pairs with one param and one grad.
_UNITS: tuple[type, ...] = ()


def register_unit(cls: type, /) -> type:
    """Marks the NamedTuple class ``cls`` as one leaf for ``flatten(..., units=True)``."""
    global _UNITS
    _UNITS = (*_UNITS, cls)
    return cls


def _is_unit(x: Any) -> bool:
    return isinstance(x, _UNITS)


def flatten(tree: Any, *, units: bool = False) -> tuple[list[Any], PyTreeSpec]:
    """Flattens ``tree`` into its leaves (``None`` included) and its spec. With ``units``,
    each registered unit (``register_unit``) is one leaf instead of its tensors."""
    if units and _UNITS:
        return optree.tree_flatten(
            tree, is_leaf=_is_unit, none_is_leaf=_NONE_IS_LEAF, namespace=NAMESPACE
        )
    return optree.tree_flatten(tree, none_is_leaf=_NONE_IS_LEAF, namespace=NAMESPACE)


def unflatten(spec: PyTreeSpec, leaves: Sequence[Any]) -> Any:
    """Rebuilds a tree of ``spec``'s shape from ``leaves``."""
    return optree.tree_unflatten(spec, leaves)


def _format_key(key: Any) -> str:
    return str(key)


def _entry_name(entry: Any) -> Any:
    # NamedTuple fields by name ("exp_avg"), not by position; dict keys and list
    # indices as they are.
    if isinstance(entry, optree.NamedTupleEntry):
        return entry.field
    return entry.entry


def _paths(tree: Any, units: bool = False) -> list[tuple[Any, ...]]:
    is_leaf = _is_unit if units and _UNITS else None
    accessors = optree.tree_accessors(
        tree, is_leaf=is_leaf, none_is_leaf=_NONE_IS_LEAF, namespace=NAMESPACE
    )
    return [tuple(_entry_name(e) for e in acc) for acc in accessors]


def format_path(path: Sequence[Any]) -> str:
    """``("layers", 0, "weight")`` -> ``"layers.0.weight"``; the root is ``"<root>"``."""
    return ".".join(_format_key(k) for k in path) if path else "<root>"


def leaf_paths(tree: Any, prefix: str = "", *, units: bool = False) -> list[str]:
    """The dotted path of every leaf of ``tree``, in flatten order, in one walk."""
    out = []
    for p in _paths(tree, units):
        path = format_path(p)
        if prefix:
            path = prefix if path == "<root>" else f"{prefix}.{path}"
        out.append(path)
    return out


def leaf_path(tree: Any, index: int, prefix: str = "", *, units: bool = False) -> str:
    """The dotted path of the ``index``-th leaf of ``tree``, for error messages (it walks the
    whole tree: call it once, never per leaf)."""
    return leaf_paths(tree, prefix, units=units)[index]


def register_dataclass(cls: type, /, *, children: Sequence[str]) -> None:
    """Makes the frozen dataclass ``cls`` a node of mpfunc's trees (in ``NAMESPACE``).

    The fields named in ``children`` (its tensors) are the node's children, in that
    order; every other field rides in the spec as metadata, so each field survives
    flatten/unflatten. Unflatten builds the object as ``pickle`` and ``copy`` do
    (``__new__``, then ``__dict__``), never through ``__init__``: the children may be
    whatever a tree map returned.
    """
    names = tuple(children)
    fields = [f.name for f in dataclasses.fields(cls)]
    if not set(names) <= set(fields):
        raise TypeError(f"register_dataclass: {names} are not all fields of {cls.__name__}")
    meta = tuple(n for n in fields if n not in names)

    def flatten(obj: Any) -> tuple[tuple[Any, ...], tuple[Any, ...], tuple[str, ...]]:
        return tuple(getattr(obj, n) for n in names), tuple(getattr(obj, n) for n in meta), names

    def unflatten(metadata: Any, values: Any) -> Any:
        obj: Any = object.__new__(cls)
        obj.__dict__.update(zip(meta, metadata))
        obj.__dict__.update(zip(names, values))
        return obj

    optree.register_pytree_node(cls, flatten, unflatten, namespace=NAMESPACE)

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
* Under ``torch.compile`` the same walk runs in Python, one level at a time
  through optree's own registry (``tree_flatten_one_level``): dynamo cannot trace
  optree's C++ flatten, but traces this, with the same leaf order and structure.
* A tree nests at most ``optree.MAX_RECURSION_DEPTH`` levels (1000), counting the
  containers mpfunc puts around it (a state's NamedTuple, a partition's dict); a deeper
  one is a ``ValueError`` naming the limit, never a bare ``RecursionError``.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any, NamedTuple

import optree
import torch

from mpfunc.core._compile import compiling

__all__ = [
    "NAMESPACE",
    "flatten",
    "format_path",
    "leaf_path",
    "leaf_paths",
    "map_tensors",
    "opened",
    "register_dataclass",
    "register_unit",
    "same_structure",
    "unflatten",
]

_NONE_IS_LEAF = True
# mpfunc's own node types (loss-scale states) are registered in this namespace;
# every flatten in mpfunc looks there too, so they are nodes, not opaque leaves.
NAMESPACE = "mpfunc"


def _too_deep() -> ValueError:
    """The error for a tree deeper than optree walks (its C++ walk raises RecursionError)."""
    limit = getattr(optree, "MAX_RECURSION_DEPTH", None)
    most = f"at most {limit} levels deep" if limit else "no deeper than optree walks"
    return ValueError(
        f"mpfunc: expected a tree nested {most} (optree's limit; mpfunc's own containers, "
        "such as an optimizer state's NamedTuple or a partition, add a level or two to "
        "yours), got a deeper one. Flatten it: a dict keyed by dotted paths "
        "({'layers.0.weight': t, ...}) holds the same tensors one level deep"
    )


def map_tensors(fn: Any, tree: Any, *, kept: tuple[type, ...] = ()) -> Any:
    """Applies ``fn`` to every tensor leaf; other leaves (``None``) are kept, and so are
    nodes of the types ``kept``, whole."""
    is_leaf = (lambda x: isinstance(x, kept)) if kept else None

    def one(t: Any) -> Any:
        return fn(t) if isinstance(t, torch.Tensor) else t

    if compiling():
        leaves: list[Any] = []
        spec = _walk(tree, is_leaf, leaves)
        return unflatten(spec, [one(t) for t in leaves])
    try:
        return optree.tree_map(
            one, tree, is_leaf=is_leaf, none_is_leaf=_NONE_IS_LEAF, namespace=NAMESPACE
        )
    except RecursionError as e:
        raise _too_deep() from e


# NamedTuples that stand for ONE leaf of a master or state tree although they hold several
# tensors: a master kept as its param plus a remainder, a quantized moment (codes and
# scales). Trees of them are ordinary pytrees (their tensors are leaves: checkpoints and
# shardings see every tensor); mpfunc's transforms flatten with ``units=True`` so that each
# pairs with one param and one grad.
_UNITS: tuple[type, ...] = ()


def register_unit(cls: type, /) -> type:
    """Marks the NamedTuple class ``cls`` as one leaf for ``flatten(..., units=True)``."""
    global _UNITS, _PLAIN_UNITS
    _UNITS = (*_UNITS, cls)
    _PLAIN_UNITS = _PLAIN | frozenset(_UNITS)
    return cls


# Leaf types that are never units nor nodes (``flatten``'s fast case).
_PLAIN = frozenset((torch.Tensor, torch.nn.Parameter, type(None)))
# ... and with each registered unit class, for ``flatten(..., units=True)``.
_PLAIN_UNITS = _PLAIN


def _is_unit(x: Any) -> bool:
    return isinstance(x, _UNITS)


# The spec of a list or tuple of ``n`` leaves, per (type, n): it does not depend on what the
# leaves are (a tensor, ``None`` or a unit taken whole), so a flat sequence (a model's
# ``list(model.parameters())``, its grads, masters, moments and step counts) needs no walk.
_SEQ_SPECS: dict[tuple[type, int], Any] = {}
_SEQ_SPECS_MAX = 1024


def flatten(tree: Any, *, units: bool = False) -> tuple[list[Any], Any]:
    """Flattens ``tree`` into its leaves (``None`` included) and its spec. With ``units``,
    each registered unit (``register_unit``) is one leaf instead of its tensors.

    The spec is optree's ``PyTreeSpec``; under ``torch.compile``, a ``TracedSpec`` of the
    same structure (compare specs with ``same_structure``, rebuild with ``unflatten``)."""
    is_leaf = _is_unit if units and _UNITS else None
    if compiling():
        leaves: list[Any] = []
        return leaves, _walk(tree, is_leaf, leaves)
    kind = type(tree)
    # A flat list or tuple of plain leaves (units too, with ``units``): its leaves are its
    # items, its spec one per (type, length). Exact types read in C: a subclass, a unit
    # without ``units`` or any container takes optree's walk below. (optree's walk costs
    # ~180 ns a leaf even without ``is_leaf``; this check ~20.)
    if (kind is list or kind is tuple) and (
        _PLAIN_UNITS if is_leaf is not None else _PLAIN
    ).issuperset(map(type, tree)):
        spec = _SEQ_SPECS.get((kind, len(tree)))
        if spec is not None:
            return list(tree), spec
        leaves, spec = optree.tree_flatten(
            tree, is_leaf=is_leaf, none_is_leaf=_NONE_IS_LEAF, namespace=NAMESPACE
        )
        if len(_SEQ_SPECS) >= _SEQ_SPECS_MAX:
            _SEQ_SPECS.clear()
        _SEQ_SPECS[(kind, len(tree))] = spec
        return leaves, spec
    if is_leaf is not None and type(tree) is dict and _PLAIN.issuperset(map(type, tree.values())):
        # A flat dict of tensors (``dict(model.named_parameters())``, its grads, moments of
        # a float format) holds no unit: the same leaves and spec without asking ``is_leaf``
        # of every node (a Python call per leaf). Types read in C, exact (a subclass may be
        # a node). (Units as values: optree's walk with ``is_leaf`` is the fastest measured;
        # flattening a dict of their positions instead took 2-3x as long.)
        is_leaf = None
    try:
        return optree.tree_flatten(
            tree, is_leaf=is_leaf, none_is_leaf=_NONE_IS_LEAF, namespace=NAMESPACE
        )
    except RecursionError as e:
        raise _too_deep() from e


def opened(leaves: list[Any]) -> list[Any]:
    """Leaves from ``flatten(..., units=True)`` with each unit opened into its fields, in
    order (the list itself when it holds no unit)."""
    if not compiling():  # (under dynamo, the plain form below)
        kinds = set(map(type, leaves))  # (types read in C: a few, however many leaves)
        tuples = [issubclass(k, tuple) for k in kinds]
        if not any(tuples):
            return leaves
        if all(tuples):  # units only (the common case): their fields, joined in C
            return list(itertools.chain.from_iterable(leaves))
    return [t for x in leaves for t in (x if isinstance(x, tuple) else (x,))]


def unflatten(spec: Any, leaves: Sequence[Any]) -> Any:
    """Rebuilds a tree of ``spec``'s shape from ``leaves``."""
    if isinstance(spec, TracedSpec):
        return spec.unflatten(list(leaves))
    return optree.tree_unflatten(spec, leaves)


def same_structure(a: Any, b: Any) -> bool:
    """Whether two specs from ``flatten`` describe one structure."""
    if isinstance(a, TracedSpec) and isinstance(b, TracedSpec):
        return a.same(b)
    return bool(a == b)


class TracedSpec(NamedTuple):
    """A tree's structure as ``flatten`` sees it under ``torch.compile``: what optree's
    ``PyTreeSpec`` holds, in plain Python objects that dynamo folds into constants.

    ``type`` is ``None`` for a leaf. ``keys`` are the children's keys (dict keys in
    optree's sorted order, NamedTuple field names, list indices). ``type``,
    ``entries()``, ``children()`` and ``num_leaves`` read as a ``PyTreeSpec``'s.
    """

    type: Any
    metadata: Any
    keys: tuple[Any, ...]
    kids: tuple[TracedSpec, ...]
    unflatten_func: Any
    num_leaves: int

    def entries(self) -> list[Any]:
        return list(self.keys)

    def __str__(self) -> str:
        # As PyTreeSpec prints: the tree with a * for each leaf.
        return f"PyTreeSpec({self.unflatten([_STAR] * self.num_leaves)!r}, NoneIsLeaf)"

    def children(self) -> list[TracedSpec]:
        return list(self.kids)

    def same(self, other: TracedSpec) -> bool:
        # As PyTreeSpec's ==: node types, keys (dict metadata is its keys) and the
        # metadata of other nodes (a NamedTuple's class, a dataclass's static fields).
        if self.type is not other.type or self.keys != other.keys:
            return False
        # A dict's metadata is its keys, compared above (not their insertion order).
        other_meta = self.type is not None and not isinstance(self.metadata, list)
        if other_meta and self.metadata != other.metadata:
            return False
        if len(self.kids) != len(other.kids):
            return False
        return all(a.same(b) for a, b in zip(self.kids, other.kids))

    def unflatten(self, leaves: list[Any]) -> Any:
        if self.type is None:
            return leaves[0]
        subtrees, start = [], 0
        for child in self.kids:
            subtrees.append(child.unflatten(leaves[start : start + child.num_leaves]))
            start += child.num_leaves
        return self.unflatten_func(self.metadata, subtrees)


_LEAF = TracedSpec(None, None, (), (), None, 1)


class _Star:
    def __repr__(self) -> str:
        return "*"


_STAR = _Star()


def _walk(node: Any, is_leaf: Any, leaves: list[Any]) -> TracedSpec:
    """The Python flatten: depth first, as optree's C++ walk, through optree's registry."""
    if node is None or isinstance(node, torch.Tensor) or (is_leaf is not None and is_leaf(node)):
        leaves.append(node)
        return _LEAF
    if optree.register_pytree_node.get(type(node), namespace=NAMESPACE) is None:
        leaves.append(node)  # not a node: an opaque leaf, as optree keeps it
        return _LEAF
    one = optree.tree_flatten_one_level(
        node, is_leaf=is_leaf, none_is_leaf=_NONE_IS_LEAF, namespace=NAMESPACE
    )
    entries = tuple(one.entries)
    if optree.is_namedtuple_instance(node):
        entries = tuple(optree.namedtuple_fields(node))  # fields by name, as in paths
    children = tuple(_walk(c, is_leaf, leaves) for c in one.children)
    count = sum(c.num_leaves for c in children)
    return TracedSpec(type(node), one.metadata, entries, children, one.unflatten_func, count)


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
    if compiling():
        out: list[tuple[Any, ...]] = []
        _spec_paths(_walk(tree, is_leaf, []), (), out)
        return out
    try:
        accessors = optree.tree_accessors(
            tree, is_leaf=is_leaf, none_is_leaf=_NONE_IS_LEAF, namespace=NAMESPACE
        )
    except RecursionError as e:
        raise _too_deep() from e
    return [tuple(_entry_name(e) for e in acc) for acc in accessors]


def _spec_paths(spec: TracedSpec, prefix: tuple[Any, ...], out: list[tuple[Any, ...]]) -> None:
    if spec.type is None:
        out.append(prefix)
        return
    for key, child in zip(spec.keys, spec.kids):
        _spec_paths(child, (*prefix, key), out)


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


# Children of registered dataclasses that must hold a finite value > 0 (a loss scale's
# ``loss_scale``), by class: checkpoints refuse a saved value that is not (``positives``).
_POSITIVE: dict[type, tuple[str, ...]] = {}


def register_dataclass(
    cls: type, /, *, children: Sequence[str], positive: Sequence[str] = ()
) -> None:
    """Makes the frozen dataclass ``cls`` a node of mpfunc's trees (in ``NAMESPACE``).

    The fields named in ``children`` (its tensors) are the node's children, in that
    order; every other field rides in the spec as metadata, so each field survives
    flatten/unflatten. Unflatten builds the object as ``pickle`` and ``copy`` do
    (``__new__``, then ``__dict__``), never through ``__init__``: the children may be
    whatever a tree map returned. ``positive``: children whose value must be finite and
    > 0 (``positives``).
    """
    names = tuple(children)
    fields = [f.name for f in dataclasses.fields(cls)]
    if not set(names) <= set(fields):
        raise TypeError(f"register_dataclass: {names} are not all fields of {cls.__name__}")
    if not set(positive) <= set(names):
        raise TypeError(f"register_dataclass: positive {tuple(positive)} are not all in {names}")
    if positive:
        _POSITIVE[cls] = tuple(positive)
    meta = tuple(n for n in fields if n not in names)

    def flatten(obj: Any) -> tuple[tuple[Any, ...], tuple[Any, ...], tuple[str, ...]]:
        return tuple(getattr(obj, n) for n in names), tuple(getattr(obj, n) for n in meta), names

    def unflatten(metadata: Any, values: Any) -> Any:
        obj: Any = object.__new__(cls)
        obj.__dict__.update(zip(meta, metadata))
        obj.__dict__.update(zip(names, values))
        return obj

    optree.register_pytree_node(cls, flatten, unflatten, namespace=NAMESPACE)


def positives(tree: Any) -> list[Any]:
    """The tensors of ``tree`` that a registered dataclass declares must be finite and > 0
    (``register_dataclass(positive=)``), for the checkpoint's checks of loaded values."""
    if not _POSITIVE:
        return []
    kinds = tuple(_POSITIVE)
    nodes = optree.tree_leaves(
        tree, is_leaf=lambda x: isinstance(x, kinds), none_is_leaf=True, namespace=NAMESPACE
    )
    return [getattr(x, n) for x in nodes if isinstance(x, kinds) for n in _POSITIVE[type(x)]]

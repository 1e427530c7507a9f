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

import contextlib
import functools
import gc
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NoReturn, TypeVar, cast

import optree
import torch
from optree import PyTreeSpec

__all__ = [
    "check_same_structure",
    "check_tensor_or_none",
    "describe",
    "fail",
    "first_difference",
    "flatten",
    "gc_paused",
    "leaf_path",
    "leaf_paths",
    "map_tensors",
    "unflatten",
    "without_gc",
]

_NONE_IS_LEAF = True
# mpfunc's own node types (loss-scale states) are registered in this namespace;
# every flatten in mpfunc looks there too, so they are nodes, not opaque leaves.
NAMESPACE = "mpfunc"


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pauses Python's cyclic garbage collector for one transform call.

    A step over N leaves allocates a few small objects per leaf (shapes, tuples). With
    thousands of leaves that crosses the collector's thresholds and triggers full
    collections over every live object of the program: measured at 10,000 tensors,
    they doubled ``apply_update_``'s time. Nothing a transform allocates forms a
    cycle, so pausing is safe; the collector resumes as it was on exit.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


_F = TypeVar("_F", bound=Callable[..., Any])


def without_gc(fn: _F) -> _F:
    """Runs every call of ``fn`` under ``gc_paused()``: for the per-step transforms."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with gc_paused():
            return fn(*args, **kwargs)

    return cast(_F, wrapper)


def map_tensors(fn: Any, tree: Any) -> Any:
    """Applies ``fn`` to every tensor leaf; other leaves (``None``) are kept."""
    return optree.tree_map(
        lambda t: fn(t) if isinstance(t, torch.Tensor) else t,
        tree,
        none_is_leaf=_NONE_IS_LEAF,
        namespace=NAMESPACE,
    )


def flatten(tree: Any) -> tuple[list[Any], PyTreeSpec]:
    """Flattens ``tree`` into its leaves (``None`` included) and its spec."""
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


def _paths(tree: Any) -> list[tuple[Any, ...]]:
    accessors = optree.tree_accessors(tree, none_is_leaf=_NONE_IS_LEAF, namespace=NAMESPACE)
    return [tuple(_entry_name(e) for e in acc) for acc in accessors]


def format_path(path: Sequence[Any]) -> str:
    """``("layers", 0, "weight")`` -> ``"layers.0.weight"``; the root is ``"<root>"``."""
    return ".".join(_format_key(k) for k in path) if path else "<root>"


def leaf_paths(tree: Any, prefix: str = "") -> list[str]:
    """The dotted path of every leaf of ``tree``, in flatten order, in one walk."""
    out = []
    for p in _paths(tree):
        path = format_path(p)
        if prefix:
            path = prefix if path == "<root>" else f"{prefix}.{path}"
        out.append(path)
    return out


def leaf_path(tree: Any, index: int, prefix: str = "") -> str:
    """The dotted path of the ``index``-th leaf of ``tree``, for error messages (it walks the
    whole tree: for many leaves, take ``leaf_paths`` once)."""
    return leaf_paths(tree, prefix)[index]


def describe(x: Any) -> str:
    """A short description of what arrived, for error messages."""
    if isinstance(x, torch.Tensor):
        return f"{x.dtype} tensor of shape {tuple(x.shape)} on {x.device}"
    if x is None:
        return "None"
    if isinstance(x, type):
        return f"the class {x.__module__}.{x.__qualname__}"
    if isinstance(x, (bool, int, float, str)):
        return f"{type(x).__name__} {x!r:.60}"
    return type(x).__name__


def fail(
    cls: type[Exception], fn: str, path: str, expected: str, got: str, hint: str = ""
) -> NoReturn:
    """Raises ``cls`` with mpfunc's message form: where, what was expected, what arrived."""
    msg = f"{fn}: at {path!r}: expected {expected}, got {got}"
    if hint:
        msg += f". {hint}"
    raise cls(msg)


def check_tensor_or_none(fn: str, name: str, tree: Any, leaves: Sequence[Any]) -> None:
    """Raises ``TypeError`` naming the first leaf that is neither a tensor nor ``None``."""
    for i, leaf in enumerate(leaves):
        if leaf is not None and not isinstance(leaf, torch.Tensor):
            fail(TypeError, fn, leaf_path(tree, i, name), "a tensor or None leaf", describe(leaf))


def first_difference(a: Any, b: Any, name_a: str, name_b: str) -> str:
    """Explains where two trees first differ, by path."""
    pa = [format_path(p) for p in _paths(a)]
    pb = [format_path(p) for p in _paths(b)]
    set_b = set(pb)
    set_a = set(pa)
    for p in pa:
        if p not in set_b:
            return f"{p!r} is in {name_a} but not in {name_b}"
    for p in pb:
        if p not in set_a:
            return f"{p!r} is in {name_b} but not in {name_a}"
    return "the leaf paths match but the container types differ"


def _short(spec: PyTreeSpec, limit: int = 200) -> str:
    text = str(spec)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_same_structure(
    fn: str, name_a: str, a: Any, spec_a: PyTreeSpec, name_b: str, b: Any, spec_b: PyTreeSpec
) -> None:
    """Raises ``ValueError`` if two trees differ in structure, naming the first differing path."""
    if spec_a == spec_b:
        return
    where = first_difference(a, b, name_a, name_b)
    raise ValueError(
        f"{fn}: {name_a} and {name_b} must have the same tree structure: {where}; "
        f"expected {_short(spec_a)}, got {_short(spec_b)}"
    )

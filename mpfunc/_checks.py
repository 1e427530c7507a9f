"""Every check mpfunc makes, written once, and the one wording of its errors.

An error names the function, the pytree path, what was expected and what
arrived::

    apply_update_: at 'grads.layers.0.weight': expected torch.float32 (the master's
    dtype), got torch.bfloat16 tensor of shape (4, 4) on cpu

The rules for hyperparameters (``real``, ``integer``, ``choice``, ``zero_d_bool``)
and for tensor leaves live here; ``_tree`` only says how trees are read.
Every public function runs its checks before its first write, so a bad input
leaves every tensor as it was.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NoReturn

import torch
from optree import PyTreeSpec

from mpfunc import _tree

__all__ = [
    "check_same_structure",
    "check_tensor_or_none",
    "choice",
    "describe",
    "fail",
    "integer",
    "real",
    "zero_d_bool",
]


# --- wording ------------------------------------------------------------------------------


def describe(x: Any) -> str:
    """A short description of what arrived, for error messages."""
    if isinstance(x, torch.Tensor):
        layout = "" if x.layout == torch.strided else f"{_layout_name(x.layout)} "
        return f"{x.dtype} {layout}tensor of shape {tuple(x.shape)} on {x.device}"
    if x is None:
        return "None"
    if isinstance(x, type):
        return f"the class {x.__module__}.{x.__qualname__}"
    if isinstance(x, (bool, int, float, str)):
        return f"{type(x).__name__} {x!r:.60}"
    return type(x).__name__


def _layout_name(layout: torch.layout) -> str:
    return str(layout).removeprefix("torch.")


def fail(
    cls: type[Exception], fn: str, path: str, expected: str, got: str, hint: str = ""
) -> NoReturn:
    """Raises ``cls`` with mpfunc's message form: where, what was expected, what arrived."""
    msg = f"{fn}: at {path!r}: expected {expected}, got {got}"
    if hint:
        msg += f". {hint}"
    raise cls(msg)


# --- scalars ------------------------------------------------------------------------------


def _bounds(ge: float | None, gt: float | None, le: float | None, lt: float | None) -> str:
    parts = []
    if ge is not None:
        parts.append(f">= {ge:g}")
    if gt is not None:
        parts.append(f"> {gt:g}")
    if le is not None:
        parts.append(f"<= {le:g}")
    if lt is not None:
        parts.append(f"< {lt:g}")
    return " and ".join(parts)


def real(
    fn: str,
    name: str,
    value: object,
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
) -> float:
    """A finite real number within the given bounds, returned as a Python float.

    ``bool`` is refused (``True`` is an int to Python, never a hyperparameter here).
    """
    rule = _bounds(ge, gt, le, lt)
    expected = f"a finite float {rule}".rstrip()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{fn}: {name}: expected {expected}, got {describe(value)}")
    v = float(value)
    ok = (
        math.isfinite(v)
        and (ge is None or v >= ge)
        and (gt is None or v > gt)
        and (le is None or v <= le)
        and (lt is None or v < lt)
    )
    if not ok:
        raise ValueError(f"{fn}: {name}: expected {expected}, got {v!r}")
    return v


def integer(
    fn: str, name: str, value: object, *, ge: int | None = None, le: int | None = None
) -> int:
    """A Python int (not a bool) within the given bounds."""
    rule = _bounds(ge, None, le, None)
    expected = f"an int {rule}".rstrip()
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{fn}: {name}: expected {expected}, got {describe(value)}")
    if (ge is not None and value < ge) or (le is not None and value > le):
        raise ValueError(f"{fn}: {name}: expected {expected}, got {value}")
    return value


def choice(fn: str, name: str, value: object, choices: Sequence[str]) -> str:
    """One of ``choices``."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{fn}: {name}: expected one of {', '.join(choices)}, got {value!r}")
    return value


def zero_d_bool(fn: str, name: str, value: object, hint: str = "") -> torch.Tensor | None:
    """``None`` or a 0-d bool tensor (a device-side flag such as ``skip``)."""
    if value is None:
        return None
    if not isinstance(value, torch.Tensor) or value.ndim != 0 or value.dtype != torch.bool:
        extra = f" ({hint})" if hint else ""
        raise TypeError(
            f"{fn}: {name}: expected None or a 0-d bool tensor{extra}, got {describe(value)}"
        )
    return value


# --- trees --------------------------------------------------------------------------------


def check_tensor_or_none(fn: str, name: str, tree: Any, leaves: Sequence[Any]) -> None:
    """Raises ``TypeError`` naming the first leaf that is neither a tensor nor ``None``."""
    for i, leaf in enumerate(leaves):
        if leaf is not None and not isinstance(leaf, torch.Tensor):
            path = _tree.leaf_paths(tree, name)[i]
            fail(TypeError, fn, path, "a tensor or None leaf", describe(leaf))


def _first_difference(a: Any, b: Any, name_a: str, name_b: str) -> str:
    """Explains where two trees first differ, by path."""
    pa = _tree.leaf_paths(a)
    pb = _tree.leaf_paths(b)
    set_a, set_b = set(pa), set(pb)
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
    fn: str,
    name_a: str,
    a: Any,
    spec_a: PyTreeSpec,
    name_b: str,
    b: Any,
    spec_b: PyTreeSpec,
    hint: str = "",
) -> None:
    """Raises ``ValueError`` if two trees differ in structure, naming the first differing path."""
    if spec_a == spec_b:
        return
    where = _first_difference(a, b, name_a, name_b)
    extra = f". {hint}" if hint else ""
    raise ValueError(
        f"{fn}: {name_a} and {name_b} must have the same tree structure: {where}; "
        f"expected {_short(spec_a)}, got {_short(spec_b)}{extra}"
    )

"""Shared pieces of the table-driven bad-input tests (test_errors*.py).

Each row is a callable that builds the call with fresh tensors, the exception type, and
a regex the message must match; ``check_row`` runs one and also checks that every input
tensor keeps its bits and its ``_version``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import pytest
import torch

import mpfunc

DROP = object()  # a change that removes the leaf


class WrongMessage(AssertionError):
    """The right exception arrived, but its message misses the path, expected or got."""


class Call(NamedTuple):
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


def call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Call:
    return Call(fn, args, kwargs)


def new(
    shape: tuple[int, ...] = (1, 3), dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> Callable[[], torch.Tensor]:
    """A bad leaf, made when the row runs (rows are built at collection)."""
    return lambda: torch.zeros(shape, dtype=dtype, device=device)


# --- trees -------------------------------------------------------------------------------


def nest(flat: dict[str, Any], changes: dict[str, Any] | None = None) -> Any:
    """``{"layers.0.weight": w}`` -> ``{"layers": [{"weight": w}]}``; digit keys make lists.

    ``changes`` replace leaves (a callable is called, so each row gets fresh tensors),
    add new paths, or remove them with ``DROP``.
    """
    flat = dict(flat)
    for path, value in (changes or {}).items():
        if value is DROP:
            del flat[path]
        else:
            flat[path] = value() if callable(value) else value
    root: dict[str, Any] = {}
    for path, leaf in flat.items():
        *parents, last = path.split(".")
        node = root
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = leaf
    return _listify(root)


def _listify(node: Any) -> Any:
    if not isinstance(node, dict):
        return node
    items = {k: _listify(v) for k, v in node.items()}
    if all(k.isdigit() for k in items):
        return [items[str(i)] for i in range(len(items))]
    return items


# --- snapshots ---------------------------------------------------------------------------


def tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor reachable from ``obj``: containers, torch.optim optimizers (params and
    state) and mpfunc's loss-scale states."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, torch.optim.Optimizer):
        yield from tensors(obj.param_groups)
        yield from tensors(list(obj.state.values()))
    elif isinstance(obj, (mpfunc.StaticLossScale, mpfunc.DynamicLossScale)):
        yield obj.loss_scale
        if isinstance(obj, mpfunc.DynamicLossScale):
            yield obj.counter
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from tensors(v)


Snapshot = list[tuple[torch.Tensor, torch.Tensor, int]]


def snapshot(obj: Any) -> Snapshot:
    return [(t, t.detach().clone(), t._version) for t in tensors(obj)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    # Dense and contiguous first: a sparse or stride-0 input has bits too.
    t = t.detach()
    t = t.to_dense() if t.layout != torch.strided else t
    return t.contiguous().reshape(-1).view(torch.uint8)


def assert_unchanged(snap: Snapshot) -> None:
    for t, before, version in snap:
        assert t._version == version, f"a {tuple(t.shape)} input was written in place"
        assert (t.shape, t.dtype, t.device) == (before.shape, before.dtype, before.device)
        if t.device.type != "meta":  # meta tensors have no values to compare
            assert torch.equal(_bits(t), _bits(before)), f"a {tuple(t.shape)} input changed"


# --- rows --------------------------------------------------------------------------------


def at(fn: str, path: str, expected: str, got: str) -> str:
    """The regex for mpfunc's message about one leaf; the arguments are literal text."""
    return "^" + re.escape(f"{fn}: at {path!r}: expected {expected}, got {got}")


def desc(dtype: torch.dtype, shape: tuple[int, ...] = (1, 3), device: str = "cpu") -> str:
    """How mpfunc describes a tensor that arrived."""
    return f"{dtype} tensor of shape {shape} on {device}"


def same_structure(fn: str, a: str, b: str, path: str, in_a: bool) -> str:
    """The regex for a structure mismatch that names the first differing path."""
    first, second = (a, b) if in_a else (b, a)
    return (
        rf"^{re.escape(fn)}: {a} and {b} must have the same tree structure: "
        rf"{re.escape(repr(path))} is in {first} but not in {second}; "
        r"expected PyTreeSpec\(.*\), got PyTreeSpec\("
    )


def row(id: str, make: Callable[[], Call], exc: type[Exception], regex: str, *marks: Any) -> Any:
    return pytest.param(make, exc, regex, id=id, marks=[m for m in marks if m is not None])


def check_row(make: Callable[[], Call], exc: type[Exception], regex: str) -> None:
    """Runs one row: the exception type, every input tensor untouched, then the message."""
    fn, args, kwargs = make()
    before = snapshot((args, kwargs))
    with pytest.raises(exc) as info:
        fn(*args, **kwargs)
    assert_unchanged(before)
    message = str(info.value)
    if not re.search(regex, message):
        raise WrongMessage(f"{message!r}\ndoes not match\n{regex!r}")

"""Helpers shared by the tests split out of tests/test_hardening.py."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch

import mpfunc
from support.error_table import tensors

F32, F64, BF16 = torch.float32, torch.float64, torch.bfloat16


W, B = (2, 3), (3,)  # the shapes every small tree here uses (XLA compiles each shape once)


def _rand(
    shape: tuple[int, ...], dtype: torch.dtype = F32, seed: int = 0, device: Any = "cpu"
) -> torch.Tensor:
    """Normal values rounded through bf16, so every dtype here holds them exactly."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).to(BF16).to(dtype).to(device)


def _tree(dtype: torch.dtype = F32, seed: int = 0, z: torch.dtype | None = None) -> Any:
    """``{"a": {"b", "w"}, "z": {"w"}}``: flatten order a.b, a.w, z.w; ``z`` is z.w's dtype."""
    return {
        "a": {"b": _rand(B, dtype, seed), "w": _rand(W, dtype, seed + 1)},
        "z": {"w": _rand(W, z or dtype, seed + 2)},
    }


def _with(tree: Any, path: str, value: Any) -> Any:
    """A copy of the dict tree with the leaf at dotted ``path`` replaced (containers copied
    along the path, every other leaf shared)."""
    key, _, rest = path.partition(".")
    new = dict(tree)
    new[key] = _with(tree[key], rest, value) if rest else value
    return new


def _windows(shift: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two (2, 3) views of one buffer, ``shift`` elements apart (6: adjacent, disjoint)."""
    buf = _rand((16,), F32, 9)
    return buf[:6].view(W), buf[shift : shift + 6].view(W)


def _fp8(shape: tuple[int, ...]) -> torch.Tensor:
    return _rand(shape, F32, 7).to(torch.float8_e4m3fn)


def _at(fn: str, path: str, expected: str, got: str | None = None) -> str:
    """The regex for mpfunc's message about one leaf (``got`` may be a prefix)."""
    rx = "^" + re.escape(f"{fn}: at {path!r}: expected {expected}, got ")
    return rx + re.escape(got) if got is not None else rx


def _alias(fn: str, a: str, b: str) -> str:
    """Either order: the message names both paths, one as where, one as the other name."""
    either = f"({re.escape(repr(a))}|{re.escape(repr(b))})"
    return (
        rf"^(?=.*{re.escape(repr(a))})(?=.*{re.escape(repr(b))}){re.escape(fn)}: at {either}: "
        rf"expected a tensor that shares no memory with {either}, got .* aliasing it"
    )


def _desc(shape: tuple[int, ...], dtype: torch.dtype = F32, layout: str = "") -> str:
    lay = f"{layout} " if layout else ""
    return f"{dtype} {lay}tensor of shape {shape} on cpu"


_SHARED = "a tensor whose elements do not share memory"


_DENSE = "a dense (strided) tensor"


OPTS: dict[str, Callable[[], mpfunc.Optimizer]] = {
    "sgd": lambda: mpfunc.sgd(lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01),
    "adam": lambda: mpfunc.adam(lr=0.1, weight_decay=0.01, amsgrad=True),
    "adamw": lambda: mpfunc.adamw(lr=0.1, weight_decay=0.01),
    "lion": lambda: mpfunc.lion(lr=0.1, weight_decay=0.01),
    "partition": lambda: mpfunc.partition(
        {"d": mpfunc.adamw(lr=0.1), "n": mpfunc.sgd(lr=0.1, momentum=0.9)},
        lambda path, m: "d" if m.ndim >= 2 else "n",
    ),
}


def _dense_bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    t = t.to_dense() if t.layout != torch.strided else t
    return t.contiguous().reshape(-1).view(torch.uint8)


def _snapshot(obj: Any) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    return [(t, _dense_bits(t).clone(), t._version) for t in tensors(obj)]


def _assert_unchanged(snap: list[tuple[torch.Tensor, torch.Tensor, int]]) -> None:
    for t, bits, version in snap:
        assert t._version == version, f"a {tuple(t.shape)} input was written in place"
        assert torch.equal(_dense_bits(t), bits), f"a {tuple(t.shape)} input changed"


def _to(tree: Any, device: Any) -> Any:
    return {k: _to(v, device) if isinstance(v, dict) else v.to(device) for k, v in tree.items()}


def _one(tree: Any) -> torch.Tensor:
    t = tree["x"]
    assert isinstance(t, torch.Tensor)
    return t

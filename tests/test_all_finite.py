"""``all_finite`` against ``torch.isfinite`` on the CPU."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from support.helpers import (
    assert_unchanged,
    leaves,
    snapshot,
)
from support.strategies import SHAPES, bit_trees, bits_tensor, tree_shapes
from support.trees import is_float, per_device, sync, to_device

import mpfunc

# --- all_finite ----------------------------------------------------------------------------


def reference_finite(tree_cpu: Any) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in leaves(tree_cpu) if is_float(t))


@st.composite
def any_bit_trees(draw: st.DrawFn) -> Any:
    """bit_trees (bf16/fp16), or the same nesting of arbitrary-bit fp32 leaves."""
    if draw(st.booleans()):
        return draw(bit_trees())
    return draw(
        tree_shapes(
            st.builds(lambda: bits_tensor(draw, draw(st.sampled_from(SHAPES)), torch.float32))
        )
    )


def test_all_finite_matches_isfinite(device: torch.device) -> None:
    @per_device(device, cpu=100, xla=20)
    @given(data=st.data())
    def prop(data: st.DataObject) -> None:
        tree_cpu = data.draw(any_bit_trees(), label="tree")
        tree = to_device(tree_cpu, device)
        snap = snapshot(tree)
        flag = mpfunc.all_finite(tree)
        sync(device)
        assert flag.shape == () and flag.dtype == torch.bool
        if any(is_float(t) and t.numel() for t in leaves(tree)):
            assert flag.device == device
        assert bool(flag.cpu()) == reference_finite(tree_cpu)
        assert_unchanged(tree, snap)

    prop()


@pytest.mark.parametrize(
    "tree",
    [{}, [], (), None, [None], {"n": torch.arange(3), "m": torch.tensor([True, False])}],
    ids=["dict", "list", "tuple", "none", "list-of-none", "ints"],
)
def test_all_finite_empty_and_int_trees_are_finite(tree: Any) -> None:
    flag = mpfunc.all_finite(tree)
    assert flag.shape == () and flag.dtype == torch.bool and bool(flag)


def test_all_finite_on_int_tree_on_device(device: torch.device) -> None:
    flag = mpfunc.all_finite([torch.arange(3, device=device), None])
    assert flag.shape == () and flag.dtype == torch.bool and bool(flag.cpu())


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan, 65504.0, 3e38])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_all_finite_single_special_value(device: torch.device, value: float, dtype: Any) -> None:
    """One special value in the last element of the last leaf; large finite values are
    finite (the max-norm cannot overflow the way a 2-norm would)."""
    # Set in fp32, then cast: 3e38 rounds to inf in fp16 (older torch refuses to
    # assign an out-of-range Python float to an fp16 tensor directly).
    x = torch.zeros(64)
    x[-1] = value
    x = x.to(dtype)
    tree = {"a": torch.ones(3, 5, dtype=dtype).to(device), "z": x.to(device)}
    flag = mpfunc.all_finite(tree)
    sync(device)
    assert bool(flag.cpu()) == bool(torch.isfinite(x).all()), (dtype, value, x[-1])


def test_all_finite_device_when_floating_leaves_are_empty(xla_device: torch.device) -> None:
    flag = mpfunc.all_finite({"w": torch.zeros(0, device=xla_device)})
    assert flag.device == xla_device


@pytest.mark.parametrize("value", [complex(float("nan"), 0), complex(0, float("inf")), 1 + 2j])
@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
def test_complex_leaves_are_checked_in_both_parts(value: complex, dtype: Any) -> None:
    """A complex leaf holding NaN or inf counted as finite (as a non-floating leaf), so a
    skip=~all_finite(...) guard let it through."""
    t = torch.zeros(3, dtype=dtype)
    t[1] = value
    got = bool(mpfunc.all_finite({"c": t, "f": torch.ones(2)}))
    assert got == bool(torch.isfinite(t).all())


FLOAT8 = [
    getattr(torch, n)
    for n in (
        "float8_e4m3fn",
        "float8_e5m2",
        "float8_e4m3fnuz",
        "float8_e5m2fnuz",
        "float8_e8m0fnu",
    )
    if hasattr(torch, n)
]


@pytest.mark.parametrize("value", [math.nan, math.inf, 1.0])
@pytest.mark.parametrize("dtype", FLOAT8, ids=str)
def test_float8_leaves_are_checked(value: float, dtype: Any) -> None:
    """torch implements neither the inf-norm nor isfinite for most float8 dtypes, so
    all_finite raised torch's error for them. Where a format has no inf, inf converts to
    its NaN (or its largest value, if it saturates): the reference reads the converted
    bits back in float32."""
    t = torch.tensor([0.5, value, 2.0]).to(dtype)
    tree = {"f8": t, "w": torch.ones(2), "i": torch.arange(2)}
    snap = snapshot(tree)
    assert bool(mpfunc.all_finite(tree)) == bool(torch.isfinite(t.float()).all())
    assert bool(mpfunc.all_finite({"a": t, "b": t[:1]})) == bool(torch.isfinite(t.float()).all())
    assert_unchanged(tree, snap)

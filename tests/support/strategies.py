"""Hypothesis strategies for trees of tensors, shared by the property tests.

Shapes come from a small fixed catalog, so that on XLA the same graphs recur
and the compile cache hits. Values are drawn either from raw bit patterns (to
reach subnormals, infinities, NaN and rounding ties) or from a seeded normal
distribution at a drawn scale (for optimizer trajectories).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from hypothesis import strategies as st

from mpfunc import _tree

SHAPES: list[tuple[int, ...]] = [(), (0,), (1,), (7,), (3, 5), (2, 3, 4), (64,)]
LOW = [torch.bfloat16, torch.float16]


class Pair(NamedTuple):
    weight: Any
    bias: Any


def bits_tensor(draw: st.DrawFn, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor whose elements are arbitrary bit patterns of ``dtype`` (16 or 32 bits)."""
    n = 1
    for s in shape:
        n *= s
    if dtype.itemsize == 2:
        specials = [0x0000, 0x8000, 0x0001, 0x8001, 0x7F80, 0xFF80, 0x7C00, 0x7FC0, 0x03FF]
        vals = draw(
            st.lists(
                st.one_of(st.sampled_from(specials), st.integers(0, 0xFFFF)), min_size=n, max_size=n
            )
        )
        raw = torch.tensor([v - 0x10000 if v >= 0x8000 else v for v in vals], dtype=torch.int16)
    else:
        # fp32 values that sit exactly on a bf16 rounding tie (low 16 bits 0x8000),
        # next to it, subnormals, infinities and NaNs, plus arbitrary patterns.
        specials = [
            0x3F808000, 0x3F818000, 0xBF808000, 0x00008000, 0x00000001, 0x807FFFFF,
            0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001, 0x7F7FFFFF, 0x7F7F8000,
            0x3F807FFF, 0x3F808001, 0x33800000,
        ]  # fmt: skip
        vals = draw(
            st.lists(
                st.one_of(st.sampled_from(specials), st.integers(0, 0xFFFFFFFF)),
                min_size=n,
                max_size=n,
            )
        )
        raw = torch.tensor([v - 0x100000000 if v >= 0x80000000 else v for v in vals]).to(
            torch.int32
        )
    return raw.view(dtype).reshape(shape)


@st.composite
def bit_trees(draw: st.DrawFn, dtype: torch.dtype | None = None) -> Any:
    """A nested tree (dict/list/tuple/NamedTuple) of arbitrary-bit low-precision tensors,
    with ``None`` leaves and an int buffer mixed in."""

    def leaf() -> torch.Tensor:
        d = dtype or draw(st.sampled_from(LOW))
        return bits_tensor(draw, draw(st.sampled_from(SHAPES)), d)

    return draw(tree_shapes(st.builds(leaf)))


def tree_shapes(leaves: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Nests leaves in dicts, lists, tuples and NamedTuples, with the odd None and int leaf.

    Containers are never empty, and most leaves are floating tensors, so that most
    examples exercise real numerics (empty trees and empty containers have their own tests).
    """
    extras = st.sampled_from([None, torch.arange(3), torch.tensor([True, False])])
    base = st.one_of(leaves, leaves, leaves, leaves, leaves, extras)
    return st.recursive(
        base,
        lambda children: st.one_of(
            st.dictionaries(
                st.sampled_from(["w", "b", "emb", "ln"]), children, min_size=1, max_size=3
            ),
            st.lists(children, min_size=1, max_size=3),
            st.tuples(children, children),
            st.builds(Pair, children, children),
        ),
        max_leaves=6,
    )


class Spec(NamedTuple):
    """A recipe for a tree of normal-valued tensors: structure from ``tree_shapes``, each
    leaf a (shape, dtype, scale) triple, realized with a seeded generator."""

    tree: Any  # leaves: (shape, dtype) tuples, None, or int/bool tensors
    seed: int


@st.composite
def specs(draw: st.DrawFn, dtypes: list[torch.dtype] | None = None) -> Spec:
    pool = dtypes or LOW
    leaf = st.tuples(st.sampled_from(SHAPES), st.sampled_from(pool)).map(lambda t: LeafSpec(*t))
    return Spec(draw(tree_shapes(leaf)), draw(st.integers(0, 2**31 - 1)))


class LeafSpec(NamedTuple):
    shape: tuple[int, ...]
    dtype: torch.dtype


def _map_leaves(tree: Any, f: Any) -> Any:
    import optree

    return optree.tree_map(
        lambda x: f(x) if isinstance(x, LeafSpec) else x,
        tree,
        none_is_leaf=True,
        is_leaf=lambda x: isinstance(x, LeafSpec),
    )


def realize(
    spec: Spec, device: torch.device, scale: float = 1.0, salt: int = 0, dtype: Any = None
) -> Any:
    """Builds the tree: normal values times ``scale``, rounded to each leaf's dtype
    (or ``dtype`` if given). The same (spec, salt) gives the same values on every device."""
    gen = torch.Generator().manual_seed(spec.seed * 1000 + salt)

    def make(ls: LeafSpec) -> torch.Tensor:
        x = torch.randn(ls.shape, generator=gen) * scale
        return x.to(dtype or ls.dtype).to(device)

    def move(x: Any) -> Any:
        return x.to(device) if isinstance(x, torch.Tensor) else x

    tree = _map_leaves(spec.tree, make)
    return _tree.map_tensors(move, tree)

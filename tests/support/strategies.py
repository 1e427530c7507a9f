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

from mpfunc import testing as _public
from mpfunc.core import _tree

# The public strategies (mpfunc.testing) are these tests' own; what stays here is
# specific to mpfunc's suite: the shape catalog its XLA tests compile, and specs that
# realize the same values on every device.
from mpfunc.testing import Pair, bits_tensor, tree_shapes

__all__ = [
    "LOW",
    "SHAPES",
    "LeafSpec",
    "Pair",
    "Spec",
    "bit_trees",
    "bits_tensor",
    "realize",
    "specs",
    "tree_shapes",
]

SHAPES: list[tuple[int, ...]] = [(), (0,), (1,), (7,), (3, 5), (2, 3, 4), (64,)]
LOW = list(_public.LOW_DTYPES)


def bit_trees(dtype: torch.dtype | None = None) -> Any:
    """A nested tree (dict/list/tuple/NamedTuple) of arbitrary-bit low-precision tensors,
    with ``None`` leaves and an int buffer mixed in."""
    return _public.bit_trees(dtype, shapes=SHAPES)


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

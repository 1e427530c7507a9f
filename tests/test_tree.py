"""``core._tree.flatten``'s fast cases (flat dicts, flat lists and tuples) give exactly what
optree's walk gives."""

from __future__ import annotations

from typing import Any

import optree
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mpfunc
from mpfunc.core import _tree


def _reference(tree: Any) -> tuple[list[Any], Any]:
    return optree.tree_flatten(
        tree, is_leaf=_tree._is_unit, none_is_leaf=True, namespace=_tree.NAMESPACE
    )


def _value(kind: str) -> Any:
    p = torch.zeros(4, dtype=torch.bfloat16)
    if kind == "tensor":
        return torch.zeros(2)
    if kind == "param":
        return torch.nn.Parameter(torch.zeros(2))
    if kind == "none":
        return None
    if kind == "remainder":
        return mpfunc.init_master({"w": p}, strategy="remainder")["w"]
    if kind == "stochastic":
        return mpfunc.init_master({"w": p}, strategy="stochastic")["w"]
    if kind == "tuple":
        return (torch.zeros(1), None)  # a node, not a unit
    if kind == "dict":
        return {"b": torch.zeros(1), "a": None}
    return 3  # an opaque leaf


KINDS = ("tensor", "param", "none", "remainder", "stochastic", "tuple", "dict", "int")


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.one_of(st.text(max_size=3), st.integers(-3, 3)), st.sampled_from(KINDS)),
        max_size=8,
    ),
    st.booleans(),
)
def test_flat_dicts_flatten_as_optree_walks_them(
    items: list[tuple[Any, str]], one_type: bool
) -> None:
    keys = list(dict.fromkeys(k for k, _ in items))
    if one_type:  # all keys of one type: optree sorts them
        keys = [str(k) for k in keys]
    tree = {k: _value(kind) for k, (_, kind) in zip(keys, items)}
    leaves, spec = _tree.flatten(tree, units=True)
    ref_leaves, ref_spec = _reference(tree)
    assert spec == ref_spec
    assert len(leaves) == len(ref_leaves)
    assert all(a is b for a, b in zip(leaves, ref_leaves))
    assert _tree.unflatten(spec, leaves).keys() == tree.keys()


class _Sub(list):  # a list subclass: a node optree knows, never the fast case
    pass


SEQ_KINDS = (*KINDS, "subtensor")


def _seq_value(kind: str) -> Any:
    if kind == "subtensor":  # a tensor subclass: a leaf for optree, not a plain type here
        return torch.zeros(2).as_subclass(_SubTensor)
    return _value(kind)


class _SubTensor(torch.Tensor):
    pass


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.sampled_from(SEQ_KINDS), max_size=8),
    st.sampled_from([list, tuple, _Sub]),
    st.booleans(),
    st.booleans(),
)
def test_flat_sequences_flatten_as_optree_walks_them(
    kinds: list[str], container: type, units: bool, twice: bool
) -> None:
    # Units are leaves only with units=True; without, a unit is a node and is opened. Twice:
    # the second call takes the remembered spec of its (type, length).
    tree = container(_seq_value(k) for k in kinds)
    for _ in range(2 if twice else 1):
        leaves, spec = _tree.flatten(tree, units=units)
        ref_leaves, ref_spec = optree.tree_flatten(
            tree,
            is_leaf=_tree._is_unit if units else None,
            none_is_leaf=True,
            namespace=_tree.NAMESPACE,
        )
        assert spec == ref_spec
        assert len(leaves) == len(ref_leaves)
        assert all(a is b for a, b in zip(leaves, ref_leaves))
        assert leaves is not tree  # a fresh list: callers may change it
        rebuilt = _tree.unflatten(spec, leaves)
        assert type(rebuilt) is type(tree) and len(rebuilt) == len(tree)

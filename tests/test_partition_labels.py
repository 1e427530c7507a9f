"""``partition``'s labelling function: labels follow each tree's own shapes and dtypes,
and a leaf that was ``None`` in the first tree is updated."""

from __future__ import annotations

import pytest
import torch
from support.hardening import F64, B, W, _one, _rand
from support.helpers import assert_bits_equal, settle

import mpfunc

# torch warns once per process that CSR support is in beta; these tests only hand CSR
# tensors to functions that must refuse them.
pytestmark = pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta:UserWarning")


def _by_rank() -> mpfunc.Optimizer:
    return mpfunc.partition(
        {
            "decay": mpfunc.adamw(lr=0.1, weight_decay=0.5),
            "no_decay": mpfunc.adamw(lr=0.1, weight_decay=0.0),
        },
        lambda path, m: "decay" if m.ndim >= 2 else "no_decay",
    )


def _alone(master: torch.Tensor, grad: torch.Tensor, opt: mpfunc.Optimizer) -> torch.Tensor:
    m = {"x": master.clone()}
    mpfunc.apply_update_(m, {"x": grad}, opt.init(m), opt)
    return _one(m)


def test_partition_labels_a_same_structure_tree_by_its_own_shapes(device: torch.device) -> None:
    """The first tree has a 2-d ``w``; the second, of the same structure, a 1-d ``w``: it
    must get ``no_decay``, not the first tree's cached ``decay``."""
    opt = _by_rank()
    first = {"b": _rand(B, device=device), "w": _rand(W, device=device)}
    s1 = opt.init(first)
    assert s1["decay"].step["w"] is not None
    g1 = {"b": _rand(B, seed=1, device=device), "w": _rand(W, seed=2, device=device)}
    mpfunc.apply_update_(first, g1, s1, opt)
    second = {"b": _rand(B, seed=3, device=device), "w": _rand(B, seed=4, device=device)}
    s2 = opt.init(second)
    assert s2["decay"].step["w"] is None and s2["no_decay"].step["w"] is not None
    g = {"b": _rand(B, seed=5, device=device), "w": _rand(B, seed=6, device=device)}
    expected = _alone(second["w"], g["w"], mpfunc.adamw(lr=0.1, weight_decay=0.0))
    mpfunc.apply_update_(second, g, s2, opt)
    assert_bits_equal(second["w"], expected)


def test_partition_updates_a_leaf_that_was_none_in_the_first_tree(device: torch.device) -> None:
    opt = _by_rank()
    first = {"b": _rand(B, device=device), "w": None}
    s1 = opt.init(first)
    mpfunc.apply_update_(first, {"b": _rand(B, seed=1, device=device), "w": None}, s1, opt)
    second = {"b": _rand(B, seed=3, device=device), "w": _rand(W, seed=4, device=device)}
    s2 = opt.init(second)
    g = {"b": _rand(B, seed=5, device=device), "w": _rand(W, seed=6, device=device)}
    expected = _alone(second["w"], g["w"], mpfunc.adamw(lr=0.1, weight_decay=0.5))
    before = second["w"].clone()
    mpfunc.apply_update_(second, g, s2, opt)
    settle(before)
    assert not torch.equal(second["w"].cpu(), before.cpu())
    assert_bits_equal(second["w"], expected)


def test_partition_labels_by_dtype_are_not_reused_across_dtypes() -> None:
    opt = mpfunc.partition(
        {"wide": mpfunc.sgd(lr=0.1), "narrow": mpfunc.sgd(lr=0.5)},
        lambda path, m: "wide" if m.dtype == F64 else "narrow",
    )
    assert opt.init({"w": _rand(W)})["narrow"].step["w"] is not None
    assert opt.init({"w": _rand(W, F64)})["wide"].step["w"] is not None


def test_missing_labels_are_named_by_their_leaf_beside_units() -> None:
    """A label tree missing leaves named the first remainder master's field ('a.param')
    instead of the missing leaf."""
    p = {"a": torch.randn(4, 8).bfloat16(), "i": torch.randn(3).bfloat16(), "n": None}
    masters = mpfunc.init_master(p, strategy={"a": "remainder", "i": "fp32", "n": None})
    opt = mpfunc.partition({"x": mpfunc.adamw(1e-3)}, {"a": "x"})
    with pytest.raises(ValueError, match=r"'i' is in masters but not in labels"):
        opt.init(masters)


def test_an_unhashable_label_from_a_function_is_named() -> None:
    """A labels function returning a list raised a bare "unhashable type: 'list'"."""
    masters = mpfunc.init_master({"a": torch.randn(4, 8).bfloat16()})
    opt = mpfunc.partition({"x": mpfunc.adamw(1e-3)}, lambda path, leaf: ["x"])
    with pytest.raises(ValueError, match=r"^partition\.init: at 'masters\.a': expected a label "):
        opt.init(masters)

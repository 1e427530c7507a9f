"""Properties of the casts: init_master, grads_to_fp32(_), masters_to_model(_).

References are independent of mpfunc: ``Tensor.to(dtype)`` on the CPU.
"""

from __future__ import annotations

from typing import Any

import optree
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from support.helpers import (
    assert_bits_equal,
    assert_trees_bits_equal,
    assert_unchanged,
    leaves,
    snapshot,
)
from support.strategies import bit_trees, bits_tensor

import mpfunc


def to_device(tree: Any, device: torch.device) -> Any:
    return optree.tree_map(
        lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, tree, none_is_leaf=True
    )


def is_float(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point()


@given(data=st.data())
def test_round_trip_is_bit_identical(device: torch.device, data: st.DataObject) -> None:
    """masters_to_model(init_master(p), p) == p bit for bit, for any bf16/fp16 tree.

    NaN payloads: torch's CPU fp32->bf16/fp16 cast canonicalizes every NaN (as
    ``Tensor.to`` does), so on the CPU a NaN stays a NaN but its bits may change.
    XLA keeps payloads, so there the round trip is exact for every bit pattern.
    """
    params = to_device(data.draw(bit_trees()), device)
    snap = snapshot(params)
    masters = mpfunc.init_master(params)
    back = mpfunc.masters_to_model(masters, params)
    assert_trees_bits_equal(back, params, nan_payload=device.type != "cpu")
    assert_unchanged(params, snap)
    # Structure, shapes, devices kept; non-floating leaves get no master and pass through.
    assert optree.tree_structure(masters, none_is_leaf=True) == optree.tree_structure(
        params, none_is_leaf=True
    )
    for p, m, b in zip(leaves(params), leaves(masters), leaves(back)):
        if is_float(p):
            assert m.dtype == torch.float32 and m.shape == p.shape and m.device == p.device
            assert not m.requires_grad
            assert b.dtype == p.dtype and b.device == p.device
            if p.numel():
                assert m.data_ptr() != p.data_ptr() or device.type != "cpu"
        else:
            assert m is None
            assert b is p


@given(data=st.data())
def test_round_trip_in_place(device: torch.device, data: st.DataObject) -> None:
    """masters_to_model_ writes the same bits into the model's own tensors."""
    params = to_device(data.draw(bit_trees()), device)
    target = optree.tree_map(
        lambda t: t.clone() if isinstance(t, torch.Tensor) else t, params, none_is_leaf=True
    )
    # Scramble the floating targets so the write is observable.
    for t in leaves(target):
        if is_float(t):
            t.fill_(3.0)
    masters = mpfunc.init_master(params)
    m_snap = snapshot(masters)
    out = mpfunc.masters_to_model_(masters, target)
    assert out is target
    # In place, both backends' copy_ may canonicalize NaN payloads; a NaN stays a NaN.
    assert_trees_bits_equal(target, params, nan_payload=False)
    assert_unchanged(masters, m_snap)


@given(data=st.data(), dtype=st.sampled_from([torch.bfloat16, torch.float16]))
def test_rounding_matches_tensor_to(device: torch.device, data: st.DataObject, dtype: Any) -> None:
    """fp32 -> low precision rounds exactly as ``Tensor.to`` does: ties to even,
    subnormals, overflow to inf, infinities and NaN."""
    params = to_device(data.draw(bit_trees(dtype=dtype)), device)
    masters_cpu = optree.tree_map(
        lambda t: bits_tensor(data.draw, tuple(t.shape), torch.float32) if is_float(t) else None,
        params,
        none_is_leaf=True,
    )
    masters = to_device(masters_cpu, device)
    pure = mpfunc.masters_to_model(masters, params)
    for m_cpu, m, q in zip(leaves(masters_cpu), leaves(masters), leaves(pure)):
        if m is None:
            continue
        # Against the CPU reference, every bit on the CPU; NaN payloads aside on XLA.
        assert_bits_equal(q, m_cpu.to(dtype), nan_payload=device.type == "cpu")
        # Against the device's own Tensor.to, every bit including NaN payloads.
        assert_bits_equal(q, m.to(dtype))
    mpfunc.masters_to_model_(masters, params)
    # torch 2.4's grouped copy writes a 0-d NaN as 0xFFFF where its own Tensor.to writes
    # 0x7FC0 (NaN stays NaN; NOTES.md): payloads are compared from torch 2.5 on.
    old_torch = tuple(int(x) for x in torch.__version__.split(".")[:2]) < (2, 5)
    assert_trees_bits_equal(params, pure, nan_payload=device.type == "cpu" and not old_torch)


@given(data=st.data())
def test_grads_to_fp32_is_exact_and_twins_agree(device: torch.device, data: st.DataObject) -> None:
    """Every bf16/fp16 value is an fp32 value: the cast is exact, bits included."""
    grads_cpu = data.draw(bit_trees())
    # Gradients of int buffers do not exist: replace non-floating leaves by None.
    grads_cpu = optree.tree_map(lambda t: t if is_float(t) else None, grads_cpu, none_is_leaf=True)
    grads = to_device(grads_cpu, device)
    snap = snapshot(grads)
    g32 = mpfunc.grads_to_fp32(grads)
    assert_unchanged(grads, snap)
    for g_cpu, g in zip(leaves(grads_cpu), leaves(g32)):
        if g_cpu is None:
            assert g is None
            continue
        assert g.dtype == torch.float32 and g.device == device
        # CPU and XLA agree on every bit but NaN payloads (CPU canonicalizes fp16 NaN).
        assert_bits_equal(g, g_cpu.to(torch.float32), nan_payload=device.type == "cpu")

    out = mpfunc.init_master(grads)  # a preallocated fp32 tree
    res = mpfunc.grads_to_fp32_(grads, out)
    # XLA's copy_ canonicalizes NaN payloads; a NaN stays a NaN.
    assert_trees_bits_equal(res, g32, nan_payload=device.type == "cpu")
    for r, o in zip(leaves(res), leaves(out)):
        assert r is None or r is o  # the buffers themselves, no new allocation
    assert_unchanged(grads, snap)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_master_dtypes(device: torch.device, dtype: torch.dtype) -> None:
    p = {"w": torch.randn(3, 5).bfloat16().to(device), "n": None}
    m = mpfunc.init_master(p, dtype=dtype)
    assert m["w"].dtype == dtype and m["n"] is None
    g = mpfunc.grads_to_fp32({"w": p["w"], "n": None}, dtype=dtype)
    assert g["w"].dtype == dtype
    assert torch.equal(mpfunc.masters_to_model(m, p)["w"].cpu(), p["w"].cpu())


def test_fp32_model_gets_fresh_masters() -> None:
    """An fp32 parameter's master is a copy, and masters_to_model returns another copy."""
    p = {"w": torch.randn(4, 4)}
    m = mpfunc.init_master(p)
    assert m["w"].data_ptr() != p["w"].data_ptr()
    q = mpfunc.masters_to_model(m, p)
    assert q["w"].data_ptr() != m["w"].data_ptr()
    assert torch.equal(q["w"], p["w"])


def test_module_parameters_train_in_place() -> None:
    """The documented loop on an nn.Module: masters_to_model_ writes into the Parameters."""
    model = torch.nn.Linear(4, 3).to(torch.bfloat16)
    params = dict(model.named_parameters())
    masters = mpfunc.init_master(params)
    masters["weight"].add_(1.0)
    mpfunc.masters_to_model_(masters, params)
    assert torch.equal(model.weight.detach(), masters["weight"].to(torch.bfloat16))
    assert model.weight.requires_grad

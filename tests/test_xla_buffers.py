"""On XLA, params, masters and state never share a device buffer: every tensor stays
readable after each step, and a transform's result shares no buffer with its input."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from support.hardening import BF16, F32, F64, B, W, _one, _rand, _to
from support.helpers import assert_bits_equal, leaves

import mpfunc

# torch warns once per process that CSR support is in beta; these tests only hand CSR
# tensors to functions that must refuse them.
pytestmark = pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta:UserWarning")


def _model(seed: int) -> Any:
    # A bf16 layer and a norm weight kept in fp32: the fp32 leaf is the one whose master
    # once shared the param's XLA buffer.
    return {
        "fc": {"b": _rand(B, BF16, seed), "w": _rand(W, BF16, seed + 1)},
        "norm": {"w": _rand(B, F32, seed + 2)},
    }


def _read(tree: Any) -> list[torch.Tensor]:
    """Every tensor of ``tree`` copied to the CPU: fails if an XLA buffer was donated."""
    return [t.detach().cpu().clone() for t in leaves(tree) if isinstance(t, torch.Tensor)]


@pytest.mark.xla
@pytest.mark.parametrize("mode", ["inplace", "pure", "mixed"])
def test_xla_every_tensor_stays_readable_after_each_step(
    xla_device: torch.device, mode: str
) -> None:
    """Item 6: three steps of adamw on XLA; after every transform and sync, every param,
    master and state tensor reads back, with the values the same loop gives on the CPU."""
    import torch_xla

    d = xla_device
    params, ref_params = _to(_model(0), d), _model(0)
    masters, ref_masters = mpfunc.init_master(params), mpfunc.init_master(ref_params)
    for m, p in zip(leaves(masters), leaves(params)):
        assert not torch._C._is_alias_of(m, p)
    opt = mpfunc.adamw(lr=0.1, weight_decay=0.1)  # foreach on XLA
    ref_opt = mpfunc.adamw(lr=0.1, weight_decay=0.1, impl="foreach")
    state, ref_state = opt.init(masters), ref_opt.init(ref_masters)
    torch_xla.sync()
    for step in range(3):
        grads = _model(10 * step + 5)
        g32 = mpfunc.grads_to_fp32(_to(grads, d))
        if mode == "pure":
            masters, state = mpfunc.apply_update(masters, g32, state, opt)
        else:
            mpfunc.apply_update_(masters, g32, state, opt)
        torch_xla.sync()
        for got, want in zip(_read(params), leaves(ref_params)):  # not yet written back
            assert_bits_equal(got, want)
        if mode == "inplace":
            mpfunc.masters_to_model_(masters, params)
        else:
            params = mpfunc.masters_to_model(masters, params)
        torch_xla.sync()
        mpfunc.apply_update_(ref_masters, mpfunc.grads_to_fp32(grads), ref_state, ref_opt)
        mpfunc.masters_to_model_(ref_masters, ref_params)
        got_m, got_s, got_p = _read(masters), _read(state), _read(params)
        want = [t for t in leaves((ref_masters, ref_state)) if t is not None]
        for got, expected in zip(got_m + got_s, want, strict=True):
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
        for p, m in zip(got_p, got_m):
            assert_bits_equal(p, m.to(p.dtype))  # each param is its master, rounded
        # The XLA params now hold the XLA masters' rounding; continue from those on the CPU
        # too, so a one-ulp bf16 difference cannot grow over the steps.
        ref_params = _to({"fc": {"b": got_p[0], "w": got_p[1]}, "norm": {"w": got_p[2]}}, "cpu")


def _sgd_pure(s: torch.Tensor) -> torch.Tensor:
    opt = mpfunc.sgd(lr=0.1)
    m = {"x": s}
    return _one(mpfunc.apply_update(m, {"x": torch.zeros_like(s)}, opt.init(m), opt)[0])


def _with_zeros(fn: Callable[..., Any]) -> Callable[[torch.Tensor], torch.Tensor]:
    """``fn({"x": s}, {"x": zeros})``: a transform whose second tree is a fresh buffer."""
    return lambda s: _one(fn({"x": s}, {"x": torch.zeros_like(s)}))


# name -> (source dtype, source -> the tensor the transform makes or writes from it)
COPIES: dict[str, tuple[torch.dtype, Callable[[torch.Tensor], torch.Tensor]]] = {
    "init_master": (F32, lambda s: _one(mpfunc.init_master({"x": s}))),
    "init_master-f64": (F64, lambda s: _one(mpfunc.init_master({"x": s}))),
    "grads_to_fp32": (F32, lambda s: _one(mpfunc.grads_to_fp32({"x": s}))),
    "grads_to_fp32_": (F32, _with_zeros(mpfunc.grads_to_fp32_)),
    "masters_to_model": (F32, _with_zeros(mpfunc.masters_to_model)),
    "masters_to_model_": (F32, _with_zeros(mpfunc.masters_to_model_)),
    "accumulate_grads": (F32, _with_zeros(mpfunc.accumulate_grads)),
    "apply_update": (F32, _sgd_pure),
    "clip_by_global_norm": (F32, lambda s: _one(mpfunc.clip_by_global_norm({"x": s}, 1e9)[0])),
}


@pytest.mark.xla
@pytest.mark.parametrize("written", ["copy", "source"])
@pytest.mark.parametrize("name", sorted(COPIES))
def test_xla_a_transform_result_shares_no_buffer_with_its_input(
    xla_device: torch.device, name: str, written: str
) -> None:
    """Item 6, transform by transform: whatever a transform makes or writes from an input of
    the same dtype (an fp32 norm weight, its fp32 grad) can be written in place, and the
    input still reads back with its old values; and the other way round."""
    import torch_xla

    dtype, transform = COPIES[name]
    src = torch.full(B, 1.5, dtype=dtype, device=xla_device)
    torch_xla.sync()
    dst = transform(src)
    torch_xla.sync()
    expected_dst = dst.cpu()
    (dst if written == "copy" else src).mul_(2)
    torch_xla.sync()
    other = src if written == "copy" else dst
    want = torch.full(B, 1.5, dtype=dtype) if written == "copy" else expected_dst
    assert torch.equal(other.cpu(), want)


@pytest.mark.xla
def test_xla_fp32_grads_stay_readable_after_clipping_their_copy(xla_device: torch.device) -> None:
    """A norm weight's fp32 grad: copied by grads_to_fp32_, a sync (the step's graph
    boundary), then clipped in place: the grad itself must still read back."""
    import torch_xla

    grads = {"norm": torch.full(B, 4.0, device=xla_device)}
    out = mpfunc.init_grads(grads)
    torch_xla.sync()
    mpfunc.grads_to_fp32_(grads, out)
    torch_xla.sync()
    mpfunc.clip_by_global_norm_(out, 0.1)
    torch_xla.sync()
    assert torch.equal(grads["norm"].cpu(), torch.full(B, 4.0))

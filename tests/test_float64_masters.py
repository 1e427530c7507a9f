"""Float64 leaves beside the low-precision ones, and params trained after a freeze.

A float64 param keeps a float64 master (``"fp32"``) or steps as itself (``"none"``), and
its step computes in float64 whatever the state format: fp32 and bf16 moments widen to
float64 and round back; 8- and 4-bit moments decode to float32, widen exactly, and are
rounded to float32 before they are encoded. Both once failed inside torch's kernel after
the other leaves had stepped (found by a review; the errors named no path). Each result is
compared with torch.optim on float64 copies holding the same decoded moments.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from support.helpers import assert_bits_equal, assert_unchanged, leaves, snapshot, state_tensors

import mpfunc
from mpfunc.state_formats import _quantize, _quantize4

U4 = torch.uint4  # type: ignore[attr-defined]
N = 96  # three 8-bit blocks


def _decoded(q: Any) -> torch.Tensor:
    if isinstance(q, _quantize.QState):
        return _quantize.dequantize(q)
    return _quantize4.dequantize4(q, (N,))


def _codes_of(x: torch.Tensor, like: Any) -> torch.Tensor:
    """The codes a first moment ``x`` (float32) gets, rounded to nearest."""
    if isinstance(like, _quantize.QState):
        return _quantize.quantize(x, signed=True).codes
    return _quantize4.quantize4(x, signed=True).codes


def _tree(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "a": torch.randn(N, generator=g).bfloat16(),
        "w": torch.randn(N, generator=g, dtype=torch.float64),
    }


@pytest.mark.parametrize("state_dtype", [torch.uint8, U4], ids=str)
@pytest.mark.parametrize("rule", ["adamw", "sgd"])
def test_float64_master_with_encoded_state_steps_as_torch_optim(
    rule: str, state_dtype: Any
) -> None:
    params = _tree(0)
    masters = mpfunc.init_master(params)
    assert masters["w"].dtype == torch.float64
    if rule == "adamw":
        opt = mpfunc.adamw(lr=1e-2, weight_decay=0.1, state_dtype=state_dtype)
        field = "exp_avg"
    else:
        opt = mpfunc.sgd(lr=1e-2, momentum=0.9, state_dtype=state_dtype)
        field = "momentum_buffer"
    state = opt.init(masters)
    for k in range(3):
        grads = _tree(10 + k)
        # torch.optim on a float64 copy holding this step's decoded moments.
        ref = torch.nn.Parameter(masters["w"].clone())
        ref.grad = grads["w"].clone()
        m = getattr(state, field)["w"]
        if rule == "adamw":
            torch_opt: torch.optim.Optimizer = torch.optim.AdamW(
                [ref], lr=1e-2, weight_decay=0.1, foreach=False
            )
            torch_opt.state[ref] = {
                "step": state.step["w"].clone(),
                "exp_avg": _decoded(m).double(),
                "exp_avg_sq": _decoded(state.exp_avg_sq["w"]).double(),
            }
        else:
            torch_opt = torch.optim.SGD([ref], lr=1e-2, momentum=0.9, foreach=False)
            if k > 0:  # torch clones the grad into the buffer at the first step
                torch_opt.state[ref] = {"momentum_buffer": _decoded(m).double()}
        torch_opt.step()
        mpfunc.apply_update_(masters, grads, state, opt, params=params)
        # The float64 step, as torch.optim's to within rounding order (fused vs per-op).
        torch.testing.assert_close(masters["w"], ref.detach(), rtol=1e-13, atol=1e-15)
        new = getattr(state, field)["w"]
        want = torch_opt.state[ref]["exp_avg" if rule == "adamw" else "momentum_buffer"]
        assert torch.equal(new.codes, _codes_of(want.float(), new))
        assert state.step["w"].item() == k + 1
        assert params["a"].dtype == torch.bfloat16 and masters["a"].dtype == torch.float32


@pytest.mark.parametrize("state_dtype", [None, torch.bfloat16, torch.uint8, U4], ids=str)
@pytest.mark.parametrize("rule", ["adamw", "lion"])
def test_float64_param_under_none_steps_as_a_float64_master(rule: str, state_dtype: Any) -> None:
    # "none" steps the param itself, in its own float64: as an "fp32" strategy's float64
    # master does, bit for bit, for every state format.
    make = mpfunc.adamw if rule == "adamw" else mpfunc.lion
    runs = []
    for strategy in ("none", "fp32"):
        params = _tree(1)
        masters = mpfunc.init_master(params, strategy=strategy)
        opt = make(lr=1e-3, state_dtype=state_dtype)
        state = opt.init(masters)
        for k in range(3):
            kw = {"params": params} if strategy == "fp32" else {}
            mpfunc.apply_update_(masters, _tree(20 + k), state, opt, **kw)
        # Leaf "w" only: "a" (bf16) has no master under "none" and an fp32 one under "fp32".
        fields = {f: getattr(state, f) for f in state._fields}
        runs.append((params["w"], {f: v["w"] for f, v in fields.items() if v is not None}))
    assert_bits_equal(runs[0][0], runs[1][0])
    assert runs[0][1].keys() == runs[1][1].keys()
    for f in runs[0][1]:
        for a, b in zip(leaves(runs[0][1][f]), leaves(runs[1][1][f]), strict=True):
            assert a.dtype == b.dtype and torch.equal(
                a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)
            )


@pytest.mark.parametrize("impl", ["auto", "foreach", "reference"])
def test_float64_lion_with_8bit_state_every_impl(impl: str) -> None:
    results = []
    for use in ("foreach", impl):
        params = _tree(2)
        masters = mpfunc.init_master(params)
        opt = mpfunc.lion(lr=1e-3, weight_decay=0.1, state_dtype=torch.uint8, impl=use)
        state = opt.init(masters)
        for k in range(3):
            mpfunc.apply_update_(masters, _tree(30 + k), state, opt, params=params)
        results.append((masters["w"], state.exp_avg["w"]))
    assert_bits_equal(results[0][0], results[1][0])
    assert torch.equal(results[0][1].codes, results[1][1].codes)


def test_master_optimizer_float64_param_with_8bit_state() -> None:
    q = torch.nn.Parameter(torch.randn(N).bfloat16())
    p = torch.nn.Parameter(torch.randn(N, dtype=torch.float64))
    opt = mpfunc.MasterOptimizer([q, p], lr=1e-2, state_dtype=torch.uint8)
    q0 = q.detach().clone()
    ref = torch.nn.Parameter(p.detach().clone())
    torch_opt = torch.optim.AdamW([ref], lr=1e-2, foreach=False)
    q.grad, p.grad = torch.randn(N).bfloat16(), torch.randn(N, dtype=torch.float64)
    ref.grad = p.grad.clone()
    opt.step()
    torch_opt.step()  # first step: moments from zero, as the 8-bit ones start
    torch.testing.assert_close(p.detach(), ref.detach(), rtol=1e-13, atol=1e-15)
    assert not torch.equal(q.detach(), q0)


@pytest.mark.parametrize("state_dtype", [torch.uint8, U4], ids=str)
def test_frozen_small_param_trained_later_is_refused_by_name(state_dtype: Any) -> None:
    # Frozen when added (no master, no state), trained later: too small for a block. The
    # refusal names the param as add_param_group does, offers a param group, and comes
    # before anything is written, the other param's step included.
    big = torch.nn.Parameter(torch.randn(64).bfloat16())
    small = torch.nn.Parameter(torch.randn(10).bfloat16(), requires_grad=False)
    opt = mpfunc.MasterOptimizer([big, small], lr=1e-3, state_dtype=state_dtype)
    big.grad = torch.randn(64).bfloat16()
    opt.step()
    small.requires_grad_(True)
    big.grad, small.grad = torch.randn(64).bfloat16(), torch.randn(10).bfloat16()
    watch = [big, small, state_tensors(opt)]
    snap = snapshot(watch)
    with pytest.raises(ValueError) as info:
        opt.step()
    text = str(info.value)
    assert text.startswith("MasterOptimizer.step: param_groups[0]: "), text
    assert "'param_groups[0].params[1]'" in text and "masters.1" not in text, text
    assert "'state_dtype': None" in text and "partition" not in text, text
    assert_unchanged(watch, snap)
    # Still refused, and still nothing written, at the next call.
    with pytest.raises(ValueError):
        opt.step()
    assert_unchanged(watch, snap)

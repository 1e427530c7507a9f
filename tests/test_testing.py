"""mpfunc.testing: the public strategies, the step-agreement check, the XLA step report,
and the example that property-tests a custom loop with them."""

from __future__ import annotations

import math
import sys
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from support.examples import load

import mpfunc
import mpfunc.testing as mt
from mpfunc.core import _tree

# --- strategies --------------------------------------------------------------------------


@pytest.mark.parametrize("layout", mt.GRAD_LAYOUTS)
@pytest.mark.parametrize("shape", [(), (5,), (3, 5), (2, 3, 2, 2)])
def test_in_layout_keeps_values_in_the_promised_layout(layout: str, shape: tuple[int, ...]) -> None:
    x = torch.randn(shape).to(torch.bfloat16)
    y = mt.in_layout(x, layout)
    assert y.shape == x.shape and y.dtype == x.dtype
    if layout == "expanded":
        if len(shape) >= 1 and shape[0] > 1:
            assert y.stride()[0] == 0 and torch.equal(y, x[:1].expand(shape))
        return
    assert torch.equal(y, x)
    fits = {
        "transposed": len(shape) >= 2,
        "channels_last": len(shape) == 4,
        "sliced": len(shape) >= 1,
        "offset": len(shape) >= 1,
    }
    if fits.get(layout):
        assert not y.is_contiguous() or layout == "offset"
    if layout == "offset" and len(shape) >= 1:
        assert y.storage_offset() == 3
    if layout == "channels_last" and len(shape) == 4:
        assert y.is_contiguous(memory_format=torch.channels_last)


def test_in_layout_refuses_an_unknown_layout() -> None:
    with pytest.raises(ValueError, match="expected one of contiguous, transposed"):
        mt.in_layout(torch.ones(2), "diagonal")


@settings(max_examples=30)
@given(params=mt.param_trees(), data=st.data())
def test_param_and_grad_trees_pair_up(params: Any, data: st.DataObject) -> None:
    grads = data.draw(mt.grad_trees(params))
    (p_leaves, p_spec), (g_leaves, g_spec) = _tree.flatten(params), _tree.flatten(grads)
    assert p_spec == g_spec
    for p, g in zip(p_leaves, g_leaves):
        if isinstance(p, torch.Tensor) and p.is_floating_point():
            assert p.dtype in mt.LOW_DTYPES and tuple(p.shape) in mt.SHAPES
            assert g is None or (g.shape == p.shape and g.dtype == p.dtype)
        else:
            assert g is None
    # What the strategies draw, mpfunc takes: the README loop runs on it.
    masters = mpfunc.init_master(params)
    opt = mpfunc.adamw(lr=1e-3)
    mpfunc.apply_update_(masters, mpfunc.grads_to_fp32(grads), opt.init(masters), opt)


def test_strategies_need_hypothesis_and_say_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "hypothesis", None)
    with pytest.raises(ImportError, match="need hypothesis: pip install hypothesis"):
        mt.param_trees()


# --- assert_steps_agree ------------------------------------------------------------------


def _trajectory(noise: float) -> Any:
    gen = torch.Generator().manual_seed(0)
    w = {"a": {"w": torch.ones(4)}, "b": None}

    def step(i: int) -> Any:
        w["a"]["w"] = w["a"]["w"] * 1.5 + noise * (i == 2) * torch.randn(4, generator=gen)
        return {"a": {"w": w["a"]["w"].clone()}, "b": None}

    return step


def test_steps_agree_within_the_bound_and_not_beyond() -> None:
    agreement = mt.assert_steps_agree(_trajectory(0.0), _trajectory(0.0), 5)
    assert agreement.worst_ratio == 0.0 and agreement.steps == 5
    # An error of 1e-7 relative at step 2 is within rtol=1e-6 of the largest magnitude.
    agreement = mt.assert_steps_agree(_trajectory(2.25e-7), _trajectory(0.0), 5)
    assert 0 < agreement.worst_ratio <= 1 and agreement.worst_path == "a.w"
    with pytest.raises(AssertionError, match=r"step 2: at 'a\.w': max\|a - b\| = .* exceeds"):
        mt.assert_steps_agree(_trajectory(1e-3), _trajectory(0.0), 5)
    with pytest.raises(AssertionError, match="differ in structure"):
        mt.assert_steps_agree(lambda i: {"w": torch.ones(1)}, lambda i: [torch.ones(1)], 1)
    with pytest.raises(AssertionError, match=r"at 'w': None vs"):
        mt.assert_steps_agree(lambda i: {"w": None}, lambda i: {"w": torch.ones(1)}, 1)


@pytest.mark.parametrize(
    "got, want",
    [
        ([1.0, 1.0], [math.inf, 1.0]),  # a finite value against an infinity
        ([-math.inf], [math.inf]),  # the other infinity
        ([math.inf, 1.0], [math.inf, 100.0]),  # inf - inf was a NaN error: no error
    ],
)
def test_steps_agree_catches_disagreements_beside_infinities(
    got: list[float], want: list[float]
) -> None:
    # Found in review: an infinity in the reference made the bound infinite (or the error
    # NaN), so every one of these passed with worst_ratio 0.
    with pytest.raises(AssertionError):
        mt.assert_steps_agree(lambda i: torch.tensor(got), lambda i: torch.tensor(want), steps=1)


def test_steps_agree_compares_python_and_complex_leaves() -> None:
    with pytest.raises(AssertionError, match=r"1\.0 vs 2\.0"):
        mt.assert_steps_agree(
            lambda i: (torch.ones(2), 1.0), lambda i: (torch.ones(2), 2.0), steps=1
        )
    with pytest.raises(AssertionError):
        mt.assert_steps_agree(
            lambda i: torch.tensor([1 + 1j]), lambda i: torch.tensor([1 + 5j]), steps=1
        )
    same = mt.assert_steps_agree(
        lambda i: (torch.tensor([math.inf, 2.0]), 3),
        lambda i: (torch.tensor([math.inf, 2.0]), 3),
        steps=2,
    )
    assert same.worst_ratio == 0.0


# --- the XLA step report -----------------------------------------------------------------


@pytest.mark.xla
def test_xla_report_sees_compiles_transfers_and_stability(xla_device: torch.device) -> None:
    x = torch.ones(4, device=xla_device)
    stable = mt.xla_step_report(lambda i: x.mul_(1.0001), steps=3)
    stable.assert_stable()
    assert [s.graphs for s in stable.steps] == [1, 1, 1]
    reads = mt.xla_step_report(lambda i: x.add_(1).sum().item(), steps=2)
    assert all(s.transfers_to_host >= 1 for s in reads.steps)
    shapes = mt.xla_step_report(lambda i: x.add_(torch.ones(4 + i, device=xla_device)[:4]), steps=2)
    assert all(s.compiles >= 1 for s in shapes.steps)
    with pytest.raises(AssertionError, match=r"step 2 compiled .*step 2 read"):
        mt.xla_step_report(
            lambda i: x.add_(torch.ones(4 + i, device=xla_device)[:4]).sum().item(), steps=1
        ).assert_stable()


# --- the example -------------------------------------------------------------------------


def test_example_property_tests_a_custom_loop(capsys: pytest.CaptureFixture[str]) -> None:
    load("property_test_loop").main(["--examples", "8", "--no-xla"])
    assert "agree with torch.optim" in capsys.readouterr().out


@pytest.mark.xla
def test_example_loop_is_stable_on_xla(xla_device: torch.device) -> None:
    report = load("property_test_loop").check_xla_stable(steps=3)
    assert report is not None and len(report.steps) == 3

"""Learning-rate schedules against ``torch.optim.lr_scheduler.LambdaLR``."""

from __future__ import annotations

import pytest
import torch
from support.trees import grads_for

import mpfunc


@pytest.mark.parametrize("name", ["sgd", "adam", "adamw"])
def test_schedule_matches_lambda_lr(name: str) -> None:
    """lr as a function of the step count equals torch's LambdaLR on fp32, within the
    stated bound (the schedule is evaluated in fp32 on the device, LambdaLR in
    float64 on the host)."""
    base = 0.05
    factor = lambda count: 0.9**count  # noqa: E731  (count: steps already taken)
    make = {"sgd": mpfunc.sgd, "adam": mpfunc.adam, "adamw": mpfunc.adamw}[name]
    kw = {"momentum": 0.9} if name == "sgd" else {}
    opt = make(lr=lambda step: base * factor(step), **kw)
    params = {"w": torch.randn(5, 3), "b": torch.randn(3)}
    masters = mpfunc.init_master(params)
    state = opt.init(masters)
    ref_t = [masters["b"].clone(), masters["w"].clone()]
    cls = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[name]
    ref = cls(ref_t, lr=base, **kw)
    sched = torch.optim.lr_scheduler.LambdaLR(ref, lr_lambda=factor)
    peak = max(float(t.abs().max()) for t in ref_t)
    for k in range(20):
        g = grads_for(k, params)
        masters, state = mpfunc.apply_update(masters, g, state, opt)
        ref_t[0].grad, ref_t[1].grad = g["b"], g["w"]
        ref.step()
        sched.step()
        peak = max(peak, *(float(t.abs().max()) for t in ref_t))
    for a, b in zip([masters["b"], masters["w"]], ref_t):
        assert float((a - b).abs().max()) <= 1e-6 * peak


def test_schedule_sees_the_step_count() -> None:
    seen: list[float] = []

    def lr(step: torch.Tensor) -> torch.Tensor:
        seen.append(float(step))  # a host read: fine in a test, not in a training loop
        return step * 0 + 0.1

    opt = mpfunc.sgd(lr=lr)
    m = {"w": torch.ones(2)}
    s = opt.init(m)
    for _ in range(3):
        m, s = mpfunc.apply_update(m, {"w": torch.ones(2)}, s, opt)
    assert seen[-3:] == [0.0, 1.0, 2.0]


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_schedule_counts_the_optimizers_steps_not_a_leafs(name: str) -> None:
    """A leaf whose grad is often ``None`` has taken fewer steps than the rest; sorted
    first in its (device, dtype) group it used to set everyone's lr (the schedule read
    the group's first leaf's count). Now the schedule reads the largest count, once per
    step, so every leaf follows torch's LambdaLR, which counts the optimizer's steps:
    "a" (grads on every third step) and "b" (every step) share the float32 group, "c"
    (float64, every other step) has its own."""
    base = 0.05
    factor = lambda count: 0.8**count  # noqa: E731
    calls: list[int] = []

    def lr(step: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return base * factor(step)

    kw = {"momentum": 0.9} if name == "sgd" else {}
    opt = {"sgd": mpfunc.sgd, "adamw": mpfunc.adamw}[name](lr=lr, **kw)
    params = {
        "a": torch.randn(4, 3), "b": torch.randn(3), "c": torch.randn(2, dtype=torch.float64)
    }  # fmt: skip
    masters = mpfunc.init_master(params)
    state = opt.init(masters)
    names = sorted(params)
    ref_t = [masters[n].clone() for n in names]
    cls = {"sgd": torch.optim.SGD, "adamw": torch.optim.AdamW}[name]
    ref = cls(ref_t, lr=base, **kw)
    sched = torch.optim.lr_scheduler.LambdaLR(ref, lr_lambda=factor)
    for k in range(12):
        g = grads_for(k, params)
        g = {n: (v.to(params[n].dtype) if {"a": k % 3 == 0, "b": True, "c": k % 2 == 0}[n]
                 else None) for n, v in g.items()}  # fmt: skip
        masters, state = mpfunc.apply_update(masters, g, state, opt)
        for t, n in zip(ref_t, names):
            t.grad = g[n]
        ref.step()
        sched.step()
    assert len(calls) == 12  # once per step: the two groups share one device
    assert [float(state.step[n]) for n in names] == [4.0, 12.0, 6.0]
    for n, r in zip(names, ref_t):  # the schedule runs in fp32 on the device, even for "c"
        assert float((masters[n] - r).abs().max()) <= 1e-6 * float(r.abs().max()), n

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


@pytest.mark.parametrize("kind", ["tensor", "schedule"])
def test_float64_masters_read_the_lr_in_float64(kind: str) -> None:
    """A tensor lr (or a schedule's tensor) reached float64 masters rounded to float32:
    every element off torch.optim on the same float64 params by ~3e-7, float32 error in a
    float64 run. Read in float64 there, the run is torch's fused AdamW bit for bit."""
    gen = torch.Generator().manual_seed(2)
    params = {"w": torch.randn(16, 16, generator=gen, dtype=torch.float64)}
    lr64 = torch.tensor(0.01, dtype=torch.float64)
    lr = lr64 if kind == "tensor" else (lambda step: lr64 * 1.0)
    opt = mpfunc.adamw(lr=lr, weight_decay=0.1)
    masters = mpfunc.init_master(params)
    assert masters["w"].dtype == torch.float64
    state = opt.init(masters)
    ref = torch.nn.Parameter(params["w"].clone())
    ref_opt = torch.optim.AdamW([ref], lr=0.01, weight_decay=0.1, fused=True)
    for _ in range(3):
        g = torch.randn(16, 16, generator=gen, dtype=torch.float64)
        mpfunc.apply_update_(masters, {"w": g}, state, opt)
        ref.grad = g.clone()
        ref_opt.step()
    assert torch.equal(masters["w"], ref.detach())


@pytest.mark.parametrize("impl", ["auto", "foreach"])
@pytest.mark.parametrize("name", ["sgd", "adamw", "lion"])
def test_a_schedule_value_is_checked_before_anything_is_written(impl: str, name: str) -> None:
    """A schedule returning a 1-d tensor (or a negative float) reached the kernels: the
    foreach path had already counted the step (and SGD's momentum) when torch refused it,
    and the native path named adam_mixed_ for SGD and Lion. The value is checked first."""
    make = {"sgd": lambda **k: mpfunc.sgd(momentum=0.9, **k), "adamw": mpfunc.adamw,
            "lion": mpfunc.lion}[name]  # fmt: skip
    for bad, err, says in (
        (lambda step: torch.full((2,), 1e-3), TypeError,
         r"lr: expected the schedule .*<lambda> to return a float or a 0-d floating-point "
         r"tensor, got torch\.float32 tensor of shape \(2,\)"),
        (lambda step: -1.0, ValueError, r"the schedule .*<lambda>'s value\): expected a finite "
         r"float >= 0, got -1\.0"),
    ):  # fmt: skip
        opt = make(lr=bad, impl=impl)
        masters = {"w": torch.randn(64)}
        state = opt.init(masters)
        mpfunc.apply_update_(masters, {"w": torch.ones(64)}, state, make(lr=0.0, impl=impl))
        snap = [t.clone() for t in (masters["w"], *[x["w"] for x in state if x is not None])]
        with pytest.raises(err, match=says):
            mpfunc.apply_update_(masters, {"w": torch.ones(64)}, state, opt)
        after = [masters["w"], *[x["w"] for x in state if x is not None]]
        assert all(torch.equal(a, b) for a, b in zip(snap, after))

"""``MasterOptimizer`` against torch.optim: schedulers, groups, GradScaler, checkpoints,
frozen params, and ``from_torch_optim``.

The reference is torch.optim over fp32 copies of the bf16 params, fed the same grads
upcast exactly. On CPU both sides run torch's fused AdamW kernel with the same float lr,
so the masters are compared bit for bit; on XLA (foreach, lr as a device tensor) within
the stated bound.
"""

from __future__ import annotations

import copy
import io
import re
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from support.helpers import assert_bits_equal, assert_close_bound, assert_unchanged, snapshot
from support.trees import sync

import mpfunc
from mpfunc.core import _tree
from mpfunc.optim._master_optimizer import NoGradWarning

LS = torch.optim.lr_scheduler
STEPS = 12
NAMED = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 6)  # named params


CPU = torch.device("cpu")


def make_params(device: torch.device = CPU, seed: int = 0) -> list[torch.Tensor]:
    """bf16 leaf params: a matrix, a transposed matrix, a bias, a 0-d scale."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(6, 4), (4, 6), (6,), ()]
    out = []
    for k, shape in enumerate(shapes):
        t = torch.randn(shape, generator=gen).to(torch.bfloat16)
        if k == 1:
            t = t.t().contiguous().t()  # column-major strides
        out.append(t.to(device).detach().requires_grad_())
    return out


def fp32_copies(params: list[torch.Tensor]) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(p.detach().cpu().float().clone()) for p in params]


def set_grads(k: int, params: list[torch.Tensor], ref: list[torch.Tensor]) -> None:
    gen = torch.Generator().manual_seed(1000 + k)
    for p, r in zip(params, ref):
        g = torch.randn(p.shape, generator=gen).to(torch.bfloat16)
        # In the param's layout, as autograd makes grads: torch's fused kernel pairs
        # elements by memory position (mpfunc pairs by index either way).
        p.grad = torch.empty_like(p).copy_(g)
        r.grad = torch.empty_like(r).copy_(g)


def masters(opt: mpfunc.MasterOptimizer) -> list[torch.Tensor]:
    return [opt.state[p]["master"] for g in opt.param_groups for p in g["params"]]


def adamw_pair(device: torch.device, **kw: Any) -> tuple[Any, Any, list[Any], list[Any]]:
    params, kw = make_params(device), {"lr": 1e-2, "weight_decay": 0.1, **kw}
    ref = fp32_copies(params)
    opt = mpfunc.MasterOptimizer(params, mpfunc.adamw, **kw)
    return opt, torch.optim.AdamW(ref, fused=True, **kw), params, ref


# Every scheduler of torch.optim.lr_scheduler, built over an optimizer; and how to step it.
SCHEDULERS: dict[str, Callable[[Any], Any]] = {
    "LambdaLR": lambda o: LS.LambdaLR(o, lambda e: min(e / 4, 1.0)),  # warm-up from lr 0.0
    "MultiplicativeLR": lambda o: LS.MultiplicativeLR(o, lambda e: 0.95),
    "StepLR": lambda o: LS.StepLR(o, step_size=3, gamma=0.5),
    "MultiStepLR": lambda o: LS.MultiStepLR(o, milestones=[2, 5, 9], gamma=0.3),
    "ConstantLR": lambda o: LS.ConstantLR(o, factor=0.25, total_iters=4),
    "LinearLR": lambda o: LS.LinearLR(o, start_factor=0.1, total_iters=5),
    "ExponentialLR": lambda o: LS.ExponentialLR(o, gamma=0.8),
    "SequentialLR": lambda o: LS.SequentialLR(
        o,
        [LS.LinearLR(o, start_factor=0.1, total_iters=3), LS.ExponentialLR(o, gamma=0.9)],
        milestones=[3],
    ),
    "CosineAnnealingLR": lambda o: LS.CosineAnnealingLR(o, T_max=8, eta_min=1e-4),
    "ChainedScheduler": lambda o: LS.ChainedScheduler(
        [LS.ConstantLR(o, factor=0.5, total_iters=4), LS.ExponentialLR(o, gamma=0.9)]
    ),
    "ReduceLROnPlateau": lambda o: LS.ReduceLROnPlateau(o, patience=1, factor=0.5),
    "CyclicLR": lambda o: LS.CyclicLR(
        o,
        base_lr=1e-3,
        max_lr=1e-2,
        step_size_up=3,
        cycle_momentum=True,
        base_momentum=0.8,
        max_momentum=0.9,
    ),  # betas[0] cycles
    "CosineAnnealingWarmRestarts": lambda o: LS.CosineAnnealingWarmRestarts(o, T_0=4, T_mult=2),
    "OneCycleLR": lambda o: LS.OneCycleLR(o, max_lr=2e-2, total_steps=STEPS),  # betas[0] too
    "PolynomialLR": lambda o: LS.PolynomialLR(o, total_iters=8, power=2.0),
    "SWALR": lambda o: torch.optim.swa_utils.SWALR(o, swa_lr=5e-3, anneal_epochs=4),
}


def sched_step(s: Any, k: int) -> None:
    if isinstance(s, LS.ReduceLROnPlateau):
        s.step(1.0)  # a plateau: halves the lr every other step
    else:
        s.step()


def hypers(opt: torch.optim.Optimizer) -> list[tuple[Any, ...]]:
    return [(g["lr"], tuple(g["betas"])) for g in opt.param_groups]


def test_every_scheduler_is_covered() -> None:
    """A scheduler torch adds later must join the table (or be argued inapplicable)."""
    assert set(LS.__all__) - {"LRScheduler"} <= set(SCHEDULERS)


@pytest.mark.filterwarnings(
    # SequentialLR steps its schedulers with an epoch argument, which torch itself
    # deprecates; not ours to fix.
    "ignore:The epoch parameter in `scheduler.step\\(\\)`:UserWarning"
)
@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_scheduler_drives_it_as_torch_optim(name: str) -> None:
    """The same lr (and betas) sequence as torch.optim.AdamW under the same scheduler,
    and bit-identical masters: both run torch's fused kernel with the same values."""
    opt, ref_opt, params, ref = adamw_pair(CPU)
    sched, ref_sched = SCHEDULERS[name](opt), SCHEDULERS[name](ref_opt)
    assert hypers(opt) == hypers(ref_opt)
    seen = set()
    for k in range(STEPS):
        set_grads(k, params, ref)
        opt.step()
        ref_opt.step()
        sched_step(sched, k)
        sched_step(ref_sched, k)
        assert hypers(opt) == hypers(ref_opt), f"step {k}"
        seen.add(hypers(opt)[0])
        opt.zero_grad()
    assert len(seen) > 1, "the schedule never changed the lr"
    for m, r in zip(masters(opt), ref):
        assert_bits_equal(m, r.detach())
    for p, m in zip(params, masters(opt)):
        assert_bits_equal(p.detach(), m.to(torch.bfloat16))


@pytest.mark.parametrize("cycle", ["OneCycleLR", "CyclicLR"])
def test_sgd_momentum_cycling(cycle: str) -> None:
    """SGD: the schedulers cycle ``momentum`` (a rebuild, not a recompile); against
    torch.optim.SGD within the bound (its single-tensor path orders ops differently)."""
    params = make_params()
    ref = fp32_copies(params)
    kw = {"lr": 1e-2, "momentum": 0.9, "weight_decay": 1e-3}
    opt = mpfunc.MasterOptimizer(params, mpfunc.sgd, **kw)
    ref_opt = torch.optim.SGD(ref, **kw)
    sched, ref_sched = SCHEDULERS[cycle](opt), SCHEDULERS[cycle](ref_opt)
    momenta = set()
    for k in range(STEPS):
        set_grads(k, params, ref)
        opt.step()
        ref_opt.step()
        sched.step()
        ref_sched.step()
        g = opt.param_groups[0]
        assert (g["lr"], g["momentum"]) == (
            ref_opt.param_groups[0]["lr"],
            ref_opt.param_groups[0]["momentum"],
        )
        momenta.add(g["momentum"])
        opt.zero_grad()
    assert len(momenta) > 2
    for m, r in zip(masters(opt), ref):
        assert_close_bound(m, r, lr=2e-2, steps=STEPS)


def test_param_groups_map_onto_partition() -> None:
    """Per-group values (no decay on biases, a smaller lr) as torch.optim's groups."""
    params = make_params()
    ref = fp32_copies(params)

    def groups(ps: list[Any]) -> list[dict[str, Any]]:
        return [
            {"params": [ps[0], ps[1]], "weight_decay": 0.1},
            {"params": [ps[2], ps[3]], "weight_decay": 0.0, "lr": 3e-3, "betas": (0.8, 0.99)},
        ]

    opt = mpfunc.MasterOptimizer(groups(params), mpfunc.adamw, lr=1e-2)
    ref_opt = torch.optim.AdamW(groups(ref), lr=1e-2, fused=True)
    sched, ref_sched = LS.CosineAnnealingLR(opt, T_max=6), LS.CosineAnnealingLR(ref_opt, T_max=6)
    for k in range(6):
        set_grads(k, params, ref)
        opt.step()
        ref_opt.step()
        sched.step()
        ref_sched.step()
        opt.zero_grad()
    assert hypers(opt) == hypers(ref_opt)
    for m, r in zip(masters(opt), ref):
        assert_bits_equal(m, r.detach())
    # One partition label per group.
    assert set(opt._states) == {"0", "1"}


@pytest.mark.skipif(not NAMED, reason="torch.optim takes named parameters from torch 2.6")
def test_named_parameters() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3)).to(torch.bfloat16)
    opt = mpfunc.MasterOptimizer(model.named_parameters(), mpfunc.adamw, lr=1e-3)
    names = [n for n, _ in model.named_parameters()]
    assert opt.state_dict()["param_groups"][0]["param_names"] == names
    model(torch.ones(2, 4, dtype=torch.bfloat16)).float().sum().backward()
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))


def test_grad_dtypes_and_fp32_params() -> None:
    """Grads are read in each param's dtype: bf16, fp16 and fp32 params in one group."""
    gen = torch.Generator().manual_seed(5)
    dtypes = [torch.bfloat16, torch.float16, torch.float32]
    params = [torch.randn(5, generator=gen).to(d).requires_grad_() for d in dtypes]
    ref = fp32_copies(params)
    opt = mpfunc.MasterOptimizer(params, mpfunc.adamw, lr=1e-2)
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, fused=True)
    for _ in range(3):
        for p, r in zip(params, ref):
            g = torch.randn(5, generator=gen).to(p.dtype)
            p.grad, r.grad = g, g.float()
        opt.step()
        ref_opt.step()
    for p, m, r in zip(params, masters(opt), ref):
        assert m.dtype == torch.float32
        assert_bits_equal(m, r.detach())
        assert_bits_equal(p.detach(), m.to(p.dtype))


def test_zero_grad_and_closure() -> None:
    params = make_params()
    opt = mpfunc.MasterOptimizer(params, mpfunc.sgd, lr=0.1)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = sum(p.float().square().sum() for p in params)
        assert isinstance(loss, torch.Tensor)
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert isinstance(loss, torch.Tensor) and loss.requires_grad
    assert all(p.grad is not None for p in params)
    opt.zero_grad()
    assert all(p.grad is None for p in params)
    opt.zero_grad(set_to_none=False)  # nothing to zero: grads stay None, as torch.optim


def test_skip_keeps_every_bit() -> None:
    opt, _, params, ref = adamw_pair(CPU)
    set_grads(0, params, ref)
    opt.step()
    snap = snapshot([masters(opt), params, [opt.state[p]["exp_avg"] for p in params]])
    set_grads(1, params, ref)
    opt.step(skip=torch.tensor(True))
    assert_unchanged_all(opt, params, snap)
    opt.step(skip=torch.tensor(False))
    assert not torch.equal(masters(opt)[0], snap[0][0])
    with pytest.raises(TypeError, match="skip: expected None or a 0-d bool tensor"):
        opt.step(skip=True)  # type: ignore[arg-type]


def assert_unchanged_all(opt: Any, params: list[Any], snap: list[Any]) -> None:
    now = [t.detach() for t in masters(opt) + params + [opt.state[p]["exp_avg"] for p in params]]
    for t, (clone, _) in zip(now, snap):
        assert_bits_equal(t, clone.to(t.device))


# --- GradScaler ---------------------------------------------------------------------------


def scaler_run(unscale: bool, poison: int | None) -> tuple[Any, Any, list[Any]]:
    """Trains under torch.amp.GradScaler; ``poison`` puts an inf into that step's grads."""
    params = make_params()
    opt = mpfunc.MasterOptimizer(params, mpfunc.adamw, lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    scales = []
    for k in range(5):
        opt.zero_grad()
        loss = sum((p.float() * (k + 1 + i)).sum() for i, p in enumerate(params))
        assert isinstance(loss, torch.Tensor)
        if k == poison:
            loss = loss + params[0].float().sum() * float("inf")
        scaler.scale(loss).backward()
        if unscale:
            scaler.unscale_(opt)  # e.g. to clip; the step then divides by nothing
            torch.nn.utils.clip_grad_norm_(params, max_norm=1e9)  # a no-op clip
        scaler.step(opt)
        scaler.update()
        scales.append(float(scaler.get_scale()))
    return opt, params, scales


def unscaled_run(skip_at: int | None) -> tuple[Any, list[Any]]:
    params = make_params()
    opt = mpfunc.MasterOptimizer(params, mpfunc.adamw, lr=1e-2)
    for k in range(5):
        opt.zero_grad()
        loss = sum((p.float() * (k + 1 + i)).sum() for i, p in enumerate(params))
        assert isinstance(loss, torch.Tensor)
        loss.backward()
        opt.step(skip=torch.tensor(k == skip_at))
    return opt, params


@pytest.mark.parametrize("unscale", [False, True], ids=["step", "unscale_-then-step"])
@pytest.mark.parametrize("poison", [None, 2], ids=["finite", "inf-at-2"])
def test_grad_scaler_protocol(unscale: bool, poison: int | None) -> None:
    """``scaler.step(opt)`` goes through torch's ``_step_supports_amp_scaling`` protocol:
    the scale is divided out in fp32 inside the step and an inf skips it on the device.
    Power-of-two scales are exact, so the result is bit-identical to unscaled training
    with the same step skipped."""
    opt, params, scales = scaler_run(unscale, poison)
    want_opt, want_params = unscaled_run(poison)
    for a, b in zip(masters(opt) + params, masters(want_opt) + want_params):
        assert_bits_equal(a.detach(), b.detach())
    if poison is not None:
        assert scales[poison] == scales[poison - 1] / 2  # backed off
    for p in params:
        assert float(opt.state[p]["step"]) == (5 if poison is None else 4)


def test_grad_scaler_fp16_params() -> None:
    """fp16 params: ``scaler.step(opt)`` works (unscaled in fp32 inside the step);
    GradScaler itself refuses ``unscale_`` of fp16 grads, as documented."""
    p = torch.ones(4, dtype=torch.float16, requires_grad=True)
    opt = mpfunc.MasterOptimizer([p], mpfunc.sgd, lr=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    scaler.scale((p.float() * 3).sum()).backward()
    assert float(p.grad[0]) == 3 * 2**12
    scaler.step(opt)
    scaler.update()
    assert_bits_equal(p.detach(), torch.full((4,), -0.5, dtype=torch.float16))
    scaler.scale((p.float() * 3).sum()).backward()
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
        scaler.unscale_(opt)


# --- checkpoints --------------------------------------------------------------------------


def checkpointed_run(split: int | None) -> list[torch.Tensor]:
    """Trains STEPS steps under OneCycleLR; with ``split``, saves there (optimizer,
    scheduler and bf16 model through torch.save), rebuilds everything and resumes."""
    opt, _, params, ref = adamw_pair(CPU)
    sched = SCHEDULERS["OneCycleLR"](opt)
    for k in range(STEPS):
        if k == split:
            buf = io.BytesIO()
            torch.save(
                {
                    "opt": opt.state_dict(),
                    "sched": sched.state_dict(),
                    "model": [p.detach() for p in params],
                },
                buf,
            )
            buf.seek(0)
            ckpt = torch.load(buf, weights_only=True)
            params = make_params(seed=7)  # other values: all come from the checkpoint
            with torch.no_grad():
                for p, saved in zip(params, ckpt["model"]):
                    p.copy_(saved)
            opt = mpfunc.MasterOptimizer(params, mpfunc.adamw, lr=1.0, weight_decay=0.5)
            sched = SCHEDULERS["OneCycleLR"](opt)
            opt.load_state_dict(ckpt["opt"])
            sched.load_state_dict(ckpt["sched"])
        set_grads(k, params, ref)
        opt.step()
        sched.step()
        opt.zero_grad()
    return masters(opt) + [opt.state[p][k] for p in params for k in ("exp_avg", "step")] + params


def test_state_dict_is_torch_format_and_resumes_bit_exactly() -> None:
    opt, _, _, _ = adamw_pair(CPU)
    sd = opt.state_dict()
    assert sorted(sd) == ["param_groups", "state"]
    assert sorted(sd["state"]) == [0, 1, 2, 3]
    assert sorted(sd["state"][0]) == ["exp_avg", "exp_avg_sq", "master", "step"]
    assert sd["state"][0]["master"].dtype == torch.float32
    assert sd["param_groups"][0]["params"] == [0, 1, 2, 3]
    assert sd["param_groups"][0]["betas"] == (0.9, 0.999)
    straight, resumed = checkpointed_run(None), checkpointed_run(5)
    for a, b in zip(straight, resumed):
        assert_bits_equal(a.detach(), b.detach())


def test_load_state_dict_checks_everything_before_writing() -> None:
    opt, _, params, ref = adamw_pair(CPU)
    set_grads(0, params, ref)
    opt.step()
    good = opt.state_dict()
    snap = snapshot([masters(opt), [opt.state[p]["exp_avg"] for p in params]])
    lr = opt.param_groups[0]["lr"]

    def bad(edit: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
        sd = {
            "state": {k: dict(v) for k, v in good["state"].items()},
            "param_groups": [dict(g, lr=0.5) for g in good["param_groups"]],
        }
        edit(sd)
        return sd

    cases = [
        (
            lambda sd: sd["state"][2].update(exp_avg=sd["state"][2]["exp_avg"].bfloat16()),
            ValueError,
            r"state\[2\].*'exp_avg'.*expected torch.float32",
        ),
        (lambda sd: sd["state"][3].pop("master"), ValueError, "expected the keys"),
        (lambda sd: sd["state"][1].update(master=torch.zeros(3)), ValueError, "shape"),
        (lambda sd: sd["param_groups"][0].update(params=[0, 1]), ValueError, "expected 4 params"),
        (lambda sd: sd["state"].update({9: {}}), ValueError, "param indices"),
    ]
    for edit, cls, match in cases:
        with pytest.raises(cls, match=match):
            opt.load_state_dict(bad(edit))
        assert_unchanged_all_state(opt, params, snap)
        assert opt.param_groups[0]["lr"] == lr
    with pytest.raises(TypeError, match="'state' and 'param_groups'"):
        opt.load_state_dict({"state": {}})


def _without(group: dict[str, Any], key: str) -> None:
    del group[key]


@pytest.mark.parametrize(
    ("edit", "cls", "match"),
    [
        (
            lambda g: g.update(lr="abc"),
            TypeError,
            r"load_state_dict: param_groups\[1\]: adamw: lr: expected a float >= 0, got str",
        ),
        (
            lambda g: g.update(lr=-1.0),
            ValueError,
            r"load_state_dict: param_groups\[1\]: adamw: lr: expected a finite float >= 0, got -1",
        ),
        (
            lambda g: _without(g, "betas"),
            ValueError,
            r"load_state_dict: param_groups\[1\]: expected the hyperparameters lr, betas, eps, "
            r"weight_decay, amsgrad, maximize, impl, state_dtype \(those of adamw\), got no betas",
        ),
        (lambda g: g.update(betas=(1.5, 0.9)), ValueError, r"param_groups\[1\]: adamw: betas\[0\]"),
        (
            lambda g: g.update(amsgrad=True),
            ValueError,
            r"param_groups\[1\]: expected values whose state this optimizer holds \(exp_avg, "
            r"exp_avg_sq, step\), got values that use exp_avg, exp_avg_sq, max_exp_avg_sq, step",
        ),
    ],
    ids=["lr-str", "lr-negative", "no-betas", "betas", "amsgrad"],
)
def test_load_state_dict_checks_hyperparameters_before_writing(
    edit: Callable[[dict[str, Any]], None], cls: type[Exception], match: str
) -> None:
    """The saved groups' values meet the rules the constructor applies, before anything
    is loaded: a refused dict changes no tensor, no value and no group."""
    params = make_params()
    opt = mpfunc.MasterOptimizer([{"params": params[:2]}, {"params": params[2:]}], lr=1e-2)
    for k in range(2):
        set_grads(k, params, fp32_copies(params))
        opt.step()
    sd = opt.state_dict()
    sd = {
        "state": {k: {n: t.clone() + 1 for n, t in v.items()} for k, v in sd["state"].items()},
        "param_groups": [dict(g, lr=0.5) for g in sd["param_groups"]],
    }
    edit(sd["param_groups"][1])
    snap = snapshot([masters(opt), params, [list(opt.state[p].values()) for p in params]])

    def values() -> list[Any]:
        return [
            ({k: v for k, v in g.items() if k != "params"}, [id(p) for p in g["params"]])
            for g in opt.param_groups
        ]

    groups = copy.deepcopy(values())
    with pytest.raises(cls, match=match):
        opt.load_state_dict(sd)
    assert_unchanged([masters(opt), params, [list(opt.state[p].values()) for p in params]], snap)
    assert values() == groups
    opt.step()  # the optimizer still steps with its own values


def assert_unchanged_all_state(opt: Any, params: list[Any], snap: list[Any]) -> None:
    now = masters(opt) + [opt.state[p]["exp_avg"] for p in params]
    for t, (clone, version) in zip(now, snap):
        assert t._version == version
        assert_bits_equal(t, clone)


# --- frozen params, params written outside ------------------------------------------------


def test_frozen_params_get_no_master_or_state() -> None:
    params = make_params()
    params[0].requires_grad_(False)
    ref = fp32_copies(params)
    opt = mpfunc.MasterOptimizer(params, mpfunc.adamw, lr=1e-2)
    ref_opt = torch.optim.AdamW(ref[1:], lr=1e-2, fused=True)
    assert params[0] not in opt.state
    assert opt._masters[0] is None
    assert all(getattr(opt._states["0"], f)[0] is None for f in ("exp_avg", "exp_avg_sq"))
    assert sorted(opt.state_dict()["state"]) == [1, 2, 3]
    frozen_before = params[0].detach().clone()
    for k in range(3):
        set_grads(k, params[1:], ref[1:])
        opt.step()
        ref_opt.step()
    assert_bits_equal(params[0].detach(), frozen_before)
    for m, r in zip(opt._masters[1:], ref[1:]):
        assert m is not None
        assert_bits_equal(m, r.detach())
    # Unfrozen later: master and state are made at its first grad, as torch.optim does.
    params[0].requires_grad_(True)
    params[0].grad = torch.ones(6, 4, dtype=torch.bfloat16)
    opt.step()
    assert float(opt.state[params[0]]["step"]) == 1
    assert sorted(opt.state_dict()["state"]) == [0, 1, 2, 3]


def test_params_written_outside_are_taken_up() -> None:
    """``model.load_state_dict`` after building the optimizer: the step starts from the
    loaded values, as torch.optim would; an element rewritten with its own value keeps
    its master's fp32 bits."""
    opt, _, params, ref = adamw_pair(CPU)
    set_grads(0, params, ref)
    opt.step()
    kept = masters(opt)[1].clone()
    loaded = [p.detach().clone() + 1 for p in params]
    with torch.no_grad():
        params[0].copy_(loaded[0])
        params[1].mul_(1)  # a write that changes no value
    assert_bits_equal(masters(opt)[1], kept)
    params[0].grad = params[1].grad = None
    params[2].grad = params[3].grad = None
    with pytest.warns(NoGradWarning, match="no param this optimizer trains has a .grad"):
        opt.step()  # no grads: only the resync
    assert_bits_equal(masters(opt)[0], loaded[0].float())
    assert_bits_equal(masters(opt)[1], kept)


def test_a_model_moved_after_the_optimizer_is_not_trained_silently() -> None:
    """``model.to(device)`` after making the optimizer gives the model new Parameters on
    a device whose tensors cannot share a CPU one's (XLA, CUDA); the optimizer's params
    never get a grad, and torch.optim (and mpfunc) then step nothing with no word. The
    first step without any grad warns, naming that cause; once per optimizer, and never
    where grads exist."""
    model = torch.nn.Linear(8, 4).to(torch.bfloat16)
    opt = mpfunc.MasterOptimizer(model.parameters(), mpfunc.adamw, lr=1e-2)
    held = list(model.parameters())
    model.weight = torch.nn.Parameter(model.weight.detach().clone())  # what .to(xla) does
    model.bias = torch.nn.Parameter(model.bias.detach().clone())
    model(torch.randn(2, 8, dtype=torch.bfloat16)).float().sum().backward()
    cause = r"moved with \.to\(device\)/\.cuda\(\) after the optimizer was made.*make the"
    with pytest.warns(NoGradWarning, match=cause):
        opt.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()  # once per optimizer
        opt2 = mpfunc.MasterOptimizer(held, mpfunc.adamw, lr=1e-2)
        held[0].grad = torch.ones_like(held[0])
        opt2.step()  # a grad somewhere: no warning
    assert all(p.grad is None for p in held[1:])


@pytest.mark.parametrize("change", ["append", "replace", "new group", "drop group"])
def test_params_added_by_hand_are_refused_not_left_untrained(change: str) -> None:
    """torch.optim trains a param appended to ``param_groups[i]["params"]`` (its state is
    made at the first step); MasterOptimizer makes masters when a group is added, so such
    a param, another list or a group appended or removed by hand was silently not trained.
    Refused before anything is written; add_param_group still works."""
    params = make_params()
    opt = mpfunc.MasterOptimizer(params[:3], mpfunc.adamw, lr=1e-2)
    extra = params[3]
    groups = opt.param_groups
    if change == "append":
        groups[0]["params"].append(extra)
        match = r"param_groups\[0\]\['params'\]: expected the 3 params the group was made "
        match += r"with, got a list of 4 \(the same list, changed\).*opt\.add_param_group"
    elif change == "replace":
        groups[0]["params"] = [*groups[0]["params"], extra]
        match = r"got a list of 4 \(another list\)"
    elif change == "new group":
        groups.append({**groups[0], "params": [extra]})
        match = r"param_groups: expected the 1 groups this optimizer holds, got 2"
    else:
        groups.pop()
        match = r"param_groups: expected the 1 groups this optimizer holds, got 0"
    for p in params:
        p.grad = torch.ones_like(p)
    snap = snapshot(params)
    with pytest.raises(ValueError, match=match):
        opt.step()
    assert_unchanged(params, snap)
    opt2 = mpfunc.MasterOptimizer(params[:3], mpfunc.adamw, lr=1e-2)
    opt2.add_param_group({"params": [extra]})
    opt2.step()
    assert not torch.equal(extra.detach(), snap[3][0].to(extra.device))


def test_a_model_with_fp32_norms_takes_a_strategy_per_param() -> None:
    """A model that keeps its norms in fp32 beside bf16 weights was refused by every
    strategy but "fp32", with a hint (a function of path and param) that MasterOptimizer
    did not take. ``strategy=`` now takes ``(name, param) -> name``: "remainder" for the
    bf16 weights and "none" for the fp32 norms (their own exact masters) train bit for bit
    as torch's fused AdamW on fp32 copies, an emptied entry starts afresh with its own
    strategy, and a single name names the param and the way out."""
    gen = torch.Generator().manual_seed(4)
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.LayerNorm(4))
    model[0].to(torch.bfloat16)
    ref = [torch.nn.Parameter(p.detach().float().clone()) for p in model.parameters()]
    kw = {"lr": 1e-2, "weight_decay": 0.1}
    # torch.optim takes named parameters from torch 2.6; before, names are list positions.
    named = model.named_parameters if NAMED else model.parameters
    opt = mpfunc.MasterOptimizer(
        named(), mpfunc.adamw,
        strategy=lambda name, p: "remainder" if p.dtype == torch.bfloat16 else "none", **kw,
    )  # fmt: skip
    ref_opt = torch.optim.AdamW(ref, fused=True, **kw)
    params = list(model.parameters())
    assert [sorted(opt.state[p]) for p in params][1::2] == [
        ["exp_avg", "exp_avg_sq", "remainder", "step", "ties"], ["exp_avg", "exp_avg_sq", "step"]
    ]  # fmt: skip
    for k in range(5):
        for p, r in zip(params, ref):
            g = torch.randn(p.shape, generator=gen).to(p.dtype)
            p.grad, r.grad = g.clone(), g.float()
        opt.step()
        ref_opt.step()
        if k == 2:
            opt.state[params[0]] = {}  # starts afresh, as a "remainder" master again
            ref_opt.state[ref[0]] = {}
            with torch.no_grad():
                ref[0].copy_(params[0].float())
    for p, r in zip(params, ref):  # the bf16 params: the exact master rounded
        assert_bits_equal(p.detach(), r.detach().to(p.dtype))
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert_bits_equal(opt.state[p][name], ref_opt.state[r][name])
    norm_w = r"1\.weight" if NAMED else r"param_groups\[0\]\.params\[2\]"
    bias = "0.bias" if NAMED else "param_groups[0].params[1]"
    with pytest.raises(ValueError, match=(
        rf"MasterOptimizer: param_groups\[0\]: init_master: at '{norm_w}': expected a param "
        r"the 'remainder' strategy applies to, got torch\.float32 .*strategy=lambda path, p: "
        r"'remainder' if p\.dtype == torch\.bfloat16 else 'none'"
    )):  # fmt: skip
        mpfunc.MasterOptimizer(named(), mpfunc.adamw, strategy="remainder")
    with pytest.raises(ValueError, match=rf"strategy\('{re.escape(bias)}'\): expected a strategy"):
        mpfunc.MasterOptimizer(named(), strategy=lambda n, p: "fp8" if n == bias else "fp32")


# --- opt.state is the live state, as in torch.optim -----------------------------------------


def assert_same_as_torch(opt: Any, ref_opt: Any, params: list[Any], ref: list[Any]) -> None:
    for p, m, r in zip(params, masters(opt), ref):
        assert_bits_equal(m, r.detach())
        assert_bits_equal(p.detach(), m.to(torch.bfloat16))
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert_bits_equal(opt.state[p][k], ref_opt.state[r][k])


def test_state_writes_are_the_state_as_in_torch_optim() -> None:
    """The "reset the moments" idioms on ``opt.state``: written in place (``.zero_()``),
    replaced (``= torch.zeros_like(...)``), the step count or the master replaced, a whole
    entry emptied (``= {}``), ``opt.state.clear()``. The next step uses what was written,
    bit for bit as torch.optim, and ``state_dict()`` saves what that step uses."""
    opt, ref_opt, params, ref = adamw_pair(CPU)

    def step_both(k: int) -> None:
        set_grads(k, params, ref)
        opt.step()
        ref_opt.step()

    step_both(0)
    step_both(1)
    for o, ps in ((opt, params), (ref_opt, ref)):
        o.state[ps[0]]["exp_avg_sq"].zero_()
        with torch.no_grad():  # the master written in place (torch.optim: the param itself)
            (o.state[ps[0]]["master"] if o is opt else ps[0]).mul_(-2.0)
        o.state[ps[1]]["exp_avg"] = torch.zeros_like(o.state[ps[1]]["exp_avg"])
        o.state[ps[2]]["step"] = torch.zeros_like(o.state[ps[2]]["step"])
    assigned = opt.state[params[1]]["exp_avg"]
    opt.state[params[3]]["master"] = torch.full_like(masters(opt)[3], 5.0)
    with torch.no_grad():
        ref[3].fill_(5.0)
    saved = opt.state_dict()["state"]
    assert float(saved[3]["master"]) == 5.0 and not saved[1]["exp_avg"].any()
    assert float(params[3].detach()) == 5.0  # the param shows the master it now has
    step_both(2)
    assert opt.state[params[1]]["exp_avg"] is assigned  # the assigned tensor is the state
    assert_same_as_torch(opt, ref_opt, params, ref)
    # A param's whole entry, then all of them: state afresh, the master from the param.
    opt.state[params[0]] = {}
    ref_opt.state[ref[0]] = {}
    with torch.no_grad():
        ref[0].copy_(params[0].float())
    step_both(3)
    assert_same_as_torch(opt, ref_opt, params, ref)
    opt.state.clear()
    ref_opt.state.clear()
    with torch.no_grad():
        for p, r in zip(params, ref):
            r.copy_(p.float())
    assert sorted(opt.state_dict()["state"]) == [0, 1, 2, 3]
    step_both(4)
    assert_same_as_torch(opt, ref_opt, params, ref)
    assert float(opt.state[params[0]]["step"]) == 1
    # load_state_dict loads into the entries the next step uses.
    sd = opt.state_dict()
    assigned = opt.state[params[1]]["exp_avg"] = torch.zeros(4, 6)
    opt.load_state_dict(sd)
    assert opt.state[params[1]]["exp_avg"] is assigned
    assert_bits_equal(assigned, sd["state"][1]["exp_avg"])


def _drop(entry: dict[str, Any], key: str) -> None:
    del entry[key]


STATE_WRITES: list[tuple[Callable[[dict[str, Any]], None], type[Exception], str]] = [
    (
        lambda e: e.update(exp_avg=e["exp_avg"].bfloat16()),
        ValueError,
        r"at 'opt\.state\[param_groups\[0\]\.params\[1\]\]\.exp_avg': expected "
        r"torch\.float32 tensor of shape \(4, 6\) on cpu \(like the one it replaces\), got "
        r"torch\.bfloat16 tensor of shape \(4, 6\) on cpu",
    ),
    (
        lambda e: e.update(exp_avg_sq=torch.zeros(6, 4)),
        ValueError,
        r"\.exp_avg_sq': expected torch.float32 tensor of shape \(4, 6\).*got torch"
        r"\.float32 tensor of shape \(6, 4\)",
    ),
    (lambda e: e.update(step=0), TypeError, r"\.step': expected .*, got int 0"),
    (lambda e: e.update(master=None), TypeError, r"\.master': expected .*, got None"),
    (
        lambda e: _drop(e, "exp_avg"),
        ValueError,
        r"at 'opt\.state\[param_groups\[0\]\.params\[1\]\]': expected the keys \['exp_avg', "
        r"'exp_avg_sq', 'master', 'step'\] \(or an empty dict.*\), got \['exp_avg_sq', 'master', "
        r"'step'\]",
    ),
    (
        lambda e: e.update(momentum_buffer=torch.zeros(4, 6)),
        ValueError,
        r"expected the keys .*, got \['exp_avg', 'exp_avg_sq', 'master', 'momentum_buffer', ",
    ),
]


@pytest.mark.parametrize("where", ["step", "state_dict"])
@pytest.mark.parametrize("case", range(len(STATE_WRITES)))
def test_a_bad_state_write_is_refused_before_any_write(case: int, where: str) -> None:
    """A replaced entry that is not like the one it replaces (dtype, shape, device), a
    missing or extra key: refused by the next ``step()`` or ``state_dict()``, naming the
    entry, before any tensor is written; put right, the step runs."""
    edit, cls, match = STATE_WRITES[case]
    opt, _, params, ref = adamw_pair(CPU)
    set_grads(0, params, ref)
    opt.step()
    good = dict(opt.state[params[1]])

    def held() -> list[Any]:  # what the step writes: masters, params, the group's state
        return [opt._masters, params, list(opt._states["0"])]

    snap = snapshot(held())
    groups = [dict(g) for g in opt.param_groups]
    opt.state[params[0]]["exp_avg"] = torch.zeros(6, 4)  # a good write beside the bad one
    edit(opt.state[params[1]])
    with pytest.raises(cls, match=match):
        opt.step() if where == "step" else opt.state_dict()
    assert_unchanged(held(), snap)
    assert opt.param_groups == groups
    opt.state[params[1]] = good
    opt.step()
    assert not opt.state[params[0]]["exp_avg"].eq(0).all()


# --- errors -------------------------------------------------------------------------------


def test_errors_name_what_was_expected() -> None:
    ps = make_params()
    with pytest.raises(TypeError, match="got a built adamw optimizer"):
        mpfunc.MasterOptimizer(ps, mpfunc.adamw(lr=1e-3))
    with pytest.raises(TypeError, match=r"MasterOptimizer\.from_torch"):
        mpfunc.MasterOptimizer(ps, torch.optim.AdamW)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="got momentum"):
        mpfunc.MasterOptimizer(ps, mpfunc.adamw, momentum=0.9)
    with pytest.raises(ValueError, match=r"param_groups\[1\]: adamw: betas\[0\]"):
        mpfunc.MasterOptimizer([{"params": ps[:2]}, {"params": ps[2:], "betas": (1.5, 0.9)}])
    with pytest.raises(ValueError, match="strategy"):
        mpfunc.MasterOptimizer(ps, strategy="fp8")
    with pytest.raises(ValueError, match="shares no memory"):
        base = torch.zeros(8, dtype=torch.bfloat16, requires_grad=True)
        mpfunc.MasterOptimizer([base, base.detach()[:4].requires_grad_()])


@pytest.mark.parametrize("change", ["state_dtype", "lr"])
def test_a_bad_change_raises_before_writing(change: str) -> None:
    opt, _, params, ref = adamw_pair(CPU)
    set_grads(0, params, ref)
    opt.step()
    snap = snapshot([masters(opt), params, [opt.state[p]["exp_avg"] for p in params]])
    if change == "state_dtype":  # the moments would need converting
        opt.param_groups[0]["state_dtype"] = torch.uint8
        match = (
            r"param_groups\[0\]: state_dtype: expected None \(the format this group's "
            r"moments were made in\), got torch\.uint8\. Moments are not converted mid-run"
        )
    else:
        opt.param_groups[0]["lr"] = -1.0
        match = r"param_groups\[0\]: adamw: lr"
    with pytest.raises(ValueError, match=match):
        opt.step()
    assert_unchanged_all(opt, params, snap)
    opt.param_groups[0][change] = None if change == "state_dtype" else 1e-2
    opt.step()  # set back, the run goes on


def test_momentum_switched_on_with_dampening_is_refused() -> None:
    """torch.optim starts the buffer as the next grad whatever the dampening; mpfunc's step
    dampens all but a buffer's first step, told by the step count: refused, not silently
    another first step."""
    params = make_params()
    opt = mpfunc.MasterOptimizer(params, mpfunc.sgd, lr=1e-2, dampening=0.5)
    set_grads(0, params, fp32_copies(params))
    opt.step()
    opt.param_groups[0]["momentum"] = 0.9
    snap = snapshot([masters(opt), params])
    with pytest.raises(ValueError, match=r"param_groups\[0\]: momentum: expected it switched "
                       r"on with dampening=0, got dampening=0\.5"):  # fmt: skip
        opt.step()
    assert_unchanged([masters(opt), params], snap)


def test_a_change_of_which_state_a_group_keeps_is_torchs() -> None:
    """torch's habit of switching ``momentum`` or ``amsgrad`` in ``param_groups`` mid-run:
    the field the new values need is made as ``init`` makes it (zeros) and one they no
    longer use is dropped, where it said "Was this state made by opt.init()". Against
    torch.optim on fp32 copies: SGD makes its buffer from the next grad (dampening 0) and
    ignores it at momentum 0; AdamW, which raises a KeyError there, is given a zero
    ``max_exp_avg_sq`` by hand, as mpfunc makes it. One difference, documented: a field
    switched off is dropped (its memory freed), so switched on again it starts afresh,
    where torch.optim picks up the one it kept; the reference drops it by hand too.
    ``opt.state`` and ``state_dict`` follow."""
    params = make_params()
    ref = fp32_copies(params)
    opt = mpfunc.MasterOptimizer(params, mpfunc.sgd, lr=1e-2)
    ref_opt = torch.optim.SGD(ref, lr=1e-2)
    for k, momentum in enumerate([0.0, 0.0, 0.9, 0.9, 0.9, 0.0, 0.0, 0.5, 0.5]):
        for o in (opt, ref_opt):
            o.param_groups[0]["momentum"] = momentum
        for p in ref if not momentum else []:  # torch keeps it, to pick up again at 0.5
            ref_opt.state[p].pop("momentum_buffer", None)
        set_grads(k, params, ref)
        opt.step()
        ref_opt.step()
        keys = sorted(opt.state[params[0]])
        assert keys == sorted(["master", "step"] + (["momentum_buffer"] if momentum else []))
        assert sorted(opt.state_dict()["state"][0]) == keys
    for m, r in zip(masters(opt), ref):
        assert_close_bound(m, r, lr=1e-2, steps=9)

    opt, ref_opt, params, ref = adamw_pair(CPU)
    for k, amsgrad in enumerate([False, False, True, True, True, False, True]):
        for o in (opt, ref_opt):
            o.param_groups[0]["amsgrad"] = amsgrad
        for p in ref if amsgrad else []:
            if "max_exp_avg_sq" not in ref_opt.state[p]:
                ref_opt.state[p]["max_exp_avg_sq"] = torch.zeros_like(p)
        for p in ref if not amsgrad else []:
            ref_opt.state[p].pop("max_exp_avg_sq", None)
        set_grads(k, params, ref)
        opt.step()
        ref_opt.step()
        assert ("max_exp_avg_sq" in opt.state[params[0]]) == amsgrad
        for m, r in zip(masters(opt), ref):
            assert_bits_equal(m, r.detach())


# --- XLA ----------------------------------------------------------------------------------


# lr factors whose values a traced constant would trip on: 0.0 (a special scalar that
# torch_xla bakes into the graph) and 10.0 (lr 0.1 == weight_decay: torch_xla caches
# scalar inputs by value, so two equal ones merge into one and the graph changes).
TRAPS = [1.0, 0.5, 0.3, 0.7, 0.0, 0.2, 10.0, 0.4, 1.0, 0.6, 0.8, 0.9]
XLA_SCHEDULERS: dict[str, Callable[[Any], Any]] = {
    "OneCycleLR": SCHEDULERS["OneCycleLR"],  # lr and betas[0] change every step
    "LambdaLR-traps": lambda o: LS.LambdaLR(o, lambda e: TRAPS[e % len(TRAPS)]),
}


@pytest.mark.xla
@pytest.mark.parametrize("name", sorted(XLA_SCHEDULERS))
def test_xla_schedulers_compile_nothing_new(xla_device: torch.device, name: str) -> None:
    """After warm-up no graph is compiled whatever values the scheduler sets, nothing is
    read back to the host, nothing falls back to the CPU, and the masters stay within
    the bound of torch.optim on the CPU."""
    import torch_xla.core.xla_model as xm
    import torch_xla.debug.metrics as met

    def count(name: str) -> int:
        data = met.metric_data(name)
        return 0 if data is None else int(data[0])

    opt, ref_opt, params, ref = adamw_pair(xla_device)
    sched, ref_sched = XLA_SCHEDULERS[name](opt), XLA_SCHEDULERS[name](ref_opt)
    fallbacks_before = {n: met.counter_value(n) for n in met.counter_names() if "aten::" in n}
    compiles = to_host = 0
    lrs = set()
    for k in range(STEPS):
        if k == 3:
            xm.wait_device_ops()
            compiles, to_host = count("CompileTime"), count("TransferFromDeviceTime")
        set_grads(k, params, ref)
        opt.step()
        ref_opt.step()
        sched.step()
        ref_sched.step()
        lrs.add(opt.param_groups[0]["lr"])
        opt.zero_grad()
        sync(xla_device)
    xm.wait_device_ops()
    assert count("CompileTime") == compiles, "a changed lr or beta compiled a new graph"
    assert count("TransferFromDeviceTime") == to_host, "a step read a tensor back"
    fallbacks = {n: met.counter_value(n) for n in met.counter_names() if "aten::" in n}
    assert fallbacks == fallbacks_before
    assert hypers(opt) == hypers(ref_opt)
    assert len(lrs) > 5
    for m, r in zip(masters(opt), ref):
        assert_close_bound(m, r, lr=0.1, steps=STEPS)


# --- migration ----------------------------------------------------------------------------


def test_from_torch_optim_labels_and_matches_torch() -> None:
    model = torch.nn.ModuleDict(
        {
            "emb": torch.nn.Embedding(10, 4),
            "fc": torch.nn.Linear(4, 4),
            "ln": torch.nn.LayerNorm(4),
            "head": torch.nn.Linear(4, 2),
        }
    )
    model["emb"].weight.requires_grad_(False)  # frozen, yet listed in a group
    decay = [model["fc"].weight, model["emb"].weight]
    no_decay = [model["fc"].bias, model["ln"].weight, model["ln"].bias]
    torch_opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": 0.1},
            {"params": no_decay, "weight_decay": 0.0, "lr": 1e-3},
        ],
        lr=1e-2,
        fused=True,
    )  # head: in no group, so torch never trains it
    params = dict(model.named_parameters())
    labels, opt = mpfunc.from_torch_optim(torch_opt, params)
    assert labels == {
        "emb.weight": "frozen",
        "fc.weight": "group0",
        "fc.bias": "group1",
        "ln.weight": "group1",
        "ln.bias": "group1",
        "head.weight": "frozen",
        "head.bias": "frozen",
    }
    masters_ = mpfunc.init_master(params, trainable_only=True)
    assert masters_["emb.weight"] is None and masters_["head.weight"] is not None
    state = opt.init(masters_)
    assert state["frozen"] is None
    before = {n: m.clone() for n, m in masters_.items() if m is not None}
    for k in range(4):
        gen = torch.Generator().manual_seed(k)
        grads = {n: torch.randn(p.shape, generator=gen) for n, p in params.items()}
        for n, p in params.items():
            p.grad = grads[n].clone() if p.requires_grad else None
        torch_opt.step()
        mpfunc.apply_update_(
            masters_,
            {n: g if masters_[n] is not None else None for n, g in grads.items()},
            state,
            opt,
        )
    for n, m in masters_.items():
        if m is None:
            continue
        assert_bits_equal(m, params[n].detach())
    assert torch.equal(masters_["head.weight"], before["head.weight"])


def test_from_torch_optim_refuses_a_param_it_cannot_see() -> None:
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3))
    torch_opt = torch.optim.SGD([a, b], lr=0.1)
    with pytest.raises(ValueError, match=r"param_groups\[0\]\.params\[1\].*a leaf of params"):
        mpfunc.from_torch_optim(torch_opt, {"a": a})
    with pytest.raises(TypeError, match=r"torch\.optim\.Optimizer instance"):
        mpfunc.from_torch_optim(object(), {"a": a})  # type: ignore[arg-type]


def test_from_torch_optim_other_classes_run_through_torch_optimizer() -> None:
    a = torch.nn.Parameter(torch.ones(3))
    ref = torch.nn.Parameter(torch.ones(3))
    labels, opt = mpfunc.from_torch_optim(torch.optim.RMSprop([a], lr=0.1), {"a": a})
    ref_opt = torch.optim.RMSprop([ref], lr=0.1)
    masters_ = mpfunc.init_master({"a": a})
    state = opt.init(masters_)
    for _ in range(3):
        ref.grad = torch.full((3,), 0.5)
        ref_opt.step()
        mpfunc.apply_update_(masters_, {"a": torch.full((3,), 0.5)}, state, opt)
    assert_bits_equal(masters_["a"], ref.detach())
    assert labels == {"a": "group0"}


def test_master_optimizer_from_torch() -> None:
    params = make_params()
    ref = fp32_copies(params)
    groups = [{"params": params[:2], "weight_decay": 0.1}, {"params": params[2:], "lr": 1e-3}]
    torch_opt = torch.optim.AdamW(groups, lr=1e-2, betas=(0.8, 0.9))
    opt = mpfunc.MasterOptimizer.from_torch(torch_opt)
    ref_opt = torch.optim.AdamW(
        [{"params": ref[:2], "weight_decay": 0.1}, {"params": ref[2:], "lr": 1e-3}],
        lr=1e-2,
        betas=(0.8, 0.9),
        fused=True,
    )
    for k in range(3):
        set_grads(k, params, ref)
        opt.step()
        ref_opt.step()
    for m, r in zip(masters(opt), ref):
        assert_bits_equal(m, r.detach())
    with pytest.raises(TypeError, match="no native optimizer"):
        mpfunc.MasterOptimizer.from_torch(torch.optim.RMSprop(params, lr=0.1))


@pytest.mark.parametrize("state_dtype", [torch.uint8, torch.uint4] if hasattr(torch, "uint4")
                         else [torch.uint8], ids=str)  # fmt: skip
def test_a_small_param_with_8bit_state_names_the_param_and_a_param_group(
    state_dtype: torch.dtype,
) -> None:
    """A param too small for an 8/4-bit block: the error named 'masters.5' and a functional
    partition, and came after the optimizer had taken the group in (a later step ran on a
    half-added group). Now it names the param, offers a param group with
    state_dtype=None (which trains), and the optimizer is as before the call."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 4))
    model.to(torch.bfloat16)
    big = [model[0].weight, model[1].weight]
    small = [model[0].bias, model[1].bias]
    named = model.named_parameters if NAMED else model.parameters
    bias = "1.bias" if NAMED else r"param_groups\[0\]\.params\[3\]"
    with pytest.raises(ValueError, match=(
        rf"^MasterOptimizer: param_groups\[0\]: adamw\.init: at '{bias}': expected a leaf of "
        r"at least 32 elements .*, got 4 elements\. Keep small params in fp32 state, in a "
        r"param group of their own: MasterOptimizer\(\[\{'params': big\}, \{'params': "
        r"small, 'state_dtype': None\}\], \.\.\.\)"
    )):  # fmt: skip
        mpfunc.MasterOptimizer(named(), mpfunc.adamw, state_dtype=state_dtype)
    opt = mpfunc.MasterOptimizer(
        [{"params": big}, {"params": small, "state_dtype": None}], mpfunc.adamw,
        state_dtype=state_dtype, lr=1e-2,
    )  # fmt: skip
    extra = torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))
    before = (len(opt.param_groups), len(opt._params), len(opt._masters), dict(opt._states))
    with pytest.raises(ValueError, match=r"at least 32 elements"):
        opt.add_param_group({"params": [extra]})
    assert before == (len(opt.param_groups), len(opt._params), len(opt._masters),
                      dict(opt._states))  # fmt: skip
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    extra.grad = torch.ones_like(extra)
    opt.step()  # the refused group's param is not trained, the others are
    assert torch.equal(extra.detach(), torch.zeros(3, dtype=torch.bfloat16))
    assert all(float(opt.state[p]["step"]) == 1.0 for p in model.parameters())


DECOUPLED = "decoupled_weight_decay" in torch.optim.Adam([torch.zeros(1)]).defaults


@pytest.mark.skipif(not DECOUPLED, reason="Adam takes decoupled_weight_decay from torch 2.7")
def test_adam_groups_with_their_own_decoupled_weight_decay() -> None:
    """torch >= 2.7's Adam takes ``decoupled_weight_decay`` per group (AdamW's math there).
    ``from_torch_optim`` read it from the defaults only, so such a group ran L2 decay:
    another update, silently. Each group now gets its own math; ``MasterOptimizer.from_torch``
    (one optimizer) takes groups that all agree, and refuses a mix, naming the group."""
    params = make_params()
    ref = fp32_copies(params)
    kw = {"lr": 1e-2, "weight_decay": 0.1}
    torch_opt = torch.optim.Adam(
        [{"params": ref[:2]}, {"params": ref[2:], "decoupled_weight_decay": True}], **kw
    )
    fp32 = [p.detach().float().clone() for p in params]
    tree = {str(i): t for i, t in enumerate(fp32)}
    _, opt = mpfunc.from_torch_optim(torch_opt, {str(i): r for i, r in enumerate(ref)})
    ref_opt = torch.optim.Adam(
        [{"params": ref[:2]}, {"params": ref[2:], "decoupled_weight_decay": True}], **kw
    )
    state = opt.init(tree)
    for k in range(3):
        set_grads(k, params, ref)
        ref_opt.step()
        grads = {str(i): r.grad.clone() for i, r in enumerate(ref)}
        mpfunc.apply_update_(tree, grads, state, opt)
    for i, r in enumerate(ref):
        assert_close_bound(tree[str(i)], r.detach(), lr=1e-2, steps=3)
    # One MasterOptimizer: groups that agree take their math, a mix is refused.
    both = torch.optim.Adam(
        [{"params": params[:2], "decoupled_weight_decay": True},
         {"params": params[2:], "decoupled_weight_decay": True}], **kw
    )  # fmt: skip
    assert mpfunc.MasterOptimizer.from_torch(both)._factory is mpfunc.adamw
    with pytest.raises(ValueError, match=(
        r"from_torch: torch_opt\.param_groups\[1\]: expected the math of param_groups\[0\] "
        r"\(mpfunc\.adam\), got decoupled_weight_decay=True \(mpfunc\.adamw\)"
    )):  # fmt: skip
        mpfunc.MasterOptimizer.from_torch(torch.optim.Adam(
            [{"params": params[:2]},
             {"params": params[2:], "decoupled_weight_decay": True}], **kw
        ))  # fmt: skip


def test_frozen_optimizer_keeps_leaves_and_no_state() -> None:
    tree = {"a": torch.ones(3), "b": torch.ones(2)}
    opt = mpfunc.partition({"t": mpfunc.sgd(lr=0.5), "f": mpfunc.frozen()}, {"a": "t", "b": "f"})
    state = opt.init(tree)
    assert state["f"] is None
    grads = {"a": torch.ones(3), "b": torch.full((2,), float("nan"))}
    new, _ = mpfunc.apply_update(tree, grads, state, opt)
    assert torch.equal(new["b"], tree["b"]) and torch.equal(new["a"], torch.full((3,), 0.5))
    assert _tree.flatten(mpfunc.state_dict({"s": state}))[0] is not None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(TypeError, match="frozen\\(\\) keeps no state"):
            mpfunc.apply_update(tree, grads, {"t": state["t"], "f": 1}, opt)


# --- the example --------------------------------------------------------------------------


def load_example() -> Any:
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parent.parent / "examples" / "master_optimizer.py"
    spec = importlib.util.spec_from_file_location("master_optimizer_example", path)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_example_runs(device: torch.device, capsys: pytest.CaptureFixture[str]) -> None:
    loss = load_example().main(["--device", device.type, "--steps", "30", "--hidden", "16"])
    out = capsys.readouterr().out
    first = float(out.split("loss ")[1].split()[0])
    assert loss < first, out
    assert "6 params with fp32 masters" in out


def test_example_saves_and_resumes(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """fp16 with GradScaler (CPU), saved halfway and resumed."""
    ex, ck = load_example(), str(tmp_path / "run.pt")
    common = ["--dtype", "fp16", "--steps", "20", "--hidden", "16", "--ckpt", ck]
    ex.main(common)
    ex.main(common)
    out = capsys.readouterr().out
    assert "saved" in out and "resumed from" in out and "at step 10" in out


# --- master strategies --------------------------------------------------------------------


def test_strategies_train_and_resume() -> None:
    """``strategy="remainder"`` keeps the fp32 master exactly in bf16 + int16: the moments
    match the ``"fp32"`` run bit for bit; its state_dict holds the remainder, not a
    master, and resumes bit for bit."""

    def run(strategy: str, split: int | None = None) -> tuple[Any, list[Any]]:
        params = make_params()
        opt = mpfunc.MasterOptimizer(params, mpfunc.adamw, lr=1e-2, strategy=strategy)
        for k in range(6):
            if k == split:
                sd = opt.state_dict()
                model = [p.detach().clone() for p in params]
                params = make_params(seed=3)
                with torch.no_grad():
                    for p, saved in zip(params, model):
                        p.copy_(saved)
                opt = mpfunc.MasterOptimizer(params, mpfunc.adamw, lr=1e-2, strategy=strategy)
                opt.load_state_dict(sd)
            set_grads(k, params, fp32_copies(params))
            opt.step()
        return opt, params

    fp32, _ = run("fp32")
    rem, rem_params = run("remainder")
    assert sorted(rem.state_dict()["state"][0]) == [
        "exp_avg",
        "exp_avg_sq",
        "remainder",
        "step",
        "ties",
    ]
    assert rem.state[rem_params[0]]["remainder"].dtype == torch.int16
    for p, q in zip(fp32._params, rem_params):
        assert_bits_equal(fp32.state[p]["exp_avg_sq"], rem.state[q]["exp_avg_sq"])
    resumed, resumed_params = run("remainder", split=3)
    for p, q in zip(rem_params, resumed_params):
        assert_bits_equal(p.detach(), q.detach())
        for key in ("exp_avg", "remainder", "step"):
            assert torch.equal(rem.state[p][key], resumed.state[q][key])
    with pytest.raises(ValueError, match="param_groups\\[0\\]: init_master"):
        mpfunc.MasterOptimizer([torch.ones(3, requires_grad=True)], strategy="remainder")


def test_a_numpy_lr_is_a_real_number() -> None:
    """A LambdaLR factor computed in numpy makes the group's lr a numpy.float32, which
    torch.optim takes; MasterOptimizer refused it ('expected a float >= 0, got float32')."""
    np = pytest.importorskip("numpy")
    opt, ref_opt, params, ref = adamw_pair(CPU)
    scheds = [
        torch.optim.lr_scheduler.LambdaLR(o, lambda k: np.float32(0.5) ** k) for o in (opt, ref_opt)
    ]
    for k in range(3):
        set_grads(k, params, ref)
        opt.step()
        ref_opt.step()
        for s in scheds:
            s.step()
    assert isinstance(opt.param_groups[0]["lr"], np.floating)
    for m, r in zip(masters(opt), ref):
        assert_bits_equal(m, r.detach())


@pytest.mark.parametrize("strategy", ["fp32", "kahan", "stochastic"])
def test_deepcopy_and_pickle_keep_the_whole_optimizer(strategy: str, tmp_path: Any) -> None:
    """torch.optim's __getstate__ keeps defaults, state and param_groups only, so a
    deepcopy of (model, opt) or a pickled optimizer lost its masters and failed at the
    first step with "no attribute '_in_backward'". The copy now carries everything: it and
    the original go on in step, bit for bit, and neither touches the other."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 40), torch.nn.Linear(40, 3))
    model.to(torch.bfloat16)
    opt = mpfunc.MasterOptimizer(model.parameters(), strategy=strategy, lr=1e-2)

    def step(m: torch.nn.Module, o: mpfunc.MasterOptimizer, k: int) -> None:
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(k)).to(torch.bfloat16)
        m(x).float().pow(2).mean().backward()
        o.step()
        o.zero_grad()

    step(model, opt, 0)
    model2, opt2 = copy.deepcopy((model, opt))
    torch.save((model, opt), tmp_path / "both.pt")
    model3, opt3 = torch.load(tmp_path / "both.pt", weights_only=False)
    for k in (1, 2):
        for m, o in ((model, opt), (model2, opt2), (model3, opt3)):
            step(m, o, k)
    for m in (model2, model3):
        for a, b in zip(model.parameters(), m.parameters()):
            assert_bits_equal(a.detach(), b.detach())
    for o in (opt2, opt3):
        sd, sd0 = o.state_dict()["state"], opt.state_dict()["state"]
        for j in sd0:
            for name, t in sd0[j].items():
                if isinstance(t, torch.Tensor):
                    assert torch.equal(t, sd[j][name])
    sib = mpfunc.MasterOptimizer(model.parameters(), step_in_backward=True)
    with pytest.raises(TypeError, match=r"step_in_backward=True\): cannot be copied or pickled"):
        copy.deepcopy(sib)
    sib.close()


def test_a_model_converted_mid_run_keeps_its_masters() -> None:
    """model.float() mid-run (same Parameter objects, new data, the version counter kept):
    the step took the widened bf16 params as written and gave the "fp32" masters their
    values, their low bits lost (2.7e-4 off torch on fp32 copies). The master stays and
    the fp32 param shows it whole: torch's fp32 run bit for bit, then, back in bf16, its
    rounding. A strategy that cannot hold an fp32 param names the param."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3).to(torch.bfloat16)
    ref = [torch.nn.Parameter(p.detach().float().clone()) for p in model.parameters()]
    opt = mpfunc.MasterOptimizer(model.named_parameters() if NAMED else model.parameters(),
                                 mpfunc.adamw, lr=1e-2)  # fmt: skip
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, fused=True)

    def step(k: int) -> None:
        gen = torch.Generator().manual_seed(k)
        for p, r in zip(model.parameters(), ref):
            g = torch.randn(p.shape, generator=gen).to(torch.bfloat16)
            p.grad, r.grad = g.to(p.dtype), g.float()
        opt.step()
        ref_opt.step()

    step(0)
    model.float()
    step(1)
    for p, r in zip(model.parameters(), ref):
        assert p.dtype == torch.float32
        assert_bits_equal(p.detach(), r.detach())
    model.bfloat16()
    step(2)
    for p, r in zip(model.parameters(), ref):
        assert_bits_equal(p.detach(), r.detach().to(torch.bfloat16))
    model2 = torch.nn.Linear(4, 3).to(torch.bfloat16)
    opt2 = mpfunc.MasterOptimizer(model2.named_parameters() if NAMED else model2.parameters(),
                                  mpfunc.adamw, strategy="remainder")  # fmt: skip
    model2.float()
    for p in model2.parameters():
        p.grad = torch.ones_like(p)
    name = r"'weight'" if NAMED else r"'param_groups\[0\]\.params\[0\]'"
    with pytest.raises(ValueError, match=rf"^MasterOptimizer\.step: apply_update_: at "
                                         rf"'masters\.0' \(param {name}\): expected a "
                                         r"RemainderMaster"):  # fmt: skip
        opt2.step()


def test_torch_optimizer_refuses_what_its_step_cannot_take_and_keeps_grads() -> None:
    """torch_optimizer(LBFGS) (its step needs a closure) or SparseAdam (sparse grads) failed
    inside the step, after a partition's other labels had written their masters. Refused
    when built now. A master's own .grad is given back after the step (it was set to None)."""
    for cls, says in ((torch.optim.LBFGS, "needs no closure, got LBFGS"),
                      (torch.optim.SparseAdam, "dense grads, got SparseAdam")):  # fmt: skip
        with pytest.raises(TypeError, match=rf"^torch_optimizer: cls: expected .*{says}"):
            mpfunc.torch_optimizer(cls, lr=0.1)
    m = {"w": torch.ones(3)}
    own = torch.full((3,), 7.0)
    m["w"].grad = own
    opt = mpfunc.torch_optimizer(torch.optim.RMSprop, lr=0.1)
    mpfunc.apply_update_(m, {"w": torch.ones(3)}, opt.init(m), opt)
    assert m["w"].grad is own

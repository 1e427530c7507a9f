"""The full training-loop step on XLA: fp16 model, dynamic loss scaling, clipping,
skip on overflow, a warm-up schedule. After two warm-up steps, 10 steps that include
overflow (skipped) steps and scale growth compile nothing, run one graph each, and
read nothing back to the host."""

from __future__ import annotations

import warnings

import pytest
import torch
from support.xla_model import Model, count

import mpfunc

pytestmark = pytest.mark.xla


@pytest.mark.parametrize("inplace", [True, False], ids=["inplace", "pure"])
def test_scaled_clipped_skipping_step_is_one_stable_graph(
    xla_device: torch.device, inplace: bool
) -> None:
    import torch_xla
    import torch_xla.core.xla_model as xm

    torch.manual_seed(0)
    model = Model().to(torch.float16).to(xla_device)
    params = dict(model.named_parameters())
    masters = mpfunc.init_master(params)
    gbuf = mpfunc.init_grads(params)
    opt = mpfunc.partition(
        {
            "decay": mpfunc.adamw(lr=lambda s: 1e-3 * torch.clamp((s + 1) / 5, max=1.0)),
            "no_decay": mpfunc.adamw(lr=1e-3, weight_decay=0.0),
        },
        lambda path, p: "no_decay" if p.ndim < 2 else "decay",
    )
    state = opt.init(masters)
    # Far too large a scale: the first steps overflow in fp16 and are skipped.
    scaler = mpfunc.DynamicLossScale(2.0**28, growth_interval=2, device=xla_device)
    x = torch.randint(0, 16, (8, 4), device=xla_device)
    y = torch.randint(0, 16, (8, 4), device=xla_device)
    torch_xla.sync()
    flags: list[torch.Tensor] = []

    def step() -> None:
        nonlocal masters, state, scaler
        logits = model(x).float()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 16), y.reshape(-1))
        scaler.scale(loss).backward()
        grads = {n: p.grad for n, p in params.items()}
        if inplace:
            g32 = mpfunc.grads_to_fp32_(grads, gbuf, scale=scaler)
            finite = mpfunc.all_finite(g32)
            g32, _ = mpfunc.clip_by_global_norm_(g32, 1.0)
            mpfunc.apply_update_(masters, g32, state, opt, skip=~finite)
            mpfunc.masters_to_model_(masters, params)
        else:
            g32 = mpfunc.grads_to_fp32(grads, scale=scaler)
            finite = mpfunc.all_finite(g32)
            g32, _ = mpfunc.clip_by_global_norm(g32, 1.0)
            masters, state = mpfunc.apply_update(masters, g32, state, opt, skip=~finite)
            mpfunc.masters_to_model_(masters, params)
        scaler = scaler.adjust(finite)
        flags.append(finite)
        for p in params.values():
            p.grad = None
        torch_xla.sync()
        xm.wait_device_ops()

    step()
    step()
    compiles, executes = count("CompileTime"), count("ExecuteTime")
    to_host = count("TransferFromDeviceTime")
    for _ in range(10):
        step()
    assert count("CompileTime") == compiles, "a measured step compiled a new graph"
    assert count("ExecuteTime") - executes == 10, "expected exactly one graph per step"
    assert count("TransferFromDeviceTime") == to_host, "a step read a tensor back to the host"
    seen = [bool(f.cpu()) for f in flags[2:]]
    assert not all(seen) and any(seen), f"expected overflow and finite steps, got {seen}"
    # The masters stayed finite through the overflows, and the model equals them rounded.
    for n, p in params.items():
        m = masters[n].cpu()
        assert bool(torch.isfinite(m).all())
        assert torch.equal(p.detach().cpu(), m.to(torch.float16))


def _leaves(xla_device: torch.device) -> dict[str, torch.Tensor]:
    """test_xla_step.py's test_xla_agrees_with_cpu shapes (one compile per session)."""
    gen = torch.Generator().manual_seed(1)
    shapes = {"w": (3, 5), "b": (7,), "s": ()}
    return {k: torch.randn(s, generator=gen).bfloat16().to(xla_device) for k, s in shapes.items()}


@pytest.fixture
def unwarned(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pending-graph warning fires once per process: each test starts unwarned."""
    from mpfunc.backends import _xla_watch

    monkeypatch.setattr(_xla_watch, "_warned", False)
    monkeypatch.setattr(_xla_watch, "_ENDS", {})


@pytest.mark.parametrize("inplace", [True, False], ids=["inplace", "pure"])
def test_a_loop_without_sync_warns_once(
    xla_device: torch.device, inplace: bool, unwarned: None
) -> None:
    """No torch_xla.sync() in the loop: every step adds to one pending graph (30 such
    steps took 123 s). Step PENDING_STEPS + 1 warns, once, naming the fix. Nothing is
    synced here, so nothing compiles; the pending graph is dropped with its tensors."""
    from mpfunc.backends._xla_watch import PENDING_STEPS, PendingGraphWarning

    params = _leaves(xla_device)
    masters = mpfunc.init_master(params)
    opt = mpfunc.adamw(lr=1e-2, weight_decay=0.1)
    state = opt.init(masters)
    grads = {k: torch.ones_like(v) for k, v in params.items()}
    match = (
        rf"apply_update_?: the masters are still the pending computation of the last "
        rf"{PENDING_STEPS} steps: .* Call torch_xla\.sync\(\) once per step"
    )
    with pytest.warns(PendingGraphWarning, match=match) as record:
        for _ in range(PENDING_STEPS + 3):
            if inplace:
                mpfunc.apply_update_(masters, grads, state, opt, params=params)
            else:
                masters, state = mpfunc.apply_update(masters, grads, state, opt)
    assert len([w for w in record if w.category is PendingGraphWarning]) == 1


def test_a_synced_loop_never_warns(xla_device: torch.device, unwarned: None) -> None:
    """Synced every step, even with the masters written between the sync and the step (a
    pending computation at the step's start, but a new one each step): no warning."""
    import torch_xla

    params = _leaves(xla_device)
    masters = mpfunc.init_master(params)
    opt = mpfunc.adamw(lr=1e-2, weight_decay=0.1)
    state = opt.init(masters)
    grads = {k: torch.ones_like(v) for k, v in params.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for k in range(8):
            if k % 2:
                with torch.no_grad():
                    masters["w"].clamp_(-10.0, 10.0)
            masters, state = mpfunc.apply_update(masters, mpfunc.grads_to_fp32(grads), state, opt)
            torch_xla.sync()

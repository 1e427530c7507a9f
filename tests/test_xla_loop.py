"""The full training-loop step on XLA: fp16 model, dynamic loss scaling, clipping,
skip on overflow, a warm-up schedule. After two warm-up steps, 10 steps that include
overflow (skipped) steps and scale growth compile nothing, run one graph each, and
read nothing back to the host."""

from __future__ import annotations

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

"""A full mixed step on the XLA device: one graph per step, no recompiles, no host reads.

Checked with ``torch_xla.debug.metrics``: after two warm-up steps, 10 more steps
(with the learning rate changed in place every step) add no compile, execute
exactly one graph per step, move nothing from device to host, and mpfunc's
calls add no ``aten::`` CPU-fallback counter.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
from support.xla_model import Model, count, fallbacks

import mpfunc

pytestmark = pytest.mark.xla


OPTS: dict[str, Callable[[torch.Tensor], mpfunc.Optimizer]] = {
    "sgd": lambda lr: mpfunc.sgd(lr=lr, momentum=0.9, dampening=0.1, weight_decay=1e-4),
    "adam": lambda lr: mpfunc.adam(lr=lr, weight_decay=1e-4, amsgrad=True),
    "adamw": lambda lr: mpfunc.adamw(lr=lr),
}


@pytest.mark.parametrize("inplace", [True, False], ids=["inplace", "pure"])
@pytest.mark.parametrize("name", sorted(OPTS))
def test_mixed_step_is_one_stable_graph(xla_device: torch.device, name: str, inplace: bool) -> None:
    import torch_xla
    import torch_xla.core.xla_model as xm

    torch.manual_seed(0)
    model = Model().to(torch.bfloat16).to(xla_device)
    params = dict(model.named_parameters())
    lr = torch.tensor(1e-3, device=xla_device)
    opt = OPTS[name](lr)
    masters = mpfunc.init_master(params)
    gbuf = mpfunc.init_master(params)
    state = opt.init(masters)
    x = torch.randint(0, 16, (8, 4), device=xla_device)
    y = torch.randint(0, 16, (8, 4), device=xla_device)
    torch_xla.sync()

    mp_fallbacks: dict[str, int] = {}

    def step(k: int) -> None:
        nonlocal masters, state, params
        logits = model(x).float()  # loss in fp32
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 16), y.reshape(-1))
        loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters()}
        before = fallbacks()
        if inplace:
            g32 = mpfunc.grads_to_fp32_(grads, gbuf)
            mpfunc.apply_update_(masters, g32, state, opt)
            mpfunc.masters_to_model_(masters, params)
        else:
            g32 = mpfunc.grads_to_fp32(grads)
            masters, state = mpfunc.apply_update(masters, g32, state, opt)
            new = mpfunc.masters_to_model(masters, params)
            with torch.no_grad():
                for n, p in model.named_parameters():
                    p.copy_(new[n])
        after = fallbacks()
        for n, v in after.items():
            if v != before.get(n, 0):
                mp_fallbacks[n] = v - before.get(n, 0)
        for p in model.parameters():
            p.grad = None
        # A schedule: a new value each step. (torch_xla caches scalar device data by
        # value: an lr that happens to equal another scalar of the graph, such as
        # weight_decay, dedups two graph inputs and compiles once more. This
        # schedule never meets 1e-4; see the README's notes.)
        lr.fill_(1e-3 * 0.9**k)
        torch_xla.sync()
        # Execution (and its metrics) is asynchronous: wait so the counts are current.
        xm.wait_device_ops()

    for k in range(2):
        step(k)
    compiles, executes = count("CompileTime"), count("ExecuteTime")
    to_host = count("TransferFromDeviceTime")
    for k in range(2, 12):
        step(k)
    assert count("CompileTime") == compiles, "a measured step compiled a new graph"
    assert count("ExecuteTime") - executes == 10, "expected exactly one graph per step"
    assert count("TransferFromDeviceTime") == to_host, "a step read a tensor back to the host"
    assert mp_fallbacks == {}, f"mpfunc fell back to CPU for {mp_fallbacks}"
    # The model did train: masters moved, and params equal them rounded.
    for n, p in params.items():
        assert torch.equal(p.detach().cpu(), masters[n].cpu().to(torch.bfloat16))


def test_xla_agrees_with_cpu(xla_device: torch.device) -> None:
    """The same inputs on CPU (fused kernels) and XLA (foreach): casts bit-identical,
    masters within the stated bound after 20 steps."""
    import torch_xla

    torch.manual_seed(1)
    base = {"w": torch.randn(3, 5), "b": torch.randn(7), "s": torch.randn(())}
    runs = {}
    for dev in (torch.device("cpu"), xla_device):
        params = {k: v.to(torch.bfloat16).to(dev) for k, v in base.items()}
        opt = mpfunc.adamw(lr=1e-2, weight_decay=0.1)
        masters = mpfunc.init_master(params)
        state = opt.init(masters)
        gen = torch.Generator().manual_seed(2)
        for _ in range(20):
            grads = {
                k: torch.randn(v.shape, generator=gen).bfloat16().to(dev) for k, v in base.items()
            }
            masters, state = mpfunc.apply_update(masters, mpfunc.grads_to_fp32(grads), state, opt)
            params = mpfunc.masters_to_model(masters, params)
            if dev.type == "xla":
                torch_xla.sync()
        runs[dev.type] = (
            {k: v.cpu() for k, v in masters.items()},
            {k: v.cpu() for k, v in params.items()},
        )
    (m_cpu, _), (m_xla, p_xla) = runs["cpu"], runs["xla"]
    for k in base:
        err = (m_cpu[k].double() - m_xla[k].double()).abs().max()
        assert err <= 1e-6 * float(m_cpu[k].abs().max()), (k, float(err))
        # Each device's params are its masters rounded, bit for bit.
        assert torch.equal(p_xla[k], m_xla[k].to(torch.bfloat16))


def _xla_leaves(xla_device: torch.device) -> dict[str, torch.Tensor]:
    """test_xla_agrees_with_cpu's shapes (their step graphs compile once per session)."""
    gen = torch.Generator().manual_seed(1)
    shapes = {"w": (3, 5), "b": (7,), "s": ()}
    return {k: torch.randn(s, generator=gen).to(xla_device) for k, s in shapes.items()}


def test_a_schedule_that_reads_the_count_back_warns_once(xla_device: torch.device) -> None:
    """A warm-up written with Python's ``min`` returns a device tensor while the count is
    below 10, but ``min`` compares on the host: a device read every step. It warns once,
    saying how to write it on the device; written so, it warns nothing and reads nothing."""
    import torch_xla
    import torch_xla.core.xla_model as xm

    from mpfunc.backends._xla_watch import HostReadWarning

    def run(schedule: Callable[[torch.Tensor], object], steps: int) -> None:
        masters = _xla_leaves(xla_device)
        opt = mpfunc.adamw(lr=schedule, weight_decay=0.1)
        state = opt.init(masters)
        grads = {k: torch.ones_like(v) for k, v in masters.items()}
        torch_xla.sync()
        for _ in range(steps):
            mpfunc.apply_update_(masters, grads, state, opt)
            torch_xla.sync()
        xm.wait_device_ops()

    warmup = lambda step: 1e-3 * min(1.0, (step + 1) / 10)  # noqa: E731
    match = (
        r"lr schedule .*<lambda> returned torch\.float32 tensor of shape \(\) on xla:0 for a "
        r"step count on XLA, and read the count back to the host .*min/max.*"
        r"1e-3 \* torch\.clamp\(\(step \+ 1\) / 10, max=1\.0\)"
    )
    with pytest.warns(HostReadWarning, match=match) as record:
        run(warmup, steps=3)
    assert len([w for w in record if w.category is HostReadWarning]) == 1
    on_device = lambda step: 1e-3 * torch.clamp((step + 1) / 10, max=1.0)  # noqa: E731
    reads = count("TransferFromDeviceTime")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run(on_device, steps=3)
    assert count("TransferFromDeviceTime") == reads


@pytest.mark.xla
@pytest.mark.parametrize("impl", ["auto", "foreach"])
@pytest.mark.parametrize(
    ("strategy", "sd"), [("fp32", None), ("kahan", torch.bfloat16), ("stochastic", torch.uint8)]
)
def test_amsgrad_max_keeps_a_nan_on_xla(
    xla_device: torch.device, impl: str, strategy: str, sd: torch.dtype | None
) -> None:
    """XLA:CPU's maximum drops a NaN second operand where torch's CPU one propagates it:
    after a step with a NaN grad (not skipped), amsgrad's running max stayed finite on
    XLA, NaN on the CPU (a code 157 against 255 in 8-bit state). The XLA node and the
    foreach path on XLA now give the CPU's bits."""
    import torch_xla

    out = []
    for dev in (torch.device("cpu"), xla_device):
        dtype = torch.float32 if strategy == "fp32" else torch.bfloat16
        params = {"w": torch.linspace(-1, 1, 64).to(dtype).to(dev)}
        masters = mpfunc.init_master(params, strategy=strategy)
        opt = mpfunc.adamw(lr=1e-2, amsgrad=True, state_dtype=sd, impl=impl)
        state = opt.init(masters)
        for t in range(3):
            g = torch.ones(64) * (t + 1)
            if t == 1:
                g[5] = float("nan")
            mpfunc.apply_update_(masters, {"w": g.to(dtype).to(dev)}, state, opt)
            if dev.type == "xla":
                torch_xla.sync()
        vmax = state.max_exp_avg_sq["w"]
        vmax = vmax.codes if sd == torch.uint8 else vmax
        out.append(vmax.cpu().float())
    if sd == torch.uint8:
        assert torch.equal(out[0], out[1])
    else:
        # NaN where the CPU has it; elsewhere within the XLA bound (a fused multiply-add).
        assert torch.equal(out[0].isnan(), out[1].isnan()) and bool(out[1][5].isnan())
        torch.testing.assert_close(out[1], out[0], rtol=1e-6, atol=0.0, equal_nan=True)


@pytest.mark.xla
def test_views_xla_cannot_vouch_for_are_refused_saying_so(xla_device: torch.device) -> None:
    """On XLA a column slice reads to torch as "too hard to tell" for overlap, as an expanded
    tensor does (XLA shows no real strides): refused, as before, but the error said an
    expanded tensor and showed fake strides. Nothing is written; transposes and leading-row
    slices are taken."""
    import torch_xla

    qkv = torch.randn(8, 24).to(xla_device)
    masters = {"q": qkv[:, :8], "k": torch.randn(8, 8).to(xla_device)}
    opt = mpfunc.sgd(lr=0.1)
    state = opt.init(masters)
    grads = {k: torch.ones(8, 8).to(xla_device) for k in masters}
    torch_xla.sync()
    before = qkv.cpu().clone()
    with pytest.raises(ValueError, match=r"at 'masters\.q': .* a view torch_xla cannot tell apart"):
        mpfunc.apply_update_(masters, grads, state, opt)
    torch_xla.sync()
    assert torch.equal(qkv.cpu(), before)
    rows = {"q": qkv[:4].t(), "k": torch.randn(24, 4).to(xla_device)}
    state = opt.init(rows)
    mpfunc.apply_update_(rows, {k: torch.ones(24, 4).to(xla_device) for k in rows}, state, opt)
    torch_xla.sync()
    assert torch.equal(qkv[:4].cpu(), before[:4] - 0.1)

"""Layouts: every optimizer and implementation, pure and in place, on the layouts people have.

Params are drawn contiguous, transposed, channels_last, sliced (a non-dense view of a
larger buffer), offset views, 0-d and size-1; grads independently contiguous,
transposed or expanded (stride 0). The README's in-place loop (``init_grads`` ->
``grads_to_fp32_`` -> ``apply_update_`` -> ``masters_to_model_``) and the pure loop
must both match an independent reference on contiguous fp32 copies within the stated
bound, ``max|a - b| <= 1e-6 * M`` (``M`` the largest magnitude the reference tensor
reached), and the params must equal the masters rounded, bit for bit.

The reference is torch.optim (for-loop) for sgd/adam/adamw, and a plain transcription
of the paper's three lines for lion (torch has none).

Before the fix, a channels_last weight trained on the default fused path drifted to a
relative error of 0.55 in 10 steps: torch's fused kernel pairs elements by memory
position, and the grads were contiguous.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from support.helpers import assert_bits_equal, leaves
from support.layouts import (
    BF16,
    GRAD_LAYOUTS,
    OPTS,
    PARAM_LAYOUTS,
    LionReference,
    grad_like,
    randn,
)

import mpfunc

RTOL = 1e-6


def _sync(device: torch.device) -> None:
    if device.type == "xla":
        import torch_xla

        torch_xla.sync()


def run(device: torch.device, data: st.DataObject, in_place: bool) -> None:
    name = data.draw(st.sampled_from(sorted(OPTS)), label="optimizer")
    factory, torch_cls, hp, impls = OPTS[name]
    if device.type != "cpu":
        # "auto" is the one-node XLA kernel there; "xla" names it explicitly.
        impls = [i for i in impls if i != "fused"] + ["xla"]
    impl = data.draw(st.sampled_from(impls), label="impl")
    n = data.draw(st.integers(1, 4), label="leaves")
    layouts = [data.draw(st.sampled_from(PARAM_LAYOUTS), label=f"layout{i}") for i in range(n)]
    grad_kinds = [data.draw(st.sampled_from(GRAD_LAYOUTS), label=f"grad{i}") for i in range(n)]
    steps = data.draw(st.integers(1, 6), label="steps")
    seed = data.draw(st.integers(0, 2**16), label="seed")
    gen = torch.Generator().manual_seed(seed)

    cpu_params = {f"p{i}": lay.make(gen, BF16) for i, lay in enumerate(layouts)}
    params = {k: (v if device.type == "cpu" else v.to(device)) for k, v in cpu_params.items()}
    ref = [v.detach().float().contiguous().clone() for v in cpu_params.values()]
    peak = [r.abs().max() for r in ref]
    if torch_cls is None:
        ref_opt: Any = LionReference(ref, **hp)
    else:
        ref_opt = torch_cls(ref, **hp, foreach=False)

    opt = factory(**hp, impl=impl)
    masters = mpfunc.init_master(params)
    state = opt.init(masters)
    out = mpfunc.init_grads(params)
    for k in range(steps):
        cpu_grads = [
            grad_like(grad_kinds[i], lay.shape, gen, 10.0 ** (k % 3 - 1))
            for i, lay in enumerate(layouts)
        ]
        grads = {
            f"p{i}": (g if device.type == "cpu" else g.to(device)) for i, g in enumerate(cpu_grads)
        }
        if in_place:
            g32 = mpfunc.grads_to_fp32_(grads, out)
            mpfunc.apply_update_(masters, g32, state, opt)
            mpfunc.masters_to_model_(masters, params)
        else:
            g32 = mpfunc.grads_to_fp32(grads)
            masters, state = mpfunc.apply_update(masters, g32, state, opt)
            params = mpfunc.masters_to_model(masters, params)
        _sync(device)
        ref_grads = [g.float().contiguous() for g in cpu_grads]
        if torch_cls is None:
            ref_opt.step(ref_grads)
        else:
            for r, g in zip(ref, ref_grads):
                r.grad = g
            ref_opt.step()
        peak = [torch.maximum(pk, r.abs().max()) for pk, r in zip(peak, ref)]

    _sync(device)
    for i, lay in enumerate(layouts):
        key = f"p{i}"
        got = masters[key].detach().cpu()
        err = float((got.double() - ref[i].double()).abs().max()) if got.numel() else 0.0
        bound = RTOL * float(peak[i])
        assert err <= bound, (name, impl, lay.name, grad_kinds[i], err, bound)
        rounded = masters[key].detach().cpu().to(BF16)
        assert torch.equal(
            params[key].detach().cpu().view(torch.int16), rounded.view(torch.int16)
        ), (name, impl, lay.name)
        if in_place and device.type == "cpu":
            # Buffers follow the param's layout; the model's own tensor keeps its strides.
            assert masters[key].stride() == cpu_params[key].stride() or not _dense(cpu_params[key])
            assert params[key] is not None and params[key].stride() == cpu_params[key].stride()


def _dense(t: torch.Tensor) -> bool:
    return t.is_contiguous() or (
        t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last)
    )


@pytest.mark.parametrize("in_place", [True, False], ids=["in_place", "pure"])
@settings(max_examples=60)
@given(data=st.data())
def test_layouts_cpu(in_place: bool, data: st.DataObject) -> None:
    run(torch.device("cpu"), data, in_place)


@pytest.mark.xla
@pytest.mark.parametrize("in_place", [True, False], ids=["in_place", "pure"])
@settings(max_examples=8)
@given(data=st.data())
def test_layouts_xla(xla_device: torch.device, in_place: bool, data: st.DataObject) -> None:
    run(xla_device, data, in_place)


def test_channels_last_readme_loop_regression() -> None:
    """The reported case, fixed: a channels_last bf16 conv weight, 10 steps of the README's
    in-place AdamW loop on the default impl, against torch.optim.AdamW on fp32 copies."""
    gen = torch.Generator().manual_seed(0)
    w = randn(gen, BF16, 8, 4, 3, 3).to(memory_format=torch.channels_last)
    params = {"conv.weight": w}
    ref = [w.detach().float().contiguous().clone()]
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, foreach=False)
    opt = mpfunc.adamw(lr=1e-2)
    masters = mpfunc.init_master(params)
    state = opt.init(masters)
    out = mpfunc.init_grads(params)
    assert out["conv.weight"].stride() == w.stride()
    peak = ref[0].abs().max()
    for _ in range(10):
        g = randn(gen, BF16, 8, 4, 3, 3)  # contiguous, as autograd often returns
        mpfunc.apply_update_(masters, mpfunc.grads_to_fp32_({"conv.weight": g}, out), state, opt)
        mpfunc.masters_to_model_(masters, params)
        ref[0].grad = g.float()
        ref_opt.step()
        peak = torch.maximum(peak, ref[0].abs().max())
    err = (masters["conv.weight"].double() - ref[0].double()).abs().max()
    assert float(err) <= RTOL * float(peak)


@pytest.mark.parametrize("state_dtype", [None, torch.bfloat16, torch.uint8, torch.uint4], ids=str)
@pytest.mark.parametrize("strategy", ["fp32", "remainder", "kahan", "stochastic", "none"])
def test_size_one_dims_take_any_stride(strategy: str, state_dtype: torch.dtype | None) -> None:
    """A (1, 40) param stored as a transposed (40, 1) tensor has strides (1, 1); its grad,
    master and state may have (40, 1). A dim of size 1 is never stepped along, so the native
    pass takes them (it refused with an internal error naming no path) and gives the torch
    path's bits."""

    def run(impl: str, grad_t: bool) -> list[torch.Tensor]:
        gen = torch.Generator().manual_seed(4)
        param = torch.randn(40, 1, generator=gen).to(torch.bfloat16).t()
        assert param.stride() == (1, 1)
        params = {"head": param}
        masters = mpfunc.init_master(params, strategy=strategy)
        opt = mpfunc.adamw(lr=1e-2, impl=impl, state_dtype=state_dtype)  # type: ignore[arg-type]
        state = opt.init(masters)
        for _ in range(2):
            g = torch.randn(40, 1, generator=gen).to(torch.bfloat16)
            grad = g.t() if grad_t else g.reshape(1, 40)
            kw = {"params": params} if strategy == "fp32" else {}
            mpfunc.apply_update_(masters, {"head": grad}, state, opt, **kw)
        return [t for t in leaves((masters, state, params)) if isinstance(t, torch.Tensor)]

    for grad_t in (False, True):
        for a, b in zip(run("auto", grad_t), run("fused", grad_t)):  # the native spec
            if a.is_floating_point():
                assert_bits_equal(a, b)
            else:
                assert torch.equal(a, b)

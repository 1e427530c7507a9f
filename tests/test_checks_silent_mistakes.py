"""Mistakes that used to train nothing, or differentiate to zeros, without an error.

- a grads tree that matches the masters only up to the container type (an OrderedDict
  from ``model.state_dict()`` against a dict): a clear error naming both types;
- differentiating through a transform: ``torch.func`` transforms get an error, and eager
  ``.backward()`` through the (detached) results raises rather than giving zero grads;
- exporting masters into a ``torch.compile``d model (keys prefixed ``_orig_mod.``):
  ``masters_state_dict(masters, model)`` keys them as the model does, or raises;
- a schedule that reads the step count back to the host on XLA: a warning, once.
"""

from __future__ import annotations

import collections
import warnings
from typing import Any

import pytest
import torch
from support.helpers import assert_unchanged, snapshot

import mpfunc


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)).to(torch.bfloat16)


def _grads(model: torch.nn.Module) -> collections.OrderedDict[str, Any]:
    model(torch.ones(2, 4, dtype=torch.bfloat16)).float().sum().backward()
    return collections.OrderedDict((n, p.grad) for n, p in model.named_parameters())


def test_an_ordered_dict_against_a_dict_is_a_clear_error() -> None:
    model = _model()
    params = dict(model.named_parameters())
    ordered = {"net": _grads(model)}  # e.g. built by iterating model.state_dict()
    masters = {"net": mpfunc.init_master(params)}
    opt = mpfunc.adamw(lr=1e-2)
    state = opt.init(masters)
    out = {"net": mpfunc.init_grads(params)}
    before = snapshot([masters, state, out])
    calls = [
        lambda: mpfunc.grads_to_fp32_(ordered, out),
        lambda: mpfunc.apply_update_(masters, mpfunc.grads_to_fp32(ordered), state, opt),
        lambda: mpfunc.masters_to_model_(masters, {"net": model.state_dict()}),
    ]
    for call in calls:
        with pytest.raises(ValueError, match=r"containers differ: at 'net' \w+ holds an? ") as e:
            call()
        assert "OrderedDict" in str(e.value) and "a dict" in str(e.value), str(e.value)
    assert_unchanged([masters, state, out], before)
    # Built the same way, the same trees train.
    g32 = mpfunc.grads_to_fp32_({"net": dict(ordered["net"])}, out)
    mpfunc.apply_update_(masters, g32, state, opt)


def _transforms(params: dict[str, torch.Tensor]) -> dict[str, Any]:
    opt = mpfunc.sgd(lr=0.1)
    return {
        "masters_to_model": lambda m: mpfunc.masters_to_model(m, params)["w"].float(),
        "grads_to_fp32": lambda m: mpfunc.grads_to_fp32(m)["w"],
        "apply_update": lambda m: mpfunc.apply_update(m, {"w": m["w"] + 0}, opt.init(m), opt)[0][
            "w"
        ],
        "accumulate_grads": lambda m: mpfunc.accumulate_grads(m, m)["w"],
        "clip_by_global_norm": lambda m: mpfunc.clip_by_global_norm(m, 1.0)[0]["w"],
        "init_master": lambda m: mpfunc.init_master(m)["w"],
    }


@pytest.mark.parametrize("name", list(_transforms({})))
def test_differentiating_through_a_transform_raises(name: str) -> None:
    params = {"w": torch.randn(3, dtype=torch.bfloat16)}
    masters = mpfunc.init_master(params)
    f = _transforms(params)[name]
    # torch.func would return all-zero grads: refused, naming the path.
    with pytest.raises(TypeError, match=r"at '\w+\.w': .*torch\.func.*not differentiable"):
        torch.func.grad(lambda m: (f(m) ** 2).sum())(masters)
    with pytest.raises(TypeError, match="not differentiable"):
        torch.func.vjp(f, masters)
    # Eager autograd: the results are detached, so backward() raises; no zero grads.
    leaf = {"w": masters["w"].clone().requires_grad_(True)}
    with pytest.raises(RuntimeError, match="does not require grad"):
        (f(leaf) ** 2).sum().backward()
    assert leaf["w"].grad is None


def test_masters_export_into_a_compiled_model() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    masters = mpfunc.init_master(dict(_model().named_parameters()))
    compiled = torch.compile(model)  # wraps only: nothing compiles before a call
    assert all(k.startswith("_orig_mod.") for k in compiled.state_dict())
    # Without the model, strict=False would load nothing (the failure this prevents).
    assert not set(mpfunc.masters_state_dict(masters)) & set(compiled.state_dict())
    sd = mpfunc.masters_state_dict(masters, compiled)
    result = compiled.load_state_dict(sd, strict=False)
    assert not result.unexpected_keys and not result.missing_keys
    for name, m in masters.items():
        assert torch.equal(compiled.state_dict()[f"_orig_mod.{name}"], m)
    # Masters named after a compiled model load into a plain one.
    named_compiled = mpfunc.init_master(dict(compiled.named_parameters()))
    plain = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    assert set(mpfunc.masters_state_dict(named_compiled, plain)) == set(masters)
    # Masters of another model: every stray key and shape named, in one error.
    other = {"0.weight": torch.zeros(5, 4), "head.bias": torch.zeros(2)}
    strays = (
        r"got 2 that do not: '0\.weight' \(shape \(5, 4\), the model's '_orig_mod\.0\.weight' "
        r"has \(3, 4\)\), 'head\.bias' \(no such entry\)"
    )
    with pytest.raises(ValueError, match=strays):
        mpfunc.masters_state_dict(other, compiled)
    with pytest.raises(TypeError, match=r"model: expected None or a torch\.nn\.Module"):
        mpfunc.masters_state_dict(masters, compiled.state_dict())  # type: ignore[arg-type]


def _step(device: torch.device, lr: Any, steps: int = 2) -> None:
    masters = {"w": torch.ones(3, device=device)}
    opt = mpfunc.adamw(lr=lr)
    state = opt.init(masters)
    for _ in range(steps):
        mpfunc.apply_update_(masters, {"w": torch.ones(3, device=device)}, state, opt)


def _host_schedule(step: torch.Tensor) -> float:
    return 1e-3 * min(1.0, float(step + 1) / 10)  # reads the count back to the host


def _device_schedule(step: torch.Tensor) -> torch.Tensor:
    return 1e-3 * torch.clamp((step + 1) / 10, max=1.0)


@pytest.mark.xla
def test_a_host_schedule_warns_once_on_xla(xla_device: torch.device) -> None:
    with pytest.warns(RuntimeWarning, match="_host_schedule returned float .* XLA") as record:
        _step(xla_device, _host_schedule, steps=3)
    assert len([w for w in record if "lr schedule" in str(w.message)]) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _step(xla_device, _device_schedule)  # stays on the device: no warning
        _step(torch.device("cpu"), lambda step: 1e-3)  # on the CPU nothing waits: no warning

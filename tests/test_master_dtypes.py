"""Complex params are refused naming the path; float64 params get float64 masters and
train bit for bit as torch.optim in float64; a master narrower than its param is
refused."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from support.hardening import BF16, F32, F64, B, W, _at, _desc, _rand
from support.helpers import assert_bits_equal

import mpfunc

# torch warns once per process that CSR support is in beta; these tests only hand CSR
# tensors to functions that must refuse them.
pytestmark = pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta:UserWarning")


@pytest.mark.parametrize("fn", [mpfunc.init_master, mpfunc.init_grads])
def test_complex_params_are_refused_naming_the_path(fn: Any) -> None:
    params = {"a": {"w": _rand(W)}, "z": {"c": torch.zeros(B, dtype=torch.complex64)}}
    with pytest.raises(
        TypeError,
        match=_at(
            fn.__name__,
            "params.z.c",
            "a real tensor (complex parameters get no master)",
            "torch.complex64 tensor of shape (3,) on cpu",
        ),
    ):
        fn(params)


def test_float64_params_get_float64_masters(device: torch.device) -> None:
    params = {"d": _rand(W, F64, device=device), "h": _rand(W, BF16, device=device)}
    masters = mpfunc.init_master(params)
    assert masters["d"].dtype == F64 and masters["h"].dtype == F32
    assert mpfunc.init_grads(params)["d"].dtype == F64
    assert mpfunc.grads_to_fp32(params)["d"].dtype == F64
    # Precision survives the round trip: a step below float32's resolution is kept.
    masters["d"].add_(1e-12)
    mpfunc.masters_to_model_(masters, params)
    assert_bits_equal(params["d"], masters["d"])


@pytest.mark.parametrize("fn", [mpfunc.init_master, mpfunc.init_grads])
def test_narrower_master_dtype_than_param_is_refused(fn: Any) -> None:
    params = {"a": _rand(W), "d": _rand(W, F64)}
    with pytest.raises(
        ValueError,
        match=_at(
            fn.__name__, "params.d", "a param no wider than the torch.float32 master", _desc(W, F64)
        ),
    ):
        fn(params, dtype=F32)


TorchOpt = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]


TORCH_F64: dict[str, tuple[Callable[[], mpfunc.Optimizer], TorchOpt]] = {
    "sgd": (
        lambda: mpfunc.sgd(lr=0.1, momentum=0.9, weight_decay=0.01),
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01, foreach=False),
    ),
    "adam": (
        lambda: mpfunc.adam(lr=0.1, weight_decay=0.01, impl="fused"),
        lambda ps: torch.optim.Adam(ps, lr=0.1, weight_decay=0.01, fused=True),
    ),
    "adamw": (
        lambda: mpfunc.adamw(lr=0.1, weight_decay=0.01, impl="fused"),
        lambda ps: torch.optim.AdamW(ps, lr=0.1, weight_decay=0.01, fused=True),
    ),
}


@pytest.mark.parametrize("name", sorted(TORCH_F64))
def test_float64_training_matches_torch_optim_float64_bit_for_bit(name: str) -> None:
    make, make_torch = TORCH_F64[name]
    params = {"b": _rand(B, F64), "w": _rand(W, F64, 1)}
    ref = [torch.nn.Parameter(params["b"].clone()), torch.nn.Parameter(params["w"].clone())]
    masters = mpfunc.init_master(params)
    opt = make()
    state = opt.init(masters)
    torch_opt = make_torch(ref)
    for _ in range(5):
        grads = {"b": torch.randn(B, dtype=F64) * 1e-3, "w": torch.randn(W, dtype=F64) * 1e-3}
        ref[0].grad, ref[1].grad = grads["b"].clone(), grads["w"].clone()
        torch_opt.step()
        mpfunc.apply_update_(masters, mpfunc.grads_to_fp32(grads), state, opt)
        mpfunc.masters_to_model_(masters, params)
        assert_bits_equal(params["b"], ref[0].detach())
        assert_bits_equal(params["w"], ref[1].detach())

"""A refused ``MasterOptimizer.load_state_dict`` leaves a frozen param without master
or state."""

from __future__ import annotations

import pytest
import torch
from support.entry_checks import BF16, _assert_unchanged, _snapshot

import mpfunc
from tests.support.helpers import assert_bits_equal


def _model_params(frozen: bool) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(5)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(BF16)) for s in (6, (3, 4), 5)]
    if frozen:
        params[0].requires_grad_(False)
    return params


def test_a_refused_load_gives_a_frozen_param_no_master_or_state() -> None:
    """Issue 20, item 3: ``MasterOptimizer.load_state_dict`` made the master and state of a
    frozen param that has state in the dict, then refused a later entry's shape: the
    frozen param kept a master and a state. Now everything is checked first."""
    trained = _model_params(frozen=False)
    opt = mpfunc.MasterOptimizer(trained, lr=1e-2)
    for p in trained:
        p.grad = torch.ones_like(p)
    opt.step()
    sd = opt.state_dict()
    sd["state"][2] = {**sd["state"][2], "exp_avg": torch.zeros(7)}  # the last entry: wrong

    params = _model_params(frozen=True)
    fresh = mpfunc.MasterOptimizer(params, lr=1e-2)
    before = _snapshot([params, list(fresh.state.values())])
    with pytest.raises(ValueError, match=r"state\[2\] .*\['exp_avg'\]\": expected torch\.float32"):
        fresh.load_state_dict(sd)
    _assert_unchanged(before)
    assert params[0] not in fresh.state
    assert sorted(fresh.state_dict()["state"]) == [1, 2]

    sd["state"][2]["exp_avg"] = opt.state[trained[2]]["exp_avg"]  # the same dict, now right
    fresh.load_state_dict(sd)
    assert sorted(fresh.state_dict()["state"]) == [0, 1, 2]
    for name, t in opt.state[trained[0]].items():
        assert_bits_equal(fresh.state[params[0]][name], t)


U4: torch.dtype = torch.uint4  # type: ignore[attr-defined]


def _loads_weights_only(dtype: torch.dtype) -> bool:
    """Whether this torch's weights_only unpickler takes ``dtype`` itself (the groups hold
    each ``state_dtype``): torch 2.4 refuses ``torch.uint4``, 2.9 takes it."""
    import io

    buf = io.BytesIO()
    torch.save(dtype, buf)
    buf.seek(0)
    try:
        torch.load(buf, weights_only=True)
    except Exception:  # (the unpickler's own error type differs across versions)
        return False
    return True


@pytest.mark.parametrize("strategy", ["fp32", "remainder", "stochastic"])
@pytest.mark.parametrize("state_dtype", [torch.uint8, U4], ids=["uint8", "uint4"])
def test_encoded_state_resumes_through_torch_load_weights_only(
    tmp_path: object, strategy: str, state_dtype: torch.dtype
) -> None:
    """8-bit and 4-bit moments are NamedTuples (QState, Q4State) in the state_dict: they
    load with torch.load(weights_only=True), torch's default and HF Trainer's resume, and
    load_state_dict takes them (it read each entry as a tensor and failed with an
    AttributeError); the resumed run is the uninterrupted one, bit for bit. A saved moment
    of another format is refused naming the entry, nothing written."""
    import copy
    from pathlib import Path

    def grads(k: int) -> list[torch.Tensor]:
        gen = torch.Generator().manual_seed(k)
        return [torch.randn(64, 64, generator=gen).to(BF16)]

    def model() -> list[torch.nn.Parameter]:
        gen = torch.Generator().manual_seed(0)
        return [torch.nn.Parameter(torch.randn(64, 64, generator=gen).to(BF16))]

    def opt(ps: list[torch.nn.Parameter], sd: torch.dtype) -> mpfunc.MasterOptimizer:
        return mpfunc.MasterOptimizer(ps, lr=1e-2, strategy=strategy, state_dtype=sd)

    def step(o: mpfunc.MasterOptimizer, ps: list[torch.nn.Parameter], k: int) -> None:
        for p, g in zip(ps, grads(k)):
            p.grad = g
        o.step()
        o.zero_grad()

    ps, ps2 = model(), model()
    o = opt(ps, state_dtype)
    step(o, ps, 1)
    path = Path(str(tmp_path)) / "opt.pt"
    torch.save(o.state_dict(), path)
    saved = torch.load(path, weights_only=_loads_weights_only(state_dtype))
    with torch.no_grad():
        ps2[0].copy_(ps[0])
    o2 = opt(ps2, state_dtype)
    o2.load_state_dict(copy.deepcopy(saved))
    for k in (2, 3):
        step(o, ps, k)
        step(o2, ps2, k)
    assert_bits_equal(ps2[0], ps[0])
    other = U4 if state_dtype == torch.uint8 else torch.uint8
    o3 = opt(model(), other)
    step(o3, o3.param_groups[0]["params"], 1)
    before = _snapshot(o3)
    with pytest.raises(
        ValueError, match=r"state\[0\].*\['exp_avg'\]\": expected Q4?State, got Q4?State"
    ):
        o3.load_state_dict(saved)
    _assert_unchanged(before)

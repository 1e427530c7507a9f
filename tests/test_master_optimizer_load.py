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

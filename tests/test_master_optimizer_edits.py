"""What users do to a MasterOptimizer between steps, found in review to go wrong silently
or to write before a refusal: a refused step writes nothing (not even the masters of
params written outside, nor a param whose dtype changed), a param put in place of another
in a group is refused, a state reset survives a hyperparameter change that adds a state
field, and a master replaced through ``opt.state`` shows in its param only once the step
is accepted."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from support.helpers import assert_unchanged, snapshot, state_tensors

import mpfunc

BF16 = torch.bfloat16


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _stepped(strategy: str = "fp32", **kw: Any) -> tuple[torch.nn.Module, Any]:
    model = torch.nn.Sequential(torch.nn.Linear(64, 8), torch.nn.Linear(8, 8)).to(BF16)
    opt = mpfunc.MasterOptimizer(model.parameters(), mpfunc.adamw, lr=1e-2, strategy=strategy, **kw)
    for k, p in enumerate(model.parameters()):
        p.grad = _randn(*p.shape, seed=k).to(BF16)
    opt.step()
    return model, opt


@pytest.mark.parametrize("strategy", ["fp32", "kahan", "stochastic"])
def test_a_refused_step_writes_no_master_of_a_param_written_outside(strategy: str) -> None:
    # A write to the model (a partial load) and then a refused step (a sparse grad): the
    # masters were refreshed from the written params before the refusal.
    model, opt = _stepped(strategy)
    with torch.no_grad():
        model[0].weight.mul_(0.5)
    grads = [_randn(*p.shape, seed=9).to(BF16) for p in model.parameters()]
    grads[3] = grads[3].to_sparse()
    for p, g in zip(model.parameters(), grads):
        p.grad = g
    watch = [list(model.parameters()), state_tensors(opt)]
    snap = snapshot(watch)
    with pytest.raises(TypeError, match="params\\[3\\]"):
        opt.step()
    assert_unchanged(watch, snap)
    # The write is still taken at the next accepted step, as it would have been.
    model[1].bias.grad = grads[3].to_dense()
    opt.step()
    if strategy == "fp32":
        ref = opt.state[model[0].weight]["master"].to(BF16)
        assert torch.equal(ref, model[0].weight.detach())


def test_a_refused_step_leaves_a_param_whose_dtype_changed_unwritten() -> None:
    model, opt = _stepped()
    model[1].double()  # a float64 param beside a float32 master: refused
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    watch = [list(model.parameters()), state_tensors(opt)]
    snap = snapshot(watch)
    with pytest.raises(TypeError, match="no wider"):
        opt.step()
    assert_unchanged(watch, snap)


def test_a_master_replaced_through_opt_state_shows_only_once_the_step_is_accepted() -> None:
    w = torch.nn.Parameter(_randn(8, 64, seed=0).to(BF16))
    b = torch.nn.Parameter(_randn(16, seed=1).to(BF16), requires_grad=False)
    opt = mpfunc.MasterOptimizer([w, b], mpfunc.adamw, lr=1e-2, state_dtype=torch.uint8)
    w.grad = _randn(8, 64, seed=2).to(BF16)
    opt.step()
    opt.state[w]["master"] = torch.full((8, 64), 0.25)
    b.requires_grad_(True)  # trained now, too small for an 8-bit block: refused
    b.grad = _randn(16, seed=3).to(BF16)
    snap = snapshot([w, b])
    with pytest.raises(ValueError, match="at least 32 elements"):
        opt.step()
    assert_unchanged([w, b], snap)
    # Accepted: the step starts from the replaced master, which the param then shows.
    b.grad = None
    b.requires_grad_(False)
    w.grad = torch.zeros(8, 64, dtype=BF16)
    opt.step()
    master = opt.state[w]["master"]
    assert bool((master - 0.25).abs().max() < 0.02)
    assert torch.equal(w.detach(), master.to(BF16))


def test_a_param_put_in_place_of_another_in_a_group_is_refused() -> None:
    # torch.optim would train the new param; the old one went on training, with no word.
    a = torch.nn.Parameter(_randn(64, seed=0).to(BF16))
    b = torch.nn.Parameter(_randn(64, seed=1).to(BF16))
    opt = mpfunc.MasterOptimizer([a, b], mpfunc.adamw, lr=1e-2)
    a.grad, b.grad = _randn(64, seed=2).to(BF16), _randn(64, seed=3).to(BF16)
    opt.step()
    new = torch.nn.Parameter(_randn(64, seed=4).to(BF16))
    new.grad = _randn(64, seed=5).to(BF16)
    watch = [a, b, new, state_tensors(opt)]
    snap = snapshot(watch)
    opt.param_groups[0]["params"][0] = new
    with pytest.raises(ValueError, match=r"step: .*another tensor at params\[0\]"):
        opt.step()
    with pytest.raises(ValueError, match=r"state_dict: .*another tensor at params\[0\]"):
        opt.state_dict()  # (was a KeyError from torch's state_dict)
    assert_unchanged(watch, snap)
    opt.param_groups[0]["params"][0] = a  # put back: steps again
    opt.step()


@pytest.mark.parametrize("reset", ["clear", "empty entry", "replaced step"])
@pytest.mark.parametrize("change", ["amsgrad on", "momentum on"])
def test_a_state_reset_survives_a_change_that_adds_a_state_field(reset: str, change: str) -> None:
    # torch.optim: the reset param starts afresh at its next step. Here the restate of the
    # new field relinked opt.state first, and the reset was lost (step 4 instead of 1).
    p = torch.nn.Parameter(_randn(64, seed=0).to(BF16))
    if change == "amsgrad on":
        opt = mpfunc.MasterOptimizer([p], mpfunc.adamw, lr=1e-2)
        ref_p = torch.nn.Parameter(p.detach().float().clone())
        ref: torch.optim.Optimizer = torch.optim.AdamW([ref_p], lr=1e-2)
    else:
        opt = mpfunc.MasterOptimizer([p], mpfunc.sgd, lr=1e-2, momentum=0.0)
        ref_p = torch.nn.Parameter(p.detach().float().clone())
        ref = torch.optim.SGD([ref_p], lr=1e-2, momentum=0.0)
    for k in range(3):
        p.grad = _randn(64, seed=10 + k).to(BF16)
        ref_p.grad = p.grad.float()
        opt.step()
        ref.step()
    if reset == "clear":
        opt.state.clear()
        ref.state.clear()
    elif reset == "empty entry":
        opt.state[p] = {}
        ref.state[ref_p] = {}
    if change == "amsgrad on":
        opt.param_groups[0]["amsgrad"] = ref.param_groups[0]["amsgrad"] = True
    else:
        opt.param_groups[0]["momentum"] = ref.param_groups[0]["momentum"] = 0.9
    if reset == "replaced step":
        opt.state[p]["step"] = torch.tensor(0.0)
        if change == "amsgrad on":
            ref.state[ref_p]["step"] = torch.tensor(0.0)
    p.grad = _randn(64, seed=20).to(BF16)
    ref_p.grad = p.grad.float()
    opt.step()
    entry = opt.state[p]
    assert entry["step"].item() == 1.0
    if change == "amsgrad on":
        assert set(entry) >= {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"}
        if reset != "replaced step":  # (torch.optim cannot turn amsgrad on mid-run: KeyError)
            ref.step()
            torch.testing.assert_close(entry["exp_avg"], ref.state[ref_p]["exp_avg"])
    else:
        ref.step()
        want = ref.state[ref_p]["momentum_buffer"]
        torch.testing.assert_close(entry["momentum_buffer"], want)
    assert set(opt.state_dict()["state"][0]) == set(entry)


@pytest.mark.xla
def test_loaded_masters_show_in_the_params_on_xla_as_on_the_cpu(xla_device: torch.device) -> None:
    # torch_xla's foreach copy (the load's) bumps no version counter: the next step took the
    # params' old values over the loaded masters, on XLA only (found in review).
    for device in (torch.device("cpu"), xla_device):
        src = torch.nn.Linear(4, 2).to(BF16).to(device)
        dst = torch.nn.Linear(4, 2).to(BF16).to(device)
        with torch.no_grad():
            src.weight.fill_(1.0)
            dst.weight.fill_(-3.0)
        saved = mpfunc.MasterOptimizer(src.parameters(), lr=0.0).state_dict()
        opt = mpfunc.MasterOptimizer(dst.parameters(), lr=0.0)
        opt.load_state_dict(saved)
        for p in dst.parameters():
            p.grad = torch.zeros_like(p)
        opt.step()  # lr 0: the loaded masters, shown in the params
        assert bool((dst.weight.detach().cpu() == 1.0).all()), device
        assert bool((opt.state[dst.weight]["master"].cpu() == 1.0).all()), device


@pytest.mark.xla
@pytest.mark.parametrize("strategy", ["remainder", "kahan"])
def test_an_empty_unit_leaf_steps_on_xla(xla_device: torch.device, strategy: str) -> None:
    # The node's identity gather of no elements was refused by XLA, after the other groups
    # of the call had stepped (found in review).
    results = []
    for device in (torch.device("cpu"), xla_device):
        gen = torch.Generator().manual_seed(0)
        params = {
            "a": torch.randn(16, generator=gen).to(BF16).to(device),
            "empty": torch.zeros(0, 3, dtype=BF16, device=device),
            "f": torch.randn(8, generator=gen).to(device),
        }
        masters = mpfunc.init_master(
            params, strategy={"a": strategy, "empty": strategy, "f": "none"}
        )
        opt = mpfunc.adamw(lr=1e-2)
        state = opt.init(masters)
        grads = {k: torch.ones_like(v) for k, v in params.items()}
        mpfunc.apply_update_(masters, grads, state, opt)
        results.append({k: v.cpu() for k, v in params.items()})
    for k in ("a", "f"):
        torch.testing.assert_close(results[1][k], results[0][k], rtol=1e-2, atol=1e-6)
    assert results[1]["empty"].shape == (0, 3)


@pytest.mark.parametrize("make", ["sgd", "adamw"])
def test_from_torch_carries_the_defaults_to_groups_added_later(make: str) -> None:
    # A group added later took mpfunc's factory defaults (lr 1e-3, no momentum), where
    # torch.optim fills it from the built values (found in review).
    a, b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    if make == "sgd":
        t: torch.optim.Optimizer = torch.optim.SGD(
            a.parameters(), lr=0.5, momentum=0.9, weight_decay=0.1
        )
        keys = ("lr", "momentum", "weight_decay")
    else:
        t = torch.optim.AdamW(a.parameters(), lr=0.05, betas=(0.8, 0.95), weight_decay=0.3)
        keys = ("lr", "betas", "weight_decay")
    opt = mpfunc.MasterOptimizer.from_torch(t)
    opt.add_param_group({"params": list(b.parameters())})
    t.add_param_group({"params": list(torch.nn.Linear(4, 4).parameters())})
    for k in keys:
        assert opt.param_groups[1][k] == t.param_groups[1][k], k

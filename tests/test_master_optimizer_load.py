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


def _torch_run(cls: type, steps: int, **kw: object) -> tuple[list[torch.nn.Parameter], object]:
    """fp32 params trained ``steps`` steps by torch.optim, and the optimizer."""
    gen = torch.Generator().manual_seed(9)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in ((6, 4), (4,), ())]
    opt = cls(params, **kw)
    for k in range(steps):
        g = torch.Generator().manual_seed(100 + k)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    return params, opt


def _grads(k: int, *trees: list[torch.nn.Parameter]) -> None:
    g = torch.Generator().manual_seed(200 + k)
    for ps in zip(*trees):
        x = torch.randn(ps[0].shape, generator=g)
        for p in ps:
            p.grad = x.to(p.dtype).to(p.device)


@pytest.mark.parametrize(
    ("cls", "factory", "kw"),
    [
        (torch.optim.AdamW, mpfunc.adamw, {"lr": 1e-2, "weight_decay": 0.1, "fused": True}),
        (torch.optim.AdamW, mpfunc.adamw, {"lr": 1e-2, "amsgrad": True, "fused": True}),
        (torch.optim.Adam, mpfunc.adam, {"lr": 1e-2, "weight_decay": 0.1, "fused": True}),
        (torch.optim.SGD, mpfunc.sgd, {"lr": 1e-2, "momentum": 0.9, "dampening": 0.5}),
    ],
    ids=["adamw", "adamw-amsgrad", "adam", "sgd"],
)
def test_a_torch_optim_checkpoint_resumes(cls: type, factory: object, kw: dict) -> None:
    """Migrating: the state_dict of the torch.optim run before (its moments, step counts
    and hyperparameters) loads into a MasterOptimizer over the same params, the masters
    made from the params as they stand; the run then goes on as torch.optim's does (fp32
    params: bit for bit where both run torch's fused kernel, else within the bound). It
    said "expected the hyperparameters ... got no impl, state_dtype"."""
    from tests.support.helpers import assert_close_bound

    ref, ref_opt = _torch_run(cls, 3, **kw)
    sd = ref_opt.state_dict()
    params = [torch.nn.Parameter(p.detach().clone()) for p in ref]
    mine = {k: v for k, v in kw.items() if k != "fused"}
    opt = mpfunc.MasterOptimizer(params, factory, **{**mine, "lr": 0.5})  # type: ignore[arg-type]
    opt.load_state_dict(sd)
    assert opt.param_groups[0]["lr"] == kw["lr"] and opt.param_groups[0]["impl"] == "auto"
    for k in range(4):
        _grads(k, params, ref)
        opt.step()
        ref_opt.step()
    for p, r in zip(params, ref):
        if cls is torch.optim.SGD:
            assert_close_bound(p, r, lr=1e-2, steps=7)
        else:
            assert_bits_equal(p.detach(), r.detach())
            for name, t in ref_opt.state[r].items():
                assert_bits_equal(opt.state[p][name], t)


def test_a_torch_optim_checkpoint_into_bf16_params_and_what_is_refused() -> None:
    """Into a bf16 model (the usual migration): the moments and step counts are torch's,
    each master the bf16 param widened (the file holds no fp32 master). A torch.optim.Adam
    state into mpfunc.adamw (weight_decay means another update) and any state into an
    optimizer with 8-bit moments are refused, naming why, with nothing written."""
    ref, ref_opt = _torch_run(torch.optim.AdamW, 2, lr=1e-2)
    params = [torch.nn.Parameter(p.detach().to(BF16)) for p in ref]
    for strategy in ("fp32", "remainder"):
        opt = mpfunc.MasterOptimizer(params, mpfunc.adamw, strategy=strategy, lr=1e-2)
        opt.load_state_dict(ref_opt.state_dict())
        for p, r in zip(params, ref):
            for name in ("exp_avg", "exp_avg_sq", "step"):
                assert_bits_equal(opt.state[p][name], ref_opt.state[r][name])
        if strategy == "fp32":
            for p in params:
                assert_bits_equal(opt.state[p]["master"], p.detach().float())
    _, adam = _torch_run(torch.optim.Adam, 1, lr=1e-2)
    for factory, kw, saved, match in [
        (mpfunc.adamw, {}, adam,
         r"param_groups\[0\]: expected the state of a torch\.optim\.AdamW \(mpfunc\.adamw\), "
         r"got one with decoupled_weight_decay=False.*Use mpfunc\.adam$"),
        (mpfunc.adamw, {"state_dtype": torch.uint8}, ref_opt,
         r"param_groups\[0\]: expected state_dtype=None to load a torch\.optim state_dict"),
    ]:  # fmt: skip
        if saved is adam and "decoupled_weight_decay" not in adam.state_dict()["param_groups"][0]:
            continue  # torch < 2.7 records no such key: Adam's and AdamW's states look alike
        p = [torch.nn.Parameter(torch.randn(64, 32).to(BF16))]
        opt = mpfunc.MasterOptimizer(p, factory, lr=1e-2, **kw)  # type: ignore[arg-type]
        p[0].grad = torch.ones_like(p[0])
        opt.step()
        sd = {
            "state": {0: {"step": torch.tensor(1.0), "exp_avg": torch.zeros(64, 32),
                          "exp_avg_sq": torch.zeros(64, 32)}},
            "param_groups": [dict(saved.state_dict()["param_groups"][0], params=[0])],
        }  # fmt: skip
        state = opt.state_dict()
        before = _snapshot([p, state["state"][0]["master"], state["state"][0]["step"]])
        with pytest.raises(ValueError, match=match):
            opt.load_state_dict(sd)
        _assert_unchanged(before)


@pytest.mark.parametrize("strategy", ["fp32", "kahan"])
def test_a_cpu_torch_optim_checkpoint_resumes_on_xla(
    xla_device: torch.device, strategy: str
) -> None:
    """The migration onto a TPU-style run: torch.optim's CPU state_dict loads into a
    MasterOptimizer over bf16 params on the XLA device (moments and step counts moved to
    it, as torch.optim's load moves them), and the run goes on as torch's CPU run does
    within the stated bound, with no host read in a step."""
    import torch_xla.debug.metrics as met

    from tests.support.helpers import assert_close_bound

    def to_host() -> int:
        data = met.metric_data("TransferFromDeviceTime")
        return 0 if data is None else int(data[0])

    ref, ref_opt = _torch_run(torch.optim.AdamW, 3, lr=1e-2, weight_decay=0.1)
    sd = ref_opt.state_dict()
    with torch.no_grad():  # bf16 params holding exactly what torch's run holds
        for r in ref:
            r.copy_(r.to(BF16))
    params = [torch.nn.Parameter(r.detach().to(BF16).to(xla_device)) for r in ref]
    opt = mpfunc.MasterOptimizer(params, mpfunc.adamw, strategy=strategy, lr=0.5)
    opt.load_state_dict(sd)
    for p in params:
        for name, t in opt.state[p].items():
            if isinstance(t, torch.Tensor):
                assert t.device == p.device, name
    reads = to_host()
    for k in range(3):
        g = torch.Generator().manual_seed(200 + k)
        for p, r in zip(params, ref):  # bf16 grads, the same values for both runs
            x = torch.randn(p.shape, generator=g).to(BF16)
            p.grad, r.grad = x.to(xla_device), x.float()
        opt.step()
        ref_opt.step()
    assert to_host() == reads, "a step read a tensor back to the host"
    for p, r in zip(params, ref):  # the exact masters: torch's fp32 run, within the bound
        st = opt.state[p]
        if strategy == "fp32":
            assert_close_bound(st["master"].cpu(), r.detach(), lr=1e-2, steps=3)
        else:  # param + a bf16 compensation: about 16 significant bits
            m = p.detach().float() + st["compensation"].float()
            torch.testing.assert_close(m.cpu(), r.detach(), rtol=2**-14, atol=1e-6)


@pytest.mark.parametrize(
    ("cls", "factory", "kw"),
    [
        (torch.optim.AdamW, mpfunc.adamw, {"lr": 1e-2, "weight_decay": 0.1, "fused": True}),
        (torch.optim.SGD, mpfunc.sgd, {"lr": 1e-2}),  # momentum 0: its state is always {}
    ],
    ids=["adamw-unused-param", "sgd-no-momentum"],
)
def test_params_without_saved_state_start_afresh_as_in_torch(
    cls: type, factory: object, kw: dict
) -> None:
    """A torch.optim checkpoint with no entry for a param (it had no grad yet; plain SGD
    keeps none at all) was refused as 'expected the keys [...], got []', though torch
    loads it: such a param starts afresh at its next step. It does so here too, and the
    run goes on as torch's."""
    gen = torch.Generator().manual_seed(3)
    ref = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in ((6, 4), (4,), (3,))]
    ref_opt = cls(ref, **kw)
    for _ in range(2):
        for i, r in enumerate(ref):
            r.grad = None if i == 1 else torch.randn(r.shape, generator=gen)
        ref_opt.step()
    sd = ref_opt.state_dict()
    params = [torch.nn.Parameter(r.detach().clone()) for r in ref]
    mine = {k: v for k, v in kw.items() if k != "fused"}
    opt = mpfunc.MasterOptimizer(params, factory, **mine)  # type: ignore[arg-type]
    for p in params:  # a step first, so every param holds state the load must drop or replace
        p.grad = torch.ones_like(p)
    opt.step()
    with torch.no_grad():
        for p, r in zip(params, ref):
            p.copy_(r)
    opt.load_state_dict(sd)
    for _ in range(3):
        for p, r in zip(params, ref):
            r.grad = torch.randn(r.shape, generator=gen)
            p.grad = r.grad.clone()
        opt.step()
        ref_opt.step()
    for p, r in zip(params, ref):
        assert_bits_equal(p.detach(), r.detach())
        for name, t in ref_opt.state[r].items():
            assert_bits_equal(opt.state[p][name], t)

"""Master strategies, state dtypes and the single-pass step, against independent references.

* single pass == three calls: ``apply_update_(masters, bf16 grads, ..., params=, scale=)``
  gives the bits of ``grads_to_fp32_(scale=)`` + ``apply_update_`` + ``masters_to_model_``,
  every optimizer, implementation and layout, with skipped steps;
* ``"remainder"``: masters (joined), state and params bit-identical to ``"fp32"`` every
  step (the param is ``Tensor.to``'s: nearest even, the tie bit keeps the master exact);
* ``"none"``: an fp32 step from the param, rounded back with ``Tensor.to``;
* ``"kahan"``: param + compensation within ``steps * 2**-16 * M`` of the fp32 master;
* ``"stochastic"``: same seed, same bits; the same bits on CPU and XLA; unbiased;
* ``state_dtype=torch.bfloat16``: fp32 moments rounded to bf16 after each step;
* ``state_dtype=torch.uint8``: the Adam direction stays close to fp32 Adam's;
* diagnostics: swallowed updates and the update-to-weight ratio, by hand.

CPU comparisons are bit for bit. On XLA, XLA:CPU fuses ``a*b + c`` depending on the whole
graph, so XLA runs are compared with the same computation on the CPU within the stated
bound ``max|a - b| <= 1e-6 * M``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from support.helpers import assert_bits_equal, bits, pruned_run
from support.layouts import BF16, GRAD_LAYOUTS, OPTS, PARAM_LAYOUTS, grad_like

import mpfunc
from mpfunc.strategies import _remainder
from mpfunc.strategies._strategy_stochastic import round_stochastic

STRATEGIES = ["fp32", "remainder", "kahan", "stochastic", "none"]
STATE_DTYPES = [None, torch.bfloat16, torch.uint8, torch.uint4]  # type: ignore[attr-defined]


def _sync(device: torch.device) -> None:
    if device.type == "xla":
        import torch_xla

        torch_xla.sync()


def _leaves(tree: Any) -> list[torch.Tensor]:
    return [t for t in mpfunc.state_dict(tree).values()]


def _assert_same_bits(a: Any, b: Any, what: str) -> None:
    la, lb = mpfunc.state_dict(a), mpfunc.state_dict(b)
    assert la.keys() == lb.keys(), what
    for k in la:
        x, y = la[k].detach().cpu(), lb[k].detach().cpu()
        assert x.dtype == y.dtype and x.shape == y.shape, (what, k)
        same = torch.equal(bits(x), bits(y)) if x.is_floating_point() else torch.equal(x, y)
        assert same, (what, k)


def _assert_close(a: Any, b: Any, what: str, rtol: float = 1e-6) -> None:
    la, lb = mpfunc.state_dict(a), mpfunc.state_dict(b)
    for k in la:
        x, y = la[k].detach().cpu().double(), lb[k].detach().cpu().double()
        if x.numel() == 0:
            continue
        m = max(float(y.abs().max()), 1e-30)
        assert float((x - y).abs().max()) <= rtol * m + 1e-12, (what, k)


def _case(data: st.DataObject, device: torch.device) -> dict[str, Any]:
    name = data.draw(st.sampled_from(sorted(OPTS)), label="optimizer")
    factory, _, hp, impls = OPTS[name]
    if device.type != "cpu":
        impls = [i for i in impls if i != "fused"]
    impl = data.draw(st.sampled_from(impls), label="impl")
    n = data.draw(st.integers(1, 3), label="leaves")
    layouts = [data.draw(st.sampled_from(PARAM_LAYOUTS), label=f"layout{i}") for i in range(n)]
    kinds = [data.draw(st.sampled_from(GRAD_LAYOUTS), label=f"grad{i}") for i in range(n)]
    steps = data.draw(st.integers(1, 4), label="steps")
    skips = [data.draw(st.booleans(), label=f"skip{k}") for k in range(steps)]
    scale = data.draw(st.sampled_from([None, 1024.0, "tensor"]), label="scale")
    seed = data.draw(st.integers(0, 2**16), label="seed")
    return dict(
        factory=factory,
        hp=hp,
        impl=impl,
        layouts=layouts,
        kinds=kinds,
        steps=steps,
        skips=skips,
        scale=scale,
        seed=seed,
    )


def _params(c: dict[str, Any], device: torch.device) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(c["seed"])
    return {f"p{i}": lay.make(gen, BF16).to(device) for i, lay in enumerate(c["layouts"])}


def _grads(c: dict[str, Any], device: torch.device, k: int, gen: torch.Generator) -> Any:
    scale = 1024.0 if c["scale"] is not None else 1.0
    return {
        f"p{i}": grad_like(c["kinds"][i], lay.shape, gen, scale * 10.0 ** (k % 3 - 1)).to(device)
        for i, lay in enumerate(c["layouts"])
    }


def _scale(c: dict[str, Any], device: torch.device) -> Any:
    if c["scale"] == "tensor":
        return torch.tensor(1024.0, device=device)
    return c["scale"]


# --- single pass == three calls ----------------------------------------------------------


def run_single_vs_three(device: torch.device, data: st.DataObject) -> None:
    c = _case(data, device)
    opt = c["factory"](**c["hp"], impl=c["impl"])
    pa, pb = _params(c, device), _params(c, device)
    ma, mb = mpfunc.init_master(pa), mpfunc.init_master(pb)
    sa, sb = opt.init(ma), opt.init(mb)
    out = mpfunc.init_grads(pa)
    gen = torch.Generator().manual_seed(c["seed"] + 1)
    scale = _scale(c, device)
    for k in range(c["steps"]):
        grads = _grads(c, device, k, gen)
        skip = torch.tensor(c["skips"][k], device=device)
        g32 = mpfunc.grads_to_fp32_(grads, out, scale=scale)
        mpfunc.apply_update_(ma, g32, sa, opt, skip)
        mpfunc.masters_to_model_(ma, pa)
        mpfunc.apply_update_(mb, grads, sb, opt, skip, params=pb, scale=scale)
        _sync(device)
    check = _assert_same_bits if device.type == "cpu" else _assert_close
    check(ma, mb, "masters")
    check(sa, sb, "state")
    check(pa, pb, "params")


@settings(max_examples=60)
@given(data=st.data())
def test_single_pass_equals_three_calls_cpu(data: st.DataObject) -> None:
    run_single_vs_three(torch.device("cpu"), data)


@pytest.mark.xla
@settings(max_examples=3)
@given(data=st.data())
def test_single_pass_equals_three_calls_xla(xla_device: torch.device, data: st.DataObject) -> None:
    run_single_vs_three(xla_device, data)


def test_single_pass_keeps_no_fp32_grad_tree() -> None:
    """The temporaries of a mixed step are bounded by one chunk, not the model: 64 leaves
    of 2**16 elements (16 MiB of fp32 grads) peak far below one fp32 grad tree."""
    import tracemalloc  # noqa: F401  (torch allocations are not traced; count via storage)

    params = {f"w{i}": torch.randn(256, 256).to(BF16) for i in range(64)}
    # (impl="auto" on CPU takes the native one-pass kernel, which allocates nothing; the
    # torch path, asked for here, loads and stores chunks.)
    masters = mpfunc.init_master(params, strategy="remainder")
    opt = mpfunc.adamw(lr=1e-3, impl="fused")
    state = opt.init(masters)
    grads = {k: torch.randn_like(v) for k, v in params.items()}
    peak = 0
    from mpfunc.backends import _plan

    real = _plan._run_mixed

    def spy(mx: Any, hyper: Any) -> None:
        nonlocal peak
        peak = max(peak, sum(m.param.numel() for m in mx.masters))
        real(mx, hyper)

    _plan._run_mixed = spy
    try:
        mpfunc.apply_update_(masters, grads, state, opt, params=params)
    finally:
        _plan._run_mixed = real
    assert 0 < peak <= _plan.MIXED_CHUNK_NUMEL
    assert peak * 4 * 16 <= sum(v.numel() for v in params.values()) * 4


# --- remainder == fp32 -------------------------------------------------------------------


def run_remainder(device: torch.device, data: st.DataObject) -> None:
    c = _case(data, device)
    opt = c["factory"](**c["hp"], impl=c["impl"])
    p32, prem = _params(c, device), _params(c, device)
    m32 = mpfunc.init_master(p32)
    mrem = mpfunc.init_master(prem, strategy="remainder")
    s32, srem = opt.init(m32), opt.init(mrem)
    gen = torch.Generator().manual_seed(c["seed"] + 1)
    scale = _scale(c, device)
    for k in range(c["steps"]):
        grads = _grads(c, device, k, gen)
        skip = torch.tensor(c["skips"][k], device=device)
        mpfunc.apply_update_(m32, grads, s32, opt, skip, params=p32, scale=scale)
        mpfunc.apply_update_(mrem, grads, srem, opt, skip, params=prem, scale=scale)
        _sync(device)
        exported = mpfunc.masters_state_dict(mrem)
        if device.type == "cpu":
            _assert_same_bits(exported, m32, "masters")
            _assert_same_bits(s32, srem, "state")
        else:
            _assert_close(exported, m32, "masters")
            _assert_close(srem, s32, "state")
        for key, m in exported.items():
            # The param is the encoding's, split(master): Tensor.to's, NaN payloads aside,
            # and the fp32 run's own param.
            param = _remainder.split(m)[0]
            got = prem[key].detach().cpu()
            assert torch.equal(bits(got), bits(param)), key
            nan = torch.isnan(m)
            assert torch.equal(bits(got)[~nan], bits(m.to(BF16))[~nan]), key
            if device.type == "cpu":
                assert torch.equal(bits(got)[~nan], bits(p32[key].detach().cpu())[~nan]), key


@settings(max_examples=40)
@given(data=st.data())
def test_remainder_is_fp32_bit_for_bit_cpu(data: st.DataObject) -> None:
    run_remainder(torch.device("cpu"), data)


@pytest.mark.xla
@settings(max_examples=3)
@given(data=st.data())
def test_remainder_is_fp32_xla(xla_device: torch.device, data: st.DataObject) -> None:
    run_remainder(xla_device, data)


def test_remainder_keeps_updates_bf16_drops() -> None:
    """1000 updates of 1e-4 on a weight of 1.0 (bf16 ulp 2**-7): the remainder master moves
    by 0.1 exactly as fp32 does; "none" never moves."""
    runs = {}
    for strat in ("fp32", "remainder", "none"):
        p = {"w": torch.ones(64, dtype=BF16)}
        m = mpfunc.init_master(p, strategy=strat)
        opt = mpfunc.sgd(lr=1e-4)
        s = opt.init(m)
        for _ in range(1000):
            mpfunc.apply_update_(m, {"w": torch.ones(64, dtype=BF16)}, s, opt, params=p)
        runs[strat] = (mpfunc.masters_state_dict(m)["w"], p["w"].clone())
    assert torch.equal(runs["remainder"][0], runs["fp32"][0])
    assert float(runs["fp32"][0][0]) == pytest.approx(0.9, abs=1e-4)
    assert torch.equal(runs["none"][1], torch.ones(64, dtype=BF16))


# --- none, kahan, stochastic ----------------------------------------------------------------


def test_none_is_an_fp32_step_rounded_back() -> None:
    gen = torch.Generator().manual_seed(0)
    p = {
        "w": torch.randn(8, 8, generator=gen).to(BF16),
        "b": torch.randn(8, generator=gen).to(BF16),
    }
    ref_p = {k: v.clone() for k, v in p.items()}
    opt = mpfunc.adamw(lr=1e-2, weight_decay=0.1)
    m = mpfunc.init_master(p, strategy="none")
    s = opt.init(m)
    ref_m = mpfunc.init_master(ref_p)
    ref_s = opt.init(ref_m)
    for _ in range(10):
        g = {k: torch.randn(v.shape, generator=gen).to(BF16) for k, v in p.items()}
        mpfunc.apply_update_(m, g, s, opt, params=p)
        for k in ref_m:  # the reference master is re-read from the param every step
            ref_m[k].copy_(ref_p[k].float())
        mpfunc.apply_update_(ref_m, g, ref_s, opt, params=ref_p)
    _assert_same_bits(p, ref_p, "params")
    _assert_same_bits(s, ref_s, "state")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kahan_tracks_the_fp32_master(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    base = {"w": torch.randn(32, 16, generator=gen), "b": torch.randn(16, generator=gen)}
    p32 = {k: v.to(dtype) for k, v in base.items()}
    pk = {k: v.to(dtype) for k, v in base.items()}
    opt = mpfunc.adamw(lr=1e-4, weight_decay=0.01)
    m32, mk = mpfunc.init_master(p32), mpfunc.init_master(pk, strategy="kahan")
    s32, sk = opt.init(m32), opt.init(mk)
    steps = 50
    for _ in range(steps):
        g = {k: torch.randn(v.shape, generator=gen).to(dtype) for k, v in base.items()}
        mpfunc.apply_update_(m32, g, s32, opt, params=p32)
        mpfunc.apply_update_(mk, g, sk, opt, params=pk)
    got = mpfunc.masters_state_dict(mk)
    for k, ref in m32.items():
        err = float((got[k].double() - ref.double()).abs().max())
        assert err <= steps * 2.0**-16 * float(ref.abs().max()), (k, err)
        # The param is the compensated value rounded to nearest.
        assert torch.equal(bits(pk[k]), bits(got[k].to(dtype))), k


def test_stochastic_same_seed_same_bits_and_seed_matters() -> None:
    def run(seed: int) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(3)
        p = {"w": torch.randn(16, 16, generator=gen).to(BF16)}
        m = mpfunc.init_master(p, strategy="stochastic", seed=seed)
        opt = mpfunc.adamw(lr=1e-3)
        s = opt.init(m)
        for _ in range(5):
            mpfunc.apply_update_(m, {"w": torch.randn(16, 16, generator=gen).to(BF16)}, s, opt)
        return {"w": p["w"].clone(), "key": m["w"].key.clone()}

    a, b, c = run(0), run(0), run(1)
    _assert_same_bits(a, b, "same seed")
    assert not torch.equal(a["w"], c["w"])


def test_stochastic_rounding_is_unbiased() -> None:
    # Values spread over one bf16 interval [1, 1 + 2**-7): E[round(x)] == x.
    n = 1 << 16
    x = 1.0 + torch.rand(n, generator=torch.Generator().manual_seed(0)) * 2.0**-7
    from mpfunc.core import _rng

    total = torch.zeros(n, dtype=torch.float64)
    draws = 32
    for d in range(draws):
        total += round_stochastic(x, _rng.bits(_rng.key_for(0, d, "cpu"), x.shape)).double()
    mean_err = float((total / draws - x.double()).mean())
    # Each draw's error has sd <= ulp/2 = 2**-8; a mean of n*draws draws, 2**-8/sqrt(n*draws).
    assert abs(mean_err) <= 5 * 2.0**-8 / (n * draws) ** 0.5
    special = torch.tensor([float("inf"), -float("inf"), float("nan"), 0.0, -0.0, 3.4e38])
    out = round_stochastic(special, torch.full(special.shape, 0xFFFF, dtype=torch.int32))
    assert torch.equal(out[:2], special[:2].to(BF16)) and bool(out[2].isnan())
    assert torch.equal(bits(out[3:5]), bits(special[3:5].to(BF16)))
    assert bool(out[5].isinf())  # above bf16's largest finite, rounded up


@pytest.mark.xla
def test_stochastic_rounding_same_bits_on_xla(xla_device: torch.device) -> None:
    from mpfunc.core import _rng
    from mpfunc.strategies import _strategy_stochastic

    gen = torch.Generator().manual_seed(5)
    x = torch.randn(4, 8, generator=gen) * torch.logspace(-30, 30, 8)
    x[0, 0], x[0, 1], x[0, 2] = float("inf"), float("nan"), -0.0
    key = _rng.key_for(7, 2, "cpu")
    cpu = round_stochastic(x, _rng.bits(key, x.shape))
    noise = _rng.bits(key.to(xla_device), x.shape)
    xla = _strategy_stochastic._xla_round([x.to(xla_device)], [noise])[0]
    _sync(xla_device)
    assert torch.equal(bits(noise.cpu()), bits(_rng.bits(key, x.shape)))
    assert torch.equal(bits(xla.cpu()[x == x]), bits(cpu[x == x]))
    assert bool(xla.cpu()[0, 1].isnan())


# --- state dtypes ----------------------------------------------------------------------------


def test_bf16_state_is_fp32_moments_rounded_each_step() -> None:
    gen = torch.Generator().manual_seed(2)
    base = {"w": torch.randn(8, 4, generator=gen), "b": torch.randn(4, generator=gen)}
    pa = {k: v.to(BF16) for k, v in base.items()}
    pb = {k: v.to(BF16) for k, v in base.items()}
    ma, mb = mpfunc.init_master(pa), mpfunc.init_master(pb)
    oa = mpfunc.adamw(lr=1e-2, state_dtype=torch.bfloat16)
    ob = mpfunc.adamw(lr=1e-2)
    sa, sb = oa.init(ma), ob.init(mb)
    assert sa.exp_avg["w"].dtype == BF16
    for _ in range(8):
        g = {k: torch.randn(v.shape, generator=gen).to(BF16) for k, v in base.items()}
        mpfunc.apply_update_(ma, g, sa, oa, params=pa)
        mpfunc.apply_update_(mb, g, sb, ob, params=pb)
        for field in (sb.exp_avg, sb.exp_avg_sq):
            for t in field.values():
                t.copy_(t.to(BF16).float())
    _assert_same_bits(ma, mb, "masters")
    for field in ("exp_avg", "exp_avg_sq"):
        _assert_same_bits(
            {k: v.float() for k, v in getattr(sa, field).items()}, getattr(sb, field), field
        )


def test_uint8_state_stays_close_to_fp32_adam() -> None:
    gen = torch.Generator().manual_seed(4)
    base = {"w": torch.randn(64, 64, generator=gen)}
    runs = {}
    for sd in (None, torch.uint8):
        p = {k: v.to(BF16) for k, v in base.items()}
        m = mpfunc.init_master(p)
        opt = mpfunc.adamw(lr=1e-3, state_dtype=sd)
        s = opt.init(m)
        g_gen = torch.Generator().manual_seed(9)
        for _ in range(100):
            g = {"w": (torch.randn(64, 64, generator=g_gen) + 0.5).to(BF16)}
            mpfunc.apply_update_(m, g, s, opt, params=p)
        runs[str(sd)] = (m["w"].clone(), s)
    q = runs["torch.uint8"][1]
    assert isinstance(q.exp_avg["w"], mpfunc.QState)
    assert q.exp_avg["w"].codes.dtype == torch.int8 and q.exp_avg_sq["w"].codes.dtype == torch.uint8
    ref_m, ref_s = runs["None"]
    from mpfunc.state_formats import _quantize

    d8 = _quantize.dequantize(q.exp_avg["w"]) / _quantize.dequantize(q.exp_avg_sq["w"]).sqrt()
    d32 = ref_s.exp_avg["w"] / ref_s.exp_avg_sq["w"].sqrt()
    rel = float((d8 - d32).norm() / d32.norm())
    assert rel < 0.15, rel
    moved = runs["torch.uint8"][0] - base["w"].to(BF16).float()
    ref_moved = ref_m - base["w"].to(BF16).float()
    assert float((moved - ref_moved).norm() / ref_moved.norm()) < 0.15


# --- diagnostics ----------------------------------------------------------------------------


def test_stats_report_swallowed_updates_and_ratio() -> None:
    p = {"w": torch.ones(100, dtype=BF16)}
    m = mpfunc.init_master(p, strategy="none")
    opt = mpfunc.sgd(lr=1e-4)
    s = opt.init(m)
    stats = mpfunc.init_stats(m)
    g = torch.zeros(100, dtype=BF16)
    g[:40] = 1.0
    g[40:50] = 1000.0  # 0.1: moves the param
    mpfunc.apply_update_(m, {"w": g}, s, opt, params=p, stats=stats)
    st_w = stats["w"]
    assert float(st_w.unchanged) == pytest.approx(0.9)
    # Of the 50 elements with an update, the 40 small ones did not move the param (the
    # fraction of updates, not of elements: 40 of 100 read 0.4 before).
    assert float(st_w.swallowed) == pytest.approx(0.8)
    u = torch.zeros(100)
    u[:40], u[40:50] = -1e-4, -0.1
    assert float(st_w.ratio) == pytest.approx(float(u.pow(2).mean().sqrt()), rel=1e-3)
    m32 = mpfunc.init_master({"w": torch.ones(4, dtype=BF16)})
    st32 = mpfunc.init_stats(m32)
    mpfunc.apply_update_(m32, {"w": torch.ones(4)}, opt.init(m32), opt, stats=st32)
    assert bool(st32["w"].swallowed.isnan()) and float(st32["w"].ratio) > 0  # no params given
    # A sparse grad: every update swallowed reads 1, however few the updated elements.
    g = torch.zeros(100, dtype=BF16)
    g[:3] = 1.0
    mpfunc.apply_update_(m, {"w": g}, s, opt, params=p, stats=stats)
    assert float(stats["w"].swallowed) == 1.0 and float(stats["w"].unchanged) == 1.0
    # No update at all (a zero grad): nothing swallowed.
    mpfunc.apply_update_(m, {"w": torch.zeros(100, dtype=BF16)}, s, opt, params=p, stats=stats)
    assert float(stats["w"].swallowed) == 0.0
    # A statistic of another shape was written by broadcasting into it: refused, by path.
    bad = {"w": stats["w"]._replace(ratio=torch.zeros(2))}
    _raises(TypeError, r"apply_update_: at 'stats\.w': expected the UpdateStats of "
            r"init_stats\(masters\) \(0-d float32 tensors.*shape \(2,\)",
            mpfunc.apply_update_, m, {"w": g}, s, opt, params=p, stats=bad)  # fmt: skip


# --- every strategy x state dtype: resume, pure form, errors ---------------------------------


def _tiny(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(8, 8, generator=gen).to(BF16),
        "b": torch.randn(32, generator=gen).to(BF16),
    }


@pytest.mark.parametrize("state_dtype", STATE_DTYPES, ids=str)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_resume_is_bit_exact(strategy: str, state_dtype: Any, tmp_path: Any) -> None:
    gen = torch.Generator().manual_seed(1)
    grads = [
        {k: torch.randn(v.shape, generator=gen).to(BF16) for k, v in _tiny().items()}
        for _ in range(4)
    ]
    opt = mpfunc.adamw(lr=1e-2, state_dtype=state_dtype)
    p = _tiny()
    m = mpfunc.init_master(p, strategy=strategy, seed=5)
    s = opt.init(m)
    for g in grads[:2]:
        mpfunc.apply_update_(m, g, s, opt, params=p)
    mpfunc.save(tmp_path / "ckpt.pt", {"masters": m, "state": s})
    p2 = _tiny(seed=99)  # other values: everything must come from the file
    m2 = mpfunc.init_master(p2, strategy=strategy, seed=6)
    s2 = opt.init(m2)
    mpfunc.load_(tmp_path / "ckpt.pt", {"masters": m2, "state": s2})
    if strategy == "fp32":
        mpfunc.masters_to_model_(m2, p2)
    for g in grads[2:]:
        mpfunc.apply_update_(m, g, s, opt, params=p)
        mpfunc.apply_update_(m2, g, s2, opt, params=p2)
    _assert_same_bits({"m": m, "s": s, "p": p}, {"m": m2, "s": s2, "p": p2}, "resumed")


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_pure_form_leaves_inputs_and_agrees(strategy: str) -> None:
    p = _tiny()
    m = mpfunc.init_master(p, strategy=strategy)
    opt = mpfunc.adamw(lr=1e-2)
    s = opt.init(m)
    g = {k: torch.ones_like(v) for k, v in p.items()}
    before = {k: v.clone() for k, v in mpfunc.state_dict({"m": m, "s": s}).items()}
    new_m, new_s = mpfunc.apply_update(m, {k: v.float() for k, v in g.items()}, s, opt)
    _assert_same_bits(mpfunc.state_dict({"m": m, "s": s}), before, "inputs untouched")
    mpfunc.apply_update_(m, {k: v.float() for k, v in g.items()}, s, opt)
    _assert_same_bits({"m": new_m, "s": new_s}, {"m": m, "s": s}, "pure == in place")


def _remainder_model(seed: int, steps: int) -> tuple[torch.nn.Module, Any, Any]:
    """A small bf16 model, its "remainder" masters after ``steps`` AdamW steps, and a
    function that takes one more step."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)).to(BF16)
    params = dict(model.named_parameters())
    m = mpfunc.init_master(params, strategy="remainder")
    opt = mpfunc.adamw(lr=1e-3)
    s = opt.init(m)
    gen = torch.Generator().manual_seed(seed)

    def step() -> None:
        g = {k: torch.randn(v.shape, generator=gen).to(BF16) for k, v in params.items()}
        mpfunc.apply_update_(m, g, s, opt, params=params)

    for _ in range(steps):
        step()
    return model, m, step


def test_lossless_bf16_checkpoint(tmp_path: Any) -> None:
    """The model's own bf16 state_dict plus the remainder sidecar rebuild the exact fp32
    masters."""
    model, m, _ = _remainder_model(seed=0, steps=5)
    torch.save(model.state_dict(), tmp_path / "model.pt")
    torch.save(mpfunc.remainders_state_dict(m), tmp_path / "remainders.pt")
    sd = torch.load(tmp_path / "model.pt", weights_only=True)
    side = torch.load(tmp_path / "remainders.pt", weights_only=True)
    rebuilt = mpfunc.masters_from_remainders(sd, side)
    _assert_same_bits(rebuilt, mpfunc.masters_state_dict(m), "rebuilt masters")
    moved = sum(int((r.view(torch.int32) & 0xFFFF).ne(0).sum()) for r in rebuilt.values())
    assert moved > 0  # the low halves carry real information


def test_loading_never_casts_state(tmp_path: Any) -> None:
    p = _tiny()
    m = mpfunc.init_master(p)
    s16 = mpfunc.adamw(state_dtype=torch.bfloat16).init(m)
    mpfunc.save(tmp_path / "s.pt", s16)
    s32 = mpfunc.adamw().init(m)
    snap = {k: v.clone() for k, v in mpfunc.state_dict(s32).items()}
    with pytest.raises((TypeError, ValueError), match="bfloat16"):
        mpfunc.load_(tmp_path / "s.pt", s32)
    _assert_same_bits(mpfunc.state_dict(s32), snap, "nothing written")


def _raises(exc: type[Exception], match: str, fn: Any, *args: Any, **kwargs: Any) -> None:
    from support.helpers import assert_unchanged, snapshot

    before = snapshot((args, kwargs))
    with pytest.raises(exc, match=match):
        fn(*args, **kwargs)
    assert_unchanged((args, kwargs), before)


def test_errors_name_the_path_and_write_nothing() -> None:
    f32 = {"a": torch.zeros(4), "b": torch.zeros(4, dtype=BF16)}
    _raises(
        ValueError,
        r"init_master: at 'params\.a': expected a param the 'remainder' "
        r"strategy applies to, got torch\.float32 .*Use the 'fp32' strategy",
        mpfunc.init_master,
        f32,
        strategy="remainder",
    )
    f16 = {"h": torch.zeros(4, dtype=torch.float16)}
    _raises(
        ValueError,
        r"at 'params\.h'.*'stochastic'.*float16.*'kahan'",
        mpfunc.init_master,
        f16,
        strategy="stochastic",
    )
    _raises(
        ValueError,
        r"strategy: expected a strategy name .*'fp32'.*got 'fp8'",
        mpfunc.init_master,
        f32,
        strategy="fp8",
    )
    _raises(
        ValueError,
        r"strategy\('b'\): expected a strategy name",
        mpfunc.init_master,
        f32,
        strategy=lambda path, p: "x" if path == "b" else "fp32",
    )
    _raises(
        ValueError,
        r"params and strategy must have the same tree structure",
        mpfunc.init_master,
        f32,
        strategy={"a": "fp32"},
    )
    for name in ("remainder", "kahan", "stochastic", "none"):  # dtype was silently ignored
        _raises(
            ValueError,
            rf"init_master: at 'params\.b': expected dtype None or torch\.float32 beside "
            rf"strategy '{name}' .*got dtype=torch\.float64\. Use strategy=\"fp32\"",
            mpfunc.init_master,
            f32,
            torch.float64,
            strategy={"a": "fp32", "b": name},
        )
        mixed = mpfunc.init_master(f32, torch.float32, strategy={"a": "fp32", "b": name})
        assert mixed["a"].dtype == torch.float32 and not isinstance(mixed["b"], torch.Tensor)
    assert (
        mpfunc.init_master(f32, torch.float64, strategy={"a": "fp32", "b": "fp32"})["b"].dtype
        == torch.float64
    )
    bias = {"bias": torch.zeros(3, dtype=BF16)}
    mb = mpfunc.init_master(bias, strategy="stochastic")
    _raises(
        ValueError,
        r"adamw\.init: at 'masters\.bias': expected a leaf of at least 32 "
        r"elements for state_dtype=torch\.uint8, got 3 elements\. .*partition",
        mpfunc.adamw(state_dtype=torch.uint8).init,
        mb,
    )
    _raises(
        ValueError, r"state_dtype: expected None or one of", mpfunc.adamw, state_dtype=torch.float16
    )
    p = _tiny()
    m = mpfunc.init_master(p, strategy="remainder")
    opt = mpfunc.adamw()
    s = opt.init(m)
    g = {k: torch.ones_like(v) for k, v in p.items()}
    other = {k: v.clone() for k, v in p.items()}
    _raises(
        ValueError,
        r"apply_update_: at 'params\.b': expected the param this "
        r"RemainderMaster keeps",
        mpfunc.apply_update_,
        m,
        g,
        s,
        opt,
        params=other,
    )
    bad = dict(m, w=m["w"]._replace(remainder=torch.zeros(8, 8, dtype=torch.int32)))
    _raises(
        ValueError,
        r"at 'masters\.w': expected a RemainderMaster made by init_master, "
        r"got its remainder is torch\.int32",
        mpfunc.apply_update_,
        bad,
        g,
        s,
        opt,
    )
    s8 = mpfunc.adamw(state_dtype=torch.uint8).init(m)
    _raises(
        TypeError,
        r"at 'state\.exp_avg\.b': expected a tensor or None leaf, got QState",
        mpfunc.apply_update_,
        m,
        g,
        s8,
        opt,
    )
    s16 = mpfunc.adamw(state_dtype=torch.bfloat16).init(m)
    _raises(
        TypeError,
        r"at 'state\.exp_avg\.b': expected torch\.float32 \(the state's dtype\), "
        r"got torch\.bfloat16",
        mpfunc.apply_update_,
        m,
        g,
        s16,
        opt,
    )
    _raises(
        TypeError,
        r"at 'grads\.w': expected a grad no wider than its 32-bit master",
        mpfunc.apply_update_,
        m,
        {"w": g["w"].double(), "b": g["b"]},
        s,
        opt,
    )


# --- XLA: one stable graph per step ---------------------------------------------------------


@pytest.mark.xla
def test_xla_every_strategy_and_state_dtype_is_one_stable_graph(xla_device: torch.device) -> None:
    """One tree holding every (strategy, state dtype) pair, leaf by leaf (a strategy
    function and a partition by state dtype): after two warm-up steps, three more steps with
    the lr changed every step compile nothing, execute one graph each, read nothing back
    and fall back to the CPU for nothing. The results agree with the same steps on the CPU."""
    import torch_xla
    import torch_xla.core.xla_model as xm
    from support.xla_model import count, fallbacks

    combos = [(s, d) for s in STRATEGIES for d in STATE_DTYPES]
    names = [f"{s}_{str(d).replace('torch.', '')}" for s, d in combos]
    gen = torch.Generator().manual_seed(0)
    base = {n: torch.randn(4, 32, generator=gen) for n in names}
    xs = [torch.randn(32, generator=gen) for _ in range(5)]

    def run(device: torch.device) -> tuple[Any, dict[str, int]]:
        params = {n: v.to(BF16).to(device) for n, v in base.items()}
        lr = torch.tensor(1e-2, device=device)
        opts = {str(d): mpfunc.adamw(lr=lr, state_dtype=d) for d in STATE_DTYPES}
        of = dict(zip(names, combos))
        opt = mpfunc.partition(opts, lambda path, p: str(of[path][1]))
        masters = mpfunc.init_master(params, strategy=lambda path, p: of[path][0], seed=3)
        state = opt.init(masters)
        stats = mpfunc.init_stats(masters)
        counts = {"compiles": 0, "graphs": 0, "to_host": 0}
        mp_fallbacks: dict[str, int] = {}
        for k, x in enumerate(xs):
            if device.type == "xla" and k == 2:
                counts = {
                    "compiles": count("CompileTime"),
                    "graphs": count("ExecuteTime"),
                    "to_host": count("TransferFromDeviceTime"),
                }
            xd = x.to(device)
            grads = {n: (p.float() * xd).sin().to(BF16) for n, p in params.items()}
            before = fallbacks() if device.type == "xla" else {}
            mpfunc.apply_update_(masters, grads, state, opt, params=params, scale=4.0, stats=stats)
            if device.type == "xla":
                for n, v in fallbacks().items():
                    if v != before.get(n, 0):
                        mp_fallbacks[n] = v - before.get(n, 0)
            lr.fill_(1e-2 * 0.9**k)
            if device.type == "xla":
                torch_xla.sync()
                xm.wait_device_ops()
        if device.type == "xla":
            counts = {
                "compiles": count("CompileTime") - counts["compiles"],
                "graphs": count("ExecuteTime") - counts["graphs"],
                "to_host": count("TransferFromDeviceTime") - counts["to_host"],
            }
            assert mp_fallbacks == {}, f"mpfunc fell back to CPU for {mp_fallbacks}"
        return mpfunc.masters_state_dict(masters), counts

    xla_m, counts = run(xla_device)
    assert counts == {"compiles": 0, "graphs": 3, "to_host": 0}, counts
    cpu_m, _ = run(torch.device("cpu"))
    for n in names:
        # Within the bound, except where rounding the param itself decides (stochastic draws
        # and 8-/4-bit codes: one ulp of a param or one code step apart, far below 1e-2).
        tol = 1e-2 if "stochastic" in n or "uint8" in n or "uint4" in n else 1e-5
        err = float((xla_m[n] - cpu_m[n]).abs().max())
        assert err <= tol * float(cpu_m[n].abs().max()), (n, err)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_three_call_path_keeps_working(strategy: str) -> None:
    """grads_to_fp32 -> apply_update_ -> masters_to_model_ with any strategy: the same bits
    as the single pass; masters_to_model_ has nothing left to do for a unit's own param, and
    the pure masters_to_model returns fresh copies."""
    pa, pb = _tiny(), _tiny()
    ma = mpfunc.init_master(pa, strategy=strategy, seed=1)
    mb = mpfunc.init_master(pb, strategy=strategy, seed=1)
    opt = mpfunc.adamw(lr=1e-2)
    sa, sb = opt.init(ma), opt.init(mb)
    gen = torch.Generator().manual_seed(8)
    for _ in range(3):
        g = {k: torch.randn(v.shape, generator=gen).to(BF16) for k, v in pa.items()}
        mpfunc.apply_update_(ma, mpfunc.grads_to_fp32(g), sa, opt)
        mpfunc.masters_to_model_(ma, pa)
        mpfunc.apply_update_(mb, g, sb, opt, params=pb)
    _assert_same_bits({"m": ma, "s": sa, "p": pa}, {"m": mb, "s": sb, "p": pb}, "paths")
    fresh = mpfunc.masters_to_model(ma, pa)
    for k in pa:
        assert torch.equal(bits(fresh[k]), bits(pa[k])) and fresh[k] is not pa[k]
        assert fresh[k].untyped_storage().data_ptr() != pa[k].untyped_storage().data_ptr()


def test_masters_from_remainders_refuses_bad_input() -> None:
    p = {"w": torch.randn(4, 8).to(BF16)}
    r = {"w": torch.zeros(4, 8, dtype=torch.int16)}
    _raises(
        KeyError,
        r"remainders \['v'\] have no param",
        mpfunc.masters_from_remainders,
        p,
        {"v": r["w"]},
    )
    _raises(
        TypeError,
        r"'w': expected a torch\.bfloat16 param, got torch\.float32",
        mpfunc.masters_from_remainders,
        {"w": p["w"].float()},
        r,
    )
    _raises(
        ValueError,
        r"'w': expected a torch\.int16 remainder of shape \(4, 8\)",
        mpfunc.masters_from_remainders,
        p,
        {"w": r["w"].t()},
    )
    _raises(
        ValueError,
        r"'w': expected a torch\.int16 remainder",
        mpfunc.masters_from_remainders,
        p,
        {"w": r["w"].int()},
    )


def test_masters_from_remainders_refuses_a_sidecar_of_another_step(tmp_path: Any) -> None:
    """A remainder joins with any bf16 value, so a sidecar saved one step before the
    model's state_dict gave other masters with no error. Its CRC of each param refuses
    it, naming the params, before anything is joined; the pair saved together (also
    under other keys, and a sidecar without CRCs, as written before them) still loads."""
    model, m, more = _remainder_model(seed=3, steps=1)
    params = dict(model.named_parameters())
    torch.save(mpfunc.remainders_state_dict(m), tmp_path / "side.pt")
    side = torch.load(tmp_path / "side.pt", weights_only=True)
    crcs = sorted(k for k in side if k.endswith("#param_crc32"))
    assert crcs == sorted(k + "#param_crc32" for k in params)
    assert all(side[k].dtype == torch.int64 and side[k].dim() == 0 for k in crcs)
    then = {k: v.detach().clone() for k, v in model.state_dict().items()}
    want = mpfunc.masters_state_dict(m)
    more()  # one more step: the model moves on
    now = model.state_dict()
    _raises(
        ValueError,
        r"expected each param to be the one its remainder was saved beside, got 4 whose "
        r"bits differ \(CRC-32\): \['0\.bias', '0\.weight', '1\.bias', '1\.weight'\]\. "
        r"Were the model's state_dict and the sidecar saved at the same step",
        mpfunc.masters_from_remainders,
        now,
        side,
    )
    one = dict(then, **{"1.bias": now["1.bias"]})  # a single leaf of another step
    _raises(ValueError, r"got 1 whose bits differ \(CRC-32\): \['1\.bias'\]",
            mpfunc.masters_from_remainders, one, side)  # fmt: skip
    _assert_same_bits(mpfunc.masters_from_remainders(then, side), want, "the saved pair")
    renamed = {"net." + k: v for k, v in side.items()}  # both files re-keyed alike
    got = mpfunc.masters_from_remainders({"net." + k: v for k, v in then.items()}, renamed)
    _assert_same_bits({k[4:]: v for k, v in got.items()}, want, "re-keyed")
    old = {k: v for k, v in side.items() if not k.endswith("#param_crc32")}
    _assert_same_bits(mpfunc.masters_from_remainders(then, old), want, "no CRCs")
    _raises(
        ValueError,
        r"'0\.bias#param_crc32': expected a 0-d torch\.int64 CRC, got torch\.int32",
        mpfunc.masters_from_remainders,
        then,
        dict(side, **{"0.bias#param_crc32": side["0.bias#param_crc32"].int()}),
    )
    _raises(
        KeyError,
        r"tie bits or CRCs \['v#param_crc32'\] have no remainder",
        mpfunc.masters_from_remainders,
        then,
        dict(side, **{"v#param_crc32": torch.tensor(0)}),
    )


@pytest.mark.xla
def test_lossless_bf16_checkpoint_from_xla(xla_device: torch.device) -> None:
    """The sidecar and the exported masters of XLA masters equal the CPU's, bit for bit."""
    gen = torch.Generator().manual_seed(4)
    base = {"w": torch.randn(4, 32, generator=gen), "b": torch.randn(32, generator=gen)}
    grads = [
        {k: torch.randn(v.shape, generator=gen).to(BF16) for k, v in base.items()} for _ in range(3)
    ]
    out = {}
    for device in (torch.device("cpu"), xla_device):
        params = {k: v.to(BF16).to(device) for k, v in base.items()}
        m = mpfunc.init_master(params, strategy="remainder")
        opt = mpfunc.sgd(lr=0.1)  # no a*b+c for XLA to fuse: the same bits on both devices
        s = opt.init(m)
        for g in grads:
            mpfunc.apply_update_(m, {k: v.to(device) for k, v in g.items()}, s, opt, params=params)
        _sync(device)
        side = mpfunc.remainders_state_dict(m)
        sd = {k: v.cpu() for k, v in params.items()}
        rebuilt = mpfunc.masters_from_remainders(sd, side)
        _assert_same_bits(rebuilt, mpfunc.masters_state_dict(m), f"rebuilt on {device}")
        out[device.type] = rebuilt
    _assert_same_bits(out["cpu"], out["xla"], "cpu vs xla")


@settings(max_examples=300)
@given(seed=st.integers(-(2**63), 2**64 - 1), index=st.integers(0, 2**40))
def test_leaf_keys_hash_as_the_tensor_mix_does(seed: int, index: int) -> None:
    """``_rng.key_for`` hashes in Python integers; the same bits as ``_rng._mix`` on int32
    tensors (the form the draws use on every device), the seed's high half mixed in."""
    from mpfunc.core import _rng

    s = seed % 2**64
    high = _rng._mix(torch.tensor(_rng.wrap(s >> 32), dtype=torch.int32))
    h = torch.tensor(_rng.wrap(s * 0x9E3779B1 + index), dtype=torch.int32).bitwise_xor_(high)
    want = _rng._mix(_rng._mix(h).bitwise_xor_(_rng.wrap(index)))
    got = _rng.key_for(seed, index, "cpu")
    assert got.dtype == torch.int32 and got.shape == () and int(got) == int(want)


@settings(max_examples=100)
@given(seed=st.integers(0, 2**32 - 1), index=st.integers(0, 2**20), high=st.integers(1, 2**32 - 1))
def test_every_bit_of_a_seed_counts(seed: int, index: int, high: int) -> None:
    """Seeds that differ only above bit 32 got one stream (the key was of the seed modulo
    2**32); they differ now, and a seed below 2**32 keeps the key it always had
    (``mix(mix(seed * golden + index) ^ index)``), so its runs and checkpoints are as
    before. Read modulo 2**64, as torch.manual_seed: -1 is 2**64 - 1."""
    from mpfunc.core import _rng

    old = _rng._mix_int(_rng._mix_int((seed * 0x9E3779B1 + index) & 0xFFFFFFFF) ^ index)
    assert int(_rng.key_for(seed, index, "cpu")) == _rng.wrap(old)
    assert int(_rng.key_for(seed + high * 2**32, index, "cpu")) != _rng.wrap(old)
    neg = -1 - seed
    assert int(_rng.key_for(neg, index, "cpu")) == int(_rng.key_for(neg + 2**64, index, "cpu"))


def test_seed_out_of_torchs_range_is_refused() -> None:
    p = {"w": torch.zeros(4, dtype=BF16)}
    for seed in (2**64, -(2**63) - 1):
        match = (
            r"init_master: seed: expected an int in \[-9223372036854775808, 18446744073709551615\]"
        )
        _raises(ValueError, match, mpfunc.init_master, p, strategy="stochastic", seed=seed)
    for seed in (2**64 - 1, -(2**63)):
        mpfunc.init_master(p, strategy="stochastic", seed=seed)


# --- a written param: the buffer of a strategy unit must not outlive it ---------------------


def _pruned_kahan(device: torch.device | str, impl: str, dtype: torch.dtype) -> list[torch.Tensor]:
    """The compensations of the zeroed elements still hold the old values' rounding errors."""
    unit = pruned_run("kahan", device, impl, dtype, seed=12, steps=2)["w"]
    return [unit.param.cpu(), unit.compensation.cpu()]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("impl", ["auto", "foreach"])
def test_kahan_pruned_param_stays_zero(impl: str, dtype: torch.dtype) -> None:
    """A param zeroed between steps stays zero through a zero-grad step, as with "fp32"
    masters: a zero param's stale compensation is dropped (it came back as the old value's
    rounding error, up to ~1e-3, before). The native pass, its tiles and the torch path
    give the same bits."""
    param, comp = _pruned_kahan("cpu", impl, dtype)
    assert bool((param[:, :32] == 0).all()) and bool((comp[:, :32] == 0).all())
    assert bool(torch.signbit(param[0, :8]).all())
    assert not bool(torch.signbit(param[1:, :32]).any())
    assert bool((param[:, 32:] != 0).all())  # the rest trained on


def test_kahan_pruned_param_native_equals_the_torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    from mpfunc.backends import _native

    if not _native.available():
        pytest.skip("no native kernel")
    ref = _pruned_kahan("cpu", "foreach", torch.bfloat16)
    assert_bits_equal(_pruned_kahan("cpu", "auto", torch.bfloat16)[0], ref[0])
    monkeypatch.setenv("MPFUNC_NATIVE_TILES", "1")
    assert_bits_equal(_pruned_kahan("cpu", "auto", torch.bfloat16)[0], ref[0])


@pytest.mark.xla
def test_kahan_pruned_param_stays_zero_on_xla(xla_device: torch.device) -> None:
    ref = _pruned_kahan("cpu", "foreach", torch.bfloat16)
    got = _pruned_kahan(xla_device, "auto", torch.bfloat16)
    assert_bits_equal(got[0], ref[0])
    assert bool((got[1][:, :32] == 0).all())


def _rewritten_kahan(
    device: torch.device | str, impl: str, dtype: torch.dtype, state_dtype: Any = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Kahan run at magnitude ~100 whose param is then partly rewritten to small values
    (a re-init: ``[:, :32]`` to 0.01..0.04), and one step whose update is exactly zero (SGD,
    zero grads). Returns (param, compensation, the master before the write)."""
    gen = torch.Generator().manual_seed(21)
    params = {"w": (torch.randn(4, 64, generator=gen) * 100).to(dtype).to(device)}
    masters = mpfunc.init_master(params, strategy="kahan")
    momentum = 0.0 if state_dtype is None else 0.9  # (with momentum: not a zero update)
    opt = mpfunc.sgd(lr=0.1, momentum=momentum, impl=impl, state_dtype=state_dtype)  # type: ignore[arg-type]
    state = opt.init(masters)
    for _ in range(5):
        grad = {"w": torch.randn(4, 64, generator=gen).to(dtype).to(device)}
        mpfunc.apply_update_(masters, grad, state, opt)
    unit = masters["w"]
    before = unit.param.cpu().float() + unit.compensation.cpu().float()
    with torch.no_grad():
        params["w"][:, :32] = torch.linspace(0.01, 0.04, 4 * 32).view(4, 32).to(dtype)
    zero = {"w": torch.zeros(4, 64, dtype=dtype, device=device)}
    mpfunc.apply_update_(masters, zero, state, opt)
    return unit.param.cpu(), unit.compensation.cpu(), before


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("impl", ["auto", "foreach"])
def test_kahan_param_rewritten_smaller_is_the_written_value(impl: str, dtype: torch.dtype) -> None:
    """The README's promise for a write to a unit's param: the master is the written value
    to within half a step. A Kahan compensation is absolute (sized for the old value), so a
    param rewritten from ~100 to ~0.01 once moved by up to 0.2 on a zero update (found in
    review). A compensation too large for its param is now dropped, as a zero param's is;
    the elements not written keep theirs."""
    from mpfunc.strategies._strategy_kahan import HALF_ULP

    param, comp, before = _rewritten_kahan("cpu", impl, dtype)
    written = torch.linspace(0.01, 0.04, 4 * 32).view(4, 32).to(dtype)
    assert torch.equal(param[:, :32], written)
    # Within half a step of the written value (an old compensation that small may stay).
    assert bool((comp[:, :32].float().abs() <= written.float() * HALF_ULP[dtype]).all())
    kept = param[:, 32:].float() + comp[:, 32:].float()
    assert torch.equal(kept, before[:, 32:])  # a zero update: the master as it was
    assert bool((comp[:, 32:] != 0).any())


@pytest.mark.parametrize("state_dtype", [None, torch.uint8], ids=str)
def test_kahan_rewritten_native_equals_the_torch_path(
    monkeypatch: pytest.MonkeyPatch, state_dtype: Any
) -> None:
    from mpfunc.backends import _native

    if not _native.available():
        pytest.skip("no native kernel")
    for dtype in (torch.bfloat16, torch.float16):
        ref = _rewritten_kahan("cpu", "foreach", dtype, state_dtype)
        got = _rewritten_kahan("cpu", "auto", dtype, state_dtype)
        assert_bits_equal(got[0], ref[0])
        assert_bits_equal(got[1], ref[1])
    monkeypatch.setenv("MPFUNC_NATIVE_TILES", "1")
    got = _rewritten_kahan("cpu", "auto", torch.bfloat16, state_dtype)
    ref = _rewritten_kahan("cpu", "foreach", torch.bfloat16, state_dtype)
    assert_bits_equal(got[0], ref[0])


@pytest.mark.xla
def test_kahan_rewritten_on_xla_equals_the_cpu(xla_device: torch.device) -> None:
    for impl in ("auto", "foreach"):
        ref = _rewritten_kahan("cpu", "foreach", torch.bfloat16)
        got = _rewritten_kahan(xla_device, impl, torch.bfloat16)
        assert_bits_equal(got[0], ref[0])
        assert bool((got[1][:, :32] == 0).all())


@settings(max_examples=60, deadline=None)
@given(
    exponent=st.integers(-140, 120),
    seed=st.integers(0, 2**31 - 1),
    dtype=st.sampled_from([torch.bfloat16, torch.float16]),
)
def test_kahan_store_never_leaves_a_compensation_its_load_drops(
    exponent: int, seed: int, dtype: torch.dtype
) -> None:
    """The stale rule must never fire on a compensation a store wrote: for fp32 values
    around ``2**exponent`` (subnormal, normal, overflowing to inf in fp16, exact ties and
    powers of two included), load(store(x)) is ``param + compensation`` exactly."""
    from mpfunc.strategies import _strategy_kahan

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(512, generator=gen) * 2.0**exponent
    grid = x.to(dtype).float()
    x[:64] = grid[:64]  # exact: a zero compensation
    x[64:128] = grid[64:128] * (1 + 2.0**-9)  # near ties of bf16
    x[128:136] = 2.0 ** torch.arange(exponent - 4, exponent + 4).float()
    unit = _strategy_kahan.KahanMaster(torch.zeros(512, dtype=dtype), torch.zeros(512, dtype=dtype))
    _strategy_kahan._store([unit], [x], None)
    (loaded,) = _strategy_kahan._load([unit])
    want = unit.param.float() + unit.compensation.float()
    finite = want.isfinite()  # (values: a -0.0 param loads as -0.0, as before)
    assert torch.equal(loaded[finite], want[finite])


# --- a unit whose param shows another master ------------------------------------------------


@pytest.mark.parametrize("strategy", ["remainder", "kahan", "stochastic"])
def test_rolling_back_to_units_whose_param_was_overwritten_is_refused(strategy: str) -> None:
    """Try a pure step, write it into the model, roll back with the old masters: a unit
    holds the model's param itself, which now shows the new master, so the rollback wrote
    nothing and said nothing. Refused now, naming the path, with nothing written; a deep
    copy taken first rolls back bit for bit; the pure loop that goes on from the new
    masters, a unit made afresh, a write to the param since (the param is the truth) and
    "fp32" masters are not refused."""
    import copy

    from support.helpers import assert_unchanged, snapshot

    gen = torch.Generator().manual_seed(5)
    p = {
        "w": torch.randn(8, 8, generator=gen).to(BF16),
        "b": torch.randn(8, generator=gen).to(BF16),
    }
    before = {k: v.clone() for k, v in p.items()}
    m = mpfunc.init_master(p, strategy=strategy, seed=3)
    kept = copy.deepcopy(m)
    opt = mpfunc.sgd(lr=0.5)
    s = opt.init(m)
    g = {k: torch.randn(v.shape, generator=gen).to(BF16) for k, v in p.items()}
    m2, s2 = mpfunc.apply_update(m, g, s, opt)
    mpfunc.masters_to_model_(m2, p)
    assert not torch.equal(p["w"], before["w"])
    snap = snapshot(p)
    with pytest.raises(ValueError, match=(
        rf"masters_to_model_: at 'masters\.b': expected a master whose value is still there "
        rf"\(a '{strategy}' master keeps the model's param itself as its high part\), got one "
        rf"whose param was overwritten since by masters_to_model_ with other masters .*"
        rf"copy\.deepcopy\(masters\)"
    )):  # fmt: skip
        mpfunc.masters_to_model_(m, p)
    assert_unchanged(p, snap)
    m3, _ = mpfunc.apply_update(m2, g, s2, opt)  # the pure loop goes on
    mpfunc.masters_to_model_(m3, p)
    mpfunc.masters_to_model_(kept, p)  # the copy rolls back
    for k in p:
        assert_bits_equal(p[k], before[k])
    fresh = mpfunc.init_master(p, strategy=strategy)
    mpfunc.masters_to_model_(m2, p)
    for stale in (fresh, m):  # fresh was made before that copy: stale too
        with pytest.raises(ValueError, match="overwritten since"):
            mpfunc.masters_to_model_(stale, p)
    newer = mpfunc.init_master(p, strategy=strategy)  # made after it: its value is p's
    mpfunc.masters_to_model_(newer, p)
    with torch.no_grad():
        p["w"].mul_(1.0)
        p["b"].mul_(1.0)
    mpfunc.masters_to_model_(m, p)  # written since: the param is the truth, as documented
    m32 = mpfunc.init_master(p)
    m32b, _ = mpfunc.apply_update(m32, g, mpfunc.adamw().init(m32), mpfunc.adamw())
    mpfunc.masters_to_model_(m32b, p)
    mpfunc.masters_to_model_(m32, p)

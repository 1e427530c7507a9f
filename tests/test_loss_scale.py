"""Loss scaling, step skipping and fault injection.

References: torch's own GradScaler update kernel (``torch._amp_update_scale_``)
for the dynamic scale's rules, and an uninterrupted run for fault injection.
"""

from __future__ import annotations

import io
from typing import Any

import optree
import pytest
import torch
from helpers import assert_bits_equal, assert_trees_bits_equal, assert_unchanged, snapshot
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import realize, specs

import mpfunc


def _sync(device: torch.device) -> None:
    if device.type == "xla":
        import torch_xla

        torch_xla.sync()


@settings(max_examples=40)
@given(
    finite=st.lists(st.booleans(), min_size=1, max_size=40),
    interval=st.integers(1, 5),
    init=st.sampled_from([1.0, 2.0**4, 2.0**16, 2.0**127]),
)
def test_dynamic_scale_follows_torch_grad_scaler(
    finite: list[bool], interval: int, init: float
) -> None:
    """Scale and counter follow torch.amp.GradScaler's update kernel step for step
    (min_scale=0, which GradScaler does not have)."""
    ours = mpfunc.DynamicLossScale(init, growth_interval=interval, min_scale=0.0)
    scale = torch.tensor([init])
    tracker = torch.zeros(1, dtype=torch.int32)
    for ok in finite:
        ours = ours.adjust(torch.tensor(ok))
        torch._amp_update_scale_(
            scale, tracker, torch.tensor([0.0 if ok else 1.0]), 2.0, 0.5, interval
        )
        assert float(ours.loss_scale) == float(scale[0])
        assert int(ours.counter) == int(tracker[0])


def test_min_scale_floors_the_backoff() -> None:
    s = mpfunc.DynamicLossScale(4.0, min_scale=1.0)
    for _ in range(5):
        s = s.adjust(torch.tensor(False))
    assert float(s.loss_scale) == 1.0


def test_growth_never_overflows() -> None:
    s = mpfunc.DynamicLossScale(2.0**127, growth_interval=1)
    s = s.adjust(torch.tensor(True))
    assert float(s.loss_scale) == 2.0**127


@pytest.mark.parametrize(
    "make",
    [
        lambda: mpfunc.StaticLossScale(128.0),
        lambda: mpfunc.DynamicLossScale(2.0**10, 7, 4.0, 0.25, 2.0),
    ],
    ids=["static", "dynamic"],
)
def test_every_field_survives_flatten_and_save(make: Any) -> None:
    """The jmp lesson: every field, settings included, survives optree flatten/unflatten
    (in mpfunc's namespace) and torch.save/load."""
    s = make().adjust(torch.tensor(False)).adjust(torch.tensor(True))
    flat, spec = optree.tree_flatten(s, namespace="mpfunc")
    assert all(isinstance(x, torch.Tensor) for x in flat)
    again = optree.tree_unflatten(spec, flat)
    mapped = optree.tree_map(lambda t: t.clone(), s, namespace="mpfunc")
    buf = io.BytesIO()
    torch.save(s, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    for other in (again, mapped, loaded):
        assert type(other) is type(s)
        assert repr(other) == repr(s)
        for name in type(s).__slots__:
            a, b = getattr(s, name), getattr(other, name)
            assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


@given(data=st.data(), log2=st.integers(-8, 24))
def test_unscale_is_exact_for_power_of_two_scales(
    device: torch.device, data: st.DataObject, log2: int
) -> None:
    """grads_to_fp32(g, scale=2**k) == g.float() / 2**k bit for bit, pure and in place."""
    spec = data.draw(specs())
    grads = realize(spec, device, scale=4.0)
    grads = optree.tree_map(
        lambda t: t if isinstance(t, torch.Tensor) and t.is_floating_point() else None,
        grads,
        none_is_leaf=True,
    )
    scale = mpfunc.StaticLossScale(2.0**log2)
    got = mpfunc.grads_to_fp32(grads, scale=scale)
    want = optree.tree_map(
        lambda t: None if t is None else t.cpu().float() / 2.0**log2, grads, none_is_leaf=True
    )
    assert_trees_bits_equal(
        optree.tree_map(lambda t: None if t is None else t.cpu(), got, none_is_leaf=True), want
    )
    out = mpfunc.init_grads(grads)
    got_ = mpfunc.grads_to_fp32_(grads, out, scale=2.0**log2)
    assert_trees_bits_equal(got_, got)


OPTS = {
    "sgd": lambda: mpfunc.sgd(lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01),
    "adam": lambda: mpfunc.adam(lr=0.01, weight_decay=0.01, amsgrad=True),
    "adamw": lambda: mpfunc.adamw(lr=0.01),
    "adamw-foreach": lambda: mpfunc.adamw(lr=0.01, impl="foreach"),
    "adamw-reference": lambda: mpfunc.adamw(lr=0.01, impl="reference"),
}


@settings(max_examples=30)
@given(
    data=st.data(),
    name=st.sampled_from(sorted(OPTS)),
    poison=st.sampled_from(["nan", "inf", "none"]),
)
def test_skip_true_changes_nothing_and_false_changes_nothing_else(
    device: torch.device, data: st.DataObject, name: str, poison: str
) -> None:
    """skip=True: masters, state and step counts come out bit-identical, even with NaN/inf
    grads. skip=False: the same bits as no skip at all. Both pure and in place."""
    if device.type != "cpu" and name.endswith(("foreach", "reference")):
        name = "adamw"
    spec = data.draw(specs(dtypes=[torch.float32]))
    masters = realize(spec, device)
    masters = optree.tree_map(
        lambda t: t if isinstance(t, torch.Tensor) and t.is_floating_point() else None,
        masters,
        none_is_leaf=True,
    )
    grads = realize(spec, device, salt=1, dtype=torch.float32)
    grads = optree.tree_map(
        lambda m, g: None if m is None else g, masters, grads, none_is_leaf=True
    )
    if poison != "none":
        bad = float(poison)
        grads = optree.tree_map(
            lambda g: None if g is None else g.clone().fill_(bad), grads, none_is_leaf=True
        )
    opt = OPTS[name]()
    state = opt.init(masters)
    yes = torch.tensor(True, device=device)
    no = torch.tensor(False, device=device)
    # One clean step first, so the state is not all zeros.
    clean = optree.tree_map(lambda m: None if m is None else m * 0.5, masters, none_is_leaf=True)
    masters, state = mpfunc.apply_update(masters, clean, state, opt)
    _sync(device)

    snap = snapshot((masters, state))
    m1, s1 = mpfunc.apply_update(masters, grads, state, opt, skip=yes)
    _sync(device)
    assert_trees_bits_equal((m1, s1), (masters, state))

    m_inplace = optree.tree_map(lambda t: t.clone(), masters)
    s_inplace = optree.tree_map(lambda t: t.clone(), state)
    mpfunc.apply_update_(m_inplace, grads, s_inplace, opt, skip=yes)
    _sync(device)
    assert_trees_bits_equal((m_inplace, s_inplace), (masters, state))

    m2, s2 = mpfunc.apply_update(masters, grads, state, opt, skip=no)
    m3, s3 = mpfunc.apply_update(masters, grads, state, opt)
    _sync(device)
    assert_trees_bits_equal((m2, s2), (m3, s3))
    # The pure calls left their inputs alone.
    assert_unchanged((masters, state), snap)


FAULTS = ["inf-one-element", "nan-one-element", "all-nonfinite", "nan-loss"]


@pytest.mark.parametrize("name", ["sgd", "adam", "adamw"])
def test_fault_injection_fp16_dynamic_scaling(device: torch.device, name: str) -> None:
    """fp16 model, dynamic loss scaling, inf/NaN grads injected at random steps.

    On a bad step the masters, the optimizer state and the step count stay
    bit-identical and the scale backs off; growth resumes afterwards; and the final
    masters equal, bit for bit, those of a run that never saw the bad steps.
    """
    gen = torch.Generator().manual_seed(7)
    n_good = 12
    bad_at = {2: FAULTS[0], 3: FAULTS[1], 7: FAULTS[2], 11: FAULTS[3]}
    # The model: loss = sum(c_k * w) per step, so grads are c_k * scale exactly, computed
    # by autograd through an fp32 loss into fp16 parameters.
    coefs = [torch.randn(3, 4, generator=gen).half() * 0.01 for _ in range(n_good)]
    w0 = torch.randn(3, 4, generator=gen).half()

    def run(with_faults: bool) -> tuple[Any, Any, list[dict[str, Any]]]:
        w = w0.clone().to(device).requires_grad_(True)
        params = {"w": w}
        masters = mpfunc.init_master(params)
        opt = {"sgd": mpfunc.sgd(lr=0.1, momentum=0.9), "adam": mpfunc.adam(lr=0.01),
               "adamw": mpfunc.adamw(lr=0.01)}[name]  # fmt: skip
        state = opt.init(masters)
        scaler = mpfunc.DynamicLossScale(2.0**4, growth_interval=3, device=device)
        gbuf = mpfunc.init_grads(params)
        log: list[dict[str, Any]] = []
        k = step = 0
        while k < n_good:
            fault = bad_at.get(step) if with_faults else None
            c = coefs[k].to(device)
            loss = (w.float() * c.float()).sum()
            if fault == "nan-loss":
                loss = loss * float("nan")
            scaler.scale(loss).backward()
            g = w.grad
            assert g is not None
            if fault == "inf-one-element":
                g[1, 2] = float("inf")
            elif fault == "nan-one-element":
                g[0, 0] = float("nan")
            elif fault == "all-nonfinite":
                g.fill_(float("inf"))
            before = snapshot((masters, state))
            g32 = mpfunc.grads_to_fp32_({"w": g}, gbuf, scale=scaler)
            finite = mpfunc.all_finite(g32)
            mpfunc.apply_update_(masters, g32, state, opt, skip=~finite)
            mpfunc.masters_to_model_(masters, params)
            new_scaler = scaler.adjust(finite)
            w.grad = None
            _sync(device)
            log.append(
                dict(fault=fault, finite=bool(finite.cpu()), before=before,
                     after=snapshot((masters, state)), scale=float(scaler.loss_scale.cpu()),
                     new_scale=float(new_scaler.loss_scale.cpu()))
            )  # fmt: skip
            scaler = new_scaler
            step += 1
            if fault is None:
                k += 1
        return masters, state, log

    m_faulty, s_faulty, log = run(True)
    m_clean, s_clean, _ = run(False)
    assert_trees_bits_equal((m_faulty, s_faulty), (m_clean, s_clean))
    seen = set()
    for entry in log:
        if entry["fault"] is None:
            assert entry["finite"]
            continue
        seen.add(entry["fault"])
        assert not entry["finite"]
        for a, b in zip(entry["before"], entry["after"]):
            if a is not None:  # masters, moments and step counts: every bit kept
                assert_bits_equal(a[0], b[0])
        assert entry["new_scale"] == entry["scale"] / 2, "the scale did not back off"
    assert seen == set(FAULTS)
    # Growth resumed: three finite steps after the last fault, the scale doubled.
    scales = [e["new_scale"] for e in log]
    last_bad = max(i for i, e in enumerate(log) if e["fault"])
    assert len(log) - last_bad - 1 >= 3
    assert scales[last_bad + 3] == 2 * scales[last_bad]

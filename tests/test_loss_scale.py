"""Loss scaling, step skipping and fault injection.

References: torch's own GradScaler update kernel (``torch._amp_update_scale_``) and a
plain-Python model of the rules for the dynamic scale, and an uninterrupted run for
fault injection.
"""

from __future__ import annotations

import copy
import dataclasses
import io
import math
import pickle
import re
import struct
from typing import Any

import optree
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from support.error_table import call, check_row, row
from support.helpers import assert_bits_equal, assert_trees_bits_equal, assert_unchanged, snapshot
from support.strategies import realize, specs

import mpfunc
from mpfunc.core import _tree

F32_MAX = torch.finfo(torch.float32).max
F32_TINY = torch.finfo(torch.float32).tiny  # the smallest normal float32, 2**-126
COUNT_MAX = 2**31 - 1


def _sync(device: torch.device) -> None:
    if device.type == "xla":
        import torch_xla

        torch_xla.sync()


def _fields(s: Any) -> dict[str, Any]:
    return {f.name: getattr(s, f.name) for f in dataclasses.fields(s)}


def assert_same_state(a: Any, b: Any) -> None:
    """Same class and every dataclass field equal: tensors bit for bit (dtype included)."""
    assert type(a) is type(b)
    fa, fb = _fields(a), _fields(b)
    assert fa.keys() == fb.keys()
    for name, x in fa.items():
        y = fb[name]
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor), name
            assert_bits_equal(x.cpu(), y.cpu())
        else:
            assert type(x) is type(y) and x == y, (name, x, y)


def with_state(s: Any, **tensors: Any) -> Any:
    """``s`` with other tensors, through the tree rules (as a checkpoint load builds it)."""
    leaves, spec = _tree.flatten(s)
    return _tree.unflatten(spec, [tensors.get(n, t) for n, t in zip(_tree.leaf_paths(s), leaves)])


# --- the rules, against torch and against a plain-Python model ---------------------------


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


def _f32(x: float) -> float:
    """x rounded to float32 (to nearest even; inf past the largest float32)."""
    try:
        return float(struct.unpack("f", struct.pack("f", x))[0])
    except OverflowError:
        return math.copysign(math.inf, x)


def model_adjust(
    scale: float, counter: int, finite: bool, s: mpfunc.DynamicLossScale
) -> tuple[float, int]:
    """The rules in plain Python, each product rounded to float32 as the device rounds it."""
    if not finite:
        backed = _f32(scale * _f32(s.backoff_factor))
        return max(backed, _f32(max(s.min_scale, F32_TINY))), 0
    count = min(counter + 1, COUNT_MAX)  # saturates, never wraps
    if count >= s.growth_interval:  # never true past COUNT_MAX
        grown = _f32(scale * _f32(s.growth_factor))
        return (grown if math.isfinite(grown) else scale), 0
    return scale, count


def _factor(low: float, high: float) -> st.SearchStrategy[float]:
    """Factors strictly inside (low, high): float32 values (which torch's kernel, computing
    in float64, rounds the same way), any float, and the usual ones."""
    inside: dict[str, Any] = dict(min_value=low, max_value=high, exclude_min=True, exclude_max=True)
    return st.one_of(
        st.floats(**inside, width=32), st.floats(**inside), st.sampled_from([2.0, 0.5, 0.25, 4.0])
    ).filter(lambda v: low < v < high)


@settings(max_examples=300)
@given(
    init=st.floats(F32_TINY, F32_MAX, width=32),
    min_frac=st.one_of(st.just(0.0), st.just(1.0), st.floats(0, 1)),
    interval=st.one_of(st.integers(1, 6), st.sampled_from([COUNT_MAX, 2**31, 2**40, 2**100])),
    growth=_factor(1.0, F32_MAX),
    backoff=_factor(0.0, 1.0),
    start=st.floats(0, 1),
    finite=st.lists(st.booleans(), max_size=60),
)
def test_dynamic_scale_follows_the_model_and_torch_and_stays_in_range(
    init: float,
    min_frac: float,
    interval: int,
    growth: float,
    backoff: float,
    start: float,
    finite: list[bool],
) -> None:
    """Any settings the constructor accepts, any sequence of finite/non-finite steps: the
    scale stays finite, > 0 and within [min_scale, float32 max], and every step equals the
    plain-Python model bit for bit, and torch's GradScaler kernel wherever its rules apply
    (float32 factors, no floor reached, no counter at the int32 limit, an interval
    that fits its int64 argument)."""
    assume(_f32(growth) > 1.0 and 0.0 < _f32(backoff) < 1.0)
    s = mpfunc.DynamicLossScale(init, interval, growth, backoff, min_scale=init * min_frac)
    # Start the counter anywhere below the interval, up to the int32 limit.
    counter = int(start * (min(interval, COUNT_MAX) - 1))
    s = with_state(s, counter=torch.tensor(counter, dtype=torch.int32))
    scale = init
    floor = _f32(max(s.min_scale, F32_TINY))
    for ok in finite:
        s = s.adjust(torch.tensor(ok))
        want = model_adjust(scale, counter, ok, s)
        assert (float(s.loss_scale), int(s.counter)) == want
        assert s.loss_scale.dtype == torch.float32 and s.counter.dtype == torch.int32
        assert math.isfinite(want[0]) and 0 < floor <= want[0] <= F32_MAX
        # torch's kernel from the same state, where its rules are ours.
        floored = not ok and _f32(scale * _f32(backoff)) < floor
        f32_factors = _f32(growth) == growth and _f32(backoff) == backoff
        if f32_factors and counter < COUNT_MAX and interval < 2**63:
            t_scale = torch.tensor([scale])
            tracker = torch.tensor([counter], dtype=torch.int32)
            found_inf = torch.tensor([0.0 if ok else 1.0])
            torch._amp_update_scale_(t_scale, tracker, found_inf, growth, backoff, interval)
            if not floored:
                assert (float(t_scale[0]), int(tracker[0])) == want
        scale, counter = want


@pytest.mark.parametrize("interval", [2**31, 2**40])
def test_a_huge_growth_interval_never_grows(interval: int) -> None:
    """growth_interval >= 2**31 once compared an int32 counter with a wrapped int and grew
    on every step. Now it never grows, as torch's kernel, and the counter saturates
    instead of wrapping."""
    s = mpfunc.DynamicLossScale(2.0**10, growth_interval=interval)
    scale, tracker = torch.tensor([2.0**10]), torch.zeros(1, dtype=torch.int32)
    for _ in range(20):
        s = s.adjust(torch.tensor(True))
        torch._amp_update_scale_(scale, tracker, torch.tensor([0.0]), 2.0, 0.5, interval)
        assert float(s.loss_scale) == float(scale[0]) == 2.0**10
        assert int(s.counter) == int(tracker[0])
    s = with_state(s, counter=torch.tensor(COUNT_MAX - 1, dtype=torch.int32))
    for _ in range(3):
        s = s.adjust(torch.tensor(True))
        assert float(s.loss_scale) == 2.0**10 and int(s.counter) == COUNT_MAX
    s = s.adjust(torch.tensor(False))
    assert float(s.loss_scale) == 2.0**9 and int(s.counter) == 0


def test_the_largest_int32_interval_still_grows() -> None:
    s = mpfunc.DynamicLossScale(2.0**10, growth_interval=COUNT_MAX)
    s = with_state(s, counter=torch.tensor(COUNT_MAX - 2, dtype=torch.int32))
    s = s.adjust(torch.tensor(True))
    assert (float(s.loss_scale), int(s.counter)) == (2.0**10, COUNT_MAX - 1)
    s = s.adjust(torch.tensor(True))
    assert (float(s.loss_scale), int(s.counter)) == (2.0**11, 0)


def test_min_scale_zero_never_reaches_zero() -> None:
    """min_scale=0: a long run of overflows stops at the smallest normal float32, never at
    0, where unscaling would divide 0 by 0 (GradScaler's scale reaches 0 here)."""
    s = mpfunc.DynamicLossScale(1.0, min_scale=0.0)
    for _ in range(300):
        s = s.adjust(torch.tensor(False))
    assert float(s.loss_scale) == F32_TINY
    g32 = mpfunc.grads_to_fp32({"w": torch.zeros(3, dtype=torch.bfloat16)}, scale=s)
    assert bool(mpfunc.all_finite(g32))
    s = s.adjust(torch.tensor(True)).adjust(torch.tensor(True))
    assert float(s.loss_scale) == F32_TINY  # growth_interval 2000: not yet


def test_min_scale_equal_to_init_scale_holds_the_scale() -> None:
    s = mpfunc.DynamicLossScale(8.0, min_scale=8.0, growth_interval=1)
    for ok in [False, False, True, False]:
        s = s.adjust(torch.tensor(ok))
    assert float(s.loss_scale) == 8.0


def test_adjust_returns_a_new_state_and_changes_nothing() -> None:
    s = mpfunc.DynamicLossScale(2.0**4, growth_interval=1)
    before = snapshot(s)
    t = s.adjust(torch.tensor(True))
    assert t is not s and float(t.loss_scale) == 2.0**5
    assert_unchanged(s, before)
    assert float(s.loss_scale) == 2.0**4
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.loss_scale = torch.tensor(1.0)  # type: ignore[misc]
    static = mpfunc.StaticLossScale(3.0)
    assert static.adjust(torch.tensor(False)) is static
    with pytest.raises(dataclasses.FrozenInstanceError):
        static.loss_scale = torch.tensor(1.0)  # type: ignore[misc]


# --- settings ----------------------------------------------------------------------------

D, S = "DynamicLossScale", "StaticLossScale"
DLS, SLS = mpfunc.DynamicLossScale, mpfunc.StaticLossScale


def _f32_name(name: str, value: str) -> str:
    return re.escape(f"{name} ({value} in float32)")


SETTINGS_ROWS = [
    row(
        "init_scale-1e39",
        lambda: call(DLS, 1e39),
        ValueError,
        rf"^{D}: {_f32_name('init_scale', '1e+39')}: expected a finite float >= 1\.17549e-38, "
        r"got inf$",
    ),
    row(
        "init_scale-subnormal",
        lambda: call(DLS, 1e-40),
        ValueError,
        rf"^{D}: {_f32_name('init_scale', '1e-40')}: expected a finite float >= 1\.17549e-38, "
        r"got 9\.99",
    ),
    row(
        "init_scale-0-tensor",
        lambda: call(DLS, torch.tensor(0.0)),
        ValueError,
        rf"^{D}: init_scale: expected a finite float > 0, got 0\.0$",
    ),
    row(
        "init_scale-inf-float64-tensor",
        lambda: call(DLS, torch.tensor(1e39, dtype=torch.float64)),
        ValueError,
        rf"^{D}: {_f32_name('init_scale', '1e+39')}: expected a finite float",
    ),
    row(
        "init_scale-int-tensor",
        lambda: call(DLS, torch.tensor(4)),
        TypeError,
        rf"^{D}: init_scale: expected a finite float > 0 or a 0-d float tensor, got "
        r"torch\.int64 tensor of shape \(\) on cpu$",
    ),
    row(
        "growth_interval-2.0",
        lambda: call(DLS, growth_interval=2.0),
        TypeError,
        rf"^{D}: growth_interval: expected an int >= 1, got 2\.0$",
    ),
    row(
        "growth_interval-True",
        lambda: call(DLS, growth_interval=True),
        TypeError,
        rf"^{D}: growth_interval: expected an int >= 1, got True$",
    ),
    row(
        "growth_factor-inf",
        lambda: call(DLS, growth_factor=math.inf),
        ValueError,
        rf"^{D}: growth_factor: expected a finite float > 1, got inf$",
    ),
    row(
        "growth_factor-1e39",
        lambda: call(DLS, growth_factor=1e39),
        ValueError,
        rf"^{D}: {_f32_name('growth_factor', '1e+39')}: expected a finite float > 1, got inf$",
    ),
    row(
        "growth_factor-1+1e-9",
        lambda: call(DLS, growth_factor=1 + 1e-9),
        ValueError,
        rf"^{D}: {_f32_name('growth_factor', '1.000000001')}: expected a finite float > 1, "
        r"got 1\.0$",
    ),
    row(
        "growth_factor-0.5",
        lambda: call(DLS, growth_factor=0.5),
        ValueError,
        rf"^{D}: growth_factor: expected a finite float > 1, got 0\.5$",
    ),
    row(
        "backoff_factor-1-1e-9",
        lambda: call(DLS, backoff_factor=1 - 1e-9),
        ValueError,
        rf"^{D}: {_f32_name('backoff_factor', '0.999999999')}: expected a float in \(0, 1\), "
        r"got 1\.0$",
    ),
    row(
        "backoff_factor-1e-50",
        lambda: call(DLS, backoff_factor=1e-50),
        ValueError,
        rf"^{D}: {_f32_name('backoff_factor', '1e-50')}: expected a float in \(0, 1\), "
        r"got 0\.0$",
    ),
    row(
        "backoff_factor-nan",
        lambda: call(DLS, backoff_factor=math.nan),
        ValueError,
        rf"^{D}: backoff_factor: expected a float in \(0, 1\), got nan$",
    ),
    row(
        "min_scale-above-init_scale",
        lambda: call(DLS, 2.0**10, min_scale=2.0**11),
        ValueError,
        rf"^{D}: min_scale: expected a float <= init_scale \(1024\.0\), got 2048\.0$",
    ),
    row(
        "min_scale-inf",
        lambda: call(DLS, min_scale=math.inf),
        ValueError,
        rf"^{D}: min_scale: expected a finite float >= 0, got inf$",
    ),
    row(
        "min_scale-str",
        lambda: call(DLS, min_scale="1"),
        TypeError,
        rf"^{D}: min_scale: expected a float >= 0, got str$",
    ),
    row(
        "static-1e39",
        lambda: call(SLS, 1e39),
        ValueError,
        rf"^{S}: {_f32_name('scale', '1e+39')}: expected a finite float >= 1\.17549e-38, "
        r"got inf$",
    ),
    row(
        "static-nan-tensor",
        lambda: call(SLS, torch.tensor(math.nan)),
        ValueError,
        rf"^{S}: scale: expected a finite float > 0, got nan$",
    ),
    row(
        "static-adjust-float-flag",
        lambda: call(SLS(2.0).adjust, torch.tensor(1.0)),
        TypeError,
        r"^StaticLossScale\.adjust: finite: expected a 0-d bool tensor, got torch\.float32 "
        r"tensor of shape \(\) on cpu$",
    ),
    row(
        "grads_to_fp32-scale-1e39",
        lambda: call(mpfunc.grads_to_fp32, {"w": torch.ones(2)}, scale=1e39),
        ValueError,
        rf"^grads_to_fp32: {_f32_name('scale', '1e+39')}: expected a finite float >= ",
    ),
    row(
        "grads_to_fp32_-scale-1e-40",
        lambda: call(
            mpfunc.grads_to_fp32_, {"w": torch.ones(2)}, {"w": torch.ones(2)}, scale=1e-40
        ),
        ValueError,
        rf"^grads_to_fp32_: {_f32_name('scale', '1e-40')}: expected a finite float >= ",
    ),
]


@pytest.mark.parametrize(("make", "exc", "regex"), SETTINGS_ROWS)
def test_bad_setting_is_refused(make: Any, exc: type[Exception], regex: str) -> None:
    """Settings that were accepted but broke training, and their float32 edges: refused in
    the house form, with every tensor passed in left as it was."""
    check_row(make, exc, regex)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(init_scale=F32_MAX, min_scale=F32_MAX),
        dict(init_scale=F32_TINY, min_scale=0.0),
        dict(min_scale=0.0),
        dict(growth_interval=1),
        dict(growth_interval=COUNT_MAX),
        dict(growth_interval=2**31),
        dict(growth_interval=2**100),
        dict(growth_factor=F32_MAX, backoff_factor=2.0**-149),
        dict(init_scale=torch.tensor(3.0, dtype=torch.float64)),
    ],
    ids=lambda kw: ",".join(f"{k}={v!r}" for k, v in kw.items()),
)
def test_edge_settings_are_accepted(kwargs: dict[str, Any]) -> None:
    s = mpfunc.DynamicLossScale(**kwargs)
    for ok in [True, False, True, True, False]:
        s = s.adjust(torch.tensor(ok))
        assert math.isfinite(float(s.loss_scale)) and float(s.loss_scale) > 0


# --- the state as a tree, a checkpoint and a pickle ---------------------------------------


def _states() -> list[Any]:
    """Both classes, with every setting off its default and moved tensors."""
    return [
        mpfunc.StaticLossScale(128.0),
        mpfunc.DynamicLossScale(2.0**10, 7, 4.0, 0.25, 2.0)
        .adjust(torch.tensor(False))
        .adjust(torch.tensor(True)),
    ]


# torch 2.4 unpickles tensors through torch.load and warns that weights_only is unset.
@pytest.mark.filterwarnings("ignore:You are using `torch.load` with `weights_only:FutureWarning")
@pytest.mark.parametrize("s", _states(), ids=["static", "dynamic"])
def test_every_field_survives_the_tree_rules(s: Any) -> None:
    """The jmp lesson (its flatten forgot a field): each field, settings included, is
    either a child or metadata, and survives flatten/unflatten, tree maps (even to
    non-tensors and back), copies and ``to``."""
    leaves, spec = _tree.flatten(s)
    assert all(isinstance(t, torch.Tensor) for t in leaves)
    tensors = [n for n, v in _fields(s).items() if isinstance(v, torch.Tensor)]
    assert _tree.leaf_paths(s) == tensors
    as_none = optree.tree_map(lambda t: None, s, namespace="mpfunc")
    copies = [
        _tree.unflatten(spec, leaves),
        _tree.unflatten(_tree.flatten(as_none)[1], leaves),  # through non-tensor children
        _tree.map_tensors(lambda t: t.clone(), s),
        optree.tree_map(lambda t: t + 0, s, namespace="mpfunc"),
        copy.deepcopy(s),
        copy.copy(s),
        pickle.loads(pickle.dumps(s)),
        s.to("cpu"),
    ]
    for other in copies:
        assert_same_state(other, s)
        assert repr(other) == repr(s)


def test_each_setting_is_in_the_tree_structure() -> None:
    """jmp's forgotten field was a setting: here changing any setting changes the spec."""
    base: dict[str, Any] = dict(
        init_scale=2.0**10, growth_interval=7, growth_factor=4.0, backoff_factor=0.25, min_scale=2.0
    )
    spec = _tree.flatten(DLS(**base))[1]
    assert _tree.flatten(DLS(**{**base, "init_scale": 2.0**9}))[1] == spec  # a child's value
    for name, value in [
        ("growth_interval", 8),
        ("growth_factor", 3.0),
        ("backoff_factor", 0.5),
        ("min_scale", 1.0),
    ]:
        assert _tree.flatten(DLS(**{**base, name: value}))[1] != spec, name


@pytest.mark.parametrize("s", _states(), ids=["static", "dynamic"])
def test_torch_load_weights_only_reads_them(s: Any) -> None:
    """torch.save of the state (alone, or inside a dict) reads back with
    ``torch.load(weights_only=True)``, every field kept."""
    for obj in (s, {"scaler": s, "step": 3}):
        buf = io.BytesIO()
        torch.save(obj, buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=True)
        assert_same_state(loaded if obj is s else loaded["scaler"], s)


def test_checkpoint_round_trip(device: torch.device, tmp_path: Any) -> None:
    """The tensors go through state_dict, save and load like every other state; the
    settings come from the ``like`` tree."""
    dynamic = mpfunc.DynamicLossScale(2.0**10, 3, 4.0, 0.25, 2.0, device=device)
    for ok in [True, False, True, True]:  # 256, counter 2
        dynamic = dynamic.adjust(torch.tensor(ok, device=device))
    tree = {"scale": dynamic, "static": mpfunc.StaticLossScale(512.0).to(device)}
    _sync(device)
    sd = mpfunc.state_dict(tree)
    assert sorted(sd) == ["scale.counter", "scale.loss_scale", "static.loss_scale"]
    like = {
        "scale": mpfunc.DynamicLossScale(2.0**10, 3, 4.0, 0.25, 2.0, device=device),
        "static": mpfunc.StaticLossScale(1.0).to(device),
    }
    mpfunc.save(tmp_path / "ckpt.pt", tree)
    loaded = mpfunc.load(tmp_path / "ckpt.pt", like)
    _sync(device)
    assert loaded["scale"].loss_scale.device == device
    assert_same_state(loaded["scale"], dynamic)
    assert_same_state(loaded["static"], tree["static"])
    again = mpfunc.load_state_dict(like, sd)
    assert_same_state(again["scale"], dynamic)
    # The loaded state goes on as the saved one would.
    flag = torch.tensor(True, device=device)
    a, b = loaded["scale"].adjust(flag), dynamic.adjust(flag)
    _sync(device)
    assert_same_state(a, b)
    assert float(a.loss_scale.cpu()) == 2.0**10  # counter 2 was restored: the 3rd grows


# --- devices ------------------------------------------------------------------------------


CONFIGS = {
    # factors float32 does not hold exactly, and a floor the backoff reaches
    "rounding-floor": (
        dict(
            init_scale=3.0, growth_interval=2, growth_factor=1.1, backoff_factor=0.3, min_scale=0.2
        ),
        [1, 1, 0, 0, 0, 1, 1, 1, 0, 1],
    ),
    "huge-interval": (
        dict(init_scale=2.0**10, growth_interval=2**40),
        [1, 1, 1, 0, 1, 1, 1, 1, 1, 1],
    ),
    "floor-zero": (
        dict(init_scale=2.0**-120, growth_interval=3, min_scale=0.0),
        [0, 0, 0, 0, 0, 0, 0, 1, 1, 1],
    ),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_adjust_on_device_matches_cpu_without_a_host_read(device: torch.device, name: str) -> None:
    """A few adjusts on the device, one sync, then the bits equal the CPU run's. On XLA,
    nothing is transferred or executed before the sync: adjust never waits on the host."""
    kwargs, steps = CONFIGS[name]
    cpu = mpfunc.DynamicLossScale(**kwargs)
    dev = mpfunc.DynamicLossScale(**kwargs, device=device)
    flags = [torch.tensor(bool(ok), device=device) for ok in steps]
    if device.type == "xla":
        import torch_xla
        import torch_xla.core.xla_model as xm
        import torch_xla.debug.metrics as met

        torch_xla.sync()
        xm.wait_device_ops()
        met.clear_all()
    for ok, flag in zip(steps, flags):
        cpu = cpu.adjust(torch.tensor(bool(ok)))
        dev = dev.adjust(flag)
    if device.type == "xla":
        assert met.metric_data("TransferFromDeviceTime") is None
        assert met.metric_data("ExecuteTime") is None
    _sync(device)
    assert dev.loss_scale.device == device
    assert_same_state(dev, cpu)
    assert float(cpu.loss_scale) >= _f32(max(kwargs.get("min_scale", 1.0), F32_TINY))


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
        opt = {
            "sgd": mpfunc.sgd(lr=0.1, momentum=0.9),
            "adam": mpfunc.adam(lr=0.01),
            "adamw": mpfunc.adamw(lr=0.01),
        }[name]
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
                dict(
                    fault=fault,
                    finite=bool(finite.cpu()),
                    before=before,
                    after=snapshot((masters, state)),
                    scale=float(scaler.loss_scale.cpu()),
                    new_scale=float(new_scaler.loss_scale.cpu()),
                )
            )
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


# --- a saved scale that would silence training ------------------------------------------


@pytest.mark.parametrize("bad", [math.nan, 0.0, -2.0, math.inf, -0.0])
@pytest.mark.parametrize("kind", ["static", "dynamic"])
def test_loading_a_scale_that_is_not_finite_and_positive_is_refused(
    bad: float, kind: str, tmp_path: Any
) -> None:
    """A NaN, infinite, zero or negative loss scale from a checkpoint would make every
    step's grads NaN or zero with no error: every load path refuses it by its key before
    writing anything (bits and versions unchanged)."""
    scale = mpfunc.StaticLossScale(8.0) if kind == "static" else mpfunc.DynamicLossScale(8.0)
    tree = {"scale": scale, "w": torch.arange(3.0)}
    sd = mpfunc.state_dict(tree)
    sd = {k: v.clone() for k, v in sd.items()}
    sd["w"] = sd["w"] + 1
    sd["scale.loss_scale"] = torch.tensor(bad)
    message = rf"'scale\.loss_scale': expected a loss scale that is finite and > 0, got {bad}"
    snap = snapshot(tree)
    with pytest.raises(ValueError, match=message):
        mpfunc.load_state_dict_(tree, sd)
    assert_unchanged(tree, snap)
    with pytest.raises(ValueError, match=message):
        mpfunc.load_state_dict(tree, sd)
    # A file written from a scale that went bad (its checksums are right).
    saved = copy.deepcopy(tree)
    with torch.no_grad():
        saved["scale"].loss_scale.fill_(bad)
    path = tmp_path / "ckpt.pt"
    mpfunc.save(path, saved)
    with pytest.raises(ValueError, match=message):
        mpfunc.load_(path, tree)
    assert_unchanged(tree, snap)
    with pytest.raises(ValueError, match=message):
        mpfunc.load(path, tree)
    # a good scale loads
    out = mpfunc.load_state_dict(tree, {**sd, "scale.loss_scale": torch.tensor(2.0)})
    assert float(out["scale"].loss_scale) == 2.0

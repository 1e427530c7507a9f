"""SGD and Lion in the native composed pass (``step_rule_``) against their specification,
the torch path: the strategy's load, ``_sgd._foreach``/``_lion._foreach`` on fp32
temporaries, the state format's and the strategy's stores.

Drawn: the optimizer and its hyperparameters (momentum, dampening, Nesterov, weight decay,
maximize; Lion's betas, 0 included, where torch's lerp has two forms), strategies, state
dtypes, grad dtypes, fp16 params where the strategy takes them, layouts (a leaf long enough
for torch to split it between 2 threads among them), NaN/inf/subnormal/signed-zero values,
skipped steps, loss scales, tensor lrs, several steps, 1 and 2 threads. Bits must agree
(NaN payloads aside), and the native kernel must have run where it can.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mpfunc
from mpfunc.backends import _native
from mpfunc.core import _cache
from mpfunc.core._optimizer import Group
from mpfunc.optim import _adam, _lion, _sgd
from tests.support.helpers import assert_trees_bits_equal, assert_unchanged, laid_out, snapshot
from tests.support.native import native_module
from tests.test_native_composed import (
    BLOCKED,
    LAYOUTS,
    STATE_DTYPES,
    STRATEGIES,
    _numel,
    _values,
)

# (40017 elements: two parts at 2 threads, each ending in a scalar tail of torch's lerp)
LONG = ("contiguous", (40017,))
BETAS = [(0.9, 0.99), (0.0, 0.99), (0.9, 0.0), (0.0, 0.0), (0.95, 0.5), (0.3, 0.6)]


@pytest.fixture(scope="module")
def native() -> Any:
    return native_module()


@pytest.fixture
def ran(monkeypatch: pytest.MonkeyPatch, native: Any) -> Iterator[list[int]]:
    seen: list[int] = []
    real = _native.rule_step

    def spy(group: Group, *args: Any) -> None:
        seen.append(len(group.params))
        real(group, *args)

    monkeypatch.setattr(_native, "rule_step", spy)
    yield seen


def _serves(name: str, betas: tuple[float, float] = (0.9, 0.99)) -> bool:
    """Whether the native pass takes this rule here (its probe of this torch agreed)."""
    kernel = _lion._native_kernel if name == "lion" else _sgd._native_kernel
    return _native.serves(kernel, SimpleNamespace(beta1=betas[0], beta2=betas[1]))


@pytest.fixture(params=[1, 2], ids=lambda t: f"{t}threads")
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def _optimizer(data: st.DataObject) -> tuple[str, dict[str, Any]]:
    name = data.draw(st.sampled_from(["sgd", "lion"]), "optimizer")
    kw: dict[str, Any] = dict(
        weight_decay=data.draw(st.sampled_from([0.0, 0.1]), "weight_decay"),
        maximize=data.draw(st.booleans(), "maximize"),
    )
    if name == "lion":
        kw["betas"] = data.draw(st.sampled_from(BETAS), "betas")
        return name, kw
    kw["momentum"] = data.draw(st.sampled_from([0.0, 0.9]), "momentum")
    if kw["momentum"]:
        kw["nesterov"] = data.draw(st.booleans(), "nesterov")
        if not kw["nesterov"]:
            kw["dampening"] = data.draw(st.sampled_from([0.0, 0.3, 0.9]), "dampening")
    return name, kw


def _case(data: st.DataObject) -> dict[str, Any]:
    strategy = data.draw(st.sampled_from(STRATEGIES), "strategy")
    pdt = torch.bfloat16
    if strategy in ("kahan", "none"):
        pdt = data.draw(st.sampled_from([torch.bfloat16, torch.float16]), "param dtype")
    name, kw = _optimizer(data)
    return dict(
        strategy=strategy,
        pdt=pdt,
        name=name,
        kw=kw,
        state_dtype=data.draw(st.sampled_from(STATE_DTYPES), "state_dtype"),
        gdt=data.draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), "grad"),
        layouts=data.draw(
            st.lists(st.sampled_from([*LAYOUTS, LONG]), min_size=1, max_size=3), "layouts"
        ),
        specials=data.draw(st.booleans(), "specials"),
        skip=data.draw(st.lists(st.booleans(), min_size=3, max_size=3), "skips"),
        scale=data.draw(st.sampled_from([None, 1.0, 1024.0]), "scale"),
        tensor_lr=data.draw(st.booleans(), "tensor lr"),
        seed=data.draw(st.integers(0, 2**16), "seed"),
    )


def _run(c: dict[str, Any], impl: str) -> Any:
    gen = torch.Generator().manual_seed(c["seed"])
    params = {
        f"p{i}": laid_out(kind, shape, _values(gen, _numel(shape), 0.5, False).to(c["pdt"]))
        for i, (kind, shape) in enumerate(c["layouts"])
    }
    masters = mpfunc.init_master(params, strategy=c["strategy"], seed=3)
    lr: Any = torch.tensor(1e-2) if c["tensor_lr"] else 1e-2
    make = mpfunc.lion if c["name"] == "lion" else mpfunc.sgd
    opt = make(lr=lr, state_dtype=c["state_dtype"], impl=impl, **c["kw"])
    state = opt.init(masters)
    kw: dict[str, Any] = {"params": params} if c["strategy"] == "fp32" else {}
    for k, skip in enumerate(c["skip"]):
        grads = {
            n: _values(gen, p.numel(), 1.0, c["specials"] and k == 1)
            .to(c["gdt"])
            .reshape(p.shape)
            .to(memory_format=torch.channels_last if p.dim() == 4 else torch.contiguous_format)
            for n, p in params.items()
        }
        if c["scale"] is not None:
            kw["scale"] = torch.tensor(c["scale"])
        masters, state = mpfunc.apply_update_(
            masters, grads, state, opt, skip=torch.tensor(skip), **kw
        )
    return params, masters, state


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_native_sgd_lion_equal_torch_path(
    ran: list[int], threads: int, data: st.DataObject
) -> None:
    c = _case(data)
    ran.clear()  # (one fixture serves every example)
    want = _run(c, "foreach")
    assert not ran
    got = _run(c, "auto")
    assert_trees_bits_equal(got, want, nan_payload=False)
    # Grads are contiguous (channels_last for 4-d leaves): the native pass takes every leaf
    # whose param shares that layout.
    # (Draws and 8-bit blocks follow the element index: channels_last is not taken there.)
    by_index = c["strategy"] in ("stochastic", "remainder") or c["state_dtype"] in BLOCKED
    taken = ("contiguous",) if by_index else ("contiguous", "channels_last")
    if _serves(c["name"], c["kw"].get("betas", (0.9, 0.99))) and any(
        kind in taken for kind, _ in c["layouts"]
    ):
        assert ran, "the native pass never ran"


@pytest.mark.parametrize("n", [40, 1000, 40017, 70001, 131079])
@pytest.mark.parametrize("betas", [(0.9, 0.0), (0.0, 0.0)], ids=str)
def test_lion_zero_beta_mirrors_torchs_lerp_forms(
    ran: list[int], n: int, betas: tuple[float, float]
) -> None:
    """With a beta of 0, torch's lerp writes -0 or +0 by the element's place in its thread
    split (vector loop or scalar tail); the native pass must write the same zeros, at any
    thread count (here 1 to 4: 131,079 elements make 4 parts)."""
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 3, 4):
            torch.set_num_threads(threads)
            out = []
            for impl in ("foreach", "auto"):
                gen = torch.Generator().manual_seed(n)
                masters = {"w": torch.randn(n, generator=gen)}
                opt = mpfunc.lion(lr=1e-2, betas=betas, impl=impl)
                state = opt.init(masters)
                state.exp_avg["w"].copy_(torch.randn(n, generator=gen))
                grads = {"w": torch.full((n,), -0.0)}
                out.append(mpfunc.apply_update_(masters, grads, state, opt))
            assert_trees_bits_equal(out[1], out[0])
    finally:
        torch.set_num_threads(before)
    assert ran == ([1, 1, 1, 1] if _serves("lion", betas) else [])


@pytest.mark.parametrize("name", ["sgd", "sgd-momentum", "lion"])
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("state_dtype", STATE_DTYPES, ids=str)
def test_every_pair_takes_the_native_pass(
    ran: list[int], name: str, strategy: str, state_dtype: Any
) -> None:
    params = {"w": torch.randn(64, 48).bfloat16(), "b": torch.randn(40).bfloat16()}
    masters = mpfunc.init_master(params, strategy=strategy)
    if name == "lion":
        opt = mpfunc.lion(lr=1e-3, state_dtype=state_dtype)
    else:
        opt = mpfunc.sgd(lr=1e-3, momentum=0.9 if name != "sgd" else 0.0, state_dtype=state_dtype)
    state = opt.init(masters)
    grads = {k: torch.randn_like(v) for k, v in params.items()}
    kw: dict[str, Any] = {"params": params} if strategy == "fp32" else {}
    mpfunc.apply_update_(masters, grads, state, opt, **kw)
    assert ran == ([2] if _serves(name.removesuffix("-momentum")) else [])


def test_sgd_fp32_equals_torch_optim_sgd(ran: list[int], threads: int) -> None:
    """The native pass on fp32 masters and grads is torch.optim.SGD(foreach=True) bit for
    bit (momentum, dampening, weight decay; Nesterov), tails of every length included."""
    shapes = [(7,), (1000,), (40017,), (33, 5)]
    for kw in (
        dict(momentum=0.9, dampening=0.3, weight_decay=0.1),
        dict(momentum=0.9, nesterov=True, weight_decay=0.01, maximize=True),
    ):
        gen = torch.Generator().manual_seed(1)
        ws = [torch.randn(s, generator=gen) for s in shapes]
        ref = [w.clone().requires_grad_() for w in ws]
        torch_opt = torch.optim.SGD(ref, lr=0.05, foreach=True, **kw)  # type: ignore[arg-type]
        masters = {str(i): w.clone() for i, w in enumerate(ws)}
        opt = mpfunc.sgd(lr=0.05, **kw)  # type: ignore[arg-type]
        state = opt.init(masters)
        for _ in range(3):
            gs = [torch.randn(s, generator=gen) for s in shapes]
            for r, g in zip(ref, gs):
                r.grad = g.clone()
            torch_opt.step()
            grads = {str(i): g for i, g in enumerate(gs)}
            masters, state = mpfunc.apply_update_(masters, grads, state, opt)
        assert_trees_bits_equal({str(i): r.detach() for i, r in enumerate(ref)}, masters)
    assert bool(ran) == _serves("sgd")


def test_native_rule_refuses_a_wrong_call_before_writing(native: Any) -> None:
    p = torch.randn(64).bfloat16()
    r = torch.zeros(64, dtype=torch.int16)
    t = torch.zeros(8, dtype=torch.uint8)
    g = torch.randn(64).bfloat16()
    m = torch.zeros(64)
    step = torch.zeros(())
    before = snapshot([p, r, t, m, step])
    # The entry's arguments after the tensor lists, in order.
    args = dict(
        lr=1e-3,
        lr_tensor=None,
        a=0.9,
        b=0.99,
        weight_decay=0.0,
        nesterov=False,
        maximize=False,
        grad_scale=None,
        found_inf=None,
    )
    with pytest.raises(ValueError, match=r"remainder"):  # a remainder of another shape
        native.step_rule_(1, 1, 0, [p], [r[:32], t], [g], [[m]], [], [step], [], *args.values())
    with pytest.raises(ValueError, match=r"expected tie bits of shape"):  # tie bits too short
        native.step_rule_(1, 1, 0, [p], [r, t[:7]], [g], [[m]], [], [step], [], *args.values())
    with pytest.raises(TypeError, match=r"at \[0\]"):  # an fp32 param for "remainder"
        native.step_rule_(1, 1, 0, [p.float()], [r, t], [g], [[m]], [], [step], [], *args.values())
    with pytest.raises(ValueError, match=r"one state field"):  # Lion without its moment
        native.step_rule_(1, 1, 0, [p], [r, t], [g], [], [], [step], [], *args.values())
    assert_unchanged([p, r, t, m, step], before)


def test_sgd_dampening_follows_each_leafs_own_step_count(ran: list[int]) -> None:
    """A leaf without a grad at one step keeps its count; dampening's first-step
    coefficient is then 1 for it and 1 - dampening for the others, in one native call."""
    out = []
    for impl in ("foreach", "auto"):
        gen = torch.Generator().manual_seed(5)
        masters = {"a": torch.randn(100, generator=gen), "b": torch.randn(37, generator=gen)}
        opt = mpfunc.sgd(lr=0.1, momentum=0.9, dampening=0.3, impl=impl)
        state = opt.init(masters)
        for holes in (("b",), ()):
            grads: dict[str, Any] = {
                k: None if k in holes else torch.randn(v.shape, generator=gen)
                for k, v in masters.items()
            }
            masters, state = mpfunc.apply_update_(masters, grads, state, opt)
        out.append((masters, state))
    assert_trees_bits_equal(out[1], out[0])
    assert float(out[1][1].step["a"]) == 2 and float(out[1][1].step["b"]) == 1
    assert not _serves("sgd") or ran[-1] == 2


def test_the_probe_agrees_here_and_a_disagreeing_torch_keeps_the_torch_path(
    ran: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``_native.serves`` runs the native pass and torch's foreach ops on probe leaves once
    per process; on this torch they agree. Where they would not, SGD and Lion take the
    torch path (and Adam's native pass is unaffected)."""
    assert _serves("sgd") and _serves("lion") and _serves("lion", (0.0, 0.0))
    monkeypatch.setattr(_native, "_serving", {})
    monkeypatch.setattr(_native, "_rule_probe", lambda kernel, zero_beta: False)
    with _cache.memo_off():
        for opt in (mpfunc.sgd(lr=0.1, momentum=0.9), mpfunc.lion(lr=0.1)):
            masters = {"w": torch.randn(100)}
            state = opt.init(masters)
            mpfunc.apply_update_(masters, {"w": torch.randn(100)}, state, opt)
    assert ran == []
    assert not _serves("sgd") and _native.serves(_adam._native_kernel, None)

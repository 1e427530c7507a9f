"""One tensor under two names (tied weights, views, detached copies, expanded XLA
tensors) is refused naming both paths; tied ``named_parameters`` train once, as
torch.optim does; int buffers and adjacent views are not aliases. ``apply_update_``
sweeps its masters, params, grads and state for aliases once per call."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from support.hardening import _SHARED, BF16, F32, B, W, _alias, _at, _rand, _windows
from support.helpers import assert_unchanged, settle, snapshot

import mpfunc
from mpfunc.core import _cache, _checks

# torch warns once per process that CSR support is in beta; these tests only hand CSR
# tensors to functions that must refuse them.
pytestmark = pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta:UserWarning")


@pytest.mark.parametrize("fn", [mpfunc.init_master, mpfunc.init_grads])
def test_tied_weights_listed_twice_are_refused(device: torch.device, fn: Any) -> None:
    w = _rand(W, BF16, device=device)
    params = {"emb": w, "head": w, "norm": _rand(B, F32, device=device)}
    with pytest.raises(ValueError, match=_alias(fn.__name__, "params.emb", "params.head")):
        fn(params)


@pytest.mark.parametrize("fn", [mpfunc.init_master, mpfunc.init_grads])
def test_a_leaf_viewing_another_is_refused(device: torch.device, fn: Any) -> None:
    base = _rand(W, BF16, device=device)
    params = {"a": base, "b": base[1]}  # row 1 of a: one storage under two names
    with pytest.raises(ValueError, match=_alias(fn.__name__, "params.a", "params.b")):
        fn(params)


@pytest.mark.parametrize("how", ["detach", "data"])
def test_a_leaf_detached_from_another_is_refused(device: torch.device, how: str) -> None:
    """``p.detach()`` and ``p.data`` are no views (``_base`` is None) yet share ``p``'s
    memory: a second name for ``p`` all the same."""
    p = _rand(W, BF16, device=device)
    params = {"a": p, "b": p.detach() if how == "detach" else p.data}
    with pytest.raises(ValueError, match=_alias("init_master", "params.a", "params.b")):
        mpfunc.init_master(params)


@pytest.mark.parametrize("how", ["view", "detach"])
def test_params_sharing_memory_are_refused_by_masters_to_model_(
    device: torch.device, how: str
) -> None:
    # Unchecked, p ends as a mix of both masters: one name's write is lost.
    p = torch.zeros(W, dtype=BF16, device=device)
    params = {"a": p, "b": p[1] if how == "view" else p.detach()}
    shape = B if how == "view" else W
    masters = {"a": torch.ones(W, device=device), "b": torch.full(shape, 2.0, device=device)}
    with pytest.raises(ValueError, match=_alias("masters_to_model_", "params.a", "params.b")):
        mpfunc.masters_to_model_(masters, params)


@pytest.mark.xla
@pytest.mark.parametrize("source", ["fresh", "row-of-another"])
@pytest.mark.parametrize("which", ["masters_to_model_", "apply_update_"])
def test_xla_expanded_written_tensors_are_refused(
    xla_device: torch.device, which: str, source: str
) -> None:
    """XLA reports an expanded tensor's strides as contiguous; writing one element by
    element once summed every row's result into one buffer, silently."""
    d = xla_device
    if source == "fresh":
        expanded = torch.zeros(B, device=d).expand(W)
    else:
        expanded = torch.zeros(W, device=d)[0].expand(W)
    if which == "masters_to_model_":
        run = partial(mpfunc.masters_to_model_, {"p": _rand(W, device=d)}, {"p": expanded})
        path = "params.p"
    else:
        opt = mpfunc.sgd(lr=0.1)
        m = {"p": expanded}
        run = partial(mpfunc.apply_update_, m, {"p": _rand(W, device=d)}, opt.init(m), opt)
        path = "masters.p"
    with pytest.raises(ValueError, match=_at(which, path, _SHARED)):
        run()


class _Tied(torch.nn.Module):
    """An embedding whose output layer shares its weight (GPT-2 style)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(2, 3)  # weight shape W
        self.head = torch.nn.Linear(3, 2, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.emb(x))
        return out


def test_tied_model_named_parameters_trains_once_like_torch_optim(device: torch.device) -> None:
    """``dict(model.named_parameters())`` lists a tied weight once: it gets one master, the
    summed grad, and the same trajectory as torch.optim.AdamW on a copy of the model."""
    import copy

    torch.manual_seed(0)
    ref = _Tied()
    model = copy.deepcopy(ref).to(device)
    model.head.weight = model.emb.weight  # .to(xla) makes new Parameters: tie again, as HF does
    params = dict(model.named_parameters())
    assert sorted(params) == ["emb.weight"]
    masters = mpfunc.init_master(params)
    opt = mpfunc.adamw(lr=0.1, weight_decay=0.1)
    state = opt.init(masters)
    torch_opt = torch.optim.AdamW(ref.parameters(), lr=0.1, weight_decay=0.1, foreach=False)
    x = torch.tensor([0, 1, 1])
    for _ in range(3):
        model(x.to(device)).square().mean().backward()
        g32 = mpfunc.grads_to_fp32({n: p.grad for n, p in params.items()})
        mpfunc.apply_update_(masters, g32, state, opt)
        mpfunc.masters_to_model_(masters, params)
        model.zero_grad(set_to_none=True)
        ref(x).square().mean().backward()
        torch_opt.step()
        torch_opt.zero_grad(set_to_none=True)
    settle(params["emb.weight"])
    got = model.head.weight.detach().cpu()
    assert torch.equal(got, model.emb.weight.detach().cpu())  # still tied
    torch.testing.assert_close(got, ref.emb.weight.detach(), rtol=1e-5, atol=1e-6)


def test_int_buffers_may_share_memory(device: torch.device) -> None:
    """Non-floating leaves get no master and are never written: sharing is harmless."""
    buf = torch.arange(6, device=device).reshape(W)
    params = {"buf": buf, "row": buf[1], "w": _rand(W, BF16, device=device)}
    masters = mpfunc.init_master(params)
    assert masters["buf"] is None and masters["row"] is None
    assert mpfunc.init_grads(params)["row"] is None
    opt = mpfunc.adamw(lr=0.1)
    state = opt.init(masters)
    g32 = mpfunc.grads_to_fp32({"buf": None, "row": None, "w": _rand(W, BF16, 3, device)})
    mpfunc.apply_update_(masters, g32, state, opt)
    mpfunc.masters_to_model_(masters, params)
    settle(buf)
    assert torch.equal(buf.cpu(), torch.arange(6).reshape(W))
    assert torch.equal(params["w"].cpu(), masters["w"].cpu().to(BF16))


def test_adjacent_views_of_one_buffer_are_not_aliases() -> None:
    """Memory ranges are compared: views of one buffer that touch but share no element are
    two tensors, in every function that checks aliasing."""
    a, b = _windows(6)
    mpfunc.init_master({"a": a, "b": b})
    masters = {"a": a, "b": b}
    opt = mpfunc.adamw(lr=0.1)
    grads = {"a": _rand(W, seed=1), "b": _rand(W, seed=2)}
    mpfunc.apply_update_(masters, grads, opt.init(masters), opt)
    params = {"a": torch.zeros(W, dtype=BF16), "b": torch.zeros(W, dtype=BF16)}
    mpfunc.masters_to_model_(masters, params)
    assert torch.equal(params["b"], b.to(BF16))


@pytest.mark.parametrize("strategy", ["fp32", "remainder"])
def test_interleaved_views_sharing_no_element_train_as_separate_tensors(strategy: str) -> None:
    """Columns of one buffer (``x[:, 0]``, ``x[:, 1]``: byte ranges that interleave, no
    element in common) were refused as "one tensor under two names". Elements are compared
    where ranges overlap: they train as two clones would, bit for bit; views that do share
    elements (overlapping column pairs), or a strided view over a dense one, are still
    refused, naming both."""
    base = _rand((8, 3), BF16, seed=5)
    views = {"a": base[:, 0], "b": base[:, 1], "c": base[:, 2]}
    clones = {k: v.clone() for k, v in views.items()}
    runs = []
    for params in (views, clones):
        masters = mpfunc.init_master(params, strategy=strategy)
        opt = mpfunc.adamw(lr=0.1)
        state = opt.init(masters)
        grads = {k: _rand((8,), seed=i) for i, k in enumerate(params)}
        mpfunc.apply_update_(masters, grads, state, opt, params=params)
        mpfunc.masters_to_model_(masters, params)
        runs.append({k: v.clone() for k, v in params.items()})
    for k in views:
        assert torch.equal(runs[0][k], runs[1][k])
    snap = snapshot([base])
    for params in (
        {"a": base[:, 0:2], "b": base[:, 1:3]},  # column 1 in both
        {"a": base[2], "b": base[:, 1]},  # a row and a column cross at [2, 1]
    ):
        with pytest.raises(ValueError, match=r"at 'params\.[ab]': .*shares no memory with "
                                             r"'params\.[ab]'"):  # fmt: skip
            mpfunc.init_master(params)
    assert_unchanged([base], snap)


# --- apply_update_: one alias sweep per call, over masters, params, grads and state ----------


def _aliasable(t: torch.Tensor, how: str) -> torch.Tensor:
    """``t`` under a second name: itself, a view of all of it, or ``.detach()``."""
    return {"same": t, "view": t[:], "detach": t.detach()}[how]


def _step_inputs(device: torch.device, state_dtype: torch.dtype, labels: bool) -> dict[str, Any]:
    """bf16 params and grads, their fp32 masters, AdamW (one label per leaf, with
    ``labels``: each leaf's state in its own sub-state) and its state."""
    params = {"a": _rand(W, BF16, 1, device), "z": _rand(W, BF16, 2, device)}
    adamw = mpfunc.adamw(lr=0.1, state_dtype=state_dtype)
    opt = mpfunc.partition({"a": adamw, "z": adamw}, lambda path, m: path) if labels else adamw
    masters = mpfunc.init_master(params)
    grads = {"a": _rand(W, BF16, 3, device), "z": _rand(W, BF16, 4, device)}
    state = opt.init(masters)
    return dict(params=params, masters=masters, grads=grads, opt=opt, state=state, labels=labels)


def _moments(t: dict[str, Any], leaf: str) -> tuple[Any, str]:
    """The state that holds ``leaf``'s moments (its label's, in a partition) and its name."""
    if t["labels"]:
        return t["state"][leaf], f"state[{leaf!r}]"
    return t["state"], "state"


def _set_moment(t: dict[str, Any], leaf: str, field: str, value: torch.Tensor) -> None:
    sub, _ = _moments(t, leaf)
    new = sub._replace(**{field: {**getattr(sub, field), leaf: value}})
    t["state"] = {**t["state"], leaf: new} if t["labels"] else new


def _moment(t: dict[str, Any], leaf: str, field: str) -> torch.Tensor:
    return getattr(_moments(t, leaf)[0], field)[leaf]  # type: ignore[no-any-return]


def _state_path(t: dict[str, Any], leaf: str, field: str) -> str:
    return f"{_moments(t, leaf)[1]}.{field}.{leaf}"


# Each pair of the step's trees that may not share memory where one is written:
# name -> (state dtype, the change that makes the second name, the two paths named).
ALIASES: dict[str, tuple[torch.dtype, Callable[[dict[str, Any], str], tuple[str, str]]]] = {}


def _alias_case(name: str, state_dtype: torch.dtype = F32) -> Any:
    def register(change: Callable[[dict[str, Any], str], tuple[str, str]]) -> Any:
        ALIASES[name] = (state_dtype, change)
        return change

    return register


@_alias_case("master-grad")
def _master_grad(t: dict[str, Any], how: str) -> tuple[str, str]:
    t["grads"] = {**t["grads"], "z": _aliasable(t["masters"]["z"], how)}
    return "masters.z", "grads.z"


@_alias_case("master-model")
def _master_model(t: dict[str, Any], how: str) -> tuple[str, str]:
    t["params"] = {**t["params"], "z": _aliasable(t["masters"]["z"], how)}
    return "masters.z", "params.z"


@_alias_case("model-grad")
def _model_grad(t: dict[str, Any], how: str) -> tuple[str, str]:
    t["grads"] = {**t["grads"], "z": _aliasable(t["params"]["z"], how)}
    return "params.z", "grads.z"


@_alias_case("state-master")
def _state_master(t: dict[str, Any], how: str) -> tuple[str, str]:
    _set_moment(t, "z", "exp_avg", _aliasable(t["masters"]["z"], how))
    return "masters.z", _state_path(t, "z", "exp_avg")


@_alias_case("state-grad", BF16)
def _state_grad(t: dict[str, Any], how: str) -> tuple[str, str]:
    _set_moment(t, "z", "exp_avg", _aliasable(t["grads"]["z"], how))
    return "grads.z", _state_path(t, "z", "exp_avg")


@_alias_case("state-model", BF16)
def _state_model(t: dict[str, Any], how: str) -> tuple[str, str]:
    _set_moment(t, "z", "exp_avg", _aliasable(t["params"]["z"], how))
    return "params.z", _state_path(t, "z", "exp_avg")


@_alias_case("state-state-fields")
def _state_fields(t: dict[str, Any], how: str) -> tuple[str, str]:
    _set_moment(t, "z", "exp_avg_sq", _aliasable(_moment(t, "z", "exp_avg"), how))
    return _state_path(t, "z", "exp_avg"), _state_path(t, "z", "exp_avg_sq")


@_alias_case("state-state-leaves")
def _state_leaves(t: dict[str, Any], how: str) -> tuple[str, str]:
    # In a partition, across labels: each sub-plan alone would find nothing.
    _set_moment(t, "a", "exp_avg", _aliasable(_moment(t, "z", "exp_avg"), how))
    return _state_path(t, "a", "exp_avg"), _state_path(t, "z", "exp_avg")


def _update(t: dict[str, Any]) -> None:
    mpfunc.apply_update_(t["masters"], t["grads"], t["state"], t["opt"], params=t["params"])


@pytest.mark.parametrize("combo", sorted(ALIASES))
@settings(max_examples=4)
@given(
    how=st.sampled_from(["same", "view", "detach"]),
    labels=st.booleans(),
    remembered=st.booleans(),
)
def test_every_aliasing_pair_of_a_step_is_refused_before_any_write(
    device: torch.device, combo: str, how: str, labels: bool, remembered: bool
) -> None:
    """Masters, params, grads and state: any two sharing memory where one is written
    (the same tensor, a view, ``.detach()``; in one state field, across fields, across a
    partition's labels) are refused by the step's one memory check, naming both paths,
    with every tensor's bits and ``_version`` as they were; also after identical steps
    were remembered (the new name changes the memo key), and again on the same call
    (checks that passed before the sweep refused it are not remembered)."""
    state_dtype, change = ALIASES[combo]
    t = _step_inputs(device, state_dtype, labels)
    if remembered:
        _update(t)
        _update(t)
    paths = change(t, how)
    trees = {k: t[k] for k in ("params", "masters", "grads", "state")}
    snap = snapshot(trees)
    for _ in range(2):  # a refused call is not remembered: the same call is refused again
        with pytest.raises(ValueError, match=_alias("apply_update_", *paths)):
            _update(t)
        assert_unchanged(trees, snap)


def _count_sweeps(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Records each alias sweep: every outermost call of ``check_no_alias`` or
    ``check_memory`` (whose full path calls ``check_no_alias``: one sweep)."""
    sweeps: list[str] = []
    depth = [0]
    for name in ("check_no_alias", "check_memory"):
        real = getattr(_checks, name)

        def spy(*args: Any, _real: Callable[..., Any] = real, _n: str = name, **kw: Any) -> Any:
            if depth[0] == 0:
                sweeps.append(_n)
            depth[0] += 1
            try:
                return _real(*args, **kw)
            finally:
                depth[0] -= 1

        monkeypatch.setattr(_checks, name, spy)
    return sweeps


def _sweep_case(kind: str, device: torch.device) -> Callable[[], Any]:
    """One step's call for each kind of optimizer and master: its state plain, in units
    (8-bit moments of "remainder" masters), in a partition's labels, or none at all."""
    params = {"a": _rand((4, 16), BF16, 1, device), "z": _rand((4, 16), BF16, 2, device)}
    grads = {"a": _rand((4, 16), BF16, 3, device), "z": _rand((4, 16), BF16, 4, device)}
    if kind == "adamw":
        masters = mpfunc.init_master(params)
        opt = mpfunc.adamw(lr=0.1)
    elif kind == "remainder-uint8":
        masters = mpfunc.init_master(params, strategy="remainder")
        opt = mpfunc.adamw(lr=0.1, state_dtype=torch.uint8)
    elif kind == "partition":
        masters = mpfunc.init_master(params)
        labels = {"a": "decay", "z": "momentum"}
        opt = mpfunc.partition(
            {"decay": mpfunc.adamw(lr=0.1, weight_decay=0.1), "momentum": mpfunc.sgd(0.1, 0.9)},
            labels,
        )
    else:  # torch_optimizer: a state of no tensors, fp32 grads
        masters = mpfunc.init_master(params)
        opt = mpfunc.torch_optimizer(torch.optim.RMSprop, lr=0.1)
        grads = mpfunc.grads_to_fp32(grads)
    state = opt.init(masters)
    if kind in ("adamw", "partition"):
        return lambda: mpfunc.apply_update_(masters, grads, state, opt, params=params)
    return lambda: mpfunc.apply_update_(masters, grads, state, opt)


@pytest.mark.parametrize("kind", ["adamw", "remainder-uint8", "partition", "torch_optimizer"])
def test_apply_update_sweeps_for_aliases_once_per_call(
    device: torch.device, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One alias sweep on a call checked in full (every first call; every call on XLA,
    which has no memo), over masters, params, grads and every state at once; none on a
    remembered call; one again when only the state is new (its plan is not remembered)."""
    step = _sweep_case(kind, device)
    sweeps = _count_sweeps(monkeypatch)
    per_call = []
    for _ in range(3):
        sweeps.clear()
        step()
        per_call.append(len(sweeps))
    remembered = 1 if device.type == "xla" else 0
    assert per_call == [1, remembered, remembered], (per_call, sweeps)
    with _cache.memo_off():
        sweeps.clear()
        step()
        assert len(sweeps) == 1, sweeps


def test_a_new_state_on_remembered_trees_is_swept_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The step's trees remembered, its state new: the plan checks the state in full and the
    one sweep covers it with everything else (a moment made the master's is refused)."""
    t = _step_inputs(torch.device("cpu"), F32, labels=False)
    _update(t)
    _update(t)
    sweeps = _count_sweeps(monkeypatch)
    t["state"] = t["opt"].init(t["masters"])
    _update(t)
    assert len(sweeps) == 1, sweeps
    _set_moment(t, "a", "exp_avg", t["masters"]["a"])
    trees = {k: t[k] for k in ("params", "masters", "grads", "state")}
    snap = snapshot(trees)
    with pytest.raises(ValueError, match=_alias("apply_update_", "masters.a", "state.exp_avg.a")):
        _update(t)
    assert_unchanged(trees, snap)
    assert len(sweeps) == 2, sweeps


def test_the_hint_fits_the_aliasing() -> None:
    """Tied params are "trained twice"; a tensor given to two trees of a call (a grad that
    is its own output, a master or a moment) or twice within an output tree is told
    what it is (both said "trained twice ... untie the weights")."""
    p = {"w": torch.randn(4, 8).to(BF16)}
    m = mpfunc.init_master(p)
    opt = mpfunc.adamw()
    s = opt.init(m)
    g32 = {"w": torch.randn(4, 8)}
    twice = {"a": torch.zeros(8), "b": None}
    twice["b"] = twice["a"][:4]
    x = torch.zeros(8, dtype=BF16)
    cases: list[tuple[Callable[[], Any], str]] = [
        (lambda: mpfunc.grads_to_fp32_(g32, g32), r"at 'grads\.w'.*shares no memory with "
         r"'out\.w'.*A write through one would change the other mid-call: pass grads and out "
         r"that share no memory \(clone one\)$"),
        (lambda: mpfunc.apply_update_(m, {"w": s.exp_avg["w"]}, s, opt), r"at 'grads\.w'.*"
         r"'state\.exp_avg\.w'.*pass grads and state\.exp_avg that share no memory"),
        (lambda: mpfunc.grads_to_fp32_({"a": x, "b": x[:4]}, twice), r"at 'out\.a'.*"
         r"'out\.b'.*written twice: give each leaf its own$"),
        (lambda: mpfunc.init_master({"a": x, "b": x[:4]}), r"at 'params\.a'.*'params\.b'.*"
         r"trained twice and one update lost.*untie the weights$"),
    ]  # fmt: skip
    for call, match in cases:
        snap = snapshot([p, m, s, g32, twice])
        with pytest.raises(ValueError, match=match):
            call()
        assert_unchanged([p, m, s, g32, twice], snap)

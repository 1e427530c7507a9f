"""The step inside backward (``MasterOptimizer(step_in_backward=True)``, ``step_in_backward``)
against the ordinary step after the backward: masters, params and state bit for bit, for
every strategy, state format and optimizer; None grads, tied params, a scheduler, resume;
the refusals; hooks removed; live grad bytes during backward; one XLA graph per step."""

from __future__ import annotations

import copy
import functools
import gc
import warnings
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from support.hardening import _alias
from support.helpers import assert_bits_equal, assert_unchanged, snapshot, state_tensors

import mpfunc
from mpfunc.transforms import _step_in_backward

STRATEGIES = ["fp32", "remainder", "kahan", "stochastic", "none"]
STATE_DTYPES = [torch.float32, torch.bfloat16, torch.uint8]
FACTORIES: dict[str, Any] = {
    "adam": functools.partial(mpfunc.adam, amsgrad=True, weight_decay=1e-3),
    "adamw": functools.partial(mpfunc.adamw, weight_decay=0.1),
    "sgd": functools.partial(mpfunc.sgd, momentum=0.9, nesterov=True, weight_decay=1e-3),
    "lion": functools.partial(mpfunc.lion, weight_decay=0.1),
}


class Net(torch.nn.Module):
    """A tied embedding/head, a column-major weight, a layer that never gets a grad, and
    (unless every leaf must hold an 8-bit block) a 0-d scale. Every other leaf >= 32 elements."""

    def __init__(self, scalar: bool) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(16, 32)
        self.lin = torch.nn.Linear(32, 32)
        self.lin2 = torch.nn.Linear(32, 32, bias=False)
        self.unused = torch.nn.Linear(32, 32, bias=False)
        self.scale = torch.nn.Parameter(torch.tensor(0.5)) if scalar else None
        with torch.no_grad():
            self.lin2.weight.data = self.lin2.weight.data.t().contiguous().t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.lin(self.emb(x)))
        h = self.lin2(h) + h
        if self.scale is not None:
            h = h * self.scale
        return h @ self.emb.weight.t()  # tied: the embedding is the head too


@pytest.fixture(autouse=True)
def _no_hooks_left_behind() -> Any:
    """Hooks a test leaves registered (a functional handle keeps stepping until removed)
    must not reach later tests: a live handle that stepped makes an all-None clip refuse."""
    yield
    for hooks in list(_step_in_backward._LIVE):
        hooks.remove()


def make_net(scalar: bool = True, device: torch.device | str = "cpu") -> Net:
    torch.manual_seed(0)
    return Net(scalar).to(torch.bfloat16).to(device)


def batch(k: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + k)
    x = torch.randint(0, 16, (4, 6), generator=gen)
    return x.to(device), torch.randint(0, 16, (4, 6), generator=gen).to(device)


def loss_of(net: Net, k: int, device: torch.device | str = "cpu") -> torch.Tensor:
    x, y = batch(k, device)
    return torch.nn.functional.cross_entropy(net(x).float().reshape(-1, 16), y.reshape(-1))


def train(sib: bool, strategy: str, sd: torch.dtype, name: str, steps: int = 3) -> tuple[Any, Any]:
    net = make_net(scalar=sd != torch.uint8)
    factory = functools.partial(FACTORIES[name], state_dtype=sd)
    opt = mpfunc.MasterOptimizer(
        net.parameters(), factory, strategy=strategy, step_in_backward=sib, lr=1e-2
    )
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    for k in range(steps):
        loss_of(net, k).backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    assert net.unused.weight.grad is None
    return [p.detach().clone() for p in net.parameters()], state_tensors(opt)


def assert_all_bits(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        if x.is_floating_point():
            assert_bits_equal(x, y)
        else:  # 8-bit codes, step counts as ints, RNG keys
            assert x.dtype == y.dtype and torch.equal(x.cpu(), y.cpu())


@pytest.mark.parametrize("name", sorted(FACTORIES))
@pytest.mark.parametrize("sd", STATE_DTYPES, ids=str)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_optimizer_matches_ordinary_step(strategy: str, sd: torch.dtype, name: str) -> None:
    """Params and every state tensor (masters, moments, counts, keys) bit for bit, over three
    steps with a scheduler; the unused layer never steps; the tied weight steps once."""
    p0, s0 = train(False, strategy, sd, name)
    p1, s1 = train(True, strategy, sd, name)
    assert_all_bits(p0, p1)
    assert_all_bits(s0, s1)


def test_none_grad_param_does_not_step() -> None:
    net = make_net()
    opt = mpfunc.MasterOptimizer(net.parameters(), step_in_backward=True, lr=1e-2)
    before = net.unused.weight.detach().clone()
    loss_of(net, 0).backward()
    opt.step()
    assert torch.equal(net.unused.weight, before)
    assert float(opt.state[net.unused.weight]["step"]) == 0.0
    assert float(opt.state[net.lin.weight]["step"]) == 1.0
    assert float(opt.state[net.emb.weight]["step"]) == 1.0  # tied: one step, both uses


def test_resume_is_bit_exact() -> None:
    """Two steps, state_dict, a fresh model and optimizer loading it, two more steps: the
    same as four ordinary steps."""
    ref = make_net()
    ro = mpfunc.MasterOptimizer(ref.parameters(), strategy="kahan", lr=1e-2)
    for k in range(4):
        loss_of(ref, k).backward()
        ro.step()
        ro.zero_grad()
    net = make_net()
    opt = mpfunc.MasterOptimizer(net.parameters(), strategy="kahan", step_in_backward=True, lr=1e-2)
    for k in range(2):
        loss_of(net, k).backward()
        opt.step()
    saved, model = opt.state_dict(), net.state_dict()
    opt.close()
    net2 = make_net()
    net2.load_state_dict(model)
    opt2 = mpfunc.MasterOptimizer(
        net2.parameters(), strategy="kahan", step_in_backward=True, lr=1e-2
    )
    opt2.load_state_dict(saved)
    for k in range(2, 4):
        loss_of(net2, k).backward()
        opt2.step()
    assert_all_bits([p.detach() for p in ref.parameters()], [p.detach() for p in net2.parameters()])
    assert_all_bits(state_tensors(ro), state_tensors(opt2))


# --- the functional form -----------------------------------------------------------------


def _functional(
    strategy: str, sd: torch.dtype, partitioned: bool, scale: Any, stats: bool, sib: bool
) -> tuple[list[torch.Tensor], Any]:
    net = make_net(scalar=False)
    params = dict(net.named_parameters())
    masters = mpfunc.init_master(params, strategy=strategy)
    # A float lr, a 0-d tensor lr, or a schedule of each leaf's step count.
    lr: Any = {"fp32": 1e-2, "stochastic": torch.tensor(1e-2)}.get(
        strategy, lambda t: 1e-2 * torch.pow(0.9, t)
    )
    opt: mpfunc.Optimizer = mpfunc.adamw(lr=lr, state_dtype=sd)
    if partitioned:
        opt = mpfunc.partition(
            {"a": opt, "b": mpfunc.sgd(lr=1e-2, momentum=0.5)},
            lambda path, p: "a" if "lin" in path else "b",
        )
    state = opt.init(masters)
    st_ = mpfunc.init_stats(masters) if stats else None
    handle = (
        mpfunc.step_in_backward(params, masters, state, opt, scale=scale, stats=st_)
        if sib
        else None
    )
    for k in range(3):
        loss = loss_of(net, k)
        if scale is not None:
            loss = loss * (scale.loss_scale if isinstance(scale, mpfunc.StaticLossScale) else scale)
        loss.backward()
        if handle is None:
            grads = {n: p.grad for n, p in params.items()}
            mpfunc.apply_update_(masters, grads, state, opt, params=params, scale=scale, stats=st_)
            for p in params.values():
                p.grad = None
        else:
            handle.end_step()
    if handle is not None:
        handle.remove()
    out = [t for t in _leaves((masters, state, st_)) if isinstance(t, torch.Tensor)]
    return [p.detach().clone() for p in params.values()], out


def _leaves(tree: Any) -> list[Any]:
    from mpfunc.core import _tree

    return _tree.flatten(tree)[0]


@pytest.mark.parametrize(
    ("strategy", "sd", "partitioned", "scale", "stats"),
    [
        ("fp32", torch.float32, False, None, False),
        ("stochastic", torch.uint8, False, 8.0, True),
        ("remainder", torch.bfloat16, True, None, True),
        ("kahan", torch.uint8, True, mpfunc.StaticLossScale(4.0), False),
    ],
)
def test_functional_matches_apply_update(
    strategy: str, sd: torch.dtype, partitioned: bool, scale: Any, stats: bool
) -> None:
    """One leaf at a time (elementwise optimizers) or over the whole tree with the other
    grads None (a partition): the bits of ``apply_update_`` after the backward."""
    p0, s0 = _functional(strategy, sd, partitioned, scale, stats, sib=False)
    p1, s1 = _functional(strategy, sd, partitioned, scale, stats, sib=True)
    assert_all_bits(p0, p1)
    assert_all_bits(s0, s1)


LAYOUTS = ["contiguous", "transposed", "channels_last", "sliced", "zero_d"]


def _param(layout: str, gen: torch.Generator) -> torch.Tensor:
    if layout == "transposed":
        t = torch.randn(5, 7, generator=gen).t()
    elif layout == "channels_last":
        t = torch.randn(2, 3, 4, 5, generator=gen).to(memory_format=torch.channels_last)
    elif layout == "sliced":
        t = torch.randn(6, 10, generator=gen)[:, ::2]
    elif layout == "zero_d":
        t = torch.randn((), generator=gen)
    else:
        t = torch.randn(4, 9, generator=gen)
    return t.to(torch.bfloat16).detach().requires_grad_()


@settings(max_examples=12)
@given(
    layouts=st.lists(st.sampled_from(LAYOUTS), min_size=1, max_size=4),
    used=st.lists(st.booleans(), min_size=4, max_size=4),
    strategy=st.sampled_from(STRATEGIES),
    sd=st.sampled_from([torch.float32, torch.bfloat16]),
    name=st.sampled_from(sorted(FACTORIES)),
    seed=st.integers(0, 2**16),
)
def test_functional_layouts_property(
    layouts: list[str], used: list[bool], strategy: str, sd: torch.dtype, name: str, seed: int
) -> None:
    """Drawn layouts, params that take no grad, every strategy and optimizer: the hooks give
    ``apply_update_``'s bits (params stepped in place, whatever their strides)."""
    if not any(used[: len(layouts)]):
        used = [True, *used[1:]]

    def run(sib: bool) -> list[torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        params = [_param(kind, gen) for kind in layouts]
        opt = functools.partial(FACTORIES[name], state_dtype=sd)(lr=1e-2)
        masters = mpfunc.init_master(params, strategy=strategy)
        state = opt.init(masters)
        handle = mpfunc.step_in_backward(params, masters, state, opt) if sib else None
        for k in range(2):
            g = torch.Generator().manual_seed(seed + k)
            loss = sum(
                (p.float() * torch.randn(p.shape, generator=g)).sum() ** 2
                for p, u in zip(params, used)
                if u
            )
            assert isinstance(loss, torch.Tensor)
            loss.backward()
            if handle is None:
                mpfunc.apply_update_(masters, [p.grad for p in params], state, opt, params=params)
                for p in params:
                    p.grad = None
            else:
                handle.end_step()
                assert all(p.grad is None for p in params)
        if handle is not None:
            handle.remove()
        return [p.detach().clone() for p in params] + [
            t for t in _leaves((masters, state)) if isinstance(t, torch.Tensor)
        ]

    assert_all_bits(run(False), run(True))


# --- refusals ------------------------------------------------------------------------------


def test_second_backward_is_refused_before_the_leaf_is_written_again() -> None:
    """Accumulation over two micro-batches (or a retain_graph backward) before step():
    the first hook of the second backward raises, the leaf keeps its one step."""
    net = make_net()
    opt = mpfunc.MasterOptimizer(net.parameters(), step_in_backward=True, lr=1e-2)
    loss_of(net, 0).backward()
    after_one = [p.detach().clone() for p in net.parameters()]
    counts = [float(s["step"]) for s in opt.state.values()]
    with pytest.raises(RuntimeError, match=r"second grad before the step ended.*opt.step"):
        loss_of(net, 1).backward()
    assert_all_bits(after_one, [p.detach() for p in net.parameters()])
    assert counts == [float(s["step"]) for s in opt.state.values()]
    opt.zero_grad()
    opt.step()  # ends the refused step; training goes on
    loss_of(net, 2).backward()
    opt.step()


def test_retain_graph_backward_is_refused() -> None:
    w = torch.randn(40, dtype=torch.bfloat16, requires_grad=True)
    masters = mpfunc.init_master([w])
    opt = mpfunc.adamw(lr=1e-2)
    state = opt.init(masters)
    handle = mpfunc.step_in_backward([w], masters, state, opt)
    loss = (w.float() * torch.arange(40.0)).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match=r"params.0 received a second grad.*handle.end_step\(\)"):
        loss.backward()
    handle.remove()


def test_dynamic_loss_scale_is_refused_up_front() -> None:
    net = make_net()
    params = list(net.parameters())
    masters = mpfunc.init_master(params)
    opt = mpfunc.adamw(lr=1e-2)
    with pytest.raises(TypeError, match=r"DynamicLossScale.*whole tree"):
        mpfunc.step_in_backward(
            params, masters, opt.init(masters), opt, scale=mpfunc.DynamicLossScale()
        )
    assert all(not p._post_accumulate_grad_hooks for p in params)


@pytest.mark.parametrize("strategy", ["fp32", "kahan"])
def test_aliasing_across_leaves_is_refused_up_front(strategy: str) -> None:
    """Each leaf steps alone, so no step's memory check sees two leaves: a moment of leaf
    ``b`` sharing leaf ``a``'s param (written by the step: the "fp32" master's param, or
    the param a "kahan" unit holds) is refused when the hooks are made, naming both
    paths, with no hook left and nothing written."""
    params = {k: torch.randn(4, 8).bfloat16().requires_grad_() for k in "ab"}
    masters = mpfunc.init_master(params, strategy=strategy)
    opt = mpfunc.adamw(lr=1e-2, state_dtype=torch.bfloat16)
    state = opt.init(masters)
    state = state._replace(exp_avg={**state.exp_avg, "b": params["a"].detach()})
    owner = "params.a" if strategy == "fp32" else "masters.a"
    trees = {"params": params, "masters": masters, "state": state}
    snap = snapshot(trees)
    with pytest.raises(ValueError, match=_alias("step_in_backward", owner, "state.exp_avg.b")):
        mpfunc.step_in_backward(params, masters, state, opt)
    assert all(not p._post_accumulate_grad_hooks for p in params.values())
    assert_unchanged(trees, snap)


def test_grad_scaler_is_refused() -> None:
    net = make_net()
    opt = mpfunc.MasterOptimizer(net.parameters(), step_in_backward=True, lr=1e-2)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(loss_of(net, 0)).backward()
    with pytest.raises(RuntimeError, match=r"GradScaler.*inf check spans every grad"):
        scaler.step(opt)


def test_skip_is_refused() -> None:
    net = make_net()
    opt = mpfunc.MasterOptimizer(net.parameters(), step_in_backward=True, lr=1e-2)
    loss_of(net, 0).backward()
    with pytest.raises(ValueError, match=r"skip: expected None.*before the backward"):
        opt.step(skip=torch.tensor(False))


@pytest.mark.parametrize("fn", [mpfunc.clip_by_global_norm, mpfunc.clip_by_global_norm_])
def test_global_norm_clip_is_refused(fn: Any) -> None:
    net = make_net()
    opt = mpfunc.MasterOptimizer(net.parameters(), step_in_backward=True, lr=1e-2)
    loss_of(net, 0).backward()
    with pytest.raises(ValueError, match=r"already stepped and freed them.*global-norm clip"):
        fn([p.grad for p in net.parameters()], 1.0)
    opt.step()
    fn([p.grad for p in net.parameters()], 1.0)  # no step pending: nothing freed, no error


_FREED = r"its grad was used and freed by the step inside backward"


def _consumed_run(functional: bool) -> tuple[Net, Any, Any]:
    """A net whose backward stepped every leaf inside backward (MasterOptimizer or the
    functional handle): ``(net, end, snapshot of params, masters and state)``."""
    net = make_net()
    params = [p for p in net.parameters()]
    if functional:
        masters = mpfunc.init_master(params)
        o = mpfunc.adamw(lr=1e-2)
        state = o.init(masters)
        handle = mpfunc.step_in_backward(params, masters, state, o)
        loss_of(net, 0).backward()
        return net, handle.end_step, (params, masters, state)
    opt = mpfunc.MasterOptimizer(params, step_in_backward=True, lr=1e-2)
    loss_of(net, 0).backward()
    return net, opt.step, (params, opt.state_dict())


_CLIPS = [
    lambda ps: torch.nn.utils.clip_grad_norm_(ps, 1.0),
    lambda ps: torch.nn.utils.clip_grad_norm_(ps, 1.0, foreach=False),
    lambda ps: torch.nn.utils.clip_grad_value_(ps, 0.1),
    lambda ps: torch.nn.utils.get_total_norm([p.grad for p in ps if p.grad is not None]),
]


@pytest.mark.parametrize("functional", [False, True], ids=["MasterOptimizer", "handle"])
@pytest.mark.parametrize(
    "clip",
    _CLIPS,
    ids=["clip_grad_norm_", "for-loop", "clip_grad_value_", "get_total_norm"],
)
def test_torch_clip_after_the_step_in_backward_is_refused(functional: bool, clip: Any) -> None:
    """torch's own clips over grads the step inside backward used: a clear error naming the
    param, not a clip of nothing (with None grads, clip_grad_norm_ returned 0 and clipped
    nothing, silently; HF's Trainer calls it by default). After the step ends the grads are
    None again and clip_grad_norm_ is the no-op it always was. (With torch_xla imported, as
    in this suite, clip_grad_norm_ is torch_xla's, which refuses foreach=True itself.)"""
    if clip is _CLIPS[3] and not hasattr(torch.nn.utils, "get_total_norm"):
        pytest.skip("torch.nn.utils.get_total_norm is new in torch 2.6")
    net, end, trees = _consumed_run(functional)
    params = list(net.parameters())
    assert all(isinstance(p.grad, mpfunc.ConsumedGrad) for p in params if p.grad is not None)
    snap = snapshot(trees)
    with pytest.raises(RuntimeError, match=_FREED + r".*clip_grad_norm_.*max_grad_norm=0"):
        clip(params)
    assert_unchanged(trees, snap)
    end()
    assert all(p.grad is None for p in params)
    if clip in _CLIPS[:2]:  # (torch's other two fail on a tree without grads)
        clip(params)  # the step ended: no grads, nothing to refuse


def test_consumed_grad_holds_no_memory_and_keeps_the_grads_metadata() -> None:
    net, end, _ = _consumed_run(False)
    w = net.lin.weight
    g = w.grad
    assert isinstance(g, mpfunc.ConsumedGrad)
    assert (g.shape, g.dtype, g.device) == (w.shape, w.dtype, w.device)
    assert "ConsumedGrad(param_groups[0]" in repr(g) and "freed" in repr(g)
    assert g.data_ptr() == 0  # no storage: the grad's memory is free
    assert isinstance(g.float(), mpfunc.ConsumedGrad)  # a conversion reads no values
    with pytest.raises(RuntimeError, match=_FREED):
        g.float().sum()
    with pytest.raises(RuntimeError, match=_FREED):
        g.clone()
    with pytest.raises(RuntimeError, match=_FREED):
        torch.save(g, "/dev/null")
    assert isinstance(g.detach(), mpfunc.ConsumedGrad)  # clip functions detach first
    hand = net.unused.weight  # a param without a grad in this backward gets one by hand
    hand.grad = torch.ones_like(hand)
    torch.optim.Optimizer.zero_grad(_Params([w, hand]), set_to_none=False)  # type: ignore[arg-type]
    torch.optim.Optimizer.zero_grad(_Params([w, hand], foreach=True), set_to_none=False)  # type: ignore[arg-type]
    assert isinstance(w.grad, mpfunc.ConsumedGrad) and not hand.grad.any()
    hand.grad = None
    end()
    assert w.grad is None


def test_consumed_grad_interfaces_that_bypass_dispatch_raise() -> None:
    """DLPack and the CUDA array interface reach the memory without __torch_dispatch__: a
    consumer would read memory the grad does not hold (numpy read garbage; a round trip
    through to_dlpack crashed). They raise like every other read."""
    np = pytest.importorskip("numpy")
    net, end, _ = _consumed_run(False)
    g = net.lin.weight.grad
    for read in (
        lambda: np.from_dlpack(g),
        lambda: torch.from_dlpack(g),
        lambda: g.__dlpack__(),
        lambda: g.__cuda_array_interface__,
        lambda: np.asarray(g),
        lambda: g.tolist(),  # torch's own refusal named no param
        lambda: g.numpy(),
    ):
        with pytest.raises(RuntimeError, match=_FREED):
            read()
    end()


def test_consumed_grad_follows_the_params_layout_conversion_and_copies() -> None:
    """Habits between the backward and the step that read no grad values keep working:
    model.to(dtype) converts each grad (here a marker of the new dtype), deepcopy of plain
    tensors gives the copies no grad, and the marker has the param's strides."""
    net, end, _ = _consumed_run(False)
    lin2 = net.lin2.weight  # column-major
    assert lin2.grad.stride() == lin2.stride() != lin2.contiguous().stride()
    net.to(torch.float32)
    assert isinstance(net.lin.weight.grad, mpfunc.ConsumedGrad)
    assert net.lin.weight.grad.dtype == torch.float32
    end()
    assert net.lin.weight.grad is None
    w = torch.randn(40, dtype=torch.bfloat16, requires_grad=True)
    masters = mpfunc.init_master([w])
    o = mpfunc.adamw(lr=1e-2)
    with mpfunc.step_in_backward([w], masters, o.init(masters), o) as handle:
        (w.float() ** 2).sum().backward()
        (copy_w,) = copy.deepcopy([w])
        assert copy_w.grad is None and torch.equal(copy_w, w)
        handle.end_step()


def test_a_step_left_open_after_an_error_says_so() -> None:
    """A refused clip between the backward and opt.step() leaves the step open (its leaves
    stepped); model.zero_grad() does not end it. The next backward's error says to call
    opt.step(), which ends it, and training goes on. A new optimizer over those params
    before then is refused with the same advice."""
    net, end, _ = _consumed_run(False)
    with pytest.raises(RuntimeError, match=_FREED + r".*This step's updates are already"):
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
    with pytest.raises(ValueError, match=r"has not ended.*call opt.step\(\)"):
        mpfunc.MasterOptimizer(net.parameters(), step_in_backward=True, lr=1e-2)
    net.zero_grad()
    with pytest.raises(RuntimeError, match=r"after every backward, also after an error"):
        loss_of(net, 1).backward()
    end()
    net.zero_grad()
    loss_of(net, 1).backward()
    end()


class _Params:
    """The least torch.optim.Optimizer.zero_grad reads: param_groups and defaults."""

    def __init__(self, params: list[torch.Tensor], foreach: bool = False) -> None:
        self.param_groups = [{"params": params, "foreach": foreach}]
        self.defaults = {"foreach": foreach}
        self._zero_grad_profile_name = "zero_grad"
        self._patch_step_function = lambda: None


@pytest.mark.parametrize("functional", [False, True], ids=["MasterOptimizer", "handle"])
def test_consumed_grads_passed_on_are_refused_before_any_write(functional: bool) -> None:
    """A consumed grad handed to another mpfunc call: a clear error naming its path and
    the param, before the first write (nothing to read: the step already used it)."""
    net, end, _ = _consumed_run(functional)
    params = list(net.parameters())
    masters = mpfunc.init_master(params)
    o = mpfunc.adamw(lr=1e-2)
    state = o.init(masters)
    g32 = mpfunc.grads_to_fp32([torch.zeros_like(p, dtype=torch.float32) for p in params])
    trees = (masters, state, g32, params)
    snap = snapshot(trees)
    grads = [p.grad for p in params]
    where = r"param_groups\[0\]\.params\[0\]" if not functional else r"params\.0"
    with pytest.raises(ValueError, match=r"grads.0.*holds its values.*" + where + ".*freed"):
        mpfunc.apply_update_(masters, grads, state, o)
    with pytest.raises(ValueError, match=r"grads.0.*holds its values"):
        mpfunc.grads_to_fp32_(grads, out=g32)
    with pytest.raises(ValueError, match=r"already stepped and freed them.*global-norm clip"):
        mpfunc.clip_by_global_norm_(grads, 1.0)
    assert_unchanged(trees, snap)
    end()


def test_leftover_grad_and_non_leaf_are_refused() -> None:
    net = make_net()
    loss_of(net, 0).backward()
    with pytest.raises(ValueError, match=r"params\[0\].*without a \.grad.*got a grad.*zero_grad"):
        mpfunc.MasterOptimizer(net.parameters(), step_in_backward=True, lr=1e-2)
    w = torch.randn(40, requires_grad=True)
    v = w * 2
    masters = mpfunc.init_master([v.detach()])
    opt = mpfunc.sgd(lr=1e-2)
    with pytest.raises(ValueError, match=r"params.0.*a leaf tensor"):
        mpfunc.step_in_backward([v], masters, opt.init(masters), opt)


# --- hooks removed -------------------------------------------------------------------------


def _hooked(params: list[torch.Tensor]) -> int:
    return sum(len(p._post_accumulate_grad_hooks or {}) for p in params)


def test_hooks_removed_on_close_exit_and_collection() -> None:
    net = make_net()
    params = list(net.parameters())
    opt = mpfunc.MasterOptimizer(params, step_in_backward=True, lr=1e-2)
    assert _hooked(params) == len(params)
    opt.close()
    opt.close()
    assert _hooked(params) == 0
    # After close(), step() steps what a backward left, as the ordinary step does.
    loss_of(net, 0).backward()
    opt.step()
    assert float(opt.state[net.lin.weight]["step"]) == 1.0
    opt.zero_grad()
    with mpfunc.MasterOptimizer(params, step_in_backward=True, lr=1e-2) as opt2:
        assert _hooked(params) == len(params)
    assert _hooked(params) == 0
    del opt2
    mpfunc.MasterOptimizer(params, step_in_backward=True, lr=1e-2)  # dropped at once
    gc.collect()
    assert _hooked(params) == 0
    masters = mpfunc.init_master(params)
    o = mpfunc.adamw(lr=1e-2)
    with mpfunc.step_in_backward(params, masters, o.init(masters), o):
        assert _hooked(params) == len(params)
    assert _hooked(params) == 0


def test_functional_handle_keeps_stepping_when_dropped() -> None:
    """As torch's hooks: a dropped handle does not silently stop the training."""
    w = torch.randn(40, dtype=torch.bfloat16, requires_grad=True)
    masters = mpfunc.init_master([w])
    opt = mpfunc.adamw(lr=1e-2)
    state = opt.init(masters)
    mpfunc.step_in_backward([w], masters, state, opt)
    gc.collect()
    (w.float() ** 2).sum().backward()
    assert isinstance(w.grad, mpfunc.ConsumedGrad) and float(state.step[0]) == 1.0


# --- memory --------------------------------------------------------------------------------


def _grad_bytes(p: torch.Tensor) -> int:
    """The bytes ``p.grad`` holds (a ``ConsumedGrad`` holds none: it has no storage)."""
    g = p.grad
    if g is None or isinstance(g, mpfunc.ConsumedGrad):
        return 0
    return g.untyped_storage().nbytes()


def _peak_live_grads(sib: bool) -> tuple[int, int, int]:
    """The largest total of live ``.grad`` bytes seen when any grad completes, and at the
    end of the backward; and the largest leaf's grad bytes."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(6)]).to(torch.bfloat16)
    params = list(net.parameters())
    peak = [0]

    def count(_: torch.Tensor) -> None:  # registered first: sees the grad just completed
        live = sum(_grad_bytes(p) for p in params)
        peak[0] = max(peak[0], live)

    hooks = [p.register_post_accumulate_grad_hook(count) for p in params]
    opt = mpfunc.MasterOptimizer(params, step_in_backward=sib, lr=1e-2)
    net(torch.randn(8, 64, dtype=torch.bfloat16)).float().square().mean().backward()
    end = sum(_grad_bytes(p) for p in params)
    opt.step()
    for h in hooks:
        h.remove()
    largest = max(p.numel() * p.element_size() for p in params)
    return peak[0], end, largest


def test_live_grads_never_exceed_the_largest_leaf() -> None:
    peak, end, largest = _peak_live_grads(True)
    assert peak == largest and end == 0
    peak0, end0, _ = _peak_live_grads(False)
    assert peak0 == end0 == 6 * (64 * 64 + 64) * 2  # the ordinary step holds every grad


# --- XLA -------------------------------------------------------------------------------------


@pytest.mark.xla
@pytest.mark.parametrize("sd", [torch.float32, torch.uint8], ids=str)
def test_xla_one_graph_per_step_and_same_bits(xla_device: torch.device, sd: torch.dtype) -> None:
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.debug.metrics as met

    def run(sib: bool) -> tuple[list[torch.Tensor], list[int]]:
        net = make_net(scalar=False, device=xla_device)
        factory = functools.partial(mpfunc.adamw, state_dtype=sd)
        opt = mpfunc.MasterOptimizer(
            net.parameters(), factory, strategy="stochastic", step_in_backward=sib, lr=1e-2
        )
        torch_xla.sync()
        graphs = []
        for k in range(4):
            xm.wait_device_ops()
            before = (met.metric_data("ExecuteTime") or [0])[0]
            loss_of(net, k, xla_device).backward()
            opt.step()
            opt.zero_grad()
            torch_xla.sync()
            xm.wait_device_ops()
            graphs.append(met.metric_data("ExecuteTime")[0] - before)
        out = [p.detach().cpu() for p in net.parameters()]
        return out + [t.cpu() for t in state_tensors(opt)], graphs

    ref, _ = run(False)
    got, graphs = run(True)
    assert graphs[1:] == [1, 1, 1], graphs
    assert_all_bits(ref, got)


@pytest.mark.xla
def test_xla_torch_clip_after_the_step_in_backward_is_refused(xla_device: torch.device) -> None:
    """On XLA too (torch_xla's own clip_grad_norm_ replaces torch's): a clear error, and the
    step then ends as usual, in one graph."""
    import torch_xla

    net = make_net(scalar=False, device=xla_device)
    opt = mpfunc.MasterOptimizer(net.parameters(), step_in_backward=True, lr=1e-2)
    torch_xla.sync()
    loss_of(net, 0, xla_device).backward()
    assert isinstance(net.lin.weight.grad, mpfunc.ConsumedGrad)
    assert net.lin.weight.grad.device == xla_device
    with pytest.raises(RuntimeError, match=_FREED + r".*clip_grad_norm_"):
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
    opt.step()
    assert net.lin.weight.grad is None
    torch_xla.sync()
    assert torch.isfinite(net.lin.weight.cpu()).all()


@pytest.mark.xla
def test_xla_multi_process_run_is_refused(
    xla_device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    """xmp.spawn runs reduce grads with xm.optimizer_step, without a torch.distributed
    group: XLA params in a run of several processes are refused as a process group is."""
    import torch_xla.runtime as xr

    monkeypatch.setattr(xr, "world_size", lambda: 2)
    _both_refuse(make_net(scalar=False, device=xla_device), r"an XLA run of 2 processes")
    mpfunc.MasterOptimizer(make_net().parameters(), step_in_backward=True, lr=1e-2).close()


def test_frozen_then_unfrozen() -> None:
    """A param frozen when hooked cannot carry a hook: MasterOptimizer.step() steps its late
    grad after the backward (the same bits); the functional handle refuses it at end_step."""
    nets = [make_net(), make_net()]
    opts = []
    for sib, net in zip((False, True), nets):
        net.lin.weight.requires_grad_(False)
        opts.append(mpfunc.MasterOptimizer(net.parameters(), step_in_backward=sib, lr=1e-2))
    for k in range(3):
        for net, opt in zip(nets, opts):
            if k == 1:
                net.lin.weight.requires_grad_(True)
            loss_of(net, k).backward()
            opt.step()
            opt.zero_grad()
    assert_all_bits(
        [p.detach() for p in nets[0].parameters()], [p.detach() for p in nets[1].parameters()]
    )
    assert_all_bits(state_tensors(opts[0]), state_tensors(opts[1]))
    w = torch.randn(40, dtype=torch.bfloat16)
    masters = mpfunc.init_master([w])
    o = mpfunc.adamw(lr=1e-2)
    handle = mpfunc.step_in_backward([w], masters, o.init(masters), o)
    w.requires_grad_(True)
    (w.float() ** 2).sum().backward()
    with pytest.raises(ValueError, match=r"params.0: expected no grad.*step_in_backward"):
        handle.end_step()


def test_add_param_group_is_hooked() -> None:
    nets = [make_net(), make_net()]
    opts = []
    for sib, net in zip((False, True), nets):
        first = [p for n, p in net.named_parameters() if not n.startswith("lin.")]
        opt = mpfunc.MasterOptimizer(first, step_in_backward=sib, lr=1e-2)
        opt.add_param_group({"params": list(net.lin.parameters()), "lr": 3e-3})
        opts.append(opt)
    for k in range(2):
        for net, opt in zip(nets, opts):
            loss_of(net, k).backward()
            if opt._in_backward is not None:
                # stepped by its hook: the grad is freed
                assert isinstance(net.lin.weight.grad, mpfunc.ConsumedGrad)
            opt.step()
            opt.zero_grad()
    assert_all_bits(
        [p.detach() for p in nets[0].parameters()], [p.detach() for p in nets[1].parameters()]
    )


def test_a_value_set_between_backward_and_step_is_refused() -> None:
    """A warm-up that sets the lr after the backward (or a scheduler stepped before the
    optimizer): the ordinary step uses the new value, the leaves stepped inside backward
    used the old one, and nothing said so. step() now raises naming the group, the key and
    both values; the step is complete (with the old values) and training goes on."""
    net = make_net()
    opt = mpfunc.MasterOptimizer(net.parameters(), step_in_backward=True, lr=0.0)
    loss_of(net, 0).backward()
    opt.param_groups[0]["lr"] = 1e-2
    with pytest.raises(RuntimeError, match=(
        r"step: param_groups\[0\]\['lr'\] changed after the backward began \(0\.0 -> 0\.01\)"
        r".*this step used 0\.0"
    )):  # fmt: skip
        opt.step()
    assert float(opt.state[net.lin.weight]["step"]) == 1.0  # the step is complete
    before = [p.detach().clone() for p in net.parameters()]
    loss_of(net, 1).backward()  # the next step: the new lr, no error
    opt.step()
    assert any(not torch.equal(a, p.detach()) for a, p in zip(before, net.parameters()))
    # A group added between the backward and step() changed no value the hooks read.
    loss_of(net, 2).backward()
    opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(40, dtype=torch.bfloat16))]})
    opt.step()


def test_a_refused_add_param_group_adds_nothing() -> None:
    """A new group's param holding a grad is refused by the hooks' checks; they ran after
    the group was taken in, so the optimizer kept a half-hooked group (its params trained,
    one without a hook) and the retry the message asks for was refused by torch as a param
    in two groups. Now nothing is added, and the retry after clearing the grad works."""
    net = make_net()
    first = [p for n, p in net.named_parameters() if not n.startswith("lin.")]
    opt = mpfunc.MasterOptimizer(first, step_in_backward=True, lr=1e-2)
    net.lin.bias.grad = torch.ones_like(net.lin.bias)
    before = (
        len(opt.param_groups),
        len(opt._params),
        len(opt.state),
        len(opt._in_backward.handles),
    )
    with pytest.raises(ValueError, match=(
        r"^MasterOptimizer\(step_in_backward=True\): at 'param_groups\[1\]\.params\[1\]': "
        r"expected a param without a \.grad"
    )):  # fmt: skip
        opt.add_param_group({"params": list(net.lin.parameters())})
    assert before == (len(opt.param_groups), len(opt._params), len(opt.state),
                      len(opt._in_backward.handles))  # fmt: skip
    net.lin.bias.grad = None
    opt.add_param_group({"params": list(net.lin.parameters())})
    loss_of(net, 0).backward()
    assert isinstance(net.lin.bias.grad, mpfunc.ConsumedGrad)
    opt.step()


def _both_refuse(net: Net, got: str) -> list[torch.Tensor]:
    """MasterOptimizer(step_in_backward=True) and the functional hooks refuse ``net``'s
    params in a data parallel run (``got`` names it); returns the params."""
    with pytest.raises(RuntimeError, match=f"expected a single process, got {got}.*ordinary step"):
        mpfunc.MasterOptimizer(net.parameters(), step_in_backward=True, lr=1e-2)
    params = list(net.parameters())
    masters = mpfunc.init_master(params)
    o = mpfunc.adamw(lr=1e-2)
    with pytest.raises(RuntimeError, match=f"expected a single process, got {got}"):
        mpfunc.step_in_backward(params, masters, o.init(masters), o)
    return params


def test_data_parallel_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """In a process group of several ranks the grads are reduced after they accumulate:
    stepping each leaf with this rank's grad would silently drift the replicas apart."""
    dist = torch.distributed
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda *a: 2)
    params = _both_refuse(make_net(), r"a process group of 2 ranks")
    assert _hooked(params) == 0


# --- reentrant activation checkpointing ------------------------------------------------------


class Segments(torch.nn.Module):
    """``lin`` used in two checkpointed segments (a shared block), ``head`` outside them."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.lin = torch.nn.Linear(32, 32)
        self.head = torch.nn.Linear(32, 16)
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        h = x
        for _ in range(2):
            h = checkpoint(lambda t: torch.tanh(self.lin(t)), h, use_reentrant=self.reentrant)
        return self.head(h)


def _segments_run(reentrant: bool, sib: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    net = Segments(reentrant).to(torch.bfloat16)
    params = list(net.parameters())
    opt: Any = None
    handle: Any = None
    if sib == "functional":
        masters = mpfunc.init_master(params, strategy="kahan")
        fopt = mpfunc.adamw(lr=1e-2, state_dtype=torch.bfloat16)
        state = fopt.init(masters)
        handle = mpfunc.step_in_backward(params, masters, state, fopt)
    else:
        opt = mpfunc.MasterOptimizer(
            params, mpfunc.adamw, strategy="kahan", step_in_backward=sib == "optimizer",
            lr=1e-2, state_dtype=torch.bfloat16,
        )  # fmt: skip
    for k in range(3):
        gen = torch.Generator().manual_seed(k)
        x = torch.randn(4, 32, generator=gen).to(torch.bfloat16).requires_grad_(reentrant)
        net(x).float().pow(2).mean().backward()
        if handle is not None:
            handle.end_step()
        else:
            opt.step()
            opt.zero_grad()
    out = [p.detach().clone() for p in params]
    if handle is not None:
        handle.remove()
        return out, [t for t in _leaves((masters, state)) if isinstance(t, torch.Tensor)]
    return out, state_tensors(opt)


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")
# torch 2.4's reentrant checkpoint calls the deprecated torch.cpu.amp.autocast
@pytest.mark.filterwarnings("ignore:`torch.cpu.amp.autocast:FutureWarning")
@pytest.mark.parametrize("sib", ["optimizer", "functional"])
def test_reentrant_checkpointing_steps_complete_grads(sib: str) -> None:
    """Reentrant checkpointing runs each segment's backward nested in the outer one, so a
    param shared by two segments got its hook twice: it stepped on the first segment's
    partial grad, then the second raised as if the grads were accumulated. Hooks that fire
    in a nested backward now leave the grad to complete and step at the step's end: the
    ordinary step's bits, with a warning that no grad memory is saved there. Without
    reentrancy the leaves step inside backward as before, silently."""
    ref_p, ref_s = _segments_run(True, "none")
    with pytest.warns(RuntimeWarning, match=r"nested backward \(reentrant activation chec"):
        got_p, got_s = _segments_run(True, sib)
    assert_all_bits(ref_p, got_p)
    if sib == "optimizer":
        assert_all_bits(ref_s, got_s)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no nested-backward warning
        plain_p, _ = _segments_run(False, sib)
    assert_all_bits(ref_p, plain_p)


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")
# torch 2.4's reentrant checkpoint calls the deprecated torch.cpu.amp.autocast
@pytest.mark.filterwarnings("ignore:`torch.cpu.amp.autocast:FutureWarning")
def test_reentrant_segment_after_an_outer_step_names_the_cause() -> None:
    """A param used outside a reentrant segment (its hook fires first, complete as far as
    the outer graph knows) and inside one (more grad later, nested): the nested grad raises
    naming reentrant checkpointing, not gradient accumulation."""
    from torch.utils.checkpoint import checkpoint

    w = torch.nn.Parameter(torch.randn(8, 8, dtype=torch.bfloat16))
    opt = mpfunc.MasterOptimizer([w], step_in_backward=True, lr=1e-2)
    x = torch.randn(2, 8, dtype=torch.bfloat16, requires_grad=True)
    h = checkpoint(lambda t: torch.tanh(t @ w), x, use_reentrant=True)
    with pytest.raises(RuntimeError, match=(
        r"param_groups\[0\]\.params\[0\] received more grad from a reentrant checkpointed "
        r"segment .* after it had stepped"
    )):  # fmt: skip
        (h @ w).float().sum().backward()
    opt.zero_grad()
    opt.step()


def test_a_value_changed_in_a_group_that_did_not_step_is_taken() -> None:
    """A group none of whose leaves stepped in this backward (its params took no grad) may
    change its values before step(): they were not used. The refusal said "this step
    used ..." for it; a group that stepped still refuses a change."""
    torch.manual_seed(0)
    a, b = torch.nn.Linear(4, 4).bfloat16(), torch.nn.Linear(4, 4).bfloat16()
    opt = mpfunc.MasterOptimizer(
        [{"params": a.parameters()}, {"params": b.parameters(), "lr": 1e-2}],
        lr=1e-3,
        step_in_backward=True,
    )
    x = torch.randn(2, 4).bfloat16()
    a(x).float().sum().backward()  # only group 0 steps
    opt.param_groups[1]["lr"] = 5e-3
    opt.step()
    opt.zero_grad()
    a(x).float().sum().backward()
    opt.param_groups[0]["lr"] = 5e-4
    with pytest.raises(RuntimeError, match=r"param_groups\[0\]\['lr'\] changed after the backward"):
        opt.step()
    opt.close()

"""torch.compile: a mixed-precision training step compiles with inductor on the CPU.

mpfunc's transforms are traced whole (no graph break inside them), match eager within
mpfunc's bound (``max|a - b| <= 1e-6 * M``), and compile nothing more when a tensor lr
changes. Inductor compiles take tens of seconds here, so each compiled function is built
once and shared by the assertions about it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import optree
import pytest
import torch
import torch.nn.functional as F

import mpfunc
from mpfunc.testing import assert_steps_agree

# Verified on torch 2.9. Torch 2.4's dynamo cannot trace optree's registry lookup
# (register_pytree_node.get), so every mpfunc call breaks the graph there; 2.5-2.8 untested.
pytestmark = pytest.mark.skipif(
    tuple(int(x) for x in torch.__version__.split(".")[:2]) < (2, 9),
    reason="fullgraph tracing of mpfunc is verified from torch 2.9 (torch 2.4's dynamo cannot "
    "trace optree's registry lookup)",
)

STEPS = 3
# Layer 0 keeps plain fp32 masters, layer 2 its bf16 params plus int16 remainders.
STRATEGY = {"0.weight": "fp32", "0.bias": "fp32", "2.weight": "remainder", "2.bias": "remainder"}


def _counters() -> Any:
    from torch._dynamo.utils import counters

    return counters


class Loop:
    """A bf16 model with mpfunc masters: eager and compiled copies start identical."""

    def __init__(self, make_opt: Callable[[], mpfunc.Optimizer], strategy: Any = STRATEGY) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)
        ).to(torch.bfloat16)
        self.params = dict(self.model.named_parameters())
        self.masters = mpfunc.init_master(self.params, strategy=strategy)
        self.opt = make_opt()
        self.state = self.opt.init(self.masters)

    def fresh(self) -> Loop:
        return copy.deepcopy(self)

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """Forward, backward and the single-pass update (bf16 grads in, params out)."""
        # No loss kept past backward(): dynamo resumes after that graph break and would
        # read the non-leaf loss's .grad, which warns.
        F.mse_loss(self.model(x).float(), y).backward()
        grads = {n: p.grad for n, p in self.params.items()}
        mpfunc.apply_update_(self.masters, grads, self.state, self.opt, params=self.params)

    def update(self, grads: Any) -> None:
        """The update alone, as three in-place transforms."""
        g32 = mpfunc.grads_to_fp32(grads)
        mpfunc.apply_update_(self.masters, g32, self.state, self.opt)
        mpfunc.masters_to_model_(self.masters, self.params)

    def result(self) -> Any:
        return mpfunc.masters_state_dict(self.masters), self.state, dict(self.params)


def _data(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + i)
    return (torch.randn(32, 8, generator=g).to(torch.bfloat16), torch.randn(32, 4, generator=g))


def _grads(loop: Loop, i: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(200 + i)
    return {n: torch.randn(p.shape, generator=g).to(p.dtype) for n, p in loop.params.items()}


@pytest.fixture(scope="module")
def adamw_tensor_lr() -> Any:
    """The whole training step, adamw (default impl) with a tensor lr changed every step,
    compiled once; returns the compiled and eager results and what dynamo counted."""
    lr = torch.tensor(1e-2)
    eager = Loop(lambda: mpfunc.adamw(lr=lr, weight_decay=0.1))
    compiled = eager.fresh()  # the same opt: both read lr
    torch._dynamo.reset()
    _counters().clear()
    step = torch.compile(compiled.train_step)
    results, frames = [], {}
    for i in range(STEPS):
        lr.fill_(1e-2 / (1 + i))  # a schedule: the value changes, nothing recompiles
        x, y = _data(i)
        for loop in (compiled, eager):
            loop.model.zero_grad(set_to_none=True)
        step(x, y)
        # The reference: eager mpfunc on the very grads the compiled backward made
        # (inductor's bf16 forward/backward rounds differently from eager's, by design).
        grads = {n: p.grad for n, p in compiled.params.items()}
        mpfunc.apply_update_(eager.masters, grads, eager.state, eager.opt, params=eager.params)
        results.append((compiled.result(), eager.result()))
        if i == 0:
            frames = dict(_counters()["stats"])
    breaks = {k: v for k, v in _counters()["graph_break"].items()}
    return results, frames, dict(_counters()["stats"]), breaks


@pytest.mark.slow
def test_training_step_matches_eager_with_a_changing_tensor_lr(adamw_tensor_lr: Any) -> None:
    results, _, _, _ = adamw_tensor_lr
    assert_steps_agree(lambda i: results[i][0], lambda i: results[i][1], STEPS)


@pytest.mark.slow
def test_changing_the_tensor_lr_compiles_nothing(adamw_tensor_lr: Any) -> None:
    _, first, last, _ = adamw_tensor_lr
    # Frames traced after the first step would be recompiles.
    assert last.get("unique_graphs") == first.get("unique_graphs")
    assert last.get("calls_captured", 0) >= first.get("calls_captured", 0)


@pytest.mark.slow
def test_the_only_graph_break_is_backward(adamw_tensor_lr: Any) -> None:
    _, _, _, breaks = adamw_tensor_lr
    reasons = " | ".join(breaks)
    assert breaks and all("Tensor.backward()" in r for r in breaks), reasons


def _update_only(make_opt: Callable[[], mpfunc.Optimizer], three_calls: bool) -> None:
    eager = Loop(make_opt)
    compiled = eager.fresh()

    def single_pass(grads: Any) -> None:
        mpfunc.apply_update_(
            compiled.masters, grads, compiled.state, compiled.opt, params=compiled.params
        )

    torch._dynamo.reset()
    # fullgraph: any graph break inside mpfunc's calls fails the compile.
    step = torch.compile(compiled.update if three_calls else single_pass, fullgraph=True)
    out = []
    for i in range(STEPS):
        step(_grads(compiled, i))
        if three_calls:
            eager.update(_grads(eager, i))
        else:
            grads = _grads(eager, i)
            mpfunc.apply_update_(eager.masters, grads, eager.state, eager.opt, params=eager.params)
        out.append((compiled.result(), eager.result()))
    assert_steps_agree(lambda i: out[i][0], lambda i: out[i][1], STEPS)


@pytest.mark.slow
def test_adamw_float_lr_single_pass_compiles_whole() -> None:
    _update_only(lambda: mpfunc.adamw(lr=1e-2, weight_decay=0.1), three_calls=False)


@pytest.mark.slow
def test_sgd_three_transforms_compile_whole() -> None:
    _update_only(lambda: mpfunc.sgd(lr=torch.tensor(0.1), momentum=0.9), three_calls=True)


def test_update_traces_without_a_graph_break() -> None:
    """Dynamo alone (no inductor: a few seconds): every strategy, fullgraph."""
    loop = Loop(
        lambda: mpfunc.adamw(lr=torch.tensor(1e-3)),
        strategy={
            "0.weight": "kahan",
            "0.bias": "stochastic",
            "2.weight": "none",
            "2.bias": "remainder",
        },
    )
    torch._dynamo.reset()
    step = torch.compile(
        lambda g: mpfunc.apply_update_(loop.masters, g, loop.state, loop.opt, params=loop.params),
        backend="eager",
        fullgraph=True,
    )
    step(_grads(loop, 0))


def test_checks_run_when_traced() -> None:
    """A bad input raises mpfunc's own error from a compiled call, and writes nothing.
    The checks run while dynamo traces; dynamo's guards (dtypes, shapes, strides, keys,
    one tensor passed twice) retrace and so re-check whenever an input changes."""
    loop = Loop(lambda: mpfunc.sgd(lr=0.1, momentum=0.9), strategy="fp32")
    torch._dynamo.reset()
    step = torch.compile(
        lambda g: mpfunc.apply_update_(loop.masters, g, loop.state, loop.opt, params=loop.params),
        backend="eager",
    )
    step(_grads(loop, 0))
    before = copy.deepcopy((loop.masters, loop.state, loop.params))
    wide = {n: g.double() for n, g in _grads(loop, 1).items()}
    with pytest.raises(TypeError, match=r"at 'grads.0.bias': expected a grad no wider"):
        step(wide)
    twice = {**_grads(loop, 1), "2.bias": loop.masters["2.bias"]}  # a master as its grad
    with pytest.raises(ValueError, match=r"at 'grads.2.bias': expected a tensor that shares no"):
        step(twice)
    after = optree.tree_leaves((loop.masters, loop.state, loop.params))
    for a, b in zip(optree.tree_leaves(before), after, strict=True):
        assert torch.equal(a, b)


def test_a_loop_with_loss_scaling_clipping_and_skip_traces_whole() -> None:
    """Dynamo alone: the three in-place transforms with a dynamic loss scale, clipping,
    a skip flag and stats, fullgraph (so with no graph break anywhere in them)."""
    loop = Loop(lambda: mpfunc.adamw(lr=torch.tensor(1e-3)))
    out = mpfunc.init_grads(loop.params)
    stats = mpfunc.init_stats(loop.masters)
    box = [mpfunc.DynamicLossScale()]

    def step(grads: Any) -> torch.Tensor:
        g32 = mpfunc.grads_to_fp32_(grads, out, scale=box[0])
        finite = mpfunc.all_finite(g32)
        g32, norm = mpfunc.clip_by_global_norm_(g32, 1.0)
        mpfunc.apply_update_(loop.masters, g32, loop.state, loop.opt, ~finite, stats=stats)
        mpfunc.masters_to_model_(loop.masters, loop.params)
        box[0] = box[0].adjust(finite)
        return norm

    torch._dynamo.reset()
    compiled = torch.compile(step, backend="eager", fullgraph=True)
    compiled(_grads(loop, 0))
    bad = {**_grads(loop, 1), "0.bias": torch.full((16,), float("inf"), dtype=torch.bfloat16)}
    before = copy.deepcopy(loop.masters)
    compiled(bad)  # skipped on the device: masters keep their bits, the scale backs off
    for a, b in zip(optree.tree_leaves(before), optree.tree_leaves(loop.masters), strict=True):
        assert torch.equal(a, b)
    assert float(box[0].loss_scale) == 2.0**15


def test_master_optimizer_step_inside_a_compiled_function_runs_eagerly() -> None:
    """torch's "compile the optimizer step" recipe around a MasterOptimizer crashed inside
    dynamo (an attribute write it refuses). The step is a graph break now and runs eagerly:
    the same bits as an eager loop."""
    runs = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 4).to(torch.bfloat16)
        opt = mpfunc.MasterOptimizer(model.parameters(), strategy="remainder", lr=1e-2)

        def step() -> None:
            opt.step()  # noqa: B023 (each run's own optimizer)

        run = torch.compile(step, backend="eager") if compiled else step
        for k in range(3):
            x = torch.randn(2, 8, generator=torch.Generator().manual_seed(k))
            model(x.to(torch.bfloat16)).float().pow(2).sum().backward()
            run()
            opt.zero_grad()
        runs.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*runs):
        assert torch.equal(a, b)

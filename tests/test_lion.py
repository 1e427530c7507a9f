"""``lion`` against a plain per-tensor transcription of Chen et al. 2023, Algorithm 2.

torch has no Lion, so the reference is the paper's three lines, written here one tensor
at a time in float64 on the CPU. Every implementation, float and tensor lr, maximize,
weight decay and ``skip``, on the CPU and on XLA, within the stated bound; reference and
foreach agree bit for bit.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from support.helpers import assert_trees_bits_equal

import mpfunc

SHAPES = [(3, 5), (7,), (), (2, 3, 4)]


def paper_step(
    p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, lr: float, b1: float, b2: float, wd: float
) -> None:
    """Algorithm 2: update = sign(b1*m + (1-b1)*g); p -= lr*(update + wd*p); m = b2*m + (1-b2)*g."""
    update = torch.sign(b1 * m + (1 - b1) * g)
    p.sub_(lr * (update + wd * p))
    m.copy_(b2 * m + (1 - b2) * g)


def _sync(device: torch.device) -> None:
    if device.type == "xla":
        import torch_xla

        torch_xla.sync()


@settings(max_examples=30)
@given(data=st.data())
def test_lion_matches_the_paper(device: torch.device, data: st.DataObject) -> None:
    impl = data.draw(st.sampled_from(["auto", "foreach", "reference"]))
    lr = data.draw(st.sampled_from([1e-4, 3e-3]))
    betas = data.draw(st.sampled_from([(0.9, 0.99), (0.95, 0.98), (0.0, 0.5)]))
    wd = data.draw(st.sampled_from([0.0, 0.1, 1.0]))
    maximize = data.draw(st.booleans())
    tensor_lr = data.draw(st.booleans())
    skips = data.draw(st.lists(st.booleans(), min_size=1, max_size=6))
    seed = data.draw(st.integers(0, 2**16))
    gen = torch.Generator().manual_seed(seed)
    cpu = {f"w{i}": torch.randn(s, generator=gen) for i, s in enumerate(SHAPES)}
    masters = {k: v.to(device) for k, v in cpu.items()}
    ref = {k: v.double().clone() for k, v in cpu.items()}
    mom = {k: torch.zeros_like(v) for k, v in ref.items()}
    lr_arg: Any = torch.tensor(lr, device=device) if tensor_lr else lr
    opt = mpfunc.lion(lr=lr_arg, betas=betas, weight_decay=wd, maximize=maximize, impl=impl)
    state = opt.init(masters)
    taken = 0
    for skip in skips:
        g_cpu = {k: torch.randn(v.shape, generator=gen) for k, v in cpu.items()}
        grads = {k: v.to(device) for k, v in g_cpu.items()}
        flag = torch.tensor(skip, device=device)
        mpfunc.apply_update_(masters, grads, state, opt, skip=flag)
        if not skip:
            taken += 1
            for k in ref:
                g = g_cpu[k].double() * (-1 if maximize else 1)
                paper_step(ref[k], g, mom[k], lr, betas[0], betas[1], wd)
    _sync(device)
    for k in ref:
        got = masters[k].detach().cpu().double()
        # Each step moves an element by at most lr*(1 + wd*|p|): fp32 rounding of that.
        peak = max(float(ref[k].abs().max()), 1.0)
        assert float((got - ref[k]).abs().max()) <= 1e-6 * peak * max(taken, 1), (k, impl)
        assert float(state.step[k].cpu()) == taken
        assert torch.allclose(state.exp_avg[k].cpu().double(), mom[k], rtol=1e-5, atol=1e-6)


def test_lion_reference_and_foreach_agree_bit_for_bit() -> None:
    gen = torch.Generator().manual_seed(0)
    masters = {f"w{i}": torch.randn(s, generator=gen) for i, s in enumerate(SHAPES)}
    results = []
    for impl in ("reference", "foreach"):
        m = {k: v.clone() for k, v in masters.items()}
        opt = mpfunc.lion(lr=1e-3, weight_decay=0.1, impl=impl)
        s = opt.init(m)
        g = torch.Generator().manual_seed(1)
        for _ in range(5):
            grads = {k: torch.randn(v.shape, generator=g) for k, v in m.items()}
            mpfunc.apply_update_(m, grads, s, opt)
        results.append((m, s))
    assert_trees_bits_equal(results[0], results[1])


@pytest.mark.parametrize(
    ("kwargs", "exc", "regex"),
    [
        (dict(lr=-1.0), ValueError, r"^lion: lr: expected a finite float >= 0, got -1\.0$"),
        (dict(betas=(1.5, 0.9)), ValueError, r"^lion: betas\[0\]: expected a float in \[0, 1\]"),
        (dict(betas=0.9), TypeError, r"^lion: betas: expected a pair of floats"),
        (dict(weight_decay=-0.1), ValueError, r"^lion: weight_decay: expected a finite float"),
        (dict(impl="fused"), ValueError, r"^lion: impl: expected one of auto, foreach, reference"),
    ],
)
def test_lion_bad_hyperparameters(kwargs: dict[str, Any], exc: type[Exception], regex: str) -> None:
    with pytest.raises(exc, match=regex):
        mpfunc.lion(**kwargs)

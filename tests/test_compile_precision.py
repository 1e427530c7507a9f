"""torch.compile (inductor, CPU) of a step keeps the bits of its bf16 round trips.

Inductor folds ``x.to(bf16).float()`` into ``x`` (torch 2.9): a ``"kahan"`` master lost its
whole compensation (a compiled run was plain bf16 training) and 8-bit moments were coded
against unrounded block scales (found in review, 2026-12-05). ``_tensors.widened`` reads
the bf16 or fp16 bits where dynamo traces; here it is held to ``Tensor.float()`` on every
pattern, and both steps to eager bit for bit.
"""

from __future__ import annotations

import pytest
import torch

import mpfunc

_TORCH_29 = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 9)
needs_29 = pytest.mark.skipif(not _TORCH_29, reason="mpfunc's compile support is from torch 2.9")


@needs_29
@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_widened_is_float_on_every_pattern_under_compile(dtype: torch.dtype) -> None:
    from mpfunc.core import _tensors

    p = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
    torch._dynamo.reset()
    got = torch.compile(_tensors.widened, fullgraph=True)(p)
    assert torch.equal(got.view(torch.int32), p.float().view(torch.int32))


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.is_floating_point():
        return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    return t


@needs_29
@pytest.mark.slow
def test_kahan_compensation_survives_torch_compile() -> None:
    """One SGD step on a "kahan" master, compiled with inductor, against eager: the
    compensation (what bf16 rounding dropped) must be kept. Observed: all zeros."""
    torch.manual_seed(0)
    p0 = torch.randn(64).to(torch.bfloat16)
    grad = {"p": torch.randn(64).to(torch.bfloat16)}
    runs = []
    for compiled in (False, True):
        params = {"p": p0.clone()}
        masters = mpfunc.init_master(params, strategy="kahan")
        opt = mpfunc.sgd(lr=1e-3)
        state = opt.init(masters)

        def step(g: dict[str, torch.Tensor]) -> None:
            mpfunc.apply_update_(masters, g, state, opt)  # noqa: B023

        if compiled:
            torch._dynamo.reset()
            step = torch.compile(step, fullgraph=True)
        step(grad)
        runs.append(masters["p"])
    eager, comp = runs
    assert int((eager.compensation != 0).sum()) > 0  # eager keeps the low bits
    assert torch.equal(_bits(comp.param), _bits(eager.param))
    assert torch.equal(_bits(comp.compensation), _bits(eager.compensation)), (
        f"compiled compensation nonzero in {int((comp.compensation != 0).sum())} of 64 "
        f"elements, eager in {int((eager.compensation != 0).sum())}"
    )


@needs_29
@pytest.mark.slow
def test_uint8_state_under_torch_compile_matches_eager() -> None:
    """One AdamW step with 8-bit moments ("fp32" masters), compiled against eager: the
    codes and bf16 scales (and so every later step) must agree; observed: codes differ
    (the bf16 scale's rounding is folded away before the codes are computed)."""
    torch.manual_seed(0)
    p0 = torch.randn(8, 64).to(torch.bfloat16)
    grad = {"w": (torch.randn(8, 64) * 0.1).to(torch.bfloat16)}
    runs = []
    for compiled in (False, True):
        params = {"w": p0.clone()}
        masters = mpfunc.init_master(params)
        opt = mpfunc.adamw(lr=torch.tensor(1e-2), weight_decay=0.1, state_dtype=torch.uint8)
        state = opt.init(masters)

        def step(g: dict[str, torch.Tensor]) -> None:
            mpfunc.apply_update_(masters, g, state, opt, params=params)  # noqa: B023

        if compiled:
            torch._dynamo.reset()
            step = torch.compile(step, fullgraph=True)
        step(grad)
        runs.append((state.exp_avg["w"], state.exp_avg_sq["w"]))
    (m_e, v_e), (m_c, v_c) = runs
    for e, c in ((m_e, m_c), (v_e, v_c)):
        assert torch.equal(_bits(c.scale), _bits(e.scale))
        diff = int((c.codes != e.codes).sum())
        assert diff == 0, f"{diff} of {e.codes.numel()} codes differ from eager"


@needs_29
def test_a_compiled_8bit_step_with_a_skip_flag_runs_as_eager() -> None:
    # Found in review: with a skip tensor and a 64-element leaf, the compiled step's kernel
    # failed inductor's bounds check on the stochastic encode's table gather, after the
    # master, count, codes and param were written. The encode now computes the two table
    # entries by the table's own division, with no gather.
    import copy

    gen = torch.Generator().manual_seed(0)
    params = {"b": torch.randn(64, generator=gen).to(torch.bfloat16)}
    masters = mpfunc.init_master(params)
    opt = mpfunc.adamw(lr=torch.tensor(1e-2), weight_decay=0.1, state_dtype=torch.uint8)
    state = opt.init(masters)
    eager = copy.deepcopy((masters, state, params))
    step = torch.compile(
        lambda m, g, st, s, p: mpfunc.apply_update_(m, g, st, opt, s, params=p), fullgraph=True
    )
    for k in range(3):
        g = {"b": (torch.randn(64, generator=gen) * 0.1).to(torch.bfloat16)}
        step(masters, g, state, torch.tensor(k == 1), params)
        mpfunc.apply_update_(eager[0], g, eager[1], opt, torch.tensor(k == 1), params=eager[2])
    for field in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(getattr(state, field)["b"].codes, getattr(eager[1], field)["b"].codes)
    assert torch.equal(params["b"], eager[2]["b"])
    torch.testing.assert_close(masters["b"], eager[0]["b"], rtol=1e-6, atol=0)

"""A param written behind the step's back (``.data``, ``copy_``, a load) is the truth:
the next step refreshes its master from it, on every impl, layout and device, and in
MasterOptimizer."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import mpfunc

# (optimizer factory, impls): "auto" takes the native single pass on CPU for AdamW and
# the one-node kernel on XLA; "foreach" and "fused" the torch path.
_WRITERS: dict[str, tuple[Any, tuple[str, ...]]] = {
    "adamw": (
        lambda impl: mpfunc.adamw(1e-3, weight_decay=0.1, impl=impl),
        ("auto", "foreach", "fused"),
    ),
    "adamw-uint8": (
        lambda impl: mpfunc.adamw(1e-3, state_dtype=torch.uint8, impl=impl),
        ("auto", "foreach"),
    ),
    "sgd": (lambda impl: mpfunc.sgd(1e-3, momentum=0.9, impl=impl), ("auto", "foreach")),
    "lion": (lambda impl: mpfunc.lion(1e-3, impl=impl), ("auto", "foreach")),
}


_WRITTEN = torch.linspace(-3, 7, 64 * 40).view(64, 40)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def _assert_same_bits(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))


_CASES = [(name, impl) for name, (_, impls) in _WRITERS.items() for impl in impls]


def _behind_the_back(
    name: str,
    impl: str,
    how: str,
    device: torch.device,
    *,
    skip_first: bool = False,
    transposed: bool = False,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Two steps of one tree; between them the first param is written behind the step's
    back (``how``) and, in the reference, the same value also goes into its master, the
    one supported way before. ``transposed``: the first param is a transposed view (its
    master copies that layout, its grad is contiguous: the native pass stages the leaf
    through contiguous copies). Returns (params, masters) of (the run, the reference)."""
    make = _WRITERS[name][0]
    out = []
    for reference in (False, True):
        g = torch.Generator().manual_seed(0)
        shapes = [(64, 40), (33,)]
        params = [torch.randn(s, generator=g).bfloat16().to(device) for s in shapes]
        if transposed:
            params[0] = params[0].t().contiguous().t()
        grads = [
            torch.randn(p.shape, generator=g).bfloat16().to(device).contiguous() for p in params
        ]
        masters = mpfunc.init_master(params)
        opt = make(impl)
        state = opt.init(masters)
        mpfunc.apply_update_(masters, grads, state, opt, params=params)
        new = _WRITTEN.bfloat16().to(device)
        if how == "fill":
            params[0].data.copy_(new)
        elif how == "assign":
            params[0].data = new.clone()
        else:  # a few elements only, in place under no_grad, as weight surgery does
            with torch.no_grad():
                params[0].data[3, 5:9] = new[3, 5:9]
        if reference:
            with torch.no_grad():
                same = params[0] == masters[0].bfloat16()
                masters[0].copy_(torch.where(same, masters[0], params[0].float()))
        if skip_first:
            skip = torch.tensor(True, device=device)
            mpfunc.apply_update_(masters, grads, state, opt, skip=skip, params=params)
        mpfunc.apply_update_(masters, grads, state, opt, params=params)
        out.append(([p.cpu() for p in params], [m.cpu() for m in masters]))
    return out[0], out[1]


@pytest.mark.parametrize("how", ["fill", "assign", "some"])
@pytest.mark.parametrize(("name", "impl"), _CASES, ids=[f"{n}-{i}" for n, i in _CASES])
def test_a_param_written_behind_the_steps_back_is_kept(name: str, impl: str, how: str) -> None:
    """``p.data.copy_(t)``, ``p.data = t`` or a partial write between steps: the next step
    starts from the param's new value (as torch.optim's would), bit for bit as if the
    value had been written into the master too, on every kernel; it is never undone."""
    (params, masters), (ref_params, ref_masters) = _behind_the_back(
        name, impl, how, torch.device("cpu")
    )
    _assert_same_bits([*params, *masters], [*ref_params, *ref_masters])
    if how != "some":
        assert float((params[0].float() - _WRITTEN).abs().max()) < 0.1


@pytest.mark.parametrize("how", ["fill", "some"])
@pytest.mark.parametrize("impl", ["auto", "foreach"])
def test_a_transposed_param_written_behind_the_steps_back_is_kept(impl: str, how: str) -> None:
    (params, masters), (ref_params, ref_masters) = _behind_the_back(
        "adamw", impl, how, torch.device("cpu"), transposed=True
    )
    assert not params[0].is_contiguous()
    _assert_same_bits([*params, *masters], [*ref_params, *ref_masters])


def test_a_skipped_step_keeps_the_master_and_the_next_one_refreshes() -> None:
    (params, masters), (ref_params, ref_masters) = _behind_the_back(
        "adamw", "auto", "fill", torch.device("cpu"), skip_first=True
    )
    _assert_same_bits([*params, *masters], [*ref_params, *ref_masters])


@pytest.mark.xla
@pytest.mark.parametrize("name", ["adamw", "sgd", "lion"])
@pytest.mark.parametrize("impl", ["auto", "foreach"])
def test_a_param_written_behind_the_steps_back_is_kept_on_xla(
    xla_device: torch.device, name: str, impl: str
) -> None:
    (params, masters), (ref_params, ref_masters) = _behind_the_back(name, impl, "fill", xla_device)
    _assert_same_bits([*params, *masters], [*ref_params, *ref_masters])
    assert float((params[0].float() - _WRITTEN).abs().max()) < 0.1


def test_master_optimizer_keeps_a_write_through_data() -> None:
    """The issue's case: with the default "fp32" strategy, ``p.data.fill_(7)`` between
    steps of MasterOptimizer is kept, as torch.optim keeps it (0.43 came back before)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4).bfloat16()
    ref = torch.nn.Linear(8, 4)
    ref.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    opt = mpfunc.MasterOptimizer(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    x = torch.randn(16, 8)
    for k in range(3):
        for m, o in ((model, opt), (ref, ref_opt)):
            m(x.to(next(m.parameters()).dtype)).square().mean().backward()
            o.step()
            o.zero_grad()
        if k == 0:
            model.weight.data.fill_(7)
            ref.weight.data.fill_(7)
    w, w_ref = model.weight.detach().float(), ref.weight.detach()
    assert float((w - w_ref).abs().max()) < 0.05
    assert float(w.mean()) > 6.9

"""One tensor under two names (tied weights, views, detached copies, expanded XLA
tensors) is refused naming both paths; tied ``named_parameters`` train once, as
torch.optim does; int buffers and adjacent views are not aliases."""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest
import torch
from support.hardening import _SHARED, BF16, F32, B, W, _alias, _at, _rand, _windows
from support.helpers import settle

import mpfunc

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

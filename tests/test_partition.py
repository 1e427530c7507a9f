"""Per-leaf hyperparameters (``partition``) against torch.optim param groups."""

from __future__ import annotations

import optree
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from support.helpers import leaves
from support.strategies import realize, specs
from support.trees import grads_for, model_tree

import mpfunc


@pytest.mark.parametrize("how", ["predicate", "label-tree"])
def test_no_weight_decay_on_biases_matches_param_groups(how: str) -> None:
    params = model_tree()
    opts = {
        "decay": mpfunc.adamw(lr=1e-2, weight_decay=0.1),
        "no_decay": mpfunc.adamw(lr=1e-2, weight_decay=0.0),
    }
    if how == "predicate":
        labels = lambda path, p: "no_decay" if p.ndim < 2 else "decay"  # noqa: E731
    else:
        labels = {
            "emb": "decay",
            "layers": [{"w": "decay", "b": "no_decay"}, {"w": "decay", "b": "no_decay"}],
            "ln": {"weight": "no_decay", "steps": None},
        }
    opt = mpfunc.partition(opts, labels)
    masters = mpfunc.init_master(params)
    state = opt.init(masters)
    assert set(state) == {"decay", "no_decay"}

    decay = [masters["emb"], masters["layers"][0]["w"], masters["layers"][1]["w"]]
    no_decay = [masters["layers"][0]["b"], masters["layers"][1]["b"], masters["ln"]["weight"]]
    ref_decay = [t.clone() for t in decay]
    ref_no = [t.clone() for t in no_decay]
    ref = torch.optim.AdamW(
        [{"params": ref_decay, "weight_decay": 0.1}, {"params": ref_no, "weight_decay": 0.0}],
        lr=1e-2,
        fused=True,
    )
    for k in range(5):
        g = grads_for(k, params)
        masters, state = mpfunc.apply_update(masters, g, state, opt)
        gd = [g["emb"], g["layers"][0]["w"], g["layers"][1]["w"]]
        gn = [g["layers"][0]["b"], g["layers"][1]["b"], g["ln"]["weight"]]
        for r, gg in zip(ref_decay + ref_no, gd + gn):
            r.grad = gg
        ref.step()
    got = [masters["emb"], masters["layers"][0]["w"], masters["layers"][1]["w"]]
    got += [masters["layers"][0]["b"], masters["layers"][1]["b"], masters["ln"]["weight"]]
    for a, b in zip(got, ref_decay + ref_no):
        assert torch.equal(a, b)  # the fused kernels on both sides: bit for bit
    assert masters["ln"]["steps"] is None


def test_partition_checks_every_state_before_writing() -> None:
    """A bad sub-state is found before any sub-optimizer writes."""
    params = model_tree()
    labels = lambda path, p: "a" if path.startswith("emb") else "b"  # noqa: E731
    opt = mpfunc.partition({"a": mpfunc.sgd(lr=0.1), "b": mpfunc.sgd(lr=0.1, momentum=0.9)}, labels)
    plain = mpfunc.partition({"a": mpfunc.sgd(lr=0.1), "b": mpfunc.sgd(lr=0.1)}, labels)
    masters = mpfunc.init_master(params)
    state = opt.init(masters)
    bad = dict(state, b=plain.init(masters)["b"])  # "b" without its momentum buffer
    before = masters["emb"].clone()
    with pytest.raises(ValueError, match="momentum_buffer"):
        mpfunc.apply_update_(masters, grads_for(0, params), bad, opt)
    assert torch.equal(masters["emb"], before)


@settings(max_examples=25)
@given(data=st.data())
def test_partition_matches_param_groups_on_every_device(
    device: torch.device, data: st.DataObject
) -> None:
    """For random trees, labels by rank (no decay below 2-d) and 1 to 6 steps, ``partition``
    equals torch.optim.AdamW with two param groups on fp32 CPU copies: within the stated
    bound (max|a - b| <= 1e-6 * M) on every device."""
    spec = data.draw(specs(dtypes=[torch.float32]))
    steps = data.draw(st.integers(1, 6))
    params = realize(spec, device)
    masters = mpfunc.init_master(params)
    opt = mpfunc.partition(
        {
            "decay": mpfunc.adamw(lr=1e-2, weight_decay=0.1),
            "no_decay": mpfunc.adamw(lr=1e-2, weight_decay=0.0),
        },
        lambda path, p: "no_decay" if p.ndim < 2 else "decay",
    )
    state = opt.init(masters)
    m_leaves = [m for m in leaves(masters) if m is not None]
    refs = [m.detach().cpu().clone() for m in m_leaves]
    groups = [
        {"params": [r for r, m in zip(refs, m_leaves) if m.ndim >= 2], "weight_decay": 0.1},
        {"params": [r for r, m in zip(refs, m_leaves) if m.ndim < 2], "weight_decay": 0.0},
    ]
    ref = torch.optim.AdamW([g for g in groups if g["params"]] or [torch.zeros(1)], lr=1e-2)
    peak = [float(r.abs().max()) if r.numel() else 0.0 for r in refs]
    for k in range(steps):
        g = realize(spec, device, salt=k + 1, dtype=torch.float32)
        g = optree.tree_map(lambda m, x: None if m is None else x, masters, g, none_is_leaf=True)
        masters, state = mpfunc.apply_update(masters, g, state, opt)
        for r, x in zip(refs, [x for x in leaves(g) if x is not None]):
            r.grad = x.detach().cpu()
        ref.step()
        peak = [max(p, float(r.abs().max())) if r.numel() else p for p, r in zip(peak, refs)]
    got = [m for m in leaves(masters) if m is not None]
    for m, r, top in zip(got, refs, peak):
        assert m.device.type == device.type
        if r.numel():
            assert float((m.cpu() - r).abs().max()) <= 1e-6 * top

"""Property-test your own mixed-precision step with ``mpfunc.testing``, before a TPU run.

The step under test is a custom one (loss-scale unscaling, a skip on non-finite grads,
global-norm clipping, AdamW on fp32 masters, rounding into the model). Two checks:

1. On the CPU, for parameter and grad trees that hypothesis draws (nested containers,
   bf16/fp16, transposed, channels_last, sliced and expanded layouts, ``None`` grads),
   N steps stay within ``max|a - b| <= 1e-6 * M`` of the same recipe written with
   torch.optim on fp32 copies (``torch.nn.utils.clip_grad_norm_`` + ``AdamW``), and the
   model is its masters rounded, bit for bit.
2. On XLA:CPU (``PJRT_DEVICE=CPU``, if torch_xla is installed), a full training step
   compiles nothing after warm-up, runs one graph, reads nothing back and falls back to
   the CPU for no op.

    python examples/property_test_loop.py --examples 50
"""

from __future__ import annotations

import argparse
from typing import Any

import optree
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mpfunc
import mpfunc.testing as mt

LR, MAX_NORM, SCALE = 1e-2, 1.0, 2.0**10


def leaves(tree: Any) -> list[Any]:
    return optree.tree_leaves(tree, none_is_leaf=True)  # None keeps its slot, as in mpfunc


def my_step(masters: Any, state: Any, params: Any, grads: Any, opt: Any) -> tuple[Any, Any, Any]:
    """The step being tested: grads arrive scaled by SCALE (as after a scaled backward)."""
    g32 = mpfunc.grads_to_fp32(grads, scale=SCALE)  # upcast and unscale
    finite = mpfunc.all_finite(g32)
    g32, _ = mpfunc.clip_by_global_norm(g32, MAX_NORM)
    masters, state = mpfunc.apply_update(masters, g32, state, opt, skip=~finite)
    return masters, state, mpfunc.masters_to_model(masters, params)


class Reference:
    """The same recipe with torch.optim on contiguous fp32 copies of the floating params."""

    def __init__(self, params: Any) -> None:
        flat, self.spec = optree.tree_flatten(params, none_is_leaf=True)
        self.ps = [
            torch.nn.Parameter(p.detach().float().contiguous())
            if isinstance(p, torch.Tensor) and p.is_floating_point() else None
            for p in flat
        ]  # fmt: skip
        self.live = [p for p in self.ps if p is not None]
        self.opt = torch.optim.AdamW(self.live, lr=LR) if self.live else None

    def step(self, grads: Any) -> Any:
        for p, g in zip(self.ps, leaves(grads)):
            if p is not None:
                p.grad = None if g is None else g.float() / SCALE
        with_grad = [p for p in self.live if p.grad is not None]
        finite = all(bool(torch.isfinite(p.grad).all()) for p in with_grad)  # type: ignore[arg-type]
        if finite and with_grad and self.opt is not None:  # the host may read: a reference
            torch.nn.utils.clip_grad_norm_(with_grad, MAX_NORM)
            self.opt.step()
        return optree.tree_unflatten(
            self.spec, [None if p is None else p.detach() for p in self.ps]
        )


def check_against_torch(examples: int, steps: int = 4) -> None:
    @settings(max_examples=examples, deadline=None)
    @given(params=mt.param_trees(max_leaves=4), data=st.data())
    def prop(params: Any, data: st.DataObject) -> None:
        grads = [data.draw(mt.grad_trees(params, scales=(1e-3, 1.0)), label=f"grads{i}")
                 for i in range(steps)]  # fmt: skip
        opt = mpfunc.adamw(lr=LR)
        run = {"masters": mpfunc.init_master(params)}
        run["state"] = opt.init(run["masters"])
        ref = Reference(params)

        def mine(i: int) -> Any:
            run["masters"], run["state"], run["params"] = my_step(
                run["masters"], run["state"], params, grads[i], opt
            )
            return run["masters"]

        mt.assert_steps_agree(mine, lambda i: ref.step(grads[i]), steps, rtol=1e-6)
        # The model is its masters rounded, bit for bit.
        for p, m in zip(leaves(run.get("params", params)), leaves(run["masters"])):
            if m is not None:
                assert torch.equal(p, m.to(p.dtype))

    prop()
    print(f"CPU: {examples} drawn trees x {steps} steps agree with torch.optim within 1e-6*M")


class TinyModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(16, 32)
        self.norm = torch.nn.LayerNorm(32)
        self.head = torch.nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.emb(x)))


def check_xla_stable(steps: int = 5) -> mt.XlaReport | None:
    try:
        import torch_xla
    except ImportError:
        print("XLA: torch_xla is not installed; skipped")
        return None
    device = torch_xla.device()
    torch.manual_seed(0)
    model = TinyModel().to(torch.bfloat16).to(device)
    params = dict(model.named_parameters())
    lr = torch.tensor(LR, device=device)
    opt = mpfunc.adamw(lr=lr)
    masters = mpfunc.init_master(params)
    state = opt.init(masters)
    g32_buf = mpfunc.init_grads(params)
    x = torch.randint(0, 16, (8,), device=device)

    def step(i: int) -> None:
        loss = torch.nn.functional.cross_entropy(model(x).float(), x)
        (loss * SCALE).backward()
        g32 = mpfunc.grads_to_fp32_({n: p.grad for n, p in params.items()}, g32_buf, scale=SCALE)
        finite = mpfunc.all_finite(g32)
        mpfunc.clip_by_global_norm_(g32, MAX_NORM)
        mpfunc.apply_update_(masters, g32, state, opt, skip=~finite)
        mpfunc.masters_to_model_(masters, params)
        model.zero_grad(set_to_none=True)
        lr.fill_(LR * 0.9**i)  # a schedule, changed in place: no recompile

    report = mt.xla_step_report(step, steps=steps, warmup=2)
    for i, s in enumerate(report.steps, start=report.warmup):
        print(
            f"XLA step {i}: {s.compiles} compiles, {s.graphs} graph(s), "
            f"{s.transfers_to_host} transfers to host, fallbacks {s.fallbacks or 'none'}"
        )
    report.assert_stable()
    return report


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", type=int, default=50, help="hypothesis examples on the CPU")
    ap.add_argument("--no-xla", action="store_true", help="skip the XLA stability check")
    args = ap.parse_args(argv)
    check_against_torch(args.examples)
    if not args.no_xla:
        check_xla_stable()


if __name__ == "__main__":
    main()

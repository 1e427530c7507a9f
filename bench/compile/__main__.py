"""A bf16 training step with mpfunc's single-pass update, eager against torch.compile.

One run, side by side on one machine: the first compiled call's time (dynamo tracing
plus inductor), then the median step time of eager and compiled steps over the same
data, for the whole step (forward, backward, ``apply_update_(..., params=)``) and for
the update alone (``fullgraph=True``). adamw, tensor lr, "fp32" masters.

    python -m bench.compile            # about 2 minutes on 2 quiet CPU cores
    python -m bench.compile --smoke    # a tiny model, to check that it runs
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

import mpfunc


def _loop(width: int, depth: int, strategy: str) -> Any:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(width, 16)).to(torch.bfloat16)
    params = dict(model.named_parameters())
    masters = mpfunc.init_master(params, strategy=strategy)
    lr = torch.tensor(1e-4)
    opt = mpfunc.adamw(lr=lr, weight_decay=0.1)
    return model, params, masters, opt, opt.init(masters), lr


def _time(fn: Callable[[], None], steps: int) -> float:
    samples = []
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e3


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--strategy", default="fp32")
    args = ap.parse_args(argv)
    width, depth, batch, steps = (32, 2, 8, 3) if args.smoke else (512, 4, 64, 20)
    model, params, masters, opt, state, lr = _loop(width, depth, args.strategy)
    x = torch.randn(batch, width).to(torch.bfloat16)
    y = torch.randn(batch, 16)

    def train() -> None:
        model.zero_grad(set_to_none=True)
        F.mse_loss(model(x).float(), y).backward()
        grads = {n: p.grad for n, p in params.items()}
        mpfunc.apply_update_(masters, grads, state, opt, params=params)

    grads = {n: torch.randn_like(p) for n, p in params.items()}

    def update() -> None:
        mpfunc.apply_update_(masters, grads, state, opt, params=params)

    rows = []
    n = sum(p.numel() for p in params.values())
    cases = (("training step", train, {}), ("update alone", update, {"fullgraph": True}))
    for name, fn, kw in cases:
        fn()  # warm-up
        eager = _time(fn, steps)
        torch._dynamo.reset()
        compiled = torch.compile(fn, **kw)
        start = time.perf_counter()
        compiled()
        first = time.perf_counter() - start
        lr.fill_(5e-5)  # a new lr value: no recompile
        fast = _time(compiled, steps)
        rows.append((name, first, eager, fast))
    print(
        f"{len(params)} tensors, {n / 1e6:.2f}M params, bf16, batch {batch}, "
        f"strategy {args.strategy!r}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads"
    )
    print("| step | first compiled call (s) | eager ms | compiled ms | compiled / eager |")
    print("|---|---|---|---|---|")
    for name, first, eager, fast in rows:
        print(f"| {name} | {first:.1f} | {eager:.2f} | {fast:.2f} | {fast / eager:.2f}x |")


if __name__ == "__main__":
    main()

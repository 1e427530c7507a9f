"""Many small leaves: what per-leaf Python costs, per (master strategy, state format).

For each pair, in one process: ``init_master``, ``opt.init``, the first
``apply_update_`` (every check and the plan in full) and the best of a few later ones
(the memo's path), on ``--leaves`` bf16 params of ``--numel`` elements each (AdamW, bf16
grads; the ``"fp32"`` pairs write the rounded params too). Beside them, torch's own
``AdamW(fused=True)`` on fp32 leaves of the same shapes: its construction with the first
step, and a later step. Seconds, not ratios: the cost is Python per leaf, and the question
is whether 100,000 leaves take seconds or minutes. The load average is recorded: on a
shared machine every figure is inflated when it exceeds the cores.

    python -m bench.leaves                           # 100,000 leaves of 64, ~5 minutes
    python -m bench.leaves --smoke --out /tmp/l      # seconds
    python -m bench.leaves --out bench/results/leaves   # refresh the committed results
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

import mpfunc
from bench.common import meta as meta_mod
from bench.common.machine import load_avg
from bench.common.report import fmt, header, write_json

STRATEGIES = ("fp32", "remainder", "kahan", "stochastic", "none")
FORMATS: dict[str, torch.dtype | None] = {
    "fp32": None,
    "bf16": torch.bfloat16,
    "uint8": torch.uint8,
}
LATER = 3  # later steps timed; the best is reported


def _timed(fn: Any) -> tuple[Any, float]:
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def _pair(
    strategy: str, state_dtype: torch.dtype | None, leaves: int, numel: int
) -> dict[str, Any]:
    params = {f"p{i}": torch.randn(numel).to(torch.bfloat16) for i in range(leaves)}
    grads = {k: (torch.randn(numel) * 1e-2).to(torch.bfloat16) for k in params}
    masters, t_master = _timed(lambda: mpfunc.init_master(params, strategy=strategy))
    opt = mpfunc.adamw(1e-3, state_dtype=state_dtype)
    state, t_init = _timed(lambda: opt.init(masters))
    kw = {"params": params} if strategy == "fp32" else {}

    def step() -> Any:
        return mpfunc.apply_update_(masters, grads, state, opt, **kw)

    _, t_first = _timed(step)
    later = [_timed(step)[1] for _ in range(LATER)]
    return {
        "init_master_s": t_master,
        "opt_init_s": t_init,
        "first_step_s": t_first,
        "later_step_s": min(later),
        "later_steps_s": later,
    }


def _torch(leaves: int, numel: int) -> dict[str, Any]:
    ps = [torch.nn.Parameter(torch.randn(numel)) for _ in range(leaves)]
    for p in ps:
        p.grad = torch.randn(numel) * 1e-2

    def first() -> Any:
        opt = torch.optim.AdamW(ps, lr=1e-3, fused=True)
        opt.step()
        return opt

    opt, t_first = _timed(first)
    later = [_timed(opt.step)[1] for _ in range(LATER)]
    return {"first_step_s": t_first, "later_step_s": min(later), "later_steps_s": later}


def run(args: argparse.Namespace) -> dict[str, Any]:
    run_meta = meta_mod.Run("leaves", args.argv)
    torch.set_num_threads(args.threads)
    mpfunc.init_master({"w": torch.zeros(64, dtype=torch.bfloat16)})  # imports, not timed
    load0 = load_avg()
    rows = []
    for strategy in args.strategies:
        for name in args.formats:
            row = {
                "strategy": strategy,
                "state": name,
                **_pair(strategy, FORMATS[name], args.leaves, args.numel),
            }
            rows.append(row)
            print(_line(row), flush=True)
    ref = _torch(args.leaves, args.numel)
    return {
        "meta": run_meta.finish(threads=args.threads),
        "leaves": args.leaves,
        "numel_per_leaf": args.numel,
        "threads": args.threads,
        "load_avg": {"start": load0, "end": load_avg()},
        "rows": rows,
        "torch_fused_fp32": ref,
    }


def _line(r: dict[str, Any]) -> str:
    return (
        f"| {r['strategy']} | {r['state']} | {r['init_master_s']:.2f} | {r['opt_init_s']:.2f} | "
        f"{r['first_step_s']:.2f} | {r['later_step_s']:.2f} |"
    )


def render(result: dict[str, Any]) -> str:
    cores = os.cpu_count() or 1
    load = result["load_avg"]
    busy = max((x for x in load.values() if x is not None), default=None)
    ref = result["torch_fused_fp32"]
    return "\n".join(
        [
            "# Many small leaves: setup and step, in seconds",
            "",
            *header(result["meta"]),
            "",
            f"{result['leaves']:,} leaves of {result['numel_per_leaf']} elements, "
            f"{result['threads']} thread{'s' if result['threads'] != 1 else ''}. Load average "
            f"{fmt(load['start'], '{:.2f}')} -> {fmt(load['end'], '{:.2f}')}"
            + (
                f" (WARNING: above the {cores} cores; timings are inflated)"
                if busy and busy > cores
                else ""
            ),
            "",
            "| strategy | state | init_master | opt.init | first step | later step (best) |",
            "|---|---|--:|--:|--:|--:|",
            *(_line(r) for r in result["rows"]),
            f"| torch AdamW(fused=True), fp32 | fp32 | | | {ref['first_step_s']:.2f} "
            f"(with construction) | {ref['later_step_s']:.2f} |",
            "",
        ]
    )


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.leaves", description=__doc__.splitlines()[0])
    p.add_argument("--leaves", type=int, default=100_000)
    p.add_argument("--numel", type=int, default=64, help="elements per leaf (8-bit state: >= 32)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--formats", default=",".join(FORMATS))
    p.add_argument("--smoke", action="store_true", help="1,000 leaves")
    meta_mod.add_out_argument(p, "leaves")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.strategies = str(args.strategies).split(",")
    args.formats = str(args.formats).split(",")
    if args.smoke:
        args.leaves = min(args.leaves, 1000)
    result = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(args.out / "leaves.json", result)
    (args.out / "leaves.md").write_text(render(result))
    print(f"wrote {args.out / 'leaves.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

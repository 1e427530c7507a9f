"""Two or more builds of the native kernel, one AdamW step each, side by side in one process.

A kernel change is judged against the build before it: each build's library (a cached
``mpfunc_native_<hash>.so``, e.g. main's and a branch's, after ``python -m
mpfunc.backends._native`` in each checkout) is loaded under its own name, and round by round
every pair steps once with each build (the planner calls whichever is installed). With 1
thread the clock is the thread's CPU time, which other processes on a busy machine do not
inflate (caches and SMT siblings still do); with more, wall time. Each row is the median,
over rounds, of a build's time divided by the first build's time in the same round.

    python -m bench.native_builds OLD.so NEW.so [--pairs stochastic+uint8,fp32+uint4]
    python -m bench.native_builds --smoke       # the installed build against itself
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

import mpfunc
from bench.common.machine import load_avg
from bench.common.report import fmt
from mpfunc.backends import _native

# State formats by name (fp32: moments in fp32).
FORMATS = {"uint8": torch.uint8, "uint4": torch.uint4, "bfloat16": torch.bfloat16, "fp32": None}  # type: ignore[attr-defined]


def _library(path: str) -> ModuleType:
    """The extension at ``path`` loaded under its own module name (its file's stem)."""
    name = Path(path).name.split(".")[0]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"{path}: not a loadable extension")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _step(pair: str, numel: int, tensors: int) -> Callable[[], Any]:
    strategy, fmt = pair.split("+")
    params = {f"p{i}": torch.randn(numel // tensors).to(torch.bfloat16) for i in range(tensors)}
    grads = {k: (torch.randn(v.shape) * 1e-2).to(torch.bfloat16) for k, v in params.items()}
    masters = mpfunc.init_master(params, strategy=strategy)
    opt = mpfunc.adamw(lr=1e-3, state_dtype=FORMATS[fmt])
    state = opt.init(masters)
    kw = {"params": params} if strategy == "fp32" else {}
    return lambda: mpfunc.apply_update_(masters, grads, state, opt, **kw)


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    torch.set_num_threads(args.threads)
    libs = [_library(p) for p in args.builds] if args.builds else [_native.load()] * 2
    _native.load()
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    steps = {p: _step(p, args.numel, args.tensors) for p in args.pairs}
    installed = _native._module
    try:
        for lib in libs:  # warm-up: first-call checks and plans, per build
            _native._module = lib
            for step in steps.values():
                step()
        times = {(p, b): [] for p in steps for b in range(len(libs))}  # type: ignore[var-annotated]
        for _ in range(args.rounds):
            for p, step in steps.items():
                for b, lib in enumerate(libs):
                    _native._module = lib
                    t = clock()
                    step()
                    times[(p, b)].append(clock() - t)
    finally:
        _native._module = installed
    rows = []
    for p in steps:
        base = times[(p, 0)]
        ratios = [
            statistics.median(t / b0 for t, b0 in zip(times[(p, b)], base))
            for b in range(len(libs))
        ]
        rows.append({"pair": p, "first_ms": statistics.median(base) * 1e3, "ratios": ratios})
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.native_builds", description=__doc__.splitlines()[0]
    )
    p.add_argument("builds", nargs="*", help="paths of the builds' .so files, the first the base")
    p.add_argument("--pairs", default="stochastic+uint8,fp32+uint8,stochastic+uint4,fp32+uint4")
    p.add_argument("--numel", type=int, default=1 << 23)
    p.add_argument("--tensors", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--smoke", action="store_true", help="tiny sizes, 3 rounds")
    args = p.parse_args(argv)
    if len(args.builds) == 1:
        p.error("give two builds or more (or none, with --smoke)")
    if not args.builds and not args.smoke:
        p.error("give the builds' .so files (or --smoke)")
    args.pairs = [x.strip() for x in args.pairs.split(",") if x.strip()]
    if args.smoke:
        args.numel, args.tensors, args.rounds = 1 << 14, 2, 3
    load0 = load_avg()
    rows = run(args)
    print(
        f"load average {fmt(load0, '{:.2f}')} -> {fmt(load_avg(), '{:.2f}')}, "
        f"{args.threads} thread(s), {args.rounds} rounds"
    )
    names = [Path(b).name.split(".")[0] for b in args.builds] or ["installed", "installed"]
    print("| pair | first build, ms | " + " | ".join(names[1:]) + " (ratio to the first) |")
    print("|---|--:|" + "--:|" * (len(names) - 1))
    for r in rows:
        cells = " | ".join(f"{x:.3f}" for x in r["ratios"][1:])
        print(f"| {r['pair']} | {r['first_ms']:.2f} | {cells} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

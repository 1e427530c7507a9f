"""Every (master strategy, state format) pair of one AdamW step, side by side with the peers.

One process, contenders interleaved round by round (a round times each contender once), at
each thread count in turn. Each row is the median over rounds of the row's time divided by
torch's fused fp32 AdamW (``torch.optim.AdamW(fused=True)`` on an fp32 tree of the same
shapes) in the same round, with the 25th-75th percentile of those ratios: medians of
per-round ratios hold up when other work slows the machine for a while. mpfunc steps take
bf16 grads and leave bf16 params (the ``"fp32"`` pairs write the rounded params too).

Peers run where they import (installed by the ``bench`` extra): torch-optimi's AdamW with
``kahan_sum=True``, bitsandbytes' AdamW8bit (its CPU backend), torchao's AdamW8bit,
AdamW4bit and ``_AdamW(bf16_stochastic_round=True)`` (each step wrapped in torch.compile
by torchao; compiled once, before the timed rounds), all on bf16 params and grads. A peer
that cannot import or run is a row that says why.

    python -m bench.pairs                        # 8M params, 1 and 2 threads, ~2 minutes
    python -m bench.pairs --count                # also 10,000 leaves of 1,000 elements
    python -m bench.pairs --smoke --out /tmp/p   # seconds
    python -m bench.pairs --out bench/results/pairs   # refresh the committed results

``--optimizer sgd`` or ``lion`` times the same pairs for SGD (momentum 0.9) or Lion instead,
each against torch's own step on an fp32 tree of the same shapes: ``torch.optim.SGD``
(``foreach=True``, momentum 0.9) for SGD; fused AdamW (the base) and foreach AdamW for Lion,
torch having no Lion. No peers there (theirs are AdamW steps).

    python -m bench.pairs --optimizer sgd --threads 2,1 --out bench/results/pairs_sgd
    python -m bench.pairs --optimizer lion --threads 2,1 --out bench/results/pairs_lion

(2 threads first: after a 1-thread part, torch's foreach SGD ran 30x slower at 2 threads in
the same process on the machine measured.)
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

import mpfunc
from bench.common import meta as meta_mod
from bench.common import peers as peer_mod
from bench.common.machine import load_avg
from bench.common.report import fmt, header, ratio_rows, write_json

BF16 = torch.bfloat16
U8 = torch.uint8
U4: torch.dtype = torch.uint4  # type: ignore[attr-defined]

# (strategy, state_dtype, persistent bytes per param: param + master/buffer + moments)
PAIRS: list[tuple[str, torch.dtype | None, float]] = [
    ("fp32", None, 2 + 4 + 8),
    ("remainder", None, 2 + 2 + 0.125 + 8),  # + one tie bit per element
    ("kahan", BF16, 2 + 2 + 4),
    ("fp32", U8, 2 + 4 + 2.125),
    ("remainder", U8, 2 + 2 + 0.125 + 2.125),
    ("kahan", U8, 2 + 2 + 2.125),
    ("stochastic", BF16, 2 + 4),
    ("stochastic", U8, 2 + 2.125),
    ("none", BF16, 2 + 4),
    # 4-bit moments (issue 22).
    ("fp32", U4, 2 + 4 + 1.125),
    ("stochastic", U4, 2 + 1.125),
]

Step = Callable[[], Any]
# Bytes per param of each state format's moment: SGD and Lion keep one where AdamW keeps two.
MOMENT_BYTES = {None: 4.0, BF16: 2.0, U8: 1.0625, U4: 0.5625}
# The row every ratio divides by, per optimizer.
BASE = {
    "adamw": "torch fused fp32 AdamW",
    "sgd": "torch foreach fp32 SGD (momentum 0.9)",
    "lion": "torch fused fp32 AdamW",
}


def _shapes(numel: int, tensors: int) -> list[tuple[int]]:
    return [(numel // tensors,)] * tensors


def _torch_fused(shapes: list[tuple[int]], kind: str = "fused adamw") -> Step:
    """torch's own step on an fp32 tree: fused or foreach AdamW, or foreach SGD."""
    ps = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    for p in ps:
        p.grad = torch.randn(p.shape) * 1e-2
    if kind == "foreach sgd":
        opt: torch.optim.Optimizer = torch.optim.SGD(ps, lr=1e-3, momentum=0.9, foreach=True)
    else:
        fused = kind == "fused adamw"
        opt = torch.optim.AdamW(ps, lr=1e-3, fused=fused, foreach=not fused)
    return opt.step


def _mpfunc(
    shapes: list[tuple[int]], strategy: str, state_dtype: torch.dtype | None, optimizer: str
) -> Step:
    params = {f"p{i}": torch.randn(s).to(BF16) for i, s in enumerate(shapes)}
    grads = {k: (torch.randn(v.shape) * 1e-2).to(BF16) for k, v in params.items()}
    masters = mpfunc.init_master(params, strategy=strategy)
    if optimizer == "sgd":
        opt = mpfunc.sgd(lr=1e-3, momentum=0.9, state_dtype=state_dtype)
    elif optimizer == "lion":
        opt = mpfunc.lion(lr=1e-4, state_dtype=state_dtype)
    else:
        opt = mpfunc.adamw(lr=1e-3, state_dtype=state_dtype)
    state = opt.init(masters)
    kw = {"params": params} if strategy == "fp32" else {}
    return lambda: mpfunc.apply_update_(masters, grads, state, opt, **kw)


def _torch_step(make: Callable[[list[torch.nn.Parameter]], Any], shapes: list[tuple[int]]) -> Step:
    ps = [torch.nn.Parameter(torch.randn(s).to(BF16)) for s in shapes]
    for p in ps:
        p.grad = (torch.randn(p.shape) * 1e-2).to(BF16)
    opt = make(ps)
    return opt.step


def _peers() -> list[tuple[str, float, Callable[[list[torch.nn.Parameter]], Any]]]:
    """(name, persistent bytes per param, factory) of each peer; factories import lazily."""

    def optimi_kahan(ps: list[torch.nn.Parameter]) -> Any:
        import optimi

        return optimi.AdamW(ps, lr=1e-3, kahan_sum=True)

    def bnb_8bit(ps: list[torch.nn.Parameter]) -> Any:
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(ps, lr=1e-3)

    def shared(name: str) -> Callable[[list[torch.nn.Parameter]], Any]:
        # A peer of bench.common.peers (its mode's keywords there), at FlashAdamW's and
        # torch's AdamW defaults.
        def make(ps: list[torch.nn.Parameter]) -> Any:
            return peer_mod.make(name, ps, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)

        return make

    def torchao(name: str, **kw: Any) -> Callable[[list[torch.nn.Parameter]], Any]:
        def make(ps: list[torch.nn.Parameter]) -> Any:
            from torchao import optim as ao

            return getattr(ao, name)(ps, lr=1e-3, **kw)

        return make

    return [
        ("torch-optimi AdamW kahan_sum (bf16 state)", 2 + 2 + 4, optimi_kahan),
        ("bitsandbytes AdamW8bit (CPU backend)", 2 + 2.0, bnb_8bit),
        ("torchao AdamW8bit (compiled)", 2 + 2.0, torchao("AdamW8bit")),
        ("torchao AdamW4bit (compiled)", 2 + 1.0, torchao("AdamW4bit")),
        (
            "torchao _AdamW bf16_stochastic_round (compiled)",
            2 + 4,
            torchao("_AdamW", bf16_stochastic_round=True),
        ),
        # FlashOptim: its one mode without CUDA (bf16 moments, no master bits), and its
        # default, a row that says it needs CUDA here.
        ("FlashOptim FlashAdamW plain bf16 (quantize=False)", 2 + 4, shared("flashoptim-bf16")),
        ("FlashOptim FlashAdamW (8-bit state, 24-bit masters)", 2 + 2 + 1, shared("flashoptim")),
    ]


def _pair_key(strategy: str, sd: torch.dtype | None) -> str:
    """The name ``--pairs`` knows a pair by: ``strategy+format``, e.g. ``stochastic+uint8``."""
    return f"{strategy}+{'fp32' if sd is None else str(sd).removeprefix('torch.')}"


def _contenders(
    shapes: list[tuple[int]],
    peers: bool,
    optimizer: str = "adamw",
    pairs: Sequence[str] | None = None,
) -> tuple[dict[str, tuple[float, Step]], dict[str, str]]:
    """name -> (bytes per param, step), and name -> why a peer could not run.

    ``pairs``: the ``_pair_key`` names to time (None: every pair).
    """
    out: dict[str, tuple[float, Step]] = {"torch fused fp32 AdamW": (4 + 8, _torch_fused(shapes))}
    if optimizer == "sgd":
        out = {BASE["sgd"]: (4 + 4, _torch_fused(shapes, "foreach sgd"))}
    elif optimizer == "lion":
        out["torch foreach fp32 AdamW"] = (4 + 8, _torch_fused(shapes, "foreach adamw"))
    one = optimizer != "adamw"  # one moment, not two
    for strategy, sd, nbytes in PAIRS:
        if pairs is not None and _pair_key(strategy, sd) not in pairs:
            continue
        name = f"mpfunc {strategy} + {'fp32' if sd is None else str(sd).removeprefix('torch.')}"
        if one:
            name = f"{name} ({optimizer})"
            nbytes -= MOMENT_BYTES[sd]
        out[name] = (nbytes, _mpfunc(shapes, strategy, sd, optimizer))
    failed: dict[str, str] = {}
    if peers:
        for name, nbytes, make in _peers():
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    step = _torch_step(make, shapes)
                    step()  # compiles where the peer compiles; fails here if it cannot run
                out[name] = (nbytes, step)
            except Exception as e:
                failed[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
                traceback.print_exc(limit=1, file=sys.stderr)
    return out, failed


def _measure(contenders: dict[str, tuple[float, Step]], rounds: int) -> dict[str, list[float]]:
    for _, step in contenders.values():  # warm-up: first-call checks, plans, compiles
        step()
        step()
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(rounds):
        for name, (_, step) in contenders.items():
            t = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - t)
    return times


def run(args: argparse.Namespace) -> dict[str, Any]:
    run_meta = meta_mod.Run("pairs", args.argv)
    configs = [("size", _shapes(args.numel, args.tensors), True)]
    if args.count:
        configs.append(("count", _shapes(args.count_leaves * 1000, args.count_leaves), False))
    parts = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        for label, shapes, peers in configs:
            load0 = load_avg()
            peers = peers and not args.no_peers and args.optimizer == "adamw"
            contenders, failed = _contenders(shapes, peers, args.optimizer, args.pairs)
            times = _measure(contenders, args.rounds)
            parts.append(
                {
                    "optimizer": args.optimizer,
                    "base": BASE[args.optimizer],
                    "threads": threads,
                    "config": label,
                    "tensors": len(shapes),
                    "numel": sum(math.prod(s) for s in shapes),
                    "load_avg": {"start": load0, "end": load_avg()},
                    "rows": ratio_rows(
                        times, {k: v[0] for k, v in contenders.items()}, BASE[args.optimizer]
                    ),
                    "failed": failed,
                }
            )
            print(render_part(parts[-1]), flush=True)
    return {"meta": run_meta.finish(threads=None), "parts": parts}


def render_part(part: dict[str, Any]) -> str:
    cores = os.cpu_count() or 1
    load = part["load_avg"]
    busy = max(x for x in load.values() if x is not None) if any(load.values()) else None
    lines = [
        f"### {part['numel']:,} params in {part['tensors']:,} tensors, {part['threads']} "
        f"thread{'s' if part['threads'] != 1 else ''}",
        "",
        f"Load average {fmt(load['start'], '{:.2f}')} -> {fmt(load['end'], '{:.2f}')}"
        + (
            f" (WARNING: above the {cores} cores; timings are inflated)"
            if busy and busy > cores
            else ""
        ),
        "",
        f"| contender | B/param | ms (median) | ratio to {part.get('base', BASE['adamw'])} "
        "| 25-75% |",
        "|---|--:|--:|--:|---|",
    ]
    for r in part["rows"]:
        lines.append(
            f"| {r['name']} | {r['bytes_per_param']:.3g} | {r['median_ms']:.2f} | "
            f"{r['ratio']:.2f} | {r['ratio_q25']:.2f}-{r['ratio_q75']:.2f} |"
        )
    for name, why in part["failed"].items():
        lines.append(f"| {name} | | | did not run | {why} |")
    return "\n".join(lines) + "\n"


def render(result: dict[str, Any]) -> str:
    optimizer = result["parts"][0].get("optimizer", "adamw") if result["parts"] else "adamw"
    title = {"adamw": "One AdamW step", "sgd": "One SGD step", "lion": "One Lion step"}
    out = [
        f"# {title[optimizer]} per (strategy, state format), beside the peers",
        "",
        *header(result["meta"]),
        "",
    ]
    for part in result["parts"]:
        out.append(render_part(part))
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.pairs", description=__doc__.splitlines()[0])
    p.add_argument("--numel", type=int, default=1 << 23, help="params in all (default 8M)")
    p.add_argument("--tensors", type=int, default=8)
    p.add_argument("--threads", default="1,2", help="comma list of torch thread counts")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--count", action="store_true", help="also 10,000 leaves of 1,000 elements")
    p.add_argument("--count-leaves", type=int, default=10_000)
    p.add_argument("--no-peers", action="store_true")
    p.add_argument(
        "--optimizer",
        choices=sorted(BASE),
        default="adamw",
        help="the step timed (sgd: momentum 0.9; no peers for sgd and lion)",
    )
    p.add_argument("--smoke", action="store_true", help="tiny sizes, 3 rounds, no peers")
    p.add_argument(
        "--pairs",
        default=None,
        help="comma list of the pairs to time, as strategy+format (e.g. stochastic+uint8,"
        "fp32+uint4; default: every pair); torch's own step is always timed",
    )
    meta_mod.add_out_argument(p, "pairs")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.threads = [int(t) for t in str(args.threads).split(",")]
    known = {_pair_key(st, sd) for st, sd, _ in PAIRS}
    if args.pairs is not None:
        args.pairs = [x.strip() for x in str(args.pairs).split(",") if x.strip()]
        unknown = sorted(set(args.pairs) - known)
        if unknown:
            p.error(f"--pairs: unknown {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    if args.smoke:
        args.numel, args.tensors, args.rounds, args.no_peers = 1 << 16, 4, 3, True
        args.count_leaves = 100
    result = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(args.out / "pairs.json", result)
    (args.out / "pairs.md").write_text(render(result))
    print(f"wrote {args.out / 'pairs.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

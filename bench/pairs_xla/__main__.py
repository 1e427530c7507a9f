"""Every (master strategy, state format) pair of one AdamW step on XLA, beside torch's own.

On XLA the host traces every op of a step, so the trace time is the step's host cost;
the rest is the device running the graph. One process, contenders interleaved round by
round; each row is the median over rounds of its time divided by torch's per-tensor
``torch.optim.AdamW(foreach=False)`` on an fp32 tree of the same shapes in the same round:
the host trace alone (the call returns with the graph pending), and the whole step (trace,
``torch_xla.sync()`` and waiting for the device), also as a ratio to mpfunc's ``"fp32"``
single pass (``fp32 + fp32``). ``torch_xla.amp.syncfree.AdamW`` (torch_xla's own
sync-free optimizer) runs beside them on the same fp32 tree. Each row also counts, over
the timed rounds, the compiles (0 after warm-up) and the graphs executed per step.
For mpfunc's rows, "node ms" is the part of the host trace spent in torch_xla's own calls
for the node (``_xla_kernels._run``: the user-computation call, the ``_foreach_copy_``
write-backs and the release of the node's results), which grows with the tensors a leaf
holds; the rest of the trace is mpfunc's Python (checks, layout, plan).
mpfunc steps take bf16 grads; the ``"fp32"`` pairs write the rounded bf16 params too.
Every pair is one node on XLA.

    PJRT_DEVICE=CPU python -m bench.pairs_xla                       # 101 leaves, ~3 minutes
    PJRT_DEVICE=CPU python -m bench.pairs_xla --smoke --out /tmp/p  # seconds
    PJRT_DEVICE=CPU python -m bench.pairs_xla --out bench/results/pairs_xla
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

import mpfunc
from bench.common import meta as meta_mod
from bench.common.machine import load_avg
from bench.common.report import fmt, header, write_json

STRATEGIES = ("fp32", "remainder", "kahan", "stochastic", "none")
STATES: tuple[torch.dtype | None, ...] = (
    None,
    torch.bfloat16,
    torch.uint8,
    torch.uint4,  # type: ignore[attr-defined]
)
BASE = "torch AdamW per-tensor (fp32)"
SYNCFREE = "torch_xla syncfree AdamW (fp32)"
FP32 = "mpfunc fp32 + fp32"


def _shapes(width: int, leaves: int) -> list[tuple[int, ...]]:
    """Half matrices, half vectors (a small transformer's mix): few distinct shapes."""
    return [(width, width) if i % 2 == 0 else (width,) for i in range(leaves)]


def _contenders(shapes: list[tuple[int, ...]], device: Any) -> dict[str, Callable[[], Any]]:
    gen = torch.Generator().manual_seed(0)

    def tree(dtype: torch.dtype) -> dict[str, torch.Tensor]:
        return {
            f"p{i}": torch.randn(s, generator=gen).to(dtype).to(device)
            for i, s in enumerate(shapes)
        }

    ref = [torch.nn.Parameter(t) for t in tree(torch.float32).values()]
    for p in ref:
        p.grad = torch.randn(p.shape, generator=gen).to(device)
    torch_opt = torch.optim.AdamW(ref, lr=1e-3, foreach=False)
    out: dict[str, Callable[[], Any]] = {BASE: torch_opt.step}
    from torch_xla.amp import syncfree

    ref2 = [torch.nn.Parameter(t) for t in tree(torch.float32).values()]
    for p in ref2:
        p.grad = torch.randn(p.shape, generator=gen).to(device)
    out[SYNCFREE] = syncfree.AdamW(ref2, lr=1e-3).step
    for strategy in STRATEGIES:
        for state_dtype in STATES:
            params = tree(torch.bfloat16)
            masters = mpfunc.init_master(params, strategy=strategy)
            opt = mpfunc.adamw(1e-3, state_dtype=state_dtype)
            state = opt.init(masters)
            grads = {
                k: torch.randn(v.shape, generator=gen).bfloat16().to(device)
                for k, v in params.items()
            }
            kw = {"params": params} if strategy == "fp32" else {}

            def step(
                m: Any = masters, g: Any = grads, s: Any = state, o: Any = opt, k: Any = kw
            ) -> None:
                mpfunc.apply_update_(m, g, s, o, **k)

            name = "fp32" if state_dtype is None else str(state_dtype).removeprefix("torch.")
            out[f"mpfunc {strategy} + {name}"] = step
    return out


def _time(step: Callable[[], Any]) -> tuple[float, float]:
    import torch_xla
    import torch_xla.core.xla_model as xm

    t0 = time.perf_counter()
    step()
    traced = time.perf_counter() - t0
    torch_xla.sync()
    xm.wait_device_ops()
    return traced, time.perf_counter() - t0


class _NodeClock:
    """Accumulates the time spent in ``_xla_kernels._run`` (torch_xla's calls for a node)."""

    def __init__(self) -> None:
        from mpfunc.backends import _xla_kernels

        self.module = _xla_kernels
        self.inner = _xla_kernels._run
        self.total = 0.0

    def __enter__(self) -> _NodeClock:
        def timed(*args: Any, **kwargs: Any) -> None:
            t0 = time.perf_counter()
            try:
                self.inner(*args, **kwargs)
            finally:
                self.total += time.perf_counter() - t0

        self.module._run = timed
        return self

    def __exit__(self, *exc: object) -> None:
        self.module._run = self.inner


def _counts() -> tuple[int, int]:
    """(compiles, graph executions) so far in this process."""
    import torch_xla.debug.metrics as met

    def count(name: str) -> int:
        data = met.metric_data(name)
        return 0 if data is None else int(data[0])

    return count("CompileTime"), count("ExecuteTime")


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch_xla

    run_meta = meta_mod.Run("pairs_xla", args.argv)
    torch.set_num_threads(args.threads)
    shapes = _shapes(args.width, args.leaves)
    load0 = load_avg()
    contenders = _contenders(shapes, torch_xla.device())
    for step in contenders.values():  # compile every graph before the timed rounds
        for _ in range(3):
            _time(step)
    samples: dict[str, list[tuple[float, ...]]] = {n: [] for n in contenders}
    compiles = dict.fromkeys(contenders, 0)
    graphs = dict.fromkeys(contenders, 0)
    with _NodeClock() as clock:
        for _ in range(args.rounds):
            base = _time(contenders[BASE])
            fp32 = _time(contenders[FP32])
            for name, step in contenders.items():
                c0, e0 = _counts()
                clock.total = 0.0
                t = _time(step)
                c1, e1 = _counts()
                compiles[name] += c1 - c0
                graphs[name] += e1 - e0
                ratios = (t[0] / base[0], t[1] / base[1], t[1] / fp32[1])
                samples[name].append((t[0], t[1], *ratios, clock.total))
    rows = []
    for name, xs in samples.items():
        med = [statistics.median(x[i] for x in xs) for i in range(6)]
        rows.append(
            {
                "name": name,
                "trace_ms": med[0] * 1e3,
                "step_ms": med[1] * 1e3,
                "trace_ratio": med[2],
                "node_ms": med[5] * 1e3 if name.startswith("mpfunc") else None,
                "step_ratio": med[3],
                "step_to_fp32": med[4],
                "compiles": compiles[name],
                "graphs_per_step": graphs[name] / args.rounds,
            }
        )
    part = {
        "leaves": len(shapes),
        "threads": args.threads,
        "rounds": args.rounds,
        "load_avg": {"start": load0, "end": load_avg()},
        "rows": rows,
    }
    return {"meta": run_meta.finish(threads=args.threads), "parts": [part]}


def render(result: dict[str, Any]) -> str:
    (part,) = result["parts"]
    load = part["load_avg"]
    lines = [
        "# One AdamW step per (strategy, state format) on XLA, beside torch's",
        "",
        *header(result["meta"]),
        "",
        f"{part['leaves']} leaves, {part['threads']} thread(s), medians of {part['rounds']} "
        f"rounds; load average {fmt(load['start'], '{:.2f}')} -> {fmt(load['end'], '{:.2f}')}.",
        "",
        "| contender | host trace ms | of which node ms | trace / torch's | step ms "
        "| step / torch's | step / mpfunc fp32 | compiles | graphs / step |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for r in part["rows"]:
        lines.append(
            f"| {r['name']} | {r['trace_ms']:.1f} | {fmt(r.get('node_ms'), '{:.1f}')} | "
            f"{r['trace_ratio']:.2f} | "
            f"{r['step_ms']:.1f} | {r['step_ratio']:.2f} | {r.get('step_to_fp32', 0):.2f} | "
            f"{r.get('compiles', '-')} | {r.get('graphs_per_step', 0):.1f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.pairs_xla", description=__doc__.splitlines()[0]
    )
    p.add_argument("--leaves", type=int, default=101)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--smoke", action="store_true", help="4 small leaves, 2 rounds")
    meta_mod.add_out_argument(p, "pairs_xla")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.smoke:
        args.leaves, args.width, args.rounds = 4, 64, 2
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    result = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(args.out / "pairs_xla.json", result)
    text = render(result)
    (args.out / "pairs_xla.md").write_text(text)
    print(text)
    print(f"wrote {args.out / 'pairs_xla.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

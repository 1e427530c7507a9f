"""XLA SPMD scaling: 1, 2 and 4 virtual devices, replicated against sharded masters.

Trains the shared bf16 transformer-like model with fp32 masters and AdamW under
torch_xla's SPMD mode, the batch sharded over a 1-D mesh axis ``data``, in three modes
(``replicated``, ``zero1``, ``fsdp``; see ``bench.spmd.config``) at each device count, and
writes ``spmd.md``, ``spmd.json`` and ``spmd.png`` to ``--out`` (default: a folder under
the system's temporary directory)::

    python -m bench.spmd                        # default size, 1, 2 and 4 devices
    python -m bench.spmd --devices 4 --blocks 10
    python -m bench.spmd --smoke --out /tmp/s   # tiny, fast compiles; the tests
    python -m bench.spmd --out bench/results/spmd   # refresh the committed results

Protocol. SPMD is process-wide, so each device count is one process
(``bench.spmd.worker``) with ``PJRT_DEVICE=CPU CPU_NUM_DEVICES=N``, run one after another;
inside it every mode is built and warmed up, then ``--blocks`` blocks interleave the modes
(``--steps`` timed steps each, a different mode first in each block), so a slow spell on a
shared machine hits every mode of its block. A step's time includes waiting for its graph.
XLA dumps every compiled program (``--xla_dump_to``) so the report can count the
collectives the partitioner put in the step graph. Every launch is bounded by ``--timeout``.

The virtual devices of XLA:CPU share this machine's cores: more devices split the same
work, they add no compute. The report is about bytes per device and graph structure; its
times measure overhead, not speed-up.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.common import cli
from bench.common import meta as meta_mod
from bench.common.model_config import ModelConfig, count
from bench.common.procs import Progress
from bench.common.report import read_json, write_json
from bench.spmd import report
from bench.spmd.config import MODES, PRESETS, SCHEDULES


def run_devices(
    n: int, cfg: ModelConfig, args: argparse.Namespace, logs: Path, say: Progress
) -> dict[str, Any]:
    """One worker process with ``n`` virtual devices; its result, or ``{"error": ...}``."""
    hlo = logs / f"hlo-{n}"
    shutil.rmtree(hlo, ignore_errors=True)
    setup = {
        "config": dataclasses.asdict(cfg),
        "modes": args.mode_list,
        "warmup": args.warmup,
        "blocks": args.blocks,
        "steps": args.steps,
        "seed": args.seed,
        "threads": args.threads,
        "hlo_dir": str(hlo),
    }
    flags = [os.environ.get("XLA_FLAGS", ""), f"--xla_dump_to={hlo}", "--xla_dump_hlo_as_text"]
    if args.fast_compile:
        flags.append("--xla_backend_optimization_level=0")
    env = dict(
        os.environ,
        PJRT_DEVICE="CPU",
        CPU_NUM_DEVICES=str(n),
        OMP_NUM_THREADS=str(args.threads),
        XLA_FLAGS=" ".join(f for f in flags if f),
    )
    out = logs / f"devices-{n}.json"
    out.unlink(missing_ok=True)
    say(f"{n} device{'s' if n > 1 else ''}: starting")
    try:
        with open(logs / f"devices-{n}.log", "w") as log:
            proc = subprocess.run(
                [sys.executable, "-m", "bench.spmd.worker", json.dumps(setup), str(out)],
                cwd=meta_mod.REPO,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                timeout=args.timeout,
            )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {args.timeout:g} s (see {logs}/devices-{n}.log)"}
    finally:
        if not args.keep_hlo:
            shutil.rmtree(hlo, ignore_errors=True)
    if proc.returncode != 0 or not out.exists():
        return {"error": f"exit code {proc.returncode} (see {logs}/devices-{n}.log)"}
    result: dict[str, Any] = read_json(out)
    result["summary"] = report.summarize(result["modes"])
    line = ", ".join(
        f"{m} {s['median_s'] * 1e3:.1f} ms" for m, s in result["summary"].items() if "median_s" in s
    )
    say(f"{n} device{'s' if n > 1 else ''}: {line}")
    return result


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.spmd",
        description="XLA SPMD scaling on virtual XLA:CPU devices: step time, bytes per "
        "device and the step graph's collectives of replicated, ZeRO-1 and FSDP masters.",
    )
    meta_mod.add_out_argument(p, "spmd")
    p.add_argument(
        "--render-only",
        action="store_true",
        help="rewrite spmd.md and .png from --out's spmd.json; run nothing",
    )
    p.add_argument("--devices", default="1,2,4", help="comma-separated device counts (%(default)s)")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated (%(default)s)")
    p.add_argument("--preset", choices=sorted(PRESETS), default="default")
    p.add_argument("--smoke", action="store_true", help="tiny: --preset smoke --fast-compile")
    p.add_argument("--warmup", type=int, help="warm-up steps per mode (2)")
    p.add_argument("--blocks", type=int, help="measured blocks (5; smoke 2)")
    p.add_argument("--steps", type=int, help="steps per mode per block (3; smoke 2)")
    p.add_argument(
        "--fast-compile",
        action="store_true",
        help="XLA:CPU without LLVM optimizations: ~3x faster compiles, slower steps",
    )
    p.add_argument("--keep-hlo", action="store_true", help="keep XLA's dumps under --out/logs")
    p.add_argument("--threads", type=int, default=1, help="torch threads (%(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=900, help="seconds per device count")
    args = p.parse_args(argv)
    if args.smoke:
        args.preset, args.fast_compile = "smoke", True
    cli.fill_schedule(args, SCHEDULES)
    if args.warmup < 1 or args.blocks < 1 or args.steps < 1 or args.threads < 1:
        p.error("need --warmup, --blocks, --steps and --threads >= 1")
    args.device_list = cli.counts(p, "--devices", args.devices, "counts")
    args.mode_list = cli.names(p, "--modes", args.modes, MODES)
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    say = Progress(sys.stderr, "spmd")
    out = args.out.resolve()
    if args.render_only:
        return cli.rerender("spmd", report, out, say)
    run = meta_mod.Run("spmd", argv)
    cfg = PRESETS[args.preset]
    bad = [n for n in args.device_list if cfg.batch % n]
    if bad:
        raise SystemExit(f"spmd: the batch ({cfg.batch}) must split evenly over {bad} devices")
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    params, tensors = count(cfg)
    say(
        f"model {params / 1e6:.2f}M parameters in {tensors} tensors; devices "
        f"{', '.join(map(str, args.device_list))}; modes {', '.join(args.mode_list)}; "
        f"{args.warmup} warm-up steps, then {args.blocks} blocks x {args.steps} steps"
    )
    result: dict[str, Any] = {
        "meta": {},
        "preset": args.preset,
        "config": dataclasses.asdict(cfg),
        "parameters": params,
        "tensors": tensors,
        "schedule": {"warmup": args.warmup, "blocks": args.blocks, "steps": args.steps},
        "fast_compile": args.fast_compile,
        "devices": {str(n): run_devices(n, cfg, args, logs, say) for n in args.device_list},
    }
    result["meta"] = run.finish(threads=args.threads)
    write_json(out / "spmd.json", result)
    table = cli.render("spmd", report, result, out)
    say(f"done in {result['meta']['wall_s']:.0f}s; wrote spmd.md, .json, .png to {out}")
    sys.stdout.write(table)
    failed = [n for n, d in result["devices"].items() if "error" in d]
    if failed:
        say(f"FAILED: {', '.join(failed)} devices (see {logs})")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

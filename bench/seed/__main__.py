"""The seed benchmark: the original mixed-precision slowdown, side by side with mpfunc.

Trains one transformer-like model in every mode of ``bench.seed.config`` (fp32, bf16, flat,
pertensor, mpfunc, autocast; syncfree on XLA; the torch.optim recipes again with fused
AdamW on cpu and cuda) on every available device, and writes ``seed.md``, ``seed.json``
and ``seed.png`` to ``--out``::

    python -m bench.seed                      # default size, all devices
    python -m bench.seed --preset original    # the report's 157M parameters
    python -m bench.seed --smoke --out /tmp/s # seconds; what the tests run
    python -m bench.seed --out bench/results/seed   # refresh the committed results

Protocol. Each (device, mode) runs in its own worker process (``bench.seed.worker``),
started once and kept alive while the parent drives it block by block over a pipe. A
process of its own isolates the mode's memory (its peak cannot include another mode's
tensors, allocator caches or XLA compilations) and its XLA graph cache and metrics;
keeping it alive avoids paying model building and XLA compilation again in every block.
The workers fork from a server that has imported torch (and torch_xla for XLA) once. A
device's workers start and warm up ``--jobs`` at a time (default: one per core); nothing
is timed until all are ready, and the warm-up steps are excluded. Then, in each of
``--blocks`` blocks, every mode runs ``--steps`` steps in turn, starting from a different
mode each block, while the others wait idle on their pipes. A mode's sample is its
block's time divided by its steps, with the device synced at both ends, so XLA's
asynchronous execution is counted in full. The step time is the median over blocks, and
each ratio is the median over blocks of the per-block ratio, so a slow spell on a shared
machine hits the modes of its block together and mostly cancels out. On XLA each step's
host trace time (until just before ``torch_xla.sync()``) is reported apart from the rest,
the execute time. Devices run one after another. After the last block each worker reports
its peak memory (see ``bench.common.device`` for how each device measures it).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

from bench.common import cli
from bench.common import meta as meta_mod
from bench.common.model_config import ModelConfig, count
from bench.common.procs import (
    Progress,
    WorkerError,
    WorkerProcess,
    ms,
    preload,
    ready,
    shutdown,
)
from bench.common.report import write_json
from bench.seed import report
from bench.seed.config import DEVICES, MODES, PRESETS, SCHEDULES, runs_on


def _available(device: str) -> bool:
    if device == "cpu":
        return True
    if device == "xla":
        # Whether it really imports and finds a device, the workers tell (init_failed).
        return importlib.util.find_spec("torch_xla") is not None
    import torch  # only here: the parent itself never touches a device

    return bool(torch.cuda.is_available())


class DeviceUnavailable(RuntimeError):
    pass


def run_device(
    device: str,
    modes: list[str],
    cfg: ModelConfig,
    args: argparse.Namespace,
    logs: Path,
    say: Progress,
) -> dict[str, Any]:
    """Set up, warm up and measure every mode on one device; return its results.

    Raises:
        DeviceUnavailable: no worker could even open the device.
    """
    results: dict[str, dict[str, Any]] = {m: {"samples": []} for m in modes}
    workers: dict[str, WorkerProcess] = {}
    live: list[str] = []
    # The cpu workers must not carry torch_xla: it is preloaded for the xla ones only.
    preload((["torch_xla"] if device == "xla" else []) + ["bench.seed.worker"])
    try:
        # Set-up and warm-up (model building, XLA compilation) are not measured, so they
        # overlap, `--jobs` workers at a time: each worker resets its own peak-memory gauge
        # after its own warm-up, and the blocks start only once every worker is ready.
        say(f"{device}: setting up {len(modes)} modes, {args.jobs} at a time")
        setup_msg = {
            "cmd": "setup",
            "config": dataclasses.asdict(cfg),
            "warmup": args.warmup,
            "torch_optim": args.torch_optim,
            "seed": args.seed,
        }
        waiting = list(modes)
        busy: dict[str, WorkerProcess] = {}
        while waiting or busy:
            while waiting and len(busy) < args.jobs:
                m = waiting.pop(0)
                try:
                    workers[m] = WorkerProcess(
                        "bench.seed.worker:Worker",
                        (device, m),
                        logs / f"{device}-{m}.log",
                        args.timeout,
                    )
                    workers[m].send(setup_msg)
                except WorkerError as e:
                    results[m]["error"] = str(e)
                    continue
                busy[m] = workers[m]
            if not busy:
                continue
            done = ready(list(busy.values()), args.timeout)
            if not done:
                raise SystemExit(f"seed: no worker on {device} set up in {args.timeout:.0f} s")
            for w in done:
                m = next(k for k, v in busy.items() if v is w)
                del busy[m]
                try:
                    info = w.recv()
                except WorkerError as e:
                    results[m]["error"] = str(e)
                    say(f"{device}: {m} FAILED: {e}")
                    continue
                if "unsupported" in info:
                    results[m]["unsupported"] = info["unsupported"]
                    say(f"{device}: {m} not run here: {info['unsupported']}")
                    continue
                results[m]["setup"] = info
                live.append(m)
                say(
                    f"{device}: {m} ready: built in {info['build_s']:.1f}s, warm-up steps "
                    + ", ".join(ms(s) for s in info["warmup_s"])
                    + (f", compiles {info['warmup_compiles']}" if device == "xla" else "")
                )
        live = [m for m in modes if m in live]  # interleave in the order asked for
        if not live and workers and all(w.init_failed for w in workers.values()):
            raise DeviceUnavailable(results[modes[0]]["error"])
        for b in range(args.blocks):
            order = [live[(b + i) % len(live)] for i in range(len(live))]
            line = []
            for m in order:
                try:
                    sample = workers[m].call({"cmd": "run", "steps": args.steps})
                except WorkerError as e:
                    results[m]["error"] = str(e)
                    say(f"{device}: {m} FAILED: {e}")
                    continue
                sample["block"] = b
                results[m]["samples"].append(sample)
                line.append(f"{m} {ms(sample['step_s'])}")
            live = [m for m in live if "error" not in results[m]]
            say(f"{device}: block {b + 1}/{args.blocks}: " + ", ".join(line))
        # Memory, unlike time, does not depend on what else runs: all workers at once.
        finishing = []
        for m in live:
            try:
                workers[m].send({"cmd": "finish"})
                finishing.append(m)
            except WorkerError as e:
                results[m]["error"] = str(e)
        for m in finishing:
            try:
                results[m]["memory"] = workers[m].recv()
            except WorkerError as e:
                results[m]["error"] = str(e)
    finally:
        for w in workers.values():
            w.close()  # all at once: they exit in parallel
        for w in workers.values():
            w.wait()
    return {"modes": results, **report.summarize(device, modes, results)}


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.seed",
        description="Seed benchmark: step time and memory of fp32, bf16, flat, pertensor, "
        "mpfunc, autocast and syncfree training (torch.optim recipes on torch's default "
        "AdamW and on fused AdamW), modes interleaved, on every available device.",
    )
    meta_mod.add_out_argument(p, "seed")
    p.add_argument(
        "--render-only",
        action="store_true",
        help="rewrite seed.md and seed.png from --out's seed.json; run nothing",
    )
    p.add_argument(
        "--devices",
        default="auto",
        help="comma-separated among cpu,xla,cuda; 'auto' (default): cpu, xla when torch_xla "
        "imports, cuda when available",
    )
    p.add_argument(
        "--modes",
        default=",".join(MODES),
        help="comma-separated; each device runs those it has (syncfree: xla; *-fused: cpu, "
        "cuda) (%(default)s)",
    )
    p.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default="default",
        help="default: 7.6M parameters, 0.1-0.3 s a step on 2 CPU cores; original: the "
        "report's 156.7M parameters; smoke: tiny, for tests",
    )
    p.add_argument("--smoke", action="store_true", help="tiny and fast: --preset smoke")
    size = p.add_argument_group("model size (overrides the preset)")
    for field in ("d_model", "layers", "heads", "ffn", "vocab", "seq", "batch"):
        size.add_argument("--" + field.replace("_", "-"), dest=field, type=int)
    size.add_argument("--dropout", type=float)
    sched = p.add_argument_group("schedule (default: per preset)")
    sched.add_argument("--warmup", type=int, help="warm-up steps, excluded (3)")
    sched.add_argument("--blocks", type=int, help="measured blocks (10; smoke 2)")
    sched.add_argument("--steps", type=int, help="steps per mode per block (2)")
    p.add_argument(
        "--torch-optim",
        choices=("default", "foreach", "fused"),
        default="default",
        help="torch.optim.AdamW implementation of the baselines without -fused (default: "
        "torch's choice; fused needs cpu or cuda)",
    )
    p.add_argument(
        "--jobs",
        type=int,
        default=os.cpu_count() or 1,
        help="workers set up and warmed up at once; measurement is always one at a time "
        "(default: CPU count, %(default)s)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=1800, help="seconds per worker reply")
    args = p.parse_args(argv)
    if args.smoke:
        args.preset = "smoke"
    cli.fill_schedule(args, SCHEDULES)
    if args.warmup < 0 or args.blocks < 1 or args.steps < 1 or args.jobs < 1:
        p.error("need --warmup >= 0, --blocks >= 1, --steps >= 1 and --jobs >= 1")
    args.mode_list = cli.names(p, "--modes", args.modes, MODES)
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    say = Progress(sys.stderr, "seed")
    out = args.out.resolve()
    if args.render_only:
        return cli.rerender("seed", report, out, say)
    run = meta_mod.Run("seed", argv)
    preset = PRESETS[args.preset]
    overrides = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(ModelConfig)
        if getattr(args, f.name) is not None
    }
    cfg = dataclasses.replace(preset, **overrides)
    if cfg.d_model % cfg.heads:
        raise SystemExit(f"seed: --d-model {cfg.d_model} is not a multiple of --heads {cfg.heads}")

    auto = args.devices == "auto"
    wanted = list(DEVICES) if auto else [d.strip() for d in args.devices.split(",") if d.strip()]
    bad = sorted(set(wanted) - set(DEVICES))
    if bad:
        raise SystemExit(f"seed: --devices: unknown {', '.join(bad)}; choose among cpu,xla,cuda")
    devices = [d for d in wanted if _available(d)]
    missing = [d for d in wanted if d not in devices]
    if missing and not auto:
        raise SystemExit(f"seed: requested device(s) not available: {', '.join(missing)}")

    flags = os.environ.get("XLA_FLAGS", "")
    if args.preset == "smoke" and "--xla_backend_optimization_level" not in flags:
        # The smoke run checks that everything runs, not speed: compile XLA graphs unoptimized
        # (about 3x faster to compile on 2 cores). The workers inherit it. Appended, not set:
        # importing torch_xla (as a test process has) puts its own defaults in XLA_FLAGS.
        os.environ["XLA_FLAGS"] = f"{flags} --xla_backend_optimization_level=0".strip()
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    params, tensors = count(cfg)
    say(
        f"model {params / 1e6:.1f}M parameters in {tensors} tensors; devices {', '.join(devices)};"
        f" modes {', '.join(args.mode_list)}; {args.warmup} warm-up steps, then"
        f" {args.blocks} blocks x {args.steps} steps"
    )
    result: dict[str, Any] = {
        "meta": {},
        "preset": args.preset,
        "config": dataclasses.asdict(cfg),
        "parameters": params,
        "tensors": tensors,
        "schedule": {"warmup": args.warmup, "blocks": args.blocks, "steps": args.steps},
        "torch_optim": args.torch_optim,
        "seed": args.seed,
        "devices": {},
        "skipped": {d: "not available" for d in missing},
    }
    try:
        for d in devices:
            modes = [m for m in args.mode_list if runs_on(m, d)]
            if not modes:
                result["skipped"][d] = "none of the modes asked for runs there"
                continue
            try:
                result["devices"][d] = run_device(d, modes, cfg, args, logs, say)
            except DeviceUnavailable as e:
                if not auto:
                    raise SystemExit(f"seed: device {d} unusable: {e}") from None
                say(f"{d}: skipped, unusable here: {e}")
                result["skipped"][d] = str(e)
    finally:
        shutdown()
    threads = {
        r["setup"]["threads"]
        for dev in result["devices"].values()
        for r in dev["modes"].values()
        if "setup" in r
    }
    result["meta"] = run.finish(threads=threads.pop() if len(threads) == 1 else None)
    result["targets"] = report.targets(result)

    write_json(out / "seed.json", result)
    table = cli.render("seed", report, result, out)
    say(f"done in {result['meta']['wall_s']:.0f}s; wrote seed.md, seed.json, seed.png to {out}")
    sys.stdout.write(table)
    failed = [
        f"{d}/{m}"
        for d, dev in result["devices"].items()
        for m, r in dev["modes"].items()
        if "error" in r
    ]
    if failed:
        say(f"FAILED modes: {', '.join(failed)} (see {logs})")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

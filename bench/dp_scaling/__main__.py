"""Data-parallel scaling on gloo: 1, 2 and 4 ranks, unsharded against sharded masters.

Trains one bf16 transformer-like model with fp32 masters in three modes (``unsharded``,
``sharded``, and the ``pertensor`` baseline; see ``bench.dp_scaling.config``) at each world
size, and writes ``dp_scaling.md``, ``dp_scaling.json`` and ``dp_scaling.png`` to
``--out`` (default: a folder under the system's temporary directory)::

    python -m bench.dp_scaling                       # default size, 1, 2 and 4 ranks
    python -m bench.dp_scaling --worlds 2 --blocks 20
    python -m bench.dp_scaling --smoke --out /tmp/d  # 1 and 2 ranks, tiny; the tests
    python -m bench.dp_scaling --out bench/results/dp_scaling   # refresh the committed results

Protocol. For each world size W, every mode gets its own gloo group: W processes that
join through a file store on this machine (so all traffic goes over 127.0.0.1), each
with one torch thread (``--threads``), so that W ranks oversubscribe the cores no
more than they must and a rank's compute is the same at every W. (``--threads 0`` gives
each rank usable cores // W threads instead; on a shared 2-core machine two OpenMP threads
per process made small kernels up to 100x slower whenever the other core was busy.) A
process per (mode, rank) isolates each mode's peak memory; the processes fork from a
server that has imported torch once (``bench.common.procs``). The processes are started and
warmed up together, then kept alive while the parent drives them over pipes: in each of
``--blocks`` blocks, every mode runs ``--steps`` steps in turn (all W ranks at once, a
barrier first), starting from a different mode each block, while the other modes'
processes wait idle. A step's time is the slowest rank's;
the table gives the median over all measured steps, and the ratio to the per-tensor
baseline is the median over blocks of the per-block ratio, so a slow spell on a shared
machine hits the modes of its block together and mostly cancels out. Collectives and their
bytes are counted inside each rank (see ``bench.dp_scaling.worker``). World sizes run one
after another; every launch and every reply is bounded by ``--timeout``.

With more ranks than cores (4 ranks on a 2-core machine), the rows measure data-parallel
overhead, not speedup; the report says so.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

from bench.common import cli
from bench.common import meta as meta_mod
from bench.common.machine import usable_cores
from bench.common.model_config import ModelConfig, count
from bench.common.procs import Progress, WorkerError, WorkerProcess, ms, preload, shutdown
from bench.common.report import write_json
from bench.dp_scaling import report
from bench.dp_scaling.config import MODES, PRESETS, SCHEDULES


def rank_process(
    mode: str, rank: int, world: int, store: Path, threads: int, log: Path, timeout: float
) -> WorkerProcess:
    """One ``bench.dp_scaling.worker`` process (one rank of one mode) and its pipe."""
    # A failed step ends the rank at once: peers blocked in a collective then fail at the
    # group's timeout.
    return WorkerProcess(
        "bench.dp_scaling.worker:Rank",
        (mode, rank, world, str(store), threads),
        log,
        timeout,
        name=f"rank {rank}",
        exit_hard_on_error=True,
    )


def _call_all(ranks: list[WorkerProcess], msg: dict[str, Any]) -> list[dict[str, Any]]:
    """Sends ``msg`` to every rank of a mode at once (they act collectively), then waits
    for every reply; the first failure kills the mode's other ranks and raises."""
    try:
        for r in ranks:
            r.send(msg)
        return [r.recv() for r in ranks]
    except WorkerError:
        for r in ranks:
            r.kill()
        raise


def run_world(
    world: int,
    modes: list[str],
    cfg: ModelConfig,
    args: argparse.Namespace,
    logs: Path,
    say: Progress,
) -> dict[str, Any]:
    """Set up, warm up and measure every mode with ``world`` ranks; return the results."""
    threads = args.threads or max(1, args.cores // world)
    results: dict[str, dict[str, Any]] = {m: {"samples": []} for m in modes}
    procs: dict[str, list[WorkerProcess]] = {}
    live: list[str] = []
    try:
        say(f"{world} ranks x {threads} threads: starting {world * len(modes)} processes")
        for m in modes:
            store = logs / f"store-{world}-{m}"
            store.unlink(missing_ok=True)
            procs[m] = []
            try:
                for rank in range(world):
                    log = logs / f"{world}-{m}-rank{rank}.log"
                    procs[m].append(rank_process(m, rank, world, store, threads, log, args.timeout))
            except WorkerError as e:
                results[m]["error"] = str(e)
        setup = {
            "cmd": "setup",
            "config": dataclasses.asdict(cfg),
            "warmup": args.warmup,
            "seed": args.seed,
            "reduce_dtype": args.reduce_dtype,
            "bucket_bytes": args.bucket_bytes,
            "timeout": args.timeout,
        }
        # Set-up and warm-up are not measured, so every mode's ranks do them at once.
        for m in modes:
            try:
                for r in procs[m]:
                    r.send(setup)
            except WorkerError as e:
                results[m]["error"] = str(e)
        for m in modes:
            if "error" in results[m]:
                continue
            try:
                results[m]["setup"] = [r.recv() for r in procs[m]]
            except WorkerError as e:
                results[m]["error"] = str(e)
                say(f"{world} ranks: {m} FAILED: {e}")
                for r in procs[m]:
                    r.kill()
                continue
            live.append(m)
            info = results[m]["setup"][0]
            say(
                f"{world} ranks: {m} ready: joined in {info['join_s']:.1f}s, built in "
                f"{info['build_s']:.1f}s, warm-up steps "
                + ", ".join(ms(s) for s in info["warmup_s"])
            )
        for b in range(args.blocks):
            order = [live[(b + i) % len(live)] for i in range(len(live))]
            line = []
            for m in order:
                try:
                    replies = _call_all(procs[m], {"cmd": "run", "steps": args.steps})
                except WorkerError as e:
                    results[m]["error"] = str(e)
                    say(f"{world} ranks: {m} FAILED: {e}")
                    continue
                step_s = [max(rr["step_s"][i] for rr in replies) for i in range(args.steps)]
                sample = {
                    "block": b,
                    "step_s": step_s,
                    "block_step_s": max(rr["block_s"] for rr in replies) / args.steps,
                    "loss": sum(rr["loss"] for rr in replies) / len(replies),
                    "ranks": replies,
                }
                results[m]["samples"].append(sample)
                line.append(f"{m} {ms(sample['block_step_s'])}")
            live = [m for m in live if "error" not in results[m]]
            say(f"{world} ranks: block {b + 1}/{args.blocks}: " + ", ".join(line))
        for m in live:
            try:
                results[m]["memory"] = _call_all(procs[m], {"cmd": "finish"})
            except WorkerError as e:
                results[m]["error"] = str(e)
    finally:
        for ranks in procs.values():
            for r in ranks:
                r.close()  # all at once: they exit in parallel
        for ranks in procs.values():
            for r in ranks:
                r.wait()
        for m in procs:
            (logs / f"store-{world}-{m}").unlink(missing_ok=True)
    return {
        "world": world,
        "threads": threads,
        "modes": results,
        "summary": report.summarize(results),
    }


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.dp_scaling",
        description="Data-parallel scaling on gloo: step time, collectives, bytes and "
        "per-rank memory of unsharded and sharded fp32 masters and of a per-tensor "
        "all-reduce baseline, at several world sizes.",
    )
    meta_mod.add_out_argument(p, "dp_scaling")
    p.add_argument(
        "--render-only",
        action="store_true",
        help="rewrite dp_scaling.md and .png from --out's dp_scaling.json; run nothing",
    )
    p.add_argument("--worlds", help="comma-separated world sizes (1,2,4; smoke 1,2)")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated (%(default)s)")
    p.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default="default",
        help="default: 7.4M parameters in 101 tensors; smoke: tiny, for tests",
    )
    p.add_argument("--smoke", action="store_true", help="tiny and fast: --preset smoke")
    size = p.add_argument_group("model size (overrides the preset)")
    for field in ("d_model", "layers", "heads", "ffn", "vocab", "seq", "batch"):
        size.add_argument(
            "--" + field.replace("_", "-"),
            dest=field,
            type=int,
            help="global batch, split over the ranks" if field == "batch" else None,
        )
    sched = p.add_argument_group("schedule (default: per preset)")
    sched.add_argument("--warmup", type=int, help="warm-up steps, excluded (2; smoke 1)")
    sched.add_argument("--blocks", type=int, help="measured blocks (8; smoke 2)")
    sched.add_argument("--steps", type=int, help="steps per mode per block (3; smoke 2)")
    p.add_argument(
        "--reduce-dtype",
        choices=("fp32", "bf16"),
        default="fp32",
        help="dtype the grads are summed in (fp32: upcast first, as the tests do; "
        "bf16: the grads' own)",
    )
    p.add_argument(
        "--bucket-mib",
        type=float,
        default=25.0,
        help="largest all-reduce/broadcast bucket, MiB (mpfunc's default, %(default)s)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads per rank (%(default)s); 0: usable cores // ranks, at least 1",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--timeout",
        type=float,
        default=300,
        help="seconds: each reply, and gloo's collective timeout (%(default)s)",
    )
    args = p.parse_args(argv)
    if args.smoke:
        args.preset = "smoke"
    cli.fill_schedule(args, SCHEDULES)
    if args.warmup < 0 or args.blocks < 1 or args.steps < 1 or args.threads < 0:
        p.error("need --warmup >= 0, --blocks >= 1, --steps >= 1 and --threads >= 0")
    if args.bucket_mib <= 0 or args.timeout <= 0:
        p.error("need --bucket-mib > 0 and --timeout > 0")
    args.bucket_bytes = int(args.bucket_mib * 2**20)
    if args.worlds is None:
        args.worlds = "1,2" if args.preset == "smoke" else "1,2,4"
    args.world_list = cli.counts(p, "--worlds", args.worlds, "world sizes")
    args.mode_list = cli.names(p, "--modes", args.modes, MODES)
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    say = Progress(sys.stderr, "dp_scaling")
    out = args.out.resolve()
    if args.render_only:
        return cli.rerender("dp_scaling", report, out, say)
    run = meta_mod.Run("dp_scaling", argv)
    overrides = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(ModelConfig)
        if getattr(args, f.name, None) is not None
    }
    cfg = dataclasses.replace(PRESETS[args.preset], **overrides)
    if cfg.d_model % cfg.heads:
        raise SystemExit(
            f"dp_scaling: --d-model {cfg.d_model} is not a multiple of --heads {cfg.heads}"
        )
    bad = [w for w in args.world_list if cfg.batch % w]
    if bad:
        raise SystemExit(
            f"dp_scaling: the global batch ({cfg.batch}) must split evenly over "
            f"{', '.join(map(str, bad))} ranks; pass --batch"
        )
    args.cores = usable_cores()
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    params, tensors = count(cfg)
    say(
        f"model {params / 1e6:.1f}M parameters in {tensors} tensors; ranks "
        f"{', '.join(map(str, args.world_list))} on {args.cores} cores; modes "
        f"{', '.join(args.mode_list)}; {args.warmup} warm-up steps, then {args.blocks} "
        f"blocks x {args.steps} steps"
    )
    result: dict[str, Any] = {
        "meta": {},
        "preset": args.preset,
        "config": dataclasses.asdict(cfg),
        "parameters": params,
        "tensors": tensors,
        "schedule": {"warmup": args.warmup, "blocks": args.blocks, "steps": args.steps},
        "reduce_dtype": args.reduce_dtype,
        "bucket_bytes": args.bucket_bytes,
        "seed": args.seed,
        "worlds": {},
    }
    preload(["bench.dp_scaling.worker"])
    try:
        for w in args.world_list:
            result["worlds"][str(w)] = run_world(w, args.mode_list, cfg, args, logs, say)
    finally:
        shutdown()
    threads = {d["threads"] for d in result["worlds"].values()}
    result["meta"] = run.finish(threads=threads.pop() if len(threads) == 1 else None)
    report.add_scaling(result)

    write_json(out / "dp_scaling.json", result)
    table = cli.render("dp_scaling", report, result, out)
    say(f"done in {result['meta']['wall_s']:.0f}s; wrote dp_scaling.md, .json, .png to {out}")
    sys.stdout.write(table)
    failed = [
        f"{w} ranks/{m}"
        for w, d in result["worlds"].items()
        for m, r in d["modes"].items()
        if "error" in r
    ]
    if failed:
        say(f"FAILED: {', '.join(failed)} (see {logs})")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

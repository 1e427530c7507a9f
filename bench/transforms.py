"""Microbenchmarks of every mpfunc transform against the memory roofline.

Times ``grads_to_fp32``, ``masters_to_model`` and ``apply_update`` (sgd, adam,
adamw), each pure and in place, over trees from 1M elements up (``--full``
reaches 100M), and over 10 to 10,000 tensors at a fixed total so that
per-tensor host overhead shows. Baselines: per-tensor loops,
``torch._foreach_*``, ``torch.optim`` (loop, foreach, fused) on the same fp32
tree, and a flat buffer. The machine's own ``copy_`` and in-place ``add_``
bandwidth is measured in the same run and each transform's roofline ratio is
reported against it.

    python -m bench.transforms                  # eager CPU, 2-3 minutes on 2 quiet cores
    python -m bench.transforms --full           # up to 100M elements
    python -m bench.transforms --device cpu,xla # also the XLA device (PJRT_DEVICE=CPU)
    python -m bench.transforms --smoke --out /tmp/t

Writes ``transforms.md``, ``transforms.json`` (every sample) and
``transforms.png`` to ``--out`` (default ``bench/results/transforms``).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from bench import _transforms_cases as cases_mod
from bench import _transforms_report as report

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "transforms"

# Per device: sizes for the size sweep, tensors in it, total and counts for the count sweep.
# XLA runs smaller: every call also pays graph tracing and sync.
_PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "default": {
        "cpu": {
            "sizes": [10**6, 10**7, 3 * 10**7],
            "size_tensors": 100,
            "count_total": 10**7,
            "counts": [10, 100, 1000, 10_000],
            "bw_numel": 2**28,
        },
        "xla": {
            "sizes": [10**6, 3 * 10**6],
            "size_tensors": 100,
            "count_total": 10**6,
            "counts": [10, 100, 1000],
            "bw_numel": 2**26,
        },
    },
    "full": {
        "cpu": {
            "sizes": [10**6, 3 * 10**6, 10**7, 3 * 10**7, 10**8],
            "size_tensors": 100,
            "count_total": 10**7,
            "counts": [10, 100, 1000, 10_000],
            "bw_numel": 2**28,
        },
        "xla": {
            "sizes": [10**6, 3 * 10**6, 10**7],
            "size_tensors": 100,
            "count_total": 10**6,
            "counts": [10, 100, 1000, 10_000],
            "bw_numel": 2**27,
        },
    },
    "smoke": {
        "cpu": {
            "sizes": [10**5, 3 * 10**5],
            "size_tensors": 10,
            "count_total": 10**5,
            "counts": [10, 100],
            "bw_numel": 2**20,
        },
        "xla": {
            "sizes": [10**5],
            "size_tensors": 4,
            "count_total": 10**5,
            "counts": [4],
            "bw_numel": 2**20,
        },
    },
}
_PRESETS["default"]["cuda"] = _PRESETS["full"]["cpu"]
_PRESETS["full"]["cuda"] = _PRESETS["full"]["cpu"]
_PRESETS["smoke"]["cuda"] = _PRESETS["smoke"]["cpu"]


class Device:
    """A device to time on, and how to wait for its work to finish."""

    def __init__(self, name: str) -> None:
        self.name = name
        if name == "xla":
            import torch_xla
            import torch_xla.debug.metrics as met

            self.torch_device = torch_xla.device()
            self.sync: Callable[[], None] = lambda: torch_xla.sync(wait=True)
            self.compiles: Callable[[], int | None] = lambda: (
                met.metric_data("CompileTime") or (0,)
            )[0]
        elif name == "cuda":
            if not torch.cuda.is_available():
                raise SystemExit("--device cuda: no CUDA device is available")
            self.torch_device = torch.device("cuda")
            self.sync = torch.cuda.synchronize
            self.compiles = lambda: None
        elif name == "cpu":
            self.torch_device = torch.device("cpu")
            self.sync = lambda: None
            self.compiles = lambda: None
        else:
            raise SystemExit(f"--device: expected cpu, xla or cuda, got {name!r}")


class Timed:
    """Samples of one step; ``error`` is set, and sampling stops, if the step raised."""

    def __init__(self, step: Callable[[], Any] | None, error: str | None = None) -> None:
        self.step = step
        self.error = error
        self.samples: list[float] = []
        self.compiles: int | None = None

    def call(self, sync: Callable[[], None]) -> float:
        """Runs the step once; returns its seconds, or records the error and returns 0."""
        assert self.step is not None
        try:
            t0 = time.perf_counter()
            out = self.step()
            sync()  # the result stays alive until here: XLA computes only what is alive
            dt = time.perf_counter() - t0
            del out
        except Exception as exc:  # a broken case is reported, the run goes on
            self.error = f"{type(exc).__name__}: {exc}"
            self.step = None
            return 0.0
        return dt


def time_interleaved(
    timed: list[Timed],
    sync: Callable[[], None],
    *,
    warmup: int,
    repeats: int,
    min_repeats: int,
    budget_s: float,
    compiles: Callable[[], int | None] = lambda: None,
) -> None:
    """Times several steps in rounds, one call of each per round, into ``Timed.samples``.

    Interleaving makes a burst of other work on a shared machine hit every step
    in a round alike, instead of all samples of one step. Each step first gets
    ``warmup`` untimed calls. Rounds stop after ``repeats``, or once
    ``min_repeats`` are in and the timed calls have used ``budget_s`` per step
    (3 rounds suffice when they have used 5 times that). Also counts the graphs
    compiled during each step's timed calls (XLA only).
    """
    for t in timed:
        for _ in range(warmup):
            if t.step is not None:
                t.call(sync)
        if compiles() is not None:
            t.compiles = 0
    spent = 0.0
    for r in range(repeats):
        live = [t for t in timed if t.step is not None]
        if not live:
            return
        for t in live[r % len(live) :] + live[: r % len(live)]:
            before = compiles()
            dt = t.call(sync)
            after = compiles()
            if t.step is None:
                continue
            t.samples.append(dt)
            spent += dt
            if before is not None and after is not None and t.compiles is not None:
                t.compiles += after - before
        per_step = spent / len(live)
        done = r + 1
        if (done >= min_repeats and per_step > budget_s) or (done >= 3 and per_step > 5 * budget_s):
            return


def measure_bandwidth(dev: Device, numel: int, args: argparse.Namespace) -> dict[str, Any]:
    """A large fp32 ``copy_`` (8 B/elem) and in-place ``add_`` (12 B/elem) on ``dev``."""
    a = torch.empty(numel, dtype=torch.float32, device=dev.torch_device).fill_(1.0)
    b = torch.empty(numel, dtype=torch.float32, device=dev.torch_device).fill_(0.5)
    dev.sync()
    tests = {
        "copy": ("`b.copy_(a)` fp32", 8, Timed(functools.partial(b.copy_, a))),
        "add": ("`a.add_(b)` fp32 in place", 12, Timed(functools.partial(a.add_, b))),
    }
    time_interleaved(
        [t for _, _, t in tests.values()],
        dev.sync,
        warmup=2,
        repeats=args.repeats,
        min_repeats=args.min_repeats,
        budget_s=args.budget,
    )
    result = {
        test: {"label": label, "numel": numel, "bytes_per_elem": nbytes, "samples_s": t.samples}
        for test, (label, nbytes, t) in tests.items()
    }
    del a, b, tests
    gc.collect()
    return result


def _merge_bandwidth(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Pools the start and end measurements; the median of all samples is the reference."""
    merged = {}
    for test in ("copy", "add"):
        first = runs[0][test]
        samples = [s for run in runs for s in run[test]["samples_s"]]
        median = statistics.median(samples)
        merged[test] = {
            **{k: v for k, v in first.items() if k != "samples_s"},
            "samples_s": samples,
            "per_run_median_s": [statistics.median(run[test]["samples_s"]) for run in runs],
            "median_s": median,
            "gbps": first["bytes_per_elem"] * first["numel"] / median / 1e9,
        }
    return merged


def _machine() -> tuple[str, str | None]:
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = ""
    try:
        kb = int(Path("/proc/meminfo").read_text().split()[1])
        mem = f", {kb / 2**20:.0f} GiB RAM"
    except (OSError, ValueError, IndexError):
        pass
    l3 = None
    with contextlib.suppress(OSError):
        l3 = Path("/sys/devices/system/cpu/cpu0/cache/index3/size").read_text().strip()
    return f"{model}, {os.cpu_count()} cores{mem}, {platform.system()}", l3


def _parse_counts(text: str) -> list[int]:
    units = {"k": 10**3, "m": 10**6, "g": 10**9}
    values = []
    for part in text.split(","):
        part = part.strip().lower()
        mult = units.get(part[-1:], 1)
        values.append(int(float(part[:-1] if mult > 1 else part) * mult))
    return values


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.transforms", description=__doc__.split("\n")[0]
    )
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder")
    p.add_argument(
        "--render-only",
        action="store_true",
        help="rewrite the tables and plot from --out's transforms.json; time nothing",
    )
    p.add_argument("--device", default="cpu", help="comma list of cpu, xla, cuda (default cpu)")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--full", action="store_true", help="sizes up to 100M elements")
    size.add_argument("--smoke", action="store_true", help="tiny sizes, for the test suite")
    p.add_argument("--sizes", type=_parse_counts, help="size sweep, e.g. 1M,10M,100M")
    p.add_argument("--size-tensors", type=int, help="tensors in the size sweep")
    p.add_argument("--total", type=_parse_counts, help="elements in the count sweep, e.g. 10M")
    p.add_argument("--counts", type=_parse_counts, help="count sweep, e.g. 10,100,1k,10k")
    p.add_argument("--bw-numel", type=_parse_counts, help="elements of the bandwidth buffers")
    p.add_argument("--repeats", type=int, default=None, help="max timed calls per cell")
    p.add_argument("--warmup", type=int, help="untimed calls per cell (default 2)")
    p.add_argument("--budget", type=float, default=None, help="timed seconds per cell")
    p.add_argument(
        "--only",
        default="",
        help="run only transforms containing this text (and the copy_/add_ references)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    args = p.parse_args(argv)
    if args.repeats is None:
        args.repeats = 3 if args.smoke else 9
    if args.budget is None:
        args.budget = 0.02 if args.smoke else 0.6
    if args.warmup is None:
        # Two: the first in-place call on XLA traces a different graph than the steady state.
        args.warmup = 2
    args.min_repeats = min(args.repeats, 3 if args.smoke else 5)
    return args


def _config(args: argparse.Namespace, device: str) -> dict[str, Any]:
    preset = "smoke" if args.smoke else "full" if args.full else "default"
    cfg = dict(_PRESETS[preset][device])
    if args.sizes:
        cfg["sizes"] = args.sizes
    if args.size_tensors:
        cfg["size_tensors"] = args.size_tensors
    if args.total:
        cfg["count_total"] = args.total[0]
    if args.counts:
        cfg["counts"] = args.counts
    if args.bw_numel:
        cfg["bw_numel"] = args.bw_numel[0]
    return cfg


def run_device(
    dev: Device, cfg: dict[str, Any], args: argparse.Namespace, log: Callable[[str], None]
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    model_dtype = torch.bfloat16
    log(f"[{dev.name}] memory bandwidth on {report.fmt_count(cfg['bw_numel'])}-element buffers")
    bw_runs = [measure_bandwidth(dev, cfg["bw_numel"], args)]

    # (numel, tensors) -> sweeps it belongs to; a point in both sweeps runs once.
    points: dict[tuple[int, int], list[str]] = {}
    for s in cfg["sizes"]:
        points.setdefault((s, cfg["size_tensors"]), []).append("size")
    for c in cfg["counts"]:
        points.setdefault((cfg["count_total"], c), []).append("count")

    cases = [
        c
        for c in cases_mod.all_cases()
        if dev.name in c.devices
        and (args.only in c.transform or c.transform in cases_mod.REFERENCE_TRANSFORMS)
    ]
    # Cases computing the same transform, pure or in place, are timed together,
    # interleaved, so that their ratios come from the same moments; a group's
    # buffers live only while it runs.
    groups: dict[str, list[cases_mod.Case]] = {}
    for c in cases:
        if c.transform in cases_mod.REFERENCE_TRANSFORMS:
            key = "references"
        else:
            key = c.transform.replace("_ ", " ").rstrip("_")
        groups.setdefault(key, []).append(c)
    records = []
    for i, ((numel, count), sweeps) in enumerate(points.items()):
        point = cases_mod.make_point(numel, count, dev.torch_device, model_dtype, args.seed + i)
        dev.sync()
        tag = f"[{dev.name}] {report.fmt_count(numel)} x {count:,} tensors"
        for group in groups.values():
            group = [c for c in group if not (c.size_sweep_only and sweeps == ["count"])]
            timed = []
            for case in group:
                try:
                    timed.append(Timed(case.build(point)))
                except Exception as exc:  # a broken case is reported, the run goes on
                    timed.append(Timed(None, f"{type(exc).__name__}: {exc}"))
            time_interleaved(
                timed,
                dev.sync,
                warmup=args.warmup,
                repeats=args.repeats,
                min_repeats=args.min_repeats,
                budget_s=args.budget,
                compiles=dev.compiles,
            )
            for case, t in zip(group, timed):
                rec: dict[str, Any] = {
                    "device": dev.name,
                    "transform": case.transform,
                    "variant": case.variant,
                    "numel": numel,
                    "n_tensors": count,
                    "sweeps": [s for s in sweeps if s == "size" or not case.size_sweep_only],
                    "bytes_per_elem": case.bytes_per_elem,
                    "roof": case.roof,
                    "error": t.error,
                    "samples_s": t.samples,
                    "compiles_timed": t.compiles,
                }
                if t.error is None:
                    rec["median_s"] = statistics.median(t.samples)
                    msg = f"{rec['median_s'] * 1e3:9.3f} ms"
                    if t.compiles:
                        msg += f"  ({t.compiles} compiles while timed)"
                else:
                    msg = f"ERROR {t.error}"
                records.append(rec)
                log(f"{tag}  {case.transform:<24} {case.variant:<24} {msg}")
            del timed
            gc.collect()
        del point
        gc.collect()

    log(f"[{dev.name}] memory bandwidth again, to catch drift")
    bw_runs.append(measure_bandwidth(dev, cfg["bw_numel"], args))
    bandwidth = _merge_bandwidth(bw_runs)
    # The 1-tensor copy_/add_ timed at each size: the roofline for a working set that
    # may fit in cache, next to the large-buffer (memory) roofline.
    same_size = {}
    for rec in records:
        if rec["error"] is None:
            rec["gbps"] = rec["bytes_per_elem"] * rec["numel"] / rec["median_s"] / 1e9
            rec["roofline"] = rec["gbps"] / bandwidth[rec["roof"]]["gbps"]
            if rec["transform"] in cases_mod.REFERENCE_TRANSFORMS:
                same_size[(cases_mod.REFERENCE_TRANSFORMS[rec["transform"]], rec["numel"])] = rec
    for rec in records:
        ref = same_size.get((rec["roof"], rec["numel"]))
        if rec["error"] is None and ref is not None:
            rec["roofline_same_size"] = rec["gbps"] / ref["gbps"]
    return bandwidth, records


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        return _run(args, argv)
    finally:
        torch.set_num_threads(threads)


def _load_avg() -> float | None:
    """The 1-minute load average: other work on the machine skews every timing."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def render(result: dict[str, Any], out: Path) -> None:
    """Writes the Markdown tables and the PNG from a result (fresh, or read back from JSON)."""
    (out / "transforms.md").write_text(report.markdown(result))
    report.plot(result, out / "transforms.png")


def _run(args: argparse.Namespace, argv: Sequence[str] | None) -> dict[str, Any]:
    if args.render_only:
        result: dict[str, Any] = json.loads((args.out / "transforms.json").read_text())
        render(result, args.out)
        print(f"rewrote {args.out}/transforms.md and .png", file=sys.stderr)
        return result
    t_start = time.perf_counter()
    load_start = _load_avg()
    devices = [d.strip() for d in args.device.split(",") if d.strip()]

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    result = {"devices": devices, "bandwidth": {}, "sweeps": {}, "results": []}
    for name in devices:
        dev = Device(name)
        cfg = _config(args, name)
        bandwidth, records = run_device(dev, cfg, args, log)
        result["bandwidth"][name] = bandwidth
        result["sweeps"][name] = cfg
        result["results"] += records

    machine, l3 = _machine()
    argv_list = list(sys.argv[1:] if argv is None else argv)
    result["meta"] = {
        "command": shlex.join(["python", "-m", "bench.transforms", *argv_list]),
        "machine": machine,
        "l3_cache": l3,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "model_dtype": "bfloat16",
        "warmup": args.warmup,
        "repeats": args.repeats,
        "budget_s_per_cell": args.budget,
        "wall_s": time.perf_counter() - t_start,
        "load_avg_start": load_start,
        "load_avg_end": _load_avg(),
    }
    result["targets"] = report.evaluate_targets(result)

    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "transforms.json").write_text(json.dumps(result, indent=1) + "\n")
    render(result, args.out)
    log(f"wrote {args.out}/transforms.md, .json, .png in {result['meta']['wall_s']:.0f} s")
    return result


if __name__ == "__main__":
    main()

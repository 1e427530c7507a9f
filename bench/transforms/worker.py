"""The timing loop of ``bench.transforms``; it runs in the benchmark's own process.

Cases computing the same transform (pure or in place) are timed together in interleaved
rounds, so that their ratios come from the same moments on a shared machine. The
device's own ``copy_`` and in-place ``add_`` bandwidth is measured at the start and at the
end of each device's run, and every case's achieved bandwidth is held against it.
"""

from __future__ import annotations

import argparse
import functools
import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from bench.common.device import Device
from bench.transforms import cases as cases_mod
from bench.transforms.report import fmt_count


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
    # Warm-up rounds interleaved like the timed ones: on XLA a step whose inputs another
    # step wrote last compiles its own graph once, which sequential warm-ups would miss.
    for _ in range(warmup):
        for t in timed:
            if t.step is not None:
                t.call(sync)
    if compiles() is not None:
        for t in timed:
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
    a = torch.empty(numel, dtype=torch.float32, device=dev.device).fill_(1.0)
    b = torch.empty(numel, dtype=torch.float32, device=dev.device).fill_(0.5)
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


def merge_bandwidth(runs: list[dict[str, Any]]) -> dict[str, Any]:
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


def run_device(
    dev: Device, cfg: dict[str, Any], args: argparse.Namespace, log: Callable[[str], None]
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Times every case at every point of ``cfg``'s sweeps on ``dev``.

    Returns:
        The merged bandwidth measurements, and one record per (case, point).
    """
    model_dtype = torch.bfloat16
    log(f"[{dev.kind}] memory bandwidth on {fmt_count(cfg['bw_numel'])}-element buffers")
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
        if dev.kind in c.devices
        and (
            any(part in c.transform for part in args.only.split(","))
            or c.transform in cases_mod.REFERENCE_TRANSFORMS
        )
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
        point = cases_mod.make_point(numel, count, dev.device, model_dtype, args.seed + i)
        dev.sync()
        tag = f"[{dev.kind}] {fmt_count(numel)} x {count:,} tensors"
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
                    "device": dev.kind,
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

    log(f"[{dev.kind}] memory bandwidth again, to catch drift")
    bw_runs.append(measure_bandwidth(dev, cfg["bw_numel"], args))
    bandwidth = merge_bandwidth(bw_runs)
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

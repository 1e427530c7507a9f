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
    python -m bench.transforms --out bench/results/transforms   # refresh the committed results

Writes ``transforms.md``, ``transforms.json`` (every sample) and ``transforms.png``
to ``--out`` (default: a folder under the system's temporary directory).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.common import meta as meta_mod
from bench.common.report import read_json, write_json
from bench.transforms import report

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
    meta_mod.add_out_argument(p, "transforms")
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
        help="run only transforms containing one of these comma-separated texts (and the "
        "copy_/add_ references)",
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


def render(result: dict[str, Any], out: Path) -> None:
    """Writes the Markdown tables and the PNG from a result (fresh, or read back from JSON)."""
    (out / "transforms.md").write_text(report.markdown(result))
    report.plot(result, out / "transforms.png")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.render_only:
        render(read_json(args.out / "transforms.json"), args.out)
        print(f"rewrote {args.out}/transforms.md and .png", file=sys.stderr)
        return 0
    devices = [d.strip() for d in args.device.split(",") if d.strip()]
    bad = sorted(set(devices) - {"cpu", "xla", "cuda"})
    if bad or not devices:
        raise SystemExit(f"--device: expected some of cpu, xla, cuda, got {args.device!r}")
    run = meta_mod.Run("transforms", argv)
    # torch only now: --render-only and the checks above need none of it.
    from bench.common.device import Device, torch_threads
    from bench.transforms.worker import run_device

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    result: dict[str, Any] = {
        "meta": {},
        "devices": devices,
        "settings": {
            "model_dtype": "bfloat16",
            "warmup": args.warmup,
            "repeats": args.repeats,
            "budget_s_per_cell": args.budget,
        },
        "bandwidth": {},
        "sweeps": {},
        "results": [],
    }
    with torch_threads(args.threads) as threads:
        for name in devices:
            try:
                dev = Device(name)
            except (RuntimeError, ImportError) as e:
                raise SystemExit(f"--device {name}: cannot open it here: {e}") from None
            cfg = _config(args, name)
            bandwidth, records = run_device(dev, cfg, args, log)
            result["bandwidth"][name] = bandwidth
            result["sweeps"][name] = cfg
            result["results"] += records
    result["meta"] = run.finish(threads=threads)
    result["targets"] = report.evaluate_targets(result)

    args.out.mkdir(parents=True, exist_ok=True)
    write_json(args.out / "transforms.json", result)
    render(result, args.out)
    log(f"wrote {args.out}/transforms.md, .json, .png in {result['meta']['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

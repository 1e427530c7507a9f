"""What every report shares: the header read from the metadata block, formatting, plotting."""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


def fmt(value: Any, spec: str) -> str:
    """``spec.format(value)``, or an en dash for a missing or NaN value."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return spec.format(value)


def header(meta: dict[str, Any]) -> list[str]:
    """Markdown lines saying what ran, on which code, machine and software, and how busy.

    Each line ends in a Markdown line break, so the caller may add more lines below.
    """
    git, machine, v, load = meta["git"], meta["machine"], meta["versions"], meta["load_avg"]
    if git.get("commit"):
        code = f"commit `{git['commit'][:12]}`" + (
            " with uncommitted changes" if git.get("dirty") else ""
        )
    else:
        code = "commit unknown"
    cores = f"{machine.get('cpu_count', '?')} cores"
    usable = machine.get("usable_cores")
    if usable is not None and usable != machine.get("cpu_count"):
        cores += f" ({usable} usable)"
    software = ", ".join(
        f"{k} {v[k]}" for k in ("python", "torch", "torch_xla", "mpfunc") if v.get(k)
    )
    threads = meta.get("threads")
    memory = fmt(machine.get("memory_gib"), "{:g} GiB")
    return [
        f"Command: `{meta['command']}` ({meta['date']}, {meta['wall_s']:.0f} s; {code}).  ",
        f"Machine: {machine.get('cpu', '?')}, {cores}, {memory}; "
        f"{software}; "
        + (f"{threads} torch thread{'s' if threads != 1 else ''}; " if threads else "")
        + f"1-minute load average {fmt(load.get('start'), '{:.2f}')} at the start, "
        f"{fmt(load.get('end'), '{:.2f}')} at the end (other work on the machine inflates "
        "times).  ",
    ]


def write_json(path: Path, result: dict[str, Any]) -> None:
    path.write_text(json.dumps(result, indent=1) + "\n")


def read_json(path: Path) -> dict[str, Any]:
    result: dict[str, Any] = json.loads(path.read_text())
    return result


def pyplot() -> Any:
    """matplotlib's pyplot on the file-only Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def quantile(xs: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``xs`` by nearest rank."""
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def ratio_rows(
    times: Mapping[str, Sequence[float]], nbytes: Mapping[str, float | None], base: str
) -> list[dict[str, Any]]:
    """One row per contender: its median time, and the median and quartiles of its per-round
    ratios to ``base``'s time in the same round (rounds interleave the contenders)."""
    rows = []
    for name, ts in times.items():
        ratios = [t / b for t, b in zip(ts, times[base])]
        rows.append(
            {
                "name": name,
                "bytes_per_param": nbytes[name],
                "median_ms": statistics.median(ts) * 1e3,
                "ratio": statistics.median(ratios),
                "ratio_q25": quantile(ratios, 0.25),
                "ratio_q75": quantile(ratios, 0.75),
                "times_s": list(ts),
            }
        )
    return rows

"""Summaries, targets, the Markdown table and the bar chart of the seed benchmark."""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

MIB = 2**20
REFERENCES = ("fp32", "bf16", "pertensor", "flat")


def _block_ratio(samples: list[dict[str, Any]], ref: list[dict[str, Any]]) -> float | None:
    """Median over blocks of this mode's step time over the reference's in the same block."""
    ref_by_block = {s["block"]: s["step_s"] for s in ref}
    ratios = [s["step_s"] / ref_by_block[s["block"]] for s in samples if s["block"] in ref_by_block]
    return statistics.median(ratios) if ratios else None


def summarize(device: str, modes: list[str], results: dict[str, Any]) -> dict[str, Any]:
    """Per-mode statistics of one device's samples."""
    summary: dict[str, dict[str, Any]] = {}
    for m in modes:
        r = results[m]
        samples = r["samples"]
        s: dict[str, Any] = {"blocks": len(samples)}
        if "error" in r:
            s["error"] = r["error"]
        if samples:
            times = [x["step_s"] for x in samples]
            s["median_s"] = statistics.median(times)
            s["min_s"], s["max_s"] = min(times), max(times)
            s["quartiles_s"] = (
                statistics.quantiles(times, n=4, method="inclusive")
                if len(times) > 1
                else times * 3
            )
            s["final_loss"] = samples[-1]["loss"]
            for ref in REFERENCES:
                if ref in results and results[ref]["samples"]:
                    s[f"x_{ref}"] = _block_ratio(samples, results[ref]["samples"])
            if device == "xla":
                steps = sum(len(x["host_s"]) for x in samples)
                s["compiles"] = sum(x["counters"]["compiles"] for x in samples)
                s["graphs_per_step"] = sum(x["counters"]["executions"] for x in samples) / steps
                s["transfers_per_step"] = (
                    sum(x["counters"]["transfers_to_host"] for x in samples) / steps
                )
        if "memory" in r:
            s["peak_mib"] = r["memory"]["peak_bytes"] / MIB
        summary[m] = s
    return {"summary": summary}


def targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets, each with its measured value and whether it held (None: unknown)."""

    def get(device: str, key: str) -> float | None:
        dev = result["devices"].get(device)
        if dev is None:
            return None
        value = dev["summary"].get("mpfunc", {}).get(key)
        return None if value is None else float(value)

    rows = []

    def add(device: str, text: str, key: str, limit: float, fmt: str) -> None:
        value = get(device, key)
        rows.append(
            {
                "device": device,
                "target": text,
                "measured": None if value is None else fmt.format(value),
                "value": value,
                "held": None if value is None else value <= limit,
            }
        )

    add("xla", "mpfunc step ≤ 0.95× pertensor", "x_pertensor", 0.95, "{:.2f}×")
    add("xla", "mpfunc step ≤ 0.6× flat", "x_flat", 0.6, "{:.2f}×")
    add("xla", "mpfunc: 0 compiles after warm-up", "compiles", 0, "{:.0f}")
    add("cpu", "mpfunc step ≤ 0.95× pertensor", "x_pertensor", 0.95, "{:.2f}×")
    add("cpu", "mpfunc overhead over bf16 ≤ 10% (≤ 1.10× bf16)", "x_bf16", 1.10, "{:.2f}×")
    return rows


def _f(value: Any, fmt: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return fmt.format(value)


def _device_title(name: str, result: dict[str, Any]) -> str:
    setups = [r["setup"] for r in result["devices"][name]["modes"].values() if "setup" in r]
    info = setups[0] if setups else {}
    if name == "xla":
        version = result["machine"].get("torch_xla") or "?"
        return f"xla ({info.get('device_name', '?')}, torch_xla {version})"
    if name == "cuda":
        return f"cuda ({info.get('device_name', '?')})"
    return f"cpu (eager, {info.get('threads', '?')} threads)"


def markdown(result: dict[str, Any]) -> str:
    cfg, sched, machine = result["config"], result["schedule"], result["machine"]
    lines = [
        "# Seed benchmark",
        "",
        f"Model: {result['parameters']:,} parameters in {result['tensors']} tensors "
        f"(preset `{result['preset']}`: d_model {cfg['d_model']}, {cfg['layers']} layers, "
        f"{cfg['heads']} heads, ffn {cfg['ffn']}, vocab {cfg['vocab']}, seq {cfg['seq']}, "
        f"batch {cfg['batch']}, dropout {cfg['dropout']}). AdamW everywhere, loss in fp32; "
        f"torch.optim baselines: `{result['torch_optim']}`.",
        f"Protocol: {sched['warmup']} warm-up steps excluded, then {sched['blocks']} blocks "
        f"of {sched['steps']} steps per mode, modes interleaved, each in its own process.",
        f"Machine: {machine.get('cpu', '?')}, {machine.get('cpu_count', '?')} cores, "
        f"{machine.get('memory_gib', '?')} GiB; torch {machine.get('torch', '?')}, "
        f"python {machine.get('python', '?')}, mpfunc {machine.get('mpfunc', '?')}.",
        f"Command: `{result['command']}` ({result['date']}, {result.get('wall_s', 0):.0f} s).",
        "",
    ]
    for name, dev in result["devices"].items():
        xla = name == "xla"
        lines += [f"## {_device_title(name, result)}", ""]
        head = "| mode | step ms | min–max ms | × fp32 | × bf16 | × pertensor | × flat | peak MiB |"
        rule = "|---|--:|--:|--:|--:|--:|--:|--:|"
        if xla:
            head += " compiles | graphs/step |"
            rule += "--:|--:|"
        lines += [head, rule]
        for mode, s in dev["summary"].items():
            if "median_s" not in s:
                cells = [mode, "failed", *["–"] * (9 if xla else 7)]
                lines.append("| " + " | ".join(cells) + " |")
                continue
            cells = [
                mode,
                _f(s["median_s"] * 1e3, "{:.1f}"),
                f"{s['min_s'] * 1e3:.1f}–{s['max_s'] * 1e3:.1f}",
                *(_f(s.get(f"x_{ref}"), "{:.2f}") for ref in REFERENCES),
                _f(s.get("peak_mib"), "{:.0f}"),
            ]
            if xla:
                cells += [_f(s.get("compiles"), "{}"), _f(s.get("graphs_per_step"), "{:.2f}")]
            lines.append("| " + " | ".join(cells) + " |")
        optimizers: dict[str, list[str]] = {}
        for mode, r in dev["modes"].items():
            if "setup" in r:
                optimizers.setdefault(r["setup"]["optimizer"], []).append(mode)
        lines += [
            "",
            "Optimizers: " + "; ".join(f"{o}: {', '.join(m)}" for o, m in optimizers.items()),
        ]
        spread = max(
            (s["max_s"] / s["min_s"] for s in dev["summary"].values() if "min_s" in s), default=1
        )
        if spread > 2:
            lines += [
                "",
                f"**Noisy run**: a mode's block times varied {spread:.1f}x between blocks (a busy "
                "machine?). The per-block ratios absorb some of it; rerun to confirm.",
            ]
        errors = [(m, s["error"]) for m, s in dev["summary"].items() if "error" in s]
        lines += [""] + [f"- `{m}` failed: {e}" for m, e in errors] + ([""] if errors else [])
    for name, why in result.get("skipped", {}).items():
        lines += [f"Not run here: {name} ({why}).", ""]
    lines += ["## Targets (from issue 3; measured, not asserted)", ""]
    lines += ["| device | target | measured | held |", "|---|---|--:|---|"]
    for t in result["targets"]:
        held = {True: "yes", False: "**no**", None: "not measured"}[t["held"]]
        lines.append(f"| {t['device']} | {t['target']} | {t['measured'] or '–'} | {held} |")
    kinds = {
        name: sorted({r["memory"]["memory_kind"] for r in dev["modes"].values() if "memory" in r})
        for name, dev in result["devices"].items()
    }
    lines += [
        "",
        "Step ms: median over blocks of (block time / steps), the device synced at both ends. "
        "Ratios: median over blocks of the per-block ratio. On XLA, compiles counts "
        "compilations during the measured steps and graphs/step the graph executions per step.",
        "Peak MiB: "
        + "; ".join(f"{name}: {', '.join(k) or 'n/a'}" for name, k in kinds.items())
        + ". Peak tensor bytes: live tensors at the start of one extra step plus the highest "
        "running total of its allocations (torch profiler). Peak RSS over baseline: resident "
        "set high-water mark during the measured steps, minus the worker's RSS before it built "
        "the model (XLA:CPU reports no allocator statistics).",
        "",
    ]
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    devices = list(result["devices"])
    fig, axes = plt.subplots(
        2, max(1, len(devices)), figsize=(4.6 * max(1, len(devices)), 6.6), squeeze=False
    )
    colors = {
        "fp32": "#4c72b0",
        "bf16": "#55a868",
        "flat": "#c44e52",
        "pertensor": "#dd8452",
        "mpfunc": "#8172b3",
        "autocast": "#937860",
    }
    for col, name in enumerate(devices):
        summary = result["devices"][name]["summary"]
        modes = [m for m, s in summary.items() if "median_s" in s]
        x = range(len(modes))
        med = [summary[m]["median_s"] * 1e3 for m in modes]
        # Whiskers: quartiles over blocks (min-max would let one slow spell set the scale).
        quart = [summary[m]["quartiles_s"] for m in modes]
        err = [
            [max(0.0, med[i] - q[0] * 1e3) for i, q in enumerate(quart)],
            [max(0.0, q[2] * 1e3 - med[i]) for i, q in enumerate(quart)],
        ]
        ax = axes[0][col]
        ax.bar(x, med, yerr=err, capsize=3, color=[colors.get(m, "gray") for m in modes])
        for i, m in enumerate(modes):
            ratio = summary[m].get("x_fp32")
            if ratio is not None:
                ax.annotate(
                    f"{ratio:.2f}×",
                    (i, med[i] + err[1][i]),
                    ha="center",
                    va="bottom",
                    fontsize=8,
                    xytext=(0, 2),
                    textcoords="offset points",
                )
        ax.margins(y=0.12)
        ax.set_title(_device_title(name, result), fontsize=9)
        ax.set_xticks(list(x), modes, rotation=30, fontsize=8)
        ax.set_ylabel("step time, ms (median, quartiles)" if col == 0 else "")
        ax = axes[1][col]
        mem = [summary[m].get("peak_mib", 0.0) for m in modes]
        ax.bar(x, mem, color=[colors.get(m, "gray") for m in modes])
        ax.set_xticks(list(x), modes, rotation=30, fontsize=8)
        ax.set_ylabel("peak memory, MiB (see seed.md)" if col == 0 else "")
    fig.suptitle(
        f"Seed benchmark: {result['parameters'] / 1e6:.1f}M parameters (preset "
        f"{result['preset']})\nlabels: step time ratio to fp32",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

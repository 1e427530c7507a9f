"""Summaries, targets, the Markdown table and the bar chart of the seed benchmark."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from bench.common.report import fmt, header, pyplot
from bench.seed.config import FUSED, PRESETS, REFERENCES, SCHEDULES, recipe

MIB = 2**20
COLORS = {
    "fp32": "#4c72b0",
    "bf16": "#55a868",
    "flat": "#c44e52",
    "pertensor": "#dd8452",
    "mpfunc": "#8172b3",
    "autocast": "#937860",
    "syncfree": "#da8bc3",
}


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
        if "unsupported" in r:
            s["unsupported"] = r["unsupported"]
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
            # Trace: host time until just before the step is ended (torch_xla.sync());
            # execute: the rest of the step time, per block.
            s["trace_s"] = statistics.median(t for x in samples for t in x["trace_s"])
            s["sync_s"] = statistics.median(t for x in samples for t in x["sync_s"])
            # The optimizer's part of the trace (casts, update, params written back).
            if all("update_s" in x for x in samples):
                s["update_s"] = statistics.median(t for x in samples for t in x["update_s"])
            s["execute_s"] = statistics.median(
                x["step_s"] - statistics.mean(x["trace_s"]) for x in samples
            )
            if device == "xla":
                steps = sum(len(x["trace_s"]) for x in samples)
                s["compiles"] = sum(x["counters"]["compiles"] for x in samples)
                s["graphs_per_step"] = sum(x["counters"]["executions"] for x in samples) / steps
                s["transfers_per_step"] = (
                    sum(x["counters"]["transfers_to_host"] for x in samples) / steps
                )
        if "memory" in r:
            mem = r["memory"]
            s["peak_mib"] = mem["peak_bytes"] / MIB
            if "persistent_bytes" in mem:
                s["persistent_per_param"] = mem["persistent_bytes"] / mem["params"]
            if "step" in mem:
                s["step_peak_per_param"] = mem["step"]["peak"] / mem["params"]
                s["activations_per_param"] = mem["step"]["activations"] / mem["params"]
        summary[m] = s
    for s in summary.values():
        ref = summary.get("pertensor", {}).get("update_s")
        if ref and s.get("update_s") is not None:
            s["update_x_pertensor"] = s["update_s"] / ref
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

    def add(device: str, text: str, key: str, limit: float, spec: str) -> None:
        value = get(device, key)
        rows.append(
            {
                "device": device,
                "target": text,
                "measured": None if value is None else spec.format(value),
                "value": value,
                "held": None if value is None else value <= limit,
            }
        )

    add("xla", "mpfunc update trace ≤ 0.25× pertensor's", "update_x_pertensor", 0.25, "{:.2f}×")
    add("xla", "mpfunc step ≤ 0.8× pertensor", "x_pertensor", 0.8, "{:.2f}×")
    add("xla", "mpfunc step ≤ 0.5× flat", "x_flat", 0.5, "{:.2f}×")
    add("xla", "mpfunc: 0 compiles after warm-up", "compiles", 0, "{:.0f}")
    add("cpu", "mpfunc step ≤ 0.95× pertensor", "x_pertensor", 0.95, "{:.2f}×")
    add("cpu", "mpfunc overhead over bf16 ≤ 10% (≤ 1.10× bf16)", "x_bf16", 1.10, "{:.2f}×")
    return rows


def _device_title(name: str, result: dict[str, Any]) -> str:
    setups = [r["setup"] for r in result["devices"][name]["modes"].values() if "setup" in r]
    info = setups[0] if setups else {}
    if name == "xla":
        version = result["meta"]["versions"].get("torch_xla") or "?"
        return f"xla ({info.get('device_name', '?')}, torch_xla {version})"
    if name == "cuda":
        return f"cuda ({info.get('device_name', '?')})"
    return f"cpu (eager, {info.get('threads', '?')} threads)"


def _device_table(name: str, dev: dict[str, Any]) -> list[str]:
    xla = name == "xla"
    refs = [r for r in REFERENCES if r in dev["summary"]]
    head = "| mode | step ms | min–max ms | " + " | ".join(f"× {r}" for r in refs)
    rule = "|---|--:|--:|" + "--:|" * len(refs)
    head += " | peak MiB | held B/param | peak B/param |"
    rule += "--:|--:|--:|"
    if xla:
        head += " trace ms | update ms | execute ms | compiles | graphs/step |"
        rule += "--:|--:|--:|--:|--:|"
    lines = [head, rule]
    for mode, s in dev["summary"].items():
        if "unsupported" in s:
            continue  # listed below the table, with the reason
        if "median_s" not in s:
            cells = [mode, "failed", *["–"] * (len(refs) + (9 if xla else 4))]
            lines.append("| " + " | ".join(cells) + " |")
            continue
        cells = [
            mode,
            fmt(s["median_s"] * 1e3, "{:.1f}"),
            f"{s['min_s'] * 1e3:.1f}–{s['max_s'] * 1e3:.1f}",
            *(fmt(s.get(f"x_{ref}"), "{:.2f}") for ref in refs),
            fmt(s.get("peak_mib"), "{:.0f}"),
            fmt(s.get("persistent_per_param"), "{:.2f}"),
            fmt(s.get("step_peak_per_param"), "{:.2f}"),
        ]
        if xla:
            cells += [
                fmt(_ms(s.get("trace_s")), "{:.1f}"),
                fmt(_ms(s.get("update_s")), "{:.1f}"),
                fmt(_ms(s.get("execute_s")), "{:.1f}"),
                fmt(s.get("compiles"), "{}"),
                fmt(s.get("graphs_per_step"), "{:.2f}"),
            ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _reduced(result: dict[str, Any]) -> list[str]:
    """A line saying where the run's size or schedule differs from its preset's."""
    preset = PRESETS.get(result["preset"])
    if preset is None:
        return []
    want = {
        **preset.__dict__,
        **dict(zip(("warmup", "blocks", "steps"), SCHEDULES[result["preset"]])),
    }
    got = {**result["config"], **result["schedule"]}
    diff = [f"{k} {got[k]} (preset: {want[k]})" for k in want if k in got and got[k] != want[k]]
    if not diff:
        return []
    return [f"**Reduced run** (differs from preset `{result['preset']}`): {', '.join(diff)}.  "]


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def markdown(result: dict[str, Any]) -> str:
    cfg, sched = result["config"], result["schedule"]
    lines = [
        "# Seed benchmark",
        "",
        f"Model: {result['parameters']:,} parameters in {result['tensors']} tensors "
        f"(preset `{result['preset']}`: d_model {cfg['d_model']}, {cfg['layers']} layers, "
        f"{cfg['heads']} heads, ffn {cfg['ffn']}, vocab {cfg['vocab']}, seq {cfg['seq']}, "
        f"batch {cfg['batch']}, dropout {cfg['dropout']}). AdamW everywhere, loss in fp32; "
        f"torch.optim baselines: `{result['torch_optim']}`, and `fused` in the `{FUSED}` "
        "modes.  ",
        f"Protocol: {sched['warmup']} warm-up steps excluded, then {sched['blocks']} blocks "
        f"of {sched['steps']} steps per mode, modes interleaved, each in its own process.  ",
        *header(result["meta"]),
        *_reduced(result),
        "",
    ]
    for name, dev in result["devices"].items():
        lines += [f"## {_device_title(name, result)}", "", *_device_table(name, dev)]
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
        absent = [(m, s["unsupported"]) for m, s in dev["summary"].items() if "unsupported" in s]
        lines += [f"- `{m}` not run here: {why}" for m, why in absent] + ([""] if absent else [])
    for name, why in result.get("skipped", {}).items():
        lines += [f"Not run here: {name} ({why}).", ""]
    lines += ["## Targets (from issues 3 and 11; measured, not asserted)", ""]
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
        "Ratios: median over blocks of the per-block ratio. On XLA, trace ms is the median "
        "host time from a step's start until just before `torch_xla.sync()` (building the "
        "lazy graph in Python), update ms the part of it after backward (grad copies or "
        "casts, the optimizer, params written back), execute ms the median over blocks of "
        "the rest of the step "
        "time (the `sync()` call lowering and launching the graph, and execution not hidden "
        "behind the next step's tracing; the JSON has the `sync()` time apart); compiles "
        "counts compilations during the measured steps and graphs/step the graph executions "
        "per step.",
        "Peak MiB: "
        + "; ".join(f"{name}: {', '.join(k) or 'n/a'}" for name, k in kinds.items())
        + ". Peak tensor bytes: live tensors at the start of one extra step plus the highest "
        "running total of its allocations (torch profiler). Peak RSS over baseline: resident "
        "set high-water mark during the measured steps, minus the worker's RSS before it built "
        "the model (XLA:CPU reports no allocator statistics).",
        "Held B/param: bytes of the distinct tensor storages the mode keeps from one step to "
        "the next (params, masters and their buffers, optimizer state with its scales and "
        "step counters, and the fp32 grad buffers of `flat` and `pertensor`), over the model's "
        "parameter count; on XLA from the tensors' sizes. Peak B/param (cpu and cuda): the "
        "held bytes plus the highest running total, during one extra profiled step, of the "
        "allocations that are not activations: grads, the optimizer's temporaries, an "
        "extension's scratch (torch's memory profiler tells activations apart; "
        "`bench.common.memory`, limits in `bench/README.md`). Activations are the rest of "
        "peak MiB.",
        "",
    ]
    return "\n".join(lines)


def _hatch(bars: Any, hatches: list[str]) -> None:
    for bar, hatch in zip(bars, hatches):
        bar.set_hatch(hatch)


def plot(result: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    devices = list(result["devices"])
    widths = [max(4.6, 0.55 * len(result["devices"][d]["summary"])) for d in devices] or [4.6]
    fig, axes = plt.subplots(
        2,
        max(1, len(devices)),
        figsize=(sum(widths), 6.6),
        squeeze=False,
        gridspec_kw={"width_ratios": widths},
    )
    for col, name in enumerate(devices):
        summary = result["devices"][name]["summary"]
        modes = [m for m, s in summary.items() if "median_s" in s]
        x = range(len(modes))
        colors = [COLORS.get(recipe(m), "gray") for m in modes]
        hatches = ["//" if m.endswith(FUSED) else "" for m in modes]
        med = [summary[m]["median_s"] * 1e3 for m in modes]
        # Whiskers: quartiles over blocks (min-max would let one slow spell set the scale).
        quart = [summary[m]["quartiles_s"] for m in modes]
        err = [
            [max(0.0, med[i] - q[0] * 1e3) for i, q in enumerate(quart)],
            [max(0.0, q[2] * 1e3 - med[i]) for i, q in enumerate(quart)],
        ]
        ax = axes[0][col]
        _hatch(ax.bar(x, med, yerr=err, capsize=3, color=colors), hatches)
        if name == "xla":
            # The host trace part of each step, as a darker inner bar.
            trace = [summary[m].get("trace_s", 0.0) * 1e3 for m in modes]
            ax.bar(x, trace, width=0.4, color="black", alpha=0.35, label="host trace")
            ax.legend(fontsize=7, loc="upper left")
        for i, m in enumerate(modes):
            ratio = summary[m].get("x_fp32")
            if ratio is not None:
                ax.annotate(
                    f"{ratio:.2f}×",
                    (i, med[i] + err[1][i]),
                    ha="center",
                    va="bottom",
                    fontsize=7,
                    xytext=(0, 2),
                    textcoords="offset points",
                )
        ax.margins(y=0.12)
        ax.set_title(_device_title(name, result), fontsize=9)
        ax.set_xticks(list(x), modes, rotation=40, ha="right", fontsize=7)
        ax.set_ylabel("step time, ms (median, quartiles)" if col == 0 else "")
        ax = axes[1][col]
        mem = [summary[m].get("peak_mib", 0.0) for m in modes]
        _hatch(ax.bar(x, mem, color=colors), hatches)
        ax.set_xticks(list(x), modes, rotation=40, ha="right", fontsize=7)
        ax.set_ylabel("peak memory, MiB (see seed.md)" if col == 0 else "")
    fig.suptitle(
        f"Seed benchmark: {result['parameters'] / 1e6:.1f}M parameters (preset "
        f"{result['preset']})\nlabels: step time ratio to fp32; hatched: fused torch.optim AdamW",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

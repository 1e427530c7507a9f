"""The spmd benchmark's summary, Markdown table and figure (no torch)."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from bench.common.report import fmt, header, pyplot

KIB = 1024
SHORT = {
    "all-reduce": "AR",
    "all-gather": "AG",
    "reduce-scatter": "RS",
    "collective-permute": "CP",
    "all-to-all": "A2A",
}
COLORS = {"replicated": "#4c72b0", "zero1": "#55a868", "fsdp": "#dd8452"}


def summarize(modes: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per-mode statistics of one device count's run (see ``bench.spmd.worker``)."""
    out: dict[str, dict[str, Any]] = {}
    for mode, r in modes.items():
        times = r["step_s"]
        steps = len(times)
        q = statistics.quantiles(times, n=4, method="inclusive") if steps > 1 else times * 3
        per, full = r["device_bytes"], r["full_bytes"]
        pper, pfull = r["param_device_bytes"], r["param_full_bytes"]
        out[mode] = {
            "steps": steps,
            "median_s": statistics.median(times),
            "quartiles_s": q,
            "graphs_per_step": r["counts"]["executions"] / steps,
            "compiles": r["counts"]["compiles"],
            "transfers": r["counts"]["to_host"] + r["counts"]["to_device"],
            "state_bytes_per_device": max(per.values()),
            "state_fraction": max(per.values()) / full,
            "param_bytes_per_device": max(pper.values()),
            "param_fraction": max(pper.values()) / pfull,
            "collectives": r["collectives"],
            "warmup_loss": r["warmup_loss"],
            "final_loss": r["final_loss"],
        }
    base = out.get("replicated", {}).get("median_s")
    for s in out.values():
        s["x_replicated"] = s["median_s"] / base if base else None
    return out


def _graph(coll: dict[str, dict[str, int]] | None) -> str:
    if coll is None:  # no new program compiled: torch_xla's cache had this step's graph
        return "an earlier mode's program"
    if not coll:
        return "none"
    parts = [
        f"{c['count']} {SHORT.get(k, k)} ({c['bytes'] / KIB:.1f} KiB)"
        for k, c in sorted(coll.items())
    ]
    return " + ".join(parts)


def markdown(result: dict[str, Any]) -> str:
    cfg, sched = result["config"], result["schedule"]
    fast = "; XLA:CPU without LLVM optimizations (`--fast-compile`)"
    lines = [
        "# XLA SPMD: replicated against sharded masters on virtual devices",
        "",
        f"Model: {result['parameters']:,} parameters in {result['tensors']} tensors, bf16 "
        f"(transformer-like: d_model {cfg['d_model']}, {cfg['layers']} layers, {cfg['heads']} "
        f"heads, ffn {cfg['ffn']}, vocab {cfg['vocab']}, seq {cfg['seq']}); one fixed batch of "
        f"{cfg['batch']} sequences sharded over the mesh axis `data`; `mpfunc.adamw` on fp32 "
        "masters; one process per device count (`PJRT_DEVICE=CPU CPU_NUM_DEVICES=N`, "
        "`torch_xla.runtime.use_spmd()`).",
        "Modes: `replicated`: params, masters and state on every device (data parallel: the "
        "partitioner sums the grads); `zero1`: `mpfunc.mark_sharding_(masters, mesh, 'data')`, "
        "so masters, AdamW state and fp32 grad buffers are split, params replicated; `fsdp`: "
        "params split too, everything else inherits.",
        f"Protocol: {sched['warmup']} warm-up steps per mode, then {sched['blocks']} blocks of "
        f"{sched['steps']} steps per mode, modes interleaved"
        + (fast if result["fast_compile"] else "")
        + ".  ",
        *header(result["meta"]),
        "",
        "**Virtual devices share this machine's cores**: more devices split the same work "
        "across the same cores. Read the bytes and the graph structure; the times measure "
        "partitioning overhead, not speed-up.",
        "",
        "| devices | mode | step ms | IQR ms | × replicated | graphs/step | compiles | "
        "transfers | masters+state KiB/device | params KiB/device | step graph collectives | "
        "loss |",
        "|--:|---|--:|--:|--:|--:|--:|--:|--:|--:|---|--:|",
    ]
    errors = []
    for n in sorted(result["devices"], key=int):
        d = result["devices"][n]
        if "error" in d:
            errors.append(f"- {n} devices failed: {d['error']}")
            continue
        for mode, s in d["summary"].items():
            q = s["quartiles_s"]
            cells = [
                n,
                mode,
                f"{s['median_s'] * 1e3:.1f}",
                f"{q[0] * 1e3:.1f}–{q[2] * 1e3:.1f}",
                fmt(s["x_replicated"], "{:.2f}"),
                f"{s['graphs_per_step']:g}",
                str(s["compiles"]),
                str(s["transfers"]),
                f"{s['state_bytes_per_device'] / KIB:.1f} ({s['state_fraction']:.2f})",
                f"{s['param_bytes_per_device'] / KIB:.1f} ({s['param_fraction']:.2f})",
                _graph(s["collectives"]),
                f"{s['warmup_loss']:.3f}→{s['final_loss']:.3f}",
            ]
            lines.append("| " + " | ".join(cells) + " |")
    lines += ["", *errors, *([""] if errors else [])]
    lines += [
        "Step ms: median over every measured step, the step's graph run to completion "
        "(`torch_xla.sync()` + `wait_device_ops()`); IQR: its quartiles. × replicated: the "
        "mode's median over the replicated mode's at the same device count. Graphs/step, "
        "compiles and transfers (both directions): torch_xla's counters over the measured "
        "steps.",
        "KiB/device: the most any device holds, from the device buffers (each shard that "
        "`_get_local_shards` returns, counted on the device it lies on); in parentheses, that "
        "over one whole copy. Masters+state: fp32 masters, AdamW moments and step counts. "
        "mark_sharding_ leaves tensors under 1024 elements (biases, norms) replicated, so "
        "the sharded fraction stays a little above 1/devices.",
        "Step graph collectives: the collectives in the program XLA compiled for a step (the "
        "largest module dumped during the mode's warm-up), with the bytes they produce per "
        "device (AR all-reduce, AG all-gather, RS reduce-scatter, CP collective-permute). "
        "With one device every mode traces the same graph, which torch_xla compiles once.",
        "",
    ]
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    ns = [n for n in sorted(result["devices"], key=int) if "error" not in result["devices"][n]]
    modes = list(dict.fromkeys(m for n in ns for m in result["devices"][n]["summary"]))
    fig, (a_time, a_mem) = plt.subplots(1, 2, figsize=(10, 4))
    for mode in modes:
        color = COLORS.get(mode, "gray")
        rows = [(int(n), result["devices"][n]["summary"][mode]) for n in ns]
        xs = [n for n, _ in rows]
        a_time.plot(xs, [s["median_s"] * 1e3 for _, s in rows], marker="o", color=color, label=mode)
        a_mem.plot(
            xs,
            [s["state_bytes_per_device"] / KIB for _, s in rows],
            marker="o",
            color=color,
            label=f"{mode}: masters+state",
        )
        a_mem.plot(
            xs,
            [s["param_bytes_per_device"] / KIB for _, s in rows],
            marker="s",
            ls="--",
            color=color,
            label=f"{mode}: params",
        )
    a_time.set_ylabel("step time, ms (median)")
    a_mem.set_ylabel("KiB per device (max over devices)")
    a_mem.set_yscale("log")
    for ax in (a_time, a_mem):
        ax.set_xscale("log", base=2)
        ax.set_xticks([int(n) for n in ns], ns)
        ax.set_xlabel("virtual XLA:CPU devices (shared cores)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(
        f"spmd: {result['parameters'] / 1e6:.2f}M parameters in {result['tensors']} tensors "
        "(bf16); virtual devices share the cores: times measure overhead",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

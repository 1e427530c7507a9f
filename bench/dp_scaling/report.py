"""Summaries, the Markdown table and the chart of the dp_scaling benchmark."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from bench.common.report import fmt, header, pyplot

MIB = 2**20
SHORT = {"all_reduce": "AR", "broadcast": "BC", "all_gather": "AG", "reduce": "R"}
COLORS = {"unsharded": "#4c72b0", "sharded": "#55a868", "pertensor": "#dd8452"}


def _quartiles(values: list[float]) -> list[float]:
    if len(values) == 1:
        return values * 3
    return statistics.quantiles(values, n=4, method="inclusive")


def summarize(modes: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per-mode statistics of one world size's samples (see ``bench.dp_scaling``)."""
    out: dict[str, dict[str, Any]] = {}
    ref = modes.get("pertensor", {}).get("samples", [])
    ref_by_block = {s["block"]: s["block_step_s"] for s in ref}
    for mode, r in modes.items():
        samples = r["samples"]
        s: dict[str, Any] = {"blocks": len(samples)}
        if "error" in r:
            s["error"] = r["error"]
        if samples:
            times = [t for x in samples for t in x["step_s"]]
            steps = len(times)
            s["steps"] = steps
            s["median_s"] = statistics.median(times)
            s["quartiles_s"] = _quartiles(times)
            s["min_s"], s["max_s"] = min(times), max(times)
            ratios = [
                x["block_step_s"] / ref_by_block[x["block"]]
                for x in samples
                if x["block"] in ref_by_block
            ]
            s["x_pertensor"] = statistics.median(ratios) if ratios else None
            ranks = [x["ranks"] for x in samples]
            world = len(ranks[0])
            # Every rank should make the same calls; record whether they did.
            per_rank = [[b[r]["calls"] for b in ranks] for r in range(world)]
            s["calls_agree"] = all(c == per_rank[0] for c in per_rank)
            kinds = sorted({k for b in ranks for rr in b for k in rr["calls"]})
            s["calls_per_step"] = {
                k: sum(b[0]["calls"].get(k, 0) for b in ranks) / steps for k in kinds
            }
            s["collectives_per_step"] = sum(s["calls_per_step"].values())
            s["payload_bytes_per_step"] = statistics.mean(
                sum(sum(b[r]["payload_bytes"].values()) for b in ranks) / steps
                for r in range(world)
            )
            s["payload_by_kind_per_step"] = {
                k: sum(b[0]["payload_bytes"].get(k, 0) for b in ranks) / steps for k in kinds
            }
            if all(rr["sent_bytes"] is not None for b in ranks for rr in b):
                sent = [sum(b[r]["sent_bytes"] for b in ranks) / steps for r in range(world)]
                s["sent_bytes_per_step"] = statistics.mean(sent)
                s["sent_bytes_per_step_max"] = max(sent)
                s["write_calls_per_step"] = statistics.mean(
                    sum(b[r]["write_calls"] for b in ranks) / steps for r in range(world)
                )
            s["final_loss"] = samples[-1]["loss"]
            s["warmup_loss"] = statistics.mean(x["warmup_loss"] for x in r["setup"])
        if "memory" in r:
            mem = r["memory"]
            s["state_bytes"] = [m["state_bytes"] for m in mem]
            s["peak_rss_bytes"] = [m["peak_rss_bytes"] for m in mem]
            s["baseline_rss_bytes"] = [m["baseline_rss_bytes"] for m in mem]
            s["rss_growth_bytes"] = [m["peak_rss_bytes"] - m["baseline_rss_bytes"] for m in mem]
        out[mode] = s
    return out


def add_scaling(result: dict[str, Any]) -> None:
    """Each mode's median step time over its own at the smallest world size."""
    worlds = sorted(result["worlds"], key=int)
    if not worlds:
        return
    base = result["worlds"][worlds[0]]["summary"]
    for w in worlds:
        for mode, s in result["worlds"][w]["summary"].items():
            b = base.get(mode, {}).get("median_s")
            s["x_first_world"] = s["median_s"] / b if b and "median_s" in s else None


def _range_mib(values: list[int] | None) -> str:
    if not values:
        return "–"
    lo, hi = min(values) / MIB, max(values) / MIB
    fmt = "{:.1f}" if hi >= 10 else "{:.3f}"
    return (
        fmt.format(hi) if fmt.format(lo) == fmt.format(hi) else f"{fmt.format(lo)}–{fmt.format(hi)}"
    )


def _collectives(s: dict[str, Any]) -> str:
    if "calls_per_step" not in s:
        return "–"
    parts = [f"{n:g} {SHORT.get(k, k)}" for k, n in s["calls_per_step"].items() if n]
    total = f"{s['collectives_per_step']:g}"
    warn = "" if s["calls_agree"] else " (ranks differ!)"
    return f"{total} ({' + '.join(parts)}){warn}" if len(parts) > 1 else total + warn


def markdown(result: dict[str, Any]) -> str:
    cfg, sched = result["config"], result["schedule"]
    cores = _cores(result)
    lines = [
        "# Data-parallel scaling on gloo",
        "",
        f"Model: {result['parameters']:,} parameters in {result['tensors']} tensors, bf16 "
        f"(transformer-like: d_model {cfg['d_model']}, {cfg['layers']} layers, "
        f"{cfg['heads']} heads, ffn {cfg['ffn']}, vocab {cfg['vocab']}, seq {cfg['seq']}); "
        f"one fixed global batch of {cfg['batch']} sequences split evenly over the ranks; "
        f"mpfunc.adamw on fp32 masters; grads reduced in {result['reduce_dtype']}; "
        f"buckets of {result['bucket_bytes'] / MIB:g} MiB.",
        "Modes: `unsharded`: `mpfunc.all_reduce_grads` (bucketed) and full fp32 masters on "
        "every rank; `sharded`: `mpfunc.reduce_grads_to_owners` (each bucket reduced to its "
        "owner only), masters and AdamW state for the rank's own leaves "
        "(`shard_plan`/`shard`), then `broadcast_params_`; `pertensor`: the "
        "baseline, one `torch.distributed.all_reduce` per grad tensor, full masters.",
        f"Protocol: each (ranks, mode) is its own gloo group of processes (file store, "
        f"127.0.0.1), kept alive; {sched['warmup']} warm-up steps excluded, then "
        f"{sched['blocks']} blocks of {sched['steps']} steps per mode, modes interleaved; "
        "a barrier starts each block.  ",
        *header(result["meta"]),
        "",
    ]
    worlds = sorted(result["worlds"], key=int)
    oversub = [w for w in worlds if int(w) * result["worlds"][w]["threads"] > cores]
    if oversub:
        lines += [
            f"**Note:** this machine has {cores} usable cores, and every rank runs with "
            "`threads/rank` torch threads, so that it adds no threads beyond its own. With "
            f"{' and '.join(oversub)} ranks there are still more rank threads than cores, "
            "so those rows measure data-parallel *overhead* (communication, every rank's "
            "own optimizer work, context switches), not speedup.",
            "",
        ]
    first = int(worlds[0]) if worlds else 1
    plural = "s" if first > 1 else ""
    head = (
        f"| ranks | threads/rank | mode | step ms | IQR ms | × pertensor | × {first} rank{plural} "
        "| collectives/step | payload MiB/step | sent MiB/step | masters+state MiB "
        "| peak RSS MiB | loss |"
    )
    rule = "|--:|--:|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|"
    lines += [head, rule]
    for w in worlds:
        d = result["worlds"][w]
        for mode, s in d["summary"].items():
            if "median_s" not in s:
                lines.append(f"| {w} | {d['threads']} | {mode} | failed |" + " – |" * 9)
                continue
            q = s["quartiles_s"]
            cells = [
                w,
                str(d["threads"]),
                mode,
                f"{s['median_s'] * 1e3:.1f}",
                f"{q[0] * 1e3:.1f}–{q[2] * 1e3:.1f}",
                fmt(s.get("x_pertensor"), "{:.2f}"),
                fmt(s.get("x_first_world"), "{:.2f}"),
                _collectives(s),
                fmt(s["payload_bytes_per_step"] / MIB, "{:.2f}"),
                fmt(
                    None
                    if s.get("sent_bytes_per_step") is None
                    else s["sent_bytes_per_step"] / MIB,
                    "{:.2f}",
                ),
                _range_mib(s.get("state_bytes")),
                _range_mib(s.get("peak_rss_bytes")),
                f"{s['warmup_loss']:.3f}→{s['final_loss']:.3f}",
            ]
            lines.append("| " + " | ".join(cells) + " |")
    errors = [
        (w, m, s["error"])
        for w, d in result["worlds"].items()
        for m, s in d["summary"].items()
        if "error" in s
    ]
    lines += [""] + [f"- {w} ranks, `{m}` failed: {e}" for w, m, e in errors]
    lines += [
        *([""] if errors else []),
        "Step ms: median over every measured step of the slowest rank's time for that step; "
        "IQR: its quartiles. × pertensor: median over blocks of the mode's mean step time "
        f"over the per-tensor baseline's in the same block. × {first} rank{plural}: median "
        f"step time over the same mode's with {first} rank{plural} (the global batch is "
        "fixed, so ideal scaling would divide the compute).",
        "Collectives/step: calls per step to torch.distributed's collectives, counted by "
        "wrapping them inside every rank (AR: all_reduce, BC: broadcast, R: reduce); every "
        "rank makes "
        "the same calls. Payload: bytes of the tensors one rank hands to those calls per "
        "step (a broadcast counts on every rank, root or not). Sent: bytes one rank wrote "
        "to its sockets per step, mean over ranks (growth of `wchar` in /proc/self/io: "
        "gloo's ring all-reduce sends about 2(n−1)/n of the payload, a broadcast's root "
        "sends the most, and each message adds a small header).",
        "Masters+state: bytes of the rank's fp32 masters and AdamW state, exact, from "
        "`mpfunc.state_dict`; peak RSS: the rank process's resident-set high-water mark "
        "over its life (`resource.getrusage`), including torch itself (about "
        f"{_baseline_mib(result):.0f} MiB after joining the group). A range is min–max "
        "over ranks; a single number, all ranks alike. Loss: the global batch's loss "
        "after warm-up → after the last block (mean of the ranks' slices).",
        "",
    ]
    return "\n".join(lines)


def _cores(result: dict[str, Any]) -> int:
    cores: int = result["meta"]["machine"]["usable_cores"]
    return cores


def _baseline_mib(result: dict[str, Any]) -> float:
    values = [
        b
        for d in result["worlds"].values()
        for s in d["summary"].values()
        for b in s.get("baseline_rss_bytes", [])
    ]
    return statistics.median(values) / MIB if values else float("nan")


def plot(result: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    worlds = sorted(result["worlds"], key=int)
    modes = list(dict.fromkeys(m for w in worlds for m in result["worlds"][w]["summary"]))
    fig, axes = plt.subplots(2, 2, figsize=(10, 7.4))
    (a_time, a_calls), (a_bytes, a_mem) = axes

    def series(mode: str, key: str, scale: float = 1.0) -> tuple[list[float], list[float]]:
        # Each mode a little to the side, so that equal values (unsharded and pertensor
        # send the same bytes) stay visible.
        shift = 2 ** (0.04 * (modes.index(mode) - (len(modes) - 1) / 2))
        xs, ys = [], []
        for w in worlds:
            v = result["worlds"][w]["summary"].get(mode, {}).get(key)
            if isinstance(v, list):
                v = max(v) if v else None
            if v is not None:
                xs.append(int(w) * shift)
                ys.append(v * scale)
        return xs, ys

    for mode in modes:
        color = COLORS.get(mode, "gray")
        xs, ys = series(mode, "median_s", 1e3)
        quart = [
            result["worlds"][w]["summary"][mode]["quartiles_s"]
            for w in worlds
            if "quartiles_s" in result["worlds"][w]["summary"].get(mode, {})
        ]
        err = [
            [max(0.0, y - q[0] * 1e3) for y, q in zip(ys, quart)],
            [max(0.0, q[2] * 1e3 - y) for y, q in zip(ys, quart)],
        ]
        a_time.errorbar(xs, ys, yerr=err, marker="o", capsize=3, color=color, label=mode)
        xs, ys = series(mode, "collectives_per_step")
        a_calls.plot(xs, ys, marker="o", color=color, label=mode)
        xs, ys = series(mode, "payload_bytes_per_step", 1 / MIB)
        a_bytes.plot(xs, ys, marker="o", color=color, label=f"{mode}: payload")
        xs, ys = series(mode, "sent_bytes_per_step", 1 / MIB)
        a_bytes.plot(xs, ys, marker="s", ls="--", color=color, label=f"{mode}: sent")
        xs, ys = series(mode, "state_bytes", 1 / MIB)
        a_mem.plot(xs, ys, marker="o", color=color, label=f"{mode}: masters+state")
        xs, ys = series(mode, "rss_growth_bytes", 1 / MIB)
        a_mem.plot(xs, ys, marker="s", ls="--", color=color, label=f"{mode}: peak RSS growth")
    a_time.set_ylabel("step time, ms (median, quartiles)")
    a_calls.set_ylabel("collectives per step (per rank)")
    a_calls.set_yscale("log")
    a_bytes.set_ylabel("MiB per step per rank")
    a_mem.set_ylabel("MiB per rank (max over ranks)")
    a_mem.set_title(
        "dashed: peak RSS above the RSS after joining the group",
        fontsize=8,
    )
    for ax in axes.flat:
        ax.set_xscale("log", base=2)
        ax.set_xticks([int(w) for w in worlds], worlds)
        ax.set_xlabel("ranks (gloo, CPU processes)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(
        f"dp_scaling: {result['parameters'] / 1e6:.1f}M parameters in {result['tensors']} "
        f"tensors (bf16), {_cores(result)} cores; more ranks than cores measure overhead",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

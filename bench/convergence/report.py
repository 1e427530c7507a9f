"""The convergence study's summary over seeds, its Markdown table and its curves."""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

from bench.common.report import fmt, header, pyplot
from bench.convergence.config import (
    BETAS,
    EPS,
    IDENTICAL_TO,
    PRESETS,
    REFERENCE,
    TARGETS,
    WARMUP_FRACTION,
    WEIGHT_DECAY,
)


def _runs_by(result: dict[str, Any]) -> dict[str, dict[int, dict[str, Any]]]:
    out: dict[str, dict[int, dict[str, Any]]] = {}
    for r in result["runs"]:
        out.setdefault(r["row"], {})[r["seed"]] = r
    return out


def _identical(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Bit for bit the same run: every train loss, the final params and fp32 values."""
    return (
        a["train_loss"] == b["train_loss"]
        and a["params_sha256"] == b["params_sha256"]
        and a["fp32_sha256"] == b["fp32_sha256"]
    )


def _first_difference(a: dict[str, Any], b: dict[str, Any]) -> int | None:
    """The first step whose train loss differs (its forward saw other params), else None."""
    pairs = enumerate(zip(a["train_loss"], b["train_loss"]))
    return next((i for i, (x, y) in pairs if x != y), None)


def summarize(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One entry per row: its measurements over the seeds that finished."""
    by = _runs_by(result)
    ref = by.get(REFERENCE, {})
    same_as = by.get(IDENTICAL_TO, {})
    out = []
    for row in result["rows"]:
        runs = by.get(row["name"], {})
        ok = {s: r for s, r in runs.items() if "error" not in r and "unsupported" not in r}
        entry: dict[str, Any] = {
            "row": row["name"],
            "kind": row["kind"],
            "strategy": row["strategy"],
            "state_dtype": row["state_dtype"],
            "seeds": sorted(ok),
            "errors": sorted({r["error"] for r in runs.values() if "error" in r}),
            "unsupported": sorted({r["unsupported"] for r in runs.values() if "unsupported" in r}),
        }
        if ok:
            vals = [r["final_val_loss"] for r in ok.values()]
            gaps = [
                r["final_val_loss"] / ref[s]["final_val_loss"] - 1
                for s, r in ok.items()
                if s in ref and "error" not in ref[s]
            ]
            entry.update(
                val_mean=statistics.fmean(vals),
                val_min=min(vals),
                val_max=max(vals),
                gap_mean=statistics.fmean(gaps) if gaps else None,
                gap_min=min(gaps) if gaps else None,
                gap_max=max(gaps) if gaps else None,
                gaps=gaps,
                bytes_per_param=max(r["bytes_per_param"] for r in ok.values()),
                peak_per_param=max(
                    (r["memory_per_param"]["peak"] for r in ok.values() if "memory_per_param" in r),
                    default=None,
                ),
                step_ms=statistics.median(r["step_ms_median"] for r in ok.values()),
                **{
                    k: statistics.fmean(r["diag"][k] for r in ok.values())
                    for k in ("stale", "lost", "unchanged", "ratio")
                },
            )
            twins = [r["twin"] for r in ok.values() if r.get("twin")]
            if twins:
                entry["twin"] = {k: sum(t[k] for t in twins) for k in twins[0]}
            if row["name"] != IDENTICAL_TO and same_as:
                pairs = [
                    (r, same_as[s])
                    for s, r in ok.items()
                    if "error" not in same_as.get(s, {"error": 1})
                ]
                entry["identical_to"] = bool(pairs) and all(_identical(a, b) for a, b in pairs)
                entry["first_difference"] = [_first_difference(a, b) for a, b in pairs]
        out.append(entry)
    return out


def targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 10's targets (and issue 22's for 4-bit moments), each measured: bytes per
    param, and the gap or bit-identity."""
    summary = {e["row"]: e for e in result["summary"]}
    out = []
    for row, max_bytes, max_gap in TARGETS:
        e = summary.get(row)
        t: dict[str, Any] = {"row": row, "max_bytes": max_bytes, "max_gap": max_gap}
        if e is None or not e["seeds"]:
            why = "not run" if e is None else "; ".join(e["errors"] + e.get("unsupported", []))
            t.update(held=None, why=why)
            out.append(t)
            continue
        t["bytes_per_param"] = e["bytes_per_param"]
        # To the table's 2 decimals: per-leaf 0-d step counters and RNG keys add ~1e-3.
        checks = [round(e["bytes_per_param"], 2) <= max_bytes]
        if max_gap is None:
            t["identical_to"] = e.get("identical_to")
            t["first_difference"] = e.get("first_difference")
            t["twin"] = e.get("twin")
            checks.append(bool(e.get("identical_to")))
        else:
            t["gap_mean"], t["gap_max"] = e["gap_mean"], e["gap_max"]
            checks.append(e["gap_max"] is not None and abs(e["gap_max"]) <= max_gap)
        t["held"] = all(checks)
        out.append(t)
    return out


def _reduced(cfg: dict[str, Any]) -> list[str]:
    """A line saying where the run differs from the default preset (none for smoke runs)."""
    if cfg == PRESETS["smoke"]:
        return []
    want = PRESETS["default"]
    diff = [f"{k} {cfg[k]} (default: {v})" for k, v in want.items() if cfg.get(k) != v]
    return [f"**Reduced run**: {', '.join(diff)}."] if diff else []


def _pct(x: float | None) -> str:
    return fmt(None if x is None else 100 * x, "{:+.2f}%")


def _share(x: float | None) -> str:
    return fmt(None if x is None or math.isnan(x) else 100 * x, "{:.1f}%")


def markdown(result: dict[str, Any]) -> str:
    meta, cfg, corpus = result["meta"], result["config"], result["corpus"]
    ok_runs = [r for r in result["runs"] if "error" not in r and "unsupported" not in r]
    n_params = ok_runs[0]["params"] if ok_runs else 0
    pre = ", ".join(f"{p['val_loss']:.4f} (seed {p['seed']})" for p in result["pretrained"])
    out = [
        "# Convergence: master strategies and optimizer-state dtypes against fp32",
        "",
        *header(meta),
        f"Device: {result['device']}.  ",
        f"Model: character-level transformer, {cfg['layers']} layer(s), d_model "
        f"{cfg['d_model']}, {cfg['heads']} heads, context {cfg['ctx']}, {n_params:,} "
        f"parameters; batches of {cfg['batch']} x {cfg['ctx']} tokens; loss in fp32.  ",
        f"Regime: per seed, an fp32 pretraining of {cfg['pretrain_steps']} steps at lr "
        f"{cfg['pretrain_lr']:g} (validation loss after it, rounded to bf16: {pre}); then "
        f"every row fine-tunes from that checkpoint for {cfg['steps']} steps at lr "
        f"{cfg['lr']:g}. AdamW (betas {BETAS}, eps {EPS}, weight decay {WEIGHT_DECAY}), "
        f"{WARMUP_FRACTION:.0%} linear warm-up then constant, in both phases. Seeds "
        f"{', '.join(map(str, result['seeds']))} (initial weights and batches).  ",
        f"Data: Python {meta['versions']['python']} standard library source ({corpus['root']}), "
        f"{corpus['train_chars']:,} train characters in {corpus['train_files']} files, "
        f"{corpus['val_chars']:,} held-out characters in {corpus['val_files']} other files "
        f"(sha256 {corpus['sha256'][:12]}). Final validation loss: "
        f"{cfg['final_eval_batches'] * cfg['batch']} fixed held-out windows per seed.",
        *_reduced(cfg),
        "",
        "| row | master strategy | state | bytes/param | peak B/param | final val loss | gap to "
        "fp32: mean [min, max] | stale | lost | update/weight RMS | median step ms |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    absent = []
    for e in result["summary"]:
        strategy = e["strategy"] or ("torch.optim" if e["kind"] == "torch" else "-")
        if e["kind"] == "mixed":
            strategy += " (three calls)"
        if e["kind"] == "backward":
            strategy += " (MasterOptimizer, step_in_backward)"
        if e["kind"] == "peer":
            strategy = "peer"
        state = e["state_dtype"] or ("float32" if e["row"].startswith("fp32") else "bfloat16")
        if e["kind"] == "peer":
            state = "its own"
        if not e["seeds"] and e.get("unsupported") and not e["errors"]:
            absent.append(f"`{e['row']}`: {'; '.join(e['unsupported'])}")
            continue
        if not e["seeds"]:
            out.append(
                f"| {e['row']} | {strategy} | {state} | fails: {'; '.join(e['errors'])}"
                " | | | | | | | |"
            )
            continue
        gap = (
            "-"
            if e["row"] == REFERENCE
            else f"{_pct(e['gap_mean'])} [{_pct(e['gap_min'])}, {_pct(e['gap_max'])}]"
        )
        if e.get("identical_to"):
            gap += f" (bit-identical to {IDENTICAL_TO})"
        spread = f" ± {(e['val_max'] - e['val_min']) / 2:.4f}" if len(e["seeds"]) > 1 else ""
        out.append(
            f"| {e['row']} | {strategy} | {state} | {e['bytes_per_param']:.2f} | "
            f"{fmt(e.get('peak_per_param'), '{:.2f}')} | {e['val_mean']:.4f}{spread} | {gap} | "
            f"{_share(e['stale'])} | {_share(e['lost'])} | "
            f"{fmt(e['ratio'], '{:.2e}')} | {fmt(e['step_ms'], '{:.0f}')} |"
        )
    if absent:
        out += ["", "Not run here (library or option missing): " + "; ".join(absent) + "."]
    out += ["", "Targets (issues 10 and 22), measured:", ""]
    for t in result["targets"]:
        want = f"<= {t['max_bytes']:g} B/param, " + (
            f"bit-identical to {IDENTICAL_TO}"
            if t["max_gap"] is None
            else f"final val loss within {t['max_gap']:.1%} of fp32 on every seed"
        )
        if t["held"] is None:
            got = t["why"]
        elif t["max_gap"] is None:
            got = f"{t['bytes_per_param']:.2f} B/param, bit-identical: {t['identical_to']}"
            if not t["identical_to"] and t.get("first_difference"):
                steps = ", ".join(str(i) for i in t["first_difference"])
                got += f" (the train loss first differs at step {steps}, seed by seed)"
            tw = t.get("twin")
            if tw:
                got += (
                    f"; beside it, fp32 masters stepped on the same grads: masters differ after "
                    f"{tw['master_steps_differ']} of {tw['steps']} steps, params differ from "
                    f"their `Tensor.to` at {tw['params_differ']} (element, step) pairs, "
                    f"{tw['params_differ_at_ties']} of them at exact ties (low 16 bits 0x8000)"
                )
        else:
            got = (
                f"{t['bytes_per_param']:.2f} B/param, gap {_pct(t['gap_mean'])} "
                f"(worst seed {_pct(t['gap_max'])})"
            )
        held = {True: "held", False: "missed", None: "not measured"}[t["held"]]
        out.append(f"- `{t['row']}`: {want}: {got}; **{held}**.")
    out += [
        "",
        "*bytes/param*: bytes of the distinct storages held from one step to the next "
        "(model params, masters and their remainder/compensation/RNG buffers, optimizer "
        "moments with their quantization scales and step counters, and the fp32 grad "
        "buffer of `mixed`), over the parameter count; grads, which live only between "
        "backward and the step, are left out. *peak B/param*: those bytes plus the highest "
        "running total, during one profiled step of the row (on a trainer of its own, "
        "after two steps on the run's first batches), of the allocations that are not "
        "activations: the grads, the optimizer's temporaries, an extension's scratch "
        "(`bench.common.memory`; limits in `bench/README.md`). Peers keep their own state "
        "formats (torchao and bitsandbytes leave tensors under 4,096 elements unquantized: "
        "this model's norms and biases); their *stale* and *lost* are not measured, nor "
        "*step-in-backward*'s (its leaves step inside backward, where no stats are taken). "
        "*gap*: final validation loss over fp32's, "
        "seed by seed. *val loss*: mean ± half the range over seeds. Every diagnostic "
        f"is a fraction of all parameter elements, on one step in {cfg['diag_every']}, "
        "averaged over those steps and the seeds: *stale*, the update was non-zero but "
        "the bf16 model param did not change (from `apply_update_(stats=)` for mpfunc "
        "rows); *lost*, the value the next step starts from (fp32 master, param plus "
        "remainder or compensation, or the param itself) did not change either, so the "
        "update is gone (fp32's own row gives the floor: updates below fp32's "
        "resolution, or zero; with `stochastic` an unmoved param is that step's draw, "
        "and the rounding is unbiased, so lost updates come back on average); "
        "*update/weight "
        "RMS*: rms(update) / rms(weight) over all elements. Step times leave out the "
        "diagnostic steps; they are wall-clock times on a machine shared with other "
        "work, not a speed comparison (that is `bench.seed`'s job).",
        "",
        "![convergence](convergence.png)",
    ]
    return "\n".join(out) + "\n"


_COLOURS = {"fp32": "C0", "remainder": "C2", "kahan": "C1", "stochastic": "C4", "none": "C3"}
_STYLES = {"float32": "-", "bfloat16": "--", "uint8": ":", "uint4": "-."}


def _style(row: dict[str, Any]) -> dict[str, Any]:
    if row["kind"] == "torch":
        return {"color": "k" if row["name"] == REFERENCE else "C3", "lw": 2.4, "ls": "-"}
    return {
        "color": _COLOURS.get(row["strategy"], "C7"),
        "lw": 1.2,
        "ls": _STYLES.get(row["state_dtype"], "-."),
    }


def plot(result: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    by = _runs_by(result)
    summary = {e["row"]: e for e in result["summary"]}
    labels: dict[tuple[float, float], list[str]] = {}
    fig, (ax_v, ax_g, ax_s) = plt.subplots(1, 3, figsize=(18, 5.2), constrained_layout=True)
    for row in result["rows"]:
        runs = [r for r in by.get(row["name"], {}).values() if "val_curve" in r]
        if not runs:
            continue
        st = _style(row)
        steps = [s for s, _ in runs[0]["val_curve"]]
        vals = [statistics.fmean(r["val_curve"][i][1] for r in runs) for i in range(len(steps))]
        ax_v.plot(steps, vals, label=row["name"], **st)
        per = [r["diag"]["per_step"] for r in runs]
        d_steps = [p[0] for p in per[0]]
        stale = [100 * statistics.fmean(p[i][1] for p in per) for i in range(len(d_steps))]
        ax_s.plot(d_steps, stale, label=row["name"], **st)
        e = summary[row["name"]]
        if e.get("gap_mean") is not None and row["name"] != REFERENCE:
            mid = 100 * e["gap_mean"]
            err = [[mid - 100 * e["gap_min"]], [100 * e["gap_max"] - mid]]
            ax_g.errorbar(
                e["bytes_per_param"], mid, yerr=err, fmt="o", color=st["color"], ms=5, capsize=3
            )
            # Rows that land on one spot share one label, a name per line.
            spot = (round(e["bytes_per_param"], 1), round(mid, 1))
            labels.setdefault(spot, []).append(row["name"])
    for (x, y), names in labels.items():
        ax_g.annotate(
            "\n".join(names), (x, y), fontsize=7, xytext=(4, 2), textcoords="offset points"
        )
    ax_g.axhline(0, color="k", lw=0.8)
    ax_v.set(
        xlabel="fine-tuning step",
        ylabel="validation loss (mean over seeds)",
        title="held-out validation loss while fine-tuning",
    )
    ax_g.set(
        xlabel="persistent bytes per parameter",
        ylabel="final val loss gap to fp32, % (mean, min-max over seeds)",
        title="quality against memory",
    )
    ax_s.set(
        xlabel="fine-tuning step",
        ylabel="% of parameter elements",
        title="stale updates: non-zero, bf16 param unchanged",
    )
    for ax in (ax_v, ax_g, ax_s):
        ax.grid(True, alpha=0.3)
    ax_v.legend(fontsize=7, ncol=2)
    fig.savefig(path, dpi=110)
    plt.close(fig)

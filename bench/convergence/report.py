"""The Markdown table and the curves of the convergence study."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.common.report import header, pyplot
from bench.convergence.config import (
    BETAS,
    EPS,
    FINAL_LR_FRACTION,
    MODES,
    TARGET_GAP,
    WARMUP_FRACTION,
    WEIGHT_DECAY,
)


def markdown(result: dict[str, Any]) -> str:
    meta, cfg, corpus = result["meta"], result["config"], result["corpus"]
    runs = {r["mode"]: r for r in result["runs"]}
    base = runs.get("fp32")
    out = [
        "# Convergence: fp32 vs pure bf16 vs mpfunc mixed precision",
        "",
        *header(meta),
        f"Device: {result['device']}.  ",
        f"Model: character-level transformer, {cfg['layers']} layers, d_model {cfg['d_model']}, "
        f"{cfg['heads']} heads, context {cfg['ctx']}, {result['runs'][0]['params']:,} parameters. "
        f"AdamW (betas {BETAS}, eps {EPS}, weight decay {WEIGHT_DECAY}), peak lr {cfg['lr']}, "
        f"{WARMUP_FRACTION:.0%} warm-up then cosine to {FINAL_LR_FRACTION:.0%}; "
        f"{cfg['steps']} steps of {cfg['batch']} x {cfg['ctx']} tokens; loss in fp32.  ",
        f"Data: Python {meta['versions']['python']} standard library source ({corpus['root']}), "
        f"{corpus['train_chars']:,} train characters in {corpus['train_files']} files, "
        f"{corpus['val_chars']:,} held-out characters in {corpus['val_files']} other files "
        f"(seed {cfg['seed']}, sha256 {corpus['sha256'][:12]}). Final validation loss: "
        f"{cfg['final_eval_batches'] * cfg['batch']} fixed held-out windows.",
        "",
        "| mode | final val loss | gap to fp32 | train loss (last 10% of steps) | stale "
        "updates | lost updates | median step ms | wall s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for mode in MODES:
        r = runs.get(mode)
        if r is None:
            continue
        gap = (
            f"{r['final_val_loss'] / base['final_val_loss'] - 1:+.2%}"
            if base and mode != "fp32"
            else "-"
        )
        st = r["stale"]
        stale = f"{st['stale_fraction']:.2%}" if st else "-"
        lost = f"{st['lost_fraction']:.2%}" if st else "-"
        out.append(
            f"| {mode} | {r['final_val_loss']:.4f} | {gap} | {r['final_train_loss']:.4f} | "
            f"{stale} | {lost} | {r['step_ms_median']:.0f} | {r['wall_s']:.0f} |"
        )
    t = result["target"]
    held = {True: "yes", False: "**no**", None: "n/a"}[t["held"]]
    out += [
        "",
        f"Target: mixed final validation loss within {TARGET_GAP:.0%} of fp32: "
        f"{t.get('measured', 'not measured')}; held: {held}.",
        "",
        "Of all (element, step) pairs whose AdamW update, computed in fp32 arithmetic from "
        "that step's inputs, was non-zero: *stale* is the fraction where the bf16 model weight "
        "did not change; *lost* is the fraction where the stored weight did not change either "
        "(the bf16 weight in `bf16`, the fp32 master in `mixed`). In `bf16` every stale update "
        "is lost; in `mixed` it stays in the master and moves the bf16 weight once the "
        "accumulated updates cross a bf16 rounding boundary. Step times leave out this "
        "counting; they are wall-clock times on a machine shared with other work, not a speed "
        "comparison (that is `bench.seed`'s job).",
        "",
        "![convergence](convergence.png)",
    ]
    return "\n".join(out) + "\n"


def plot(result: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    colours = {"fp32": "k", "bf16": "C3", "mixed": "C0"}
    fig, (ax_t, ax_v, ax_s) = plt.subplots(1, 3, figsize=(16, 4.6), constrained_layout=True)
    lows: list[float] = []
    highs: list[float] = []
    for r in result["runs"]:
        mode, c = r["mode"], colours[r["mode"]]
        losses = r["train_loss"]
        w = max(1, len(losses) // 30)
        smooth = [sum(losses[max(0, i - w + 1) : i + 1]) / len(losses[max(0, i - w + 1) : i + 1])
                  for i in range(len(losses))]  # fmt: skip
        ax_t.plot(range(1, len(losses) + 1), smooth, color=c, label=mode)
        steps, vals = zip(*r["val_curve"])
        ax_v.plot(steps, vals, color=c, marker="o", ms=3, label=mode)
        # Zoom past the first tenth of training, where all modes sit on top of each other.
        skip = len(losses) // 10
        lows += [min(smooth), min(vals)]
        highs += [max(smooth[skip:] or smooth), max(vals[1:] or vals)]
        if r["stale"]:
            s_steps, s_stale, s_lost = zip(*r["stale"]["per_step"])
            if mode == "bf16":
                ax_s.plot(s_steps, [100 * f for f in s_stale], color=c, label="bf16: stale = lost")
            else:
                ax_s.plot(s_steps, [100 * f for f in s_stale], color=c, label=f"{mode}: stale")
                ax_s.plot(s_steps, [100 * f for f in s_lost], ":", color=c, label=f"{mode}: lost")
    ax_t.set(xlabel="step", ylabel="train loss (moving mean)", title="train loss")
    ax_v.set(xlabel="step", ylabel="validation loss", title="held-out validation loss")
    ax_s.set(
        xlabel="step",
        ylabel="% of non-zero updates",
        title="updates that left the bf16 weight unchanged",
    )
    for ax in (ax_t, ax_v):
        ax.set_ylim(min(lows) * 0.98, max(highs) * 1.02)
    for ax in (ax_t, ax_v, ax_s):
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.savefig(path, dpi=110)
    plt.close(fig)

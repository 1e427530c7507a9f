"""Convergence: does mpfunc's mixed precision keep fp32 quality?

Trains one small character-level transformer on the Python standard library's
own source (read offline; seeded file shuffle; whole files held out for
validation) in three modes, from the same initial weights, on the same batches,
for the same number of steps:

- ``fp32``: fp32 model, ``torch.optim.AdamW``;
- ``bf16``: bf16 model and bf16 optimizer state, ``torch.optim.AdamW``;
- ``mixed``: bf16 model, fp32 masters and state through mpfunc
  (``grads_to_fp32_``, ``apply_update_`` with ``mpfunc.adamw``, ``masters_to_model_``).

The loss is computed in fp32 in every mode. Reports train and validation loss
curves, the final validation-loss gap of each mode to fp32, and the fraction of
stale bf16 updates: elements whose bf16 weight did not change in a step although
the update computed in fp32 arithmetic was non-zero. In ``bf16`` such an update
is lost; in ``mixed`` it stays in the fp32 master and reaches the weight later.

    python -m bench.convergence                 # about 4 minutes on 2 idle cores
    python -m bench.convergence --smoke --out /tmp/c

Writes ``convergence.md``, ``convergence.json`` and ``convergence.png`` to
``--out`` (default ``bench/results/convergence``).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

import mpfunc
from bench import _convergence_data as data
from bench._convergence_model import CharLM, loss_fn
from bench.transforms import _load_avg, _machine

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "convergence"
MODES = ("fp32", "bf16", "mixed")
TARGET_GAP = 0.01  # mixed final validation loss within 1% of fp32

_PRESETS: dict[str, dict[str, Any]] = {
    "default": {
        "steps": 800,
        "batch": 16,
        "ctx": 128,
        "d_model": 128,
        "layers": 3,
        "heads": 4,
        "lr": 3e-3,
        "eval_every": 50,
        "eval_batches": 4,
        "final_eval_batches": 32,
        "corpus_chars": 4_000_000,
    },
    "smoke": {
        "steps": 12,
        "batch": 4,
        "ctx": 32,
        "d_model": 32,
        "layers": 1,
        "heads": 2,
        "lr": 3e-3,
        "eval_every": 6,
        "eval_batches": 2,
        "final_eval_batches": 2,
        "corpus_chars": 200_000,
    },
}
BETAS = (0.9, 0.99)
EPS = 1e-8
WEIGHT_DECAY = 0.01
WARMUP_FRACTION = 0.05
FINAL_LR_FRACTION = 0.1


def lr_at(step: int, cfg: dict[str, Any]) -> float:
    """Linear warm-up, then cosine decay to ``FINAL_LR_FRACTION`` of the peak."""
    peak, steps = cfg["lr"], cfg["steps"]
    warmup = max(1, int(WARMUP_FRACTION * steps))
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    low = FINAL_LR_FRACTION * peak
    return low + 0.5 * (peak - low) * (1.0 + math.cos(math.pi * progress))


def windows(tokens: torch.Tensor, starts: torch.Tensor, ctx: int) -> tuple[torch.Tensor, ...]:
    """Inputs and next-token targets for windows of ``ctx`` tokens at ``starts``."""
    idx = starts[:, None] + torch.arange(ctx + 1)
    chunk = tokens[idx].long()
    return chunk[:, :-1], chunk[:, 1:]


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: list[tuple[torch.Tensor, ...]]) -> float:
    model.eval()
    losses = [loss_fn(model, x, y).item() for x, y in batches]
    model.train()
    return sum(losses) / len(losses)


class Stale:
    """Counts updates that a step's bf16 rounding swallowed.

    For every element whose AdamW update, computed in fp32 arithmetic from the
    step's inputs, is non-zero: ``stale`` when the bf16 model weight did not
    change, ``lost`` when the stored weight (the bf16 weight in ``bf16``, the fp32
    master in ``mixed``) did not change either, so the update is gone for good.
    """

    def __init__(self) -> None:
        self.nonzero = 0
        self.stale = 0
        self.lost = 0
        self.per_step: list[tuple[int, float, float]] = []

    def add(
        self,
        step: int,
        nonzero: list[torch.Tensor],
        weight_same: list[torch.Tensor],
        store_same: list[torch.Tensor],
    ) -> None:
        n_nonzero = sum(int(z.sum()) for z in nonzero)
        n_stale = sum(int((w & z).sum()) for w, z in zip(weight_same, nonzero))
        n_lost = sum(int((s & z).sum()) for s, z in zip(store_same, nonzero))
        self.nonzero += n_nonzero
        self.stale += n_stale
        self.lost += n_lost
        denom = max(1, n_nonzero)
        self.per_step.append((step, n_stale / denom, n_lost / denom))

    def summary(self) -> dict[str, Any]:
        return {
            "nonzero": self.nonzero,
            "stale": self.stale,
            "lost": self.lost,
            "stale_fraction": self.stale / max(1, self.nonzero),
            "lost_fraction": self.lost / max(1, self.nonzero),
            "per_step": self.per_step,
        }


def _adamw_delta_fp32(
    p: torch.Tensor,
    g: torch.Tensor,
    exp_avg: torch.Tensor | None,
    exp_avg_sq: torch.Tensor | None,
    step: float,
    lr: float,
) -> torch.Tensor:
    """The change AdamW makes to ``p`` this step, in fp32 arithmetic, from the state before it.

    ``step`` counts the steps taken so far; ``None`` moments mean a fresh state.
    """
    p32, g32 = p.detach().float(), g.float()
    m = torch.zeros_like(p32) if exp_avg is None else exp_avg.float()
    v = torch.zeros_like(p32) if exp_avg_sq is None else exp_avg_sq.float()
    t = step + 1
    b1, b2 = BETAS
    m = m.mul(b1).add_(g32, alpha=1 - b1)
    v = v.mul(b2).addcmul_(g32, g32, value=1 - b2)
    denom = v.sqrt_().div_(math.sqrt(1 - b2**t)).add_(EPS)
    return p32.mul(-lr * WEIGHT_DECAY).addcdiv_(m, denom, value=-lr / (1 - b1**t))


class Trainer:
    """One mode's model and optimizer; ``step`` trains on one batch."""

    def __init__(self, mode: str, cfg: dict[str, Any], device: torch.device) -> None:
        self.mode = mode
        self.diag_s = 0.0  # time spent counting stale updates, left out of step times
        torch.manual_seed(cfg["seed"])  # the same initial weights in every mode
        model = CharLM(len(data.VOCAB), cfg["ctx"], cfg["d_model"], cfg["layers"], cfg["heads"])
        if mode != "fp32":
            model = model.to(torch.bfloat16)
        self.model = model.to(device)
        self.params = dict(self.model.named_parameters())
        self.lr0 = lr_at(0, cfg)
        if mode == "mixed":
            self.masters = mpfunc.init_master(self.params)
            self.g32 = {k: torch.empty_like(m) for k, m in self.masters.items()}
            # A 0-d tensor lr is read at every step, so the schedule needs no new optimizer.
            self.lr = torch.tensor(self.lr0, dtype=torch.float32, device=device)
            self.opt = mpfunc.adamw(
                lr=self.lr, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, impl="auto"
            )
            self.state = self.opt.init(self.masters)
        else:
            self.torch_opt = torch.optim.AdamW(
                self.params.values(), lr=self.lr0, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY
            )

    def step(
        self, x: torch.Tensor, y: torch.Tensor, lr: float, stale: Stale | None, i: int
    ) -> float:
        for p in self.params.values():
            p.grad = None
        loss = loss_fn(self.model, x, y)
        loss.backward()
        if self.mode == "mixed":
            self._mixed_update(lr, stale, i)
        else:
            self._torch_update(lr, stale, i)
        return loss.item()

    def _torch_update(self, lr: float, stale: Stale | None, i: int) -> None:
        for group in self.torch_opt.param_groups:
            group["lr"] = lr
        if stale is None:
            self.torch_opt.step()
            return
        t0 = time.perf_counter()
        ps = list(self.params.values())
        with torch.no_grad():
            nonzero = []
            for p in ps:
                st = self.torch_opt.state.get(p, {})
                delta = _adamw_delta_fp32(
                    p, p.grad, st.get("exp_avg"), st.get("exp_avg_sq"), float(st.get("step", 0)), lr
                )
                nonzero.append(delta != 0)
            before = [p.detach().clone() for p in ps]
        self.diag_s += time.perf_counter() - t0
        self.torch_opt.step()
        t0 = time.perf_counter()
        same = [p.detach() == b for p, b in zip(ps, before)]
        stale.add(i, nonzero, same, same)
        self.diag_s += time.perf_counter() - t0

    def _mixed_update(self, lr: float, stale: Stale | None, i: int) -> None:
        grads = {k: p.grad for k, p in self.params.items()}
        mpfunc.grads_to_fp32_(grads, self.g32)
        self.lr.fill_(lr)
        if stale is not None:
            t0 = time.perf_counter()
            st = self.state
            nonzero = [
                _adamw_delta_fp32(
                    m, self.g32[k], st.exp_avg[k], st.exp_avg_sq[k], float(st.step[k]), lr
                )
                != 0
                for k, m in self.masters.items()
            ]
            masters_before = [m.clone() for m in self.masters.values()]
            params_before = [p.detach().clone() for p in self.params.values()]
            self.diag_s += time.perf_counter() - t0
        self.masters, self.state = mpfunc.apply_update_(
            self.masters, self.g32, self.state, self.opt
        )
        mpfunc.masters_to_model_(self.masters, self.params)
        if stale is not None:
            t0 = time.perf_counter()
            weight_same = [p.detach() == b for p, b in zip(self.params.values(), params_before)]
            master_same = [m == b for m, b in zip(self.masters.values(), masters_before)]
            stale.add(i, nonzero, weight_same, master_same)
            self.diag_s += time.perf_counter() - t0


def train_mode(
    mode: str,
    cfg: dict[str, Any],
    corpus: data.Corpus,
    device: torch.device,
    log: Callable[[str], None],
) -> dict[str, Any]:
    trainer = Trainer(mode, cfg, device)
    n_params = sum(p.numel() for p in trainer.params.values())
    gen = torch.Generator().manual_seed(cfg["seed"] + 1)  # the same batches in every mode
    ctx, batch = cfg["ctx"], cfg["batch"]
    train_starts = torch.randint(
        0, len(corpus.train) - ctx - 1, (cfg["steps"], batch), generator=gen
    )
    val_starts = torch.randint(
        0, len(corpus.val) - ctx - 1, (cfg["final_eval_batches"], batch), generator=gen
    )
    val_batches = [tuple(t.to(device) for t in windows(corpus.val, s, ctx)) for s in val_starts]
    curve_batches = val_batches[: cfg["eval_batches"]]
    stale = Stale() if mode != "fp32" else None

    train_loss: list[float] = []
    val_curve = [(0, evaluate(trainer.model, curve_batches))]
    step_s: list[float] = []
    t_mode = time.perf_counter()
    for i in range(cfg["steps"]):
        x, y = (t.to(device) for t in windows(corpus.train, train_starts[i], ctx))
        t0, diag0 = time.perf_counter(), trainer.diag_s
        train_loss.append(trainer.step(x, y, lr_at(i, cfg), stale, i))
        step_s.append(time.perf_counter() - t0 - (trainer.diag_s - diag0))
        if (i + 1) % cfg["eval_every"] == 0 or i + 1 == cfg["steps"]:
            val_curve.append((i + 1, evaluate(trainer.model, curve_batches)))
            log(
                f"[{mode:5}] step {i + 1:5d}/{cfg['steps']}  train {train_loss[-1]:.4f}  "
                f"val {val_curve[-1][1]:.4f}  {statistics.median(step_s) * 1e3:.0f} ms/step"
            )
    final_val = evaluate(trainer.model, val_batches)
    tail = max(1, cfg["steps"] // 10)
    result = {
        "mode": mode,
        "params": n_params,
        "train_loss": train_loss,
        "val_curve": val_curve,
        "final_val_loss": final_val,
        "final_train_loss": sum(train_loss[-tail:]) / tail,
        "step_ms_median": statistics.median(step_s) * 1e3,
        "wall_s": time.perf_counter() - t_mode,
        "stale": stale.summary() if stale else None,
    }
    del trainer
    gc.collect()
    return result


def _load(value: float | None) -> str:
    return "unknown" if value is None else f"{value:.2f}"


def markdown(result: dict[str, Any]) -> str:
    meta, cfg, corpus = result["meta"], result["config"], result["corpus"]
    runs = {r["mode"]: r for r in result["runs"]}
    base = runs.get("fp32")
    out = [
        "# Convergence: fp32 vs pure bf16 vs mpfunc mixed precision",
        "",
        f"Command: `{meta['command']}`  ",
        f"Machine: {meta['machine']}; torch {meta['torch']}, {meta['threads']} threads; "
        f"run time {meta['wall_s']:.0f} s; 1-minute load average "
        f"{_load(meta['load_avg_start'])} at the start, {_load(meta['load_avg_end'])} at the "
        "end.  ",
        f"Model: character-level transformer, {cfg['layers']} layers, d_model {cfg['d_model']}, "
        f"{cfg['heads']} heads, context {cfg['ctx']}, {result['runs'][0]['params']:,} parameters. "
        f"AdamW (betas {BETAS}, eps {EPS}, weight decay {WEIGHT_DECAY}), peak lr {cfg['lr']}, "
        f"{WARMUP_FRACTION:.0%} warm-up then cosine to {FINAL_LR_FRACTION:.0%}; "
        f"{cfg['steps']} steps of {cfg['batch']} x {cfg['ctx']} tokens; loss in fp32.  ",
        f"Data: Python {meta['python']} standard library source ({corpus['root']}), "
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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.convergence", description=__doc__.split("\n")[0]
    )
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder")
    p.add_argument("--smoke", action="store_true", help="a tiny run, for the test suite")
    p.add_argument(
        "--render-only",
        action="store_true",
        help="rewrite the table and plot from --out's convergence.json; train nothing",
    )
    p.add_argument("--modes", default=",".join(MODES), help="comma list of fp32, bf16, mixed")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    for key, value in _PRESETS["default"].items():
        p.add_argument(f"--{key.replace('_', '-')}", type=type(value), default=None)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        return _run(args, argv)
    finally:
        torch.set_num_threads(threads)


def _run(args: argparse.Namespace, argv: Sequence[str] | None) -> dict[str, Any]:
    if args.render_only:
        result: dict[str, Any] = json.loads((args.out / "convergence.json").read_text())
        render(result, args.out)
        print(f"rewrote {args.out}/convergence.md and .png", file=sys.stderr)
        return result
    cfg = dict(_PRESETS["smoke" if args.smoke else "default"])
    for key in cfg:
        if getattr(args, key) is not None:
            cfg[key] = getattr(args, key)
    cfg["seed"] = args.seed
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for m in modes:
        if m not in MODES:
            raise SystemExit(f"--modes: expected some of {', '.join(MODES)}, got {m!r}")
    device = torch.device(args.device)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    t_start = time.perf_counter()
    load_start = _load_avg()
    corpus = data.load(cfg["corpus_chars"], cfg["seed"])
    log(
        f"corpus: {len(corpus.train):,} train / {len(corpus.val):,} val characters from "
        f"{corpus.root}"
    )
    # Keep the caller's global RNG as it was: each mode reseeds for its own initial weights.
    with torch.random.fork_rng(devices=[]):
        runs = [train_mode(m, cfg, corpus, device, log) for m in modes]

    argv_list = list(sys.argv[1:] if argv is None else argv)
    result = {
        "meta": {
            "command": shlex.join(["python", "-m", "bench.convergence", *argv_list]),
            "machine": _machine()[0],
            "torch": torch.__version__,
            "python": platform.python_version(),
            "threads": torch.get_num_threads(),
            "device": str(device),
            "wall_s": time.perf_counter() - t_start,
            "load_avg_start": load_start,
            "load_avg_end": _load_avg(),
        },
        "config": cfg,
        "corpus": {
            "root": corpus.root,
            "train_chars": len(corpus.train),
            "val_chars": len(corpus.val),
            "train_files": corpus.n_train_files,
            "val_files": corpus.n_val_files,
            "sha256": corpus.sha256,
            "vocab_size": len(data.VOCAB),
        },
        "runs": runs,
    }
    by_mode = {r["mode"]: r for r in runs}
    if "fp32" in by_mode and "mixed" in by_mode:
        gap = by_mode["mixed"]["final_val_loss"] / by_mode["fp32"]["final_val_loss"] - 1
        result["target"] = {
            "measured": f"gap {gap:+.2%}",
            "value": gap,
            "held": abs(gap) <= TARGET_GAP,
        }
    else:
        result["target"] = {"held": None}

    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "convergence.json").write_text(json.dumps(result, indent=1) + "\n")
    render(result, args.out)
    log(f"wrote {args.out}/convergence.md, .json, .png in {result['meta']['wall_s']:.0f} s")
    return result


def render(result: dict[str, Any], out: Path) -> None:
    """Writes the Markdown table and the PNG from a result (fresh, or read back from JSON)."""
    (out / "convergence.md").write_text(markdown(result))
    plot(result, out / "convergence.png")


if __name__ == "__main__":
    main()

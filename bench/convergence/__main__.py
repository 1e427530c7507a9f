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
    python -m bench.convergence --out bench/results/convergence   # refresh the committed results

Writes ``convergence.md``, ``convergence.json`` and ``convergence.png`` to ``--out``
(default: a folder under the system's temporary directory).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.common import meta as meta_mod
from bench.common.report import read_json, write_json
from bench.convergence import report
from bench.convergence.config import MODES, PRESETS, TARGET_GAP


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.convergence", description=__doc__.split("\n")[0]
    )
    meta_mod.add_out_argument(p, "convergence")
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
    for key, value in PRESETS["default"].items():
        p.add_argument(f"--{key.replace('_', '-')}", type=type(value), default=None)
    return p.parse_args(argv)


def render(result: dict[str, Any], out: Path) -> None:
    """Writes the Markdown table and the PNG from a result (fresh, or read back from JSON)."""
    (out / "convergence.md").write_text(report.markdown(result))
    report.plot(result, out / "convergence.png")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.render_only:
        render(read_json(args.out / "convergence.json"), args.out)
        print(f"rewrote {args.out}/convergence.md and .png", file=sys.stderr)
        return 0
    cfg = dict(PRESETS["smoke" if args.smoke else "default"])
    for key in cfg:
        if getattr(args, key) is not None:
            cfg[key] = getattr(args, key)
    cfg["seed"] = args.seed
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for m in modes:
        if m not in MODES:
            raise SystemExit(f"--modes: expected some of {', '.join(MODES)}, got {m!r}")
    run = meta_mod.Run("convergence", argv)
    # torch only now: --render-only and the checks above need none of it.
    import torch

    from bench.common.device import torch_threads
    from bench.convergence import data
    from bench.convergence.worker import train_mode

    device = torch.device(args.device)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    corpus = data.load(cfg["corpus_chars"], cfg["seed"])
    log(
        f"corpus: {len(corpus.train):,} train / {len(corpus.val):,} val characters from "
        f"{corpus.root}"
    )
    # Keep the caller's global RNG as it was: each mode reseeds for its own initial weights.
    with torch_threads(args.threads) as threads, torch.random.fork_rng(devices=[]):
        runs = [train_mode(m, cfg, corpus, device, log) for m in modes]

    result: dict[str, Any] = {
        "meta": run.finish(threads=threads),
        "device": str(device),
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
    write_json(args.out / "convergence.json", result)
    render(result, args.out)
    log(f"wrote {args.out}/convergence.md, .json, .png in {result['meta']['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

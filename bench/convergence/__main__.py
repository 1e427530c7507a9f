"""Convergence: which master strategy and optimizer-state dtype keeps fp32 quality?

Trains one small character-level transformer on the Python standard library's own
source (read offline; seeded file shuffle; whole files held out for validation). For
each seed, an fp32 model is pretrained at a high learning rate (``pretrain_lr``, 3e-3)
and rounded to bf16 values; then every row fine-tunes from that same checkpoint, on
the same batches, at a learning rate 60x smaller (``lr``, 5e-5). The rows
(``config.ROWS``):

- ``fp32``: fp32 model, ``torch.optim.AdamW`` (the reference);
- ``bf16``: pure bf16 model and state, ``torch.optim.AdamW``;
- ``<strategy>/<state>``: bf16 model trained through mpfunc, every master strategy
  (``fp32``, ``remainder``, ``kahan``, ``stochastic``, ``none``) crossed with every
  optimizer-state dtype (``f32``, ``bf16``, ``u8``, ``u4``): ``init_master(strategy=)``,
  ``adamw(state_dtype=)``, one ``apply_update_(masters, bf16_grads, state, opt,
  params=params)`` per step (no fp32 grad tree);
- ``mixed`` (only with ``--rows``): fp32 masters through the three calls
  ``grads_to_fp32_``, ``apply_update_``, ``masters_to_model_``.

Why this regime: at the small fine-tuning rate, AdamW's updates are mostly below half
a bf16 step of the weights they move, so a bf16 weight swallows them (the ``stale``
column), and pure bf16 stops learning while fp32 keeps improving. A single run at a
high rate, as this study used to be (800 steps at 3e-3), cannot tell the rows apart:
pure bf16 ended within 0.13% of fp32 there.

The loss is computed in fp32 in every row. Reports, per row over the seeds: the
final validation loss and its gap to fp32 (mean and spread), the stale and lost
update fractions and the update-to-weight RMS ratio (every ``diag_every`` steps,
from ``apply_update_(stats=)``), the persistent bytes per parameter counted from the
tensors held between steps, and the median step time; and a PNG of the curves.
Each ``remainder`` row also steps plain fp32 masters beside it on the same grads and
compares the two every step, since one param that differs in one bit sends a run on
another trajectory, and a whole-run comparison then cannot say why.

    python -m bench.convergence                 # about 12 minutes of one idle core
    python -m bench.convergence --smoke --out /tmp/c
    python -m bench.convergence --rows fp32,bf16 --seeds 0,1,2    # the regime, 3 seeds
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
from bench.convergence.config import DEFAULT_ROWS, DEFAULT_SEEDS, PRESETS, ROWS


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.convergence", description=__doc__.split("\n")[0]
    )
    meta_mod.add_out_argument(p, "convergence")
    p.add_argument("--smoke", action="store_true", help="a tiny run, for the test suite")
    p.add_argument(
        "--render-only",
        action="store_true",
        help="re-summarize --out's convergence.json and rewrite it, the table and the plot; "
        "train nothing",
    )
    p.add_argument(
        "--rows", default=",".join(DEFAULT_ROWS), help=f"comma list of {', '.join(ROWS)}"
    )
    p.add_argument("--seeds", help="comma list of seeds (default: 0,1)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default: 1)")
    for key, value in PRESETS["default"].items():
        p.add_argument(f"--{key.replace('_', '-')}", type=type(value), default=None)
    return p.parse_args(argv)


def render(result: dict[str, Any], out: Path) -> None:
    """Summarizes a result (fresh, or read back from JSON) over its seeds and writes the
    JSON, the Markdown table and the PNG."""
    result["summary"] = report.summarize(result)
    result["targets"] = report.targets(result)
    write_json(out / "convergence.json", result)
    (out / "convergence.md").write_text(report.markdown(result))
    report.plot(result, out / "convergence.png")


def _list(flag: str, text: str, known: Sequence[str] | None = None) -> list[str]:
    items = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in items if known is not None and s not in known]
    if not items or bad:
        want = f"some of {', '.join(known)}" if known is not None else "a comma list"
        raise SystemExit(f"{flag}: expected {want}, got {text!r}")
    return items


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.render_only:
        render(read_json(args.out / "convergence.json"), args.out)
        print(f"rewrote {args.out}/convergence.json, .md and .png", file=sys.stderr)
        return 0
    preset = "smoke" if args.smoke else "default"
    cfg = dict(PRESETS[preset])
    for key in cfg:
        if getattr(args, key) is not None:
            cfg[key] = getattr(args, key)
    rows = [ROWS[name] for name in _list("--rows", args.rows, list(ROWS))]
    try:
        seeds = [int(s) for s in _list("--seeds", args.seeds or DEFAULT_SEEDS[preset])]
    except ValueError:
        raise SystemExit(
            f"--seeds: expected a comma list of integers, got {args.seeds!r}"
        ) from None
    run = meta_mod.Run("convergence", argv)
    # torch only now: --render-only and the checks above need none of it.
    import torch

    from bench.common.device import torch_threads
    from bench.convergence import data
    from bench.convergence.worker import Start, make_batches, pretrain, train_row

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    corpus = data.load(cfg["corpus_chars"], 0)
    log(
        f"corpus: {len(corpus.train):,} train / {len(corpus.val):,} val characters from "
        f"{corpus.root}"
    )
    pretrained: list[dict[str, Any]] = []
    runs: list[dict[str, Any]] = []
    # Keep the caller's global RNG as it was: each seed reseeds for its initial weights.
    with torch_threads(args.threads) as threads, torch.random.fork_rng(devices=[]):
        for seed in seeds:
            batches = make_batches(cfg, corpus, seed)
            weights, info = pretrain(cfg, corpus, batches, seed, log)
            pretrained.append(info)
            start = Start(cfg, corpus, batches, weights, seed)
            runs += [train_row(r, start, log) for r in rows]

    result: dict[str, Any] = {
        "meta": run.finish(threads=threads),
        "device": "cpu",
        "config": cfg,
        "seeds": seeds,
        "rows": [r._asdict() for r in rows],
        "corpus": {
            "root": corpus.root,
            "train_chars": len(corpus.train),
            "val_chars": len(corpus.val),
            "train_files": corpus.n_train_files,
            "val_files": corpus.n_val_files,
            "sha256": corpus.sha256,
            "vocab_size": len(data.VOCAB),
        },
        "pretrained": pretrained,
        "runs": runs,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    render(result, args.out)
    log(f"wrote {args.out}/convergence.md, .json, .png in {result['meta']['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

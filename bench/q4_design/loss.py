"""The final loss each candidate trains to, with the codec in the loop.

``python -m bench.q4_design.loss --out DIR`` (``--phase finetune``, the default; seeds
0, 1, 2):
pretrains as ``bench.q4_design`` does (fp32 AdamW, 800 steps at 3e-3, rounded to bf16
values), then fine-tunes an fp32 model 300 steps at 5e-5 once per candidate, with AdamW
written out here and the candidate's 4-bit moments (round trips of ``maps``) in place of
fp32 ones on the 2-d leaves (1-d leaves keep fp32 moments), and reports the final
validation loss against the same loop with fp32 moments. ``--phase scratch`` trains each
candidate from the same initial weights through the 800 pretraining steps at 3e-3
instead (the high rate, where moments steer more). Writes ``q4_loss_<phase>.md`` and
``.json``. Here (2 busy cores, one thread): scratch about 13 minutes, finetune about 7.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from bench.common import meta as meta_mod
from bench.common.report import header, write_json

# (name, (m map, m block, v map, v block (0: rank-1), v stochastic)); None: fp32 moments.
CANDIDATES: list[tuple[str, Any]] = [
    ("fp32 moments", None),
    (
        "softsign/32 | sqrt-softsign/32/stochastic (the module)",
        ("softsign", 32, "sqrt-softsign", 32, True),
    ),
    ("softsign/32 | sqrt-softsign/32/nearest", ("softsign", 32, "sqrt-softsign", 32, False)),
    ("normal/32 | sqrt-softsign/32/stochastic", ("normal", 32, "sqrt-softsign", 32, True)),
    ("normal/32 | rank1-linear0x/stochastic", ("normal", 32, "rank1-linear0x", 0, True)),
    ("softsign/128 | sqrt-softsign/128/stochastic", ("softsign", 128, "sqrt-softsign", 128, True)),
]


def markdown(result: dict[str, Any]) -> str:
    """One phase's table: per candidate, the final val loss per seed and its gap to fp32
    moments on the same seed (mean and worst)."""
    phase, seeds = result["phase"], result["seeds"]
    names = [r["name"] for r in result["rows"] if r["seed"] == seeds[0]]
    by = {(r["name"], r["seed"]): r for r in result["rows"]}
    starts = ", ".join(f"{s['val_loss']:.4f}" for s in result["starts"])
    lines = [
        "# 4-bit moment candidates in the loop: final validation loss",
        "",
        *header(result["meta"]),
        f"Seeds {', '.join(map(str, seeds))}; the convergence benchmark's default config; phase "
        f"{phase}: {result['steps']} steps at {result['peak_lr']:g} from "
        + ("the pretrained bf16-valued weights" if phase == "finetune" else "scratch")
        + f" (val {starts} there); AdamW written out, betas (0.9, 0.99); 2-d leaves hold the "
        "candidate's moments (98.4% of the params), 1-d leaves fp32 ones.",
        "",
        "| moments (m map/block + v map/block/rounding) | "
        + " | ".join(f"val, seed {s}" for s in seeds)
        + " | gap to fp32 moments, mean | worst |",
        "|---|" + "---|" * (len(seeds) + 2),
    ]
    for name in names:
        gaps = [by[(name, s)]["gap"] for s in seeds]
        vals = " | ".join(f"{by[(name, s)]['val_loss']:.4f}" for s in seeds)
        worst = max(gaps)
        lines.append(
            f"| {name.replace(' | ', ' + ')} | {vals} | {sum(gaps) / len(gaps):+.2%} | "
            f"{worst:+.2%} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.q4_design.loss")
    meta_mod.add_out_argument(p, "q4_design")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--pretrain-steps", type=int, default=800)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--phase", choices=["finetune", "scratch"], default="finetune")
    p.add_argument("--render-only", action="store_true", help="rewrite the phase's .md")
    args = p.parse_args(argv)
    if args.render_only:
        from bench.common.report import read_json

        done = read_json(args.out / f"q4_loss_{args.phase}.json")
        (args.out / f"q4_loss_{args.phase}.md").write_text(markdown(done))
        return 0
    seeds = [int(s) for s in args.seeds.split(",")]
    run = meta_mod.Run("q4_design.loss", argv)
    import torch

    from bench.common.device import torch_threads
    from bench.convergence import data
    from bench.convergence.config import BETAS, EPS, PRESETS, WEIGHT_DECAY, lr_at
    from bench.convergence.model import loss_fn
    from bench.convergence.worker import evaluate, make_batches, new_model, pretrain, windows
    from bench.q4_design import maps
    from mpfunc.core import _rng

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    cfg = dict(PRESETS["default"])
    cfg.update(pretrain_steps=args.pretrain_steps, steps=args.steps)
    corpus = data.load(cfg["corpus_chars"], 0)
    b1, b2 = BETAS
    smaps, umaps = maps.signed_maps(), maps.unsigned_maps()
    rows: list[dict[str, Any]] = []
    starts_info = []
    if args.phase == "finetune":
        steps, peak = cfg["steps"], cfg["lr"]
    else:
        steps, peak = cfg["pretrain_steps"], cfg["pretrain_lr"]
    with torch_threads(1) as threads, torch.random.fork_rng(devices=[]):
        for seed in seeds:
            batches = make_batches(cfg, corpus, seed)
            if args.phase == "finetune":
                weights, info = pretrain(cfg, corpus, batches, seed, log)
                starts = batches.train
            else:
                torch.manual_seed(seed)
                first = new_model(cfg)
                weights = {k: v.clone() for k, v in first.state_dict().items()}
                info = {"seed": seed, "val_loss": evaluate(first, batches.val)}
                starts = batches.pretrain
            starts_info.append(info)
            ref = None
            for name, cand in CANDIDATES:
                model = new_model(cfg)
                model.load_state_dict(weights)
                params = list(model.parameters())
                ms = [torch.zeros_like(q) for q in params]
                vs = [torch.zeros_like(q) for q in params]
                keys = [_rng.key_for(seed, i, "cpu") for i in range(len(params))]
                for i in range(steps):
                    lr = lr_at(i, steps, peak)
                    x, y = windows(corpus.train, starts[i], cfg["ctx"])
                    model.zero_grad(set_to_none=True)
                    loss_fn(model, x, y).backward()
                    t = i + 1
                    with torch.no_grad():
                        u = [_rng.uniform(k, q.shape) for k, q in zip(keys, params)]
                        _rng.advance(keys)
                        for j, q in enumerate(params):
                            g = q.grad
                            m = ms[j].lerp(g, 1 - b1)
                            v = vs[j].mul(b2).addcmul_(g, g, value=1 - b2)
                            if cand is not None and q.ndim == 2:
                                mm, mb, vm, vb, stoch = cand
                                m = maps.roundtrip_signed(m, smaps[mm], mb)
                                v = maps.roundtrip_unsigned(
                                    v, umaps[vm], vb, u[j] if stoch else None
                                )
                            ms[j], vs[j] = m, v
                            q.mul_(1 - lr * WEIGHT_DECAY)
                            denom = (v / (1 - b2**t)).sqrt_().add_(EPS)
                            q.addcdiv_(m, denom, value=-lr / (1 - b1**t))
                val = evaluate(model, batches.val)
                ref = val if ref is None else ref
                log(f"[seed {seed}] {name}: val {val:.4f}")
                rows.append({"name": name, "seed": seed, "val_loss": val, "gap": val / ref - 1})
    result = {
        "meta": run.finish(threads=threads),
        "config": cfg,
        "seeds": seeds,
        "phase": args.phase,
        "starts": starts_info,
        "steps": steps,
        "peak_lr": peak,
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(args.out / f"q4_loss_{args.phase}.json", result)
    (args.out / f"q4_loss_{args.phase}.md").write_text(markdown(result))
    log(f"wrote {args.out}/q4_loss_{args.phase}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())

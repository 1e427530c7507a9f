"""4-bit moment design: which block size, maps and rounding keep Adam's direction?

As the 8-bit codec was chosen (``mpfunc.state_formats._quantize``'s docstring): an fp32 AdamW run of
the convergence benchmark's model and data (``bench.convergence``: a character LM on the
Python standard library's source) feeds its gradients, step by step, to candidate 4-bit
moment codecs held on the side. Each candidate keeps its own first and second moment
(EMA updates from its own decoded values, then re-quantized, exactly what a stored state
does), and at checkpoints the study compares, against the fp32 run's own moments:

* ``dir``: the RMS relative error of Adam's direction ``m_hat / (sqrt(v_hat) + eps)``
  (bias-corrected) rebuilt from the candidate's moments, ``||d_q - d|| / ||d||``;
* ``m``, ``v``: the same for each moment alone; ``v bias``: ``sum(v_q) / sum(v) - 1``
  (a second moment that sticks drifts low or high).

Two phases, as the convergence benchmark runs them: ``pretrain`` (from scratch, 800 steps
at 3e-3 with warm-up) and ``finetune`` (the pretrained weights rounded to bf16, a fresh
optimizer and fresh candidate states, 300 steps at 5e-5: the regime the issue's target is
measured in). Betas (0.9, 0.99), as the benchmark's. The 2-d leaves are compared (every
candidate, rank-1 ones included, can hold them; the 1-d leaves are under 1% of the
parameters). One torch thread.

    python -m bench.q4_design --out bench/results/q4_design   # ~2 min CPU, one thread
    python -m bench.q4_design --smoke --out /tmp/q4           # seconds

Writes ``q4_design.md`` and ``q4_design.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
from collections.abc import Sequence
from typing import Any

from bench.common import meta as meta_mod
from bench.common.report import header, write_json

BLOCKS = (32, 64, 128)
# The budget: "stochastic" masters (a 2-byte bf16 param and a 4-byte key per
# leaf) + 4-bit moments <= 3.2 B/param, so both moments together <= about 1.2 B/param.
MOMENT_BUDGET = 1.2
# The combination mpfunc.state_formats._quantize4 implements (see its docstring for why).
MODULE = "softsign/32 | sqrt-softsign/32/stochastic"
CONFIG = {
    "pretrain_steps": 800,
    "pretrain_lr": 3e-3,
    "steps": 300,
    "lr": 5e-5,
    "batch": 16,
    "ctx": 64,
    "d_model": 64,
    "layers": 1,
    "heads": 4,
    "corpus_chars": 4_000_000,
    "seed": 0,
}
SMOKE = {"pretrain_steps": 6, "steps": 6, "batch": 4, "ctx": 16, "corpus_chars": 200_000}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.q4_design", description=__doc__.split("\n")[0]
    )
    meta_mod.add_out_argument(p, "q4_design")
    p.add_argument("--smoke", action="store_true", help="a tiny run")
    p.add_argument(
        "--render-only", action="store_true", help="rewrite --out's q4_design.md from its JSON"
    )
    p.add_argument("--threads", type=int, default=1)
    for key, value in CONFIG.items():
        p.add_argument(f"--{key.replace('_', '-')}", type=type(value), default=None)
    return p.parse_args(argv)


def checkpoints(n: int) -> list[int]:
    return sorted({max(1, n // 8), max(1, n // 2), n})


def run_phase(
    name: str,
    model: Any,
    steps: int,
    lr: float,
    cfg: dict[str, Any],
    corpus: Any,
    starts: Any,
    log: Any,
) -> dict[str, Any]:
    """One fp32 AdamW phase with every candidate on the side; errors at checkpoints."""
    import torch

    from bench.convergence.config import BETAS, EPS, WEIGHT_DECAY, lr_at
    from bench.convergence.model import loss_fn
    from bench.convergence.worker import windows
    from bench.q4_design import maps
    from mpfunc.core import _rng
    from mpfunc.state_formats import _quantize

    b1, b2 = BETAS
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=lr, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    leaves = [p for p in params if p.ndim == 2]
    shapes = [p.shape for p in leaves]
    smaps, umaps = maps.signed_maps(), maps.unsigned_maps()
    m_cands = {(mp, b): [torch.zeros(s) for s in shapes] for mp in smaps for b in BLOCKS}
    v_cands = {
        (mp, b, r): [torch.zeros(s) for s in shapes]
        for mp, um in umaps.items()
        for b in ((0,) if um.rank1 else BLOCKS)
        for r in ("nearest", "stochastic")
    }
    # The 8-bit format itself (m to nearest, v stochastic), for scale.
    q8 = [(_quantize.zeros(s, True, "cpu"), _quantize.zeros(s, False, "cpu")) for s in shapes]
    keys = [_rng.key_for(cfg["seed"], i, "cpu") for i in range(len(shapes))]
    keys8 = [_rng.key_for(cfg["seed"] + 1, i, "cpu") for i in range(len(shapes))]
    marks = checkpoints(steps)
    out: dict[str, Any] = {"steps": steps, "checkpoints": {}}
    for i in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(i, steps, lr)
        x, y = windows(corpus.train, starts[i], cfg["ctx"])
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model, x, y)
        loss.backward()
        opt.step()
        grads = [p.grad for p in leaves]
        with torch.no_grad():
            for (mp, b), ms in m_cands.items():
                for j, g in enumerate(grads):
                    ms[j] = maps.roundtrip_signed(ms[j].lerp(g, 1 - b1), smaps[mp], b)
            u = maps.draws(keys, shapes)
            for (mp, b, r), vs in v_cands.items():
                for j, g in enumerate(grads):
                    v = vs[j].mul(b2).addcmul_(g, g, value=1 - b2)
                    vs[j] = maps.roundtrip_unsigned(
                        v, umaps[mp], b, u[j] if r == "stochastic" else None
                    )
            u8 = maps.draws(keys8, shapes)
            for j, g in enumerate(grads):
                mq, vq = q8[j]
                _quantize.quantize_(_quantize.dequantize(mq).lerp_(g, 1 - b1), mq)
                v = _quantize.dequantize(vq).mul_(b2).addcmul_(g, g, value=1 - b2)
                _quantize.quantize_(v, vq, noise=u8[j])
        if i + 1 in marks:
            t = i + 1
            ref_m = torch.cat([opt.state[p]["exp_avg"].reshape(-1) for p in leaves])
            ref_v = torch.cat([opt.state[p]["exp_avg_sq"].reshape(-1) for p in leaves])
            c1, c2 = 1 - b1**t, 1 - b2**t

            def direction(m: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
                return (m / c1) / ((v / c2).sqrt() + EPS)  # noqa: B023

            ref_d = direction(ref_m, ref_v)

            def rel(a: torch.Tensor, b: torch.Tensor) -> float:
                return float((a - b).norm() / b.norm())

            flat_m = {k: torch.cat([t.reshape(-1) for t in ts]) for k, ts in m_cands.items()}
            flat_v = {k: torch.cat([t.reshape(-1) for t in ts]) for k, ts in v_cands.items()}
            m8 = torch.cat([_quantize.dequantize(q[0]).reshape(-1) for q in q8])
            v8 = torch.cat([_quantize.dequantize(q[1]).reshape(-1) for q in q8])
            out["checkpoints"][t] = {
                "loss": float(loss.detach()),
                "m": {"/".join(map(str, k)): rel(m, ref_m) for k, m in flat_m.items()},
                "v": {"/".join(map(str, k)): rel(v, ref_v) for k, v in flat_v.items()},
                "v_bias": {
                    "/".join(map(str, k)): float(v.sum() / ref_v.sum() - 1)
                    for k, v in flat_v.items()
                },
                "dir": {
                    "/".join(map(str, km)) + " | " + "/".join(map(str, kv)): rel(
                        direction(m, v), ref_d
                    )
                    for (km, m), (kv, v) in itertools.product(flat_m.items(), flat_v.items())
                },
                "u8": {
                    "m": rel(m8, ref_m),
                    "v": rel(v8, ref_v),
                    "v_bias": float(v8.sum() / ref_v.sum() - 1),
                    "dir": rel(direction(m8, v8), ref_d),
                },
            }
            log(f"[{name}] step {t}: loss {float(loss):.4f}")
    bytes_m = {
        f"{mp}/{b}": maps.bytes_per_param(shapes, smaps[mp], b, 2) for mp in smaps for b in BLOCKS
    }
    bytes_v = {
        f"{mp}/{b}": maps.bytes_per_param(shapes, umaps[mp], b, 2)
        for mp, um in umaps.items()
        for b in ((0,) if um.rank1 else BLOCKS)
    }
    out["bytes"] = {"m": bytes_m, "v": bytes_v}
    out["params"] = sum(math.prod(s) for s in shapes)
    return out


def _bytes(result: dict[str, Any], combo: str) -> float:
    km, kv = combo.split(" | ")
    b = result["phases"]["finetune"]["bytes"]
    return float(b["m"][km] + b["v"]["/".join(kv.split("/")[:2])])


def _final(result: dict[str, Any], phase: str) -> dict[str, Any]:
    ph = result["phases"][phase]
    return dict(
        ph["checkpoints"][str(ph["steps"])]
        if str(ph["steps"]) in ph["checkpoints"]
        else ph["checkpoints"][ph["steps"]]
    )


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """Every combination's final direction error in both phases, its bytes, and the pick:
    the lowest worst-of-two-phases error within the byte budget."""
    pre, fine = _final(result, "pretrain"), _final(result, "finetune")
    rows = [
        {
            "combo": c,
            "bytes": _bytes(result, c),
            "pretrain": pre["dir"][c],
            "finetune": fine["dir"][c],
            "worst": max(pre["dir"][c], fine["dir"][c]),
        }
        for c in fine["dir"]
    ]
    rows.sort(key=lambda r: r["worst"])
    within = [r for r in rows if r["bytes"] <= MOMENT_BUDGET]
    return {"ranked": rows, "pick": within[0] if within else None}


def markdown(result: dict[str, Any]) -> str:
    pre, fine = _final(result, "pretrain"), _final(result, "finetune")
    s = result["summary"]
    lines = [
        "# 4-bit moment design: Adam's direction from candidate codecs",
        "",
        *header(result["meta"]),
        f"Config: {result['config']}; {result['phases']['finetune']['params']:,} params in "
        "the 2-d leaves compared.",
        "",
        "Errors are RMS relative to the fp32 run's own moments at the end of each phase "
        "(`dir`: Adam's bias-corrected direction m/(sqrt(v)+eps); `v bias`: sum(v_q)/sum(v) - 1). "
        "Combinations are `m map/block + v map/block/rounding` (block 0: rank-1, no blocks). "
        "Bytes: both moments, per param, bf16 scales. 8-bit format for scale: "
        f"dir {pre['u8']['dir']:.1%} (pretrain), {fine['u8']['dir']:.1%} (finetune).",
        "",
        "## Block size (m softsign to nearest, v companded sqrt stochastic)",
        "",
        "| block | bytes (m+v) | dir pretrain | dir finetune | m pretrain | m finetune "
        "| v finetune | v bias finetune |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for b in (32, 64, 128):
        c = f"softsign/{b} | sqrt-softsign/{b}/stochastic"
        lines.append(
            f"| {b} | {_bytes(result, c):.4f} | {pre['dir'][c]:.1%} | {fine['dir'][c]:.1%} | "
            f"{pre['m'][f'softsign/{b}']:.1%} | {fine['m'][f'softsign/{b}']:.1%} | "
            f"{fine['v'][f'sqrt-softsign/{b}/stochastic']:.1%} | "
            f"{fine['v_bias'][f'sqrt-softsign/{b}/stochastic']:+.1%} |"
        )
    lines += [
        "",
        "## First-moment map (to nearest; v companded sqrt stochastic, same block)",
        "",
        "| m map | block | m pretrain | m finetune | dir pretrain | dir finetune |",
        "|---|---|---|---|---|---|",
    ]
    for mp in ("softsign", "linear", "normal", "log2"):
        for b in (32, 64, 128):
            c = f"{mp}/{b} | sqrt-softsign/{b}/stochastic"
            lines.append(
                f"| {mp} | {b} | {pre['m'][f'{mp}/{b}']:.1%} | {fine['m'][f'{mp}/{b}']:.1%} | "
                f"{pre['dir'][c]:.1%} | {fine['dir'][c]:.1%} |"
            )
    lines += [
        "",
        "## Second-moment map and rounding (m softsign to nearest, same block; 32 with rank-1)",
        "",
        "| v map | block | rounding | bytes (v) | v pretrain | v finetune | v bias pretrain "
        "| v bias finetune | dir pretrain | dir finetune |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    bv = result["phases"]["finetune"]["bytes"]["v"]
    for kv in fine["v"]:
        mp, b, r = kv.split("/")
        mb = b if b != "0" else "32"
        c = f"softsign/{mb} | {kv}"
        lines.append(
            f"| {mp} | {b if b != '0' else 'rank-1'} | {r} | {bv[f'{mp}/{b}']:.4f} | "
            f"{pre['v'][kv]:.1%} | {fine['v'][kv]:.1%} | {pre['v_bias'][kv]:+.1%} | "
            f"{fine['v_bias'][kv]:+.1%} | {pre['dir'][c]:.1%} | {fine['dir'][c]:.1%} |"
        )
    lines += [
        "",
        f"## The best combinations within {MOMENT_BUDGET} B/param (ranked by the worse phase)",
        "",
        "| combination | bytes (m+v) | dir pretrain | dir finetune |",
        "|---|---|---|---|",
    ]
    for r in [r for r in s["ranked"] if r["bytes"] <= MOMENT_BUDGET][:12]:
        name = r["combo"].replace(" | ", " + ")
        lines.append(f"| {name} | {r['bytes']:.4f} | {r['pretrain']:.1%} | {r['finetune']:.1%} |")
    pick = s["pick"]
    if pick is None:
        lines += ["", "Lowest: none within the budget.", ""]
        return "\n".join(lines) + "\n"
    lines += [
        "",
        f"Lowest: {pick['combo'].replace(' | ', ' + ')} ({pick['bytes']:.4f} B/param).",
        "",
        "## Over the run (direction error at each checkpoint)",
        "",
    ]
    for phase in ("pretrain", "finetune"):
        ph = result["phases"][phase]
        for label, combo in (
            ("lowest", pick["combo"]),
            ("mpfunc.state_formats._quantize4", MODULE),
        ):
            marks = sorted(ph["checkpoints"], key=int)
            cells = "; ".join(f"step {k}: {ph['checkpoints'][k]['dir'][combo]:.1%}" for k in marks)
            lines.append(f"{phase}, {label}: {cells}  ")
        u8 = "; ".join(
            f"step {k}: {ph['checkpoints'][k]['u8']['dir']:.1%}"
            for k in sorted(ph["checkpoints"], key=int)
        )
        lines.append(f"{phase}, 8-bit format: {u8}  ")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.render_only:
        from bench.common.report import read_json

        done = read_json(args.out / "q4_design.json")
        done["summary"] = summarize(done)
        write_json(args.out / "q4_design.json", done)
        (args.out / "q4_design.md").write_text(markdown(done))
        return 0
    cfg = dict(CONFIG)
    if args.smoke:
        cfg.update(SMOKE)
    for key in CONFIG:
        if getattr(args, key) is not None:
            cfg[key] = getattr(args, key)
    run = meta_mod.Run("q4_design", argv)
    import torch

    from bench.common.device import torch_threads
    from bench.convergence import data
    from bench.convergence.worker import new_model

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    corpus = data.load(cfg["corpus_chars"], 0)
    gen = torch.Generator().manual_seed(cfg["seed"] + 1)
    hi = len(corpus.train) - cfg["ctx"] - 1
    pre_starts = torch.randint(0, hi, (cfg["pretrain_steps"], cfg["batch"]), generator=gen)
    starts = torch.randint(0, hi, (cfg["steps"], cfg["batch"]), generator=gen)
    phases: dict[str, Any] = {}
    with torch_threads(args.threads) as threads, torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg["seed"])
        model = new_model(cfg)
        phases["pretrain"] = run_phase(
            "pretrain",
            model,
            cfg["pretrain_steps"],
            cfg["pretrain_lr"],
            cfg,
            corpus,
            pre_starts,
            log,
        )
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(torch.bfloat16))
        phases["finetune"] = run_phase(
            "finetune", model, cfg["steps"], cfg["lr"], cfg, corpus, starts, log
        )
    result: dict[str, Any] = {"meta": run.finish(threads=threads), "config": cfg, "phases": phases}
    # JSON keys are strings: round-trip once so the report reads what the file holds.
    import json

    result = json.loads(json.dumps(result))
    result["summary"] = summarize(result)
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(args.out / "q4_design.json", result)
    (args.out / "q4_design.md").write_text(markdown(result))
    log(f"wrote {args.out}/q4_design.md and .json in {result['meta']['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

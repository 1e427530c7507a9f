"""Smoke test of the convergence study, so that ``bench.convergence`` cannot rot.

Runs ``python -m bench.convergence --smoke`` in a subprocess and checks the
outputs' structure; a few steps prove the plumbing, not the convergence.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from bench.common.meta import META_KEYS
from bench.convergence.config import DEFAULT_ROWS, IDENTICAL_TO, REFERENCE, ROWS, TARGETS

REPO = Path(__file__).resolve().parents[1]
# Every default row but the torch.compile'd torchao peers (minutes of compiling each on a
# busy 2-core machine; tests/test_bench_seed.py runs torchao's 4-bit AdamW).
SMOKE_ROWS = [r for r in DEFAULT_ROWS if not r.startswith("peer/torchao-")]


def test_rows_table() -> None:
    # Every strategy crossed with every state dtype, plus the torch.optim baselines.
    mp = [r for r in ROWS.values() if r.kind == "mpfunc"]
    assert len(mp) == 20 and len({(r.strategy, r.state_dtype) for r in mp}) == 20
    assert {REFERENCE, "bf16", IDENTICAL_TO} <= set(DEFAULT_ROWS)
    assert all(row in DEFAULT_ROWS for row, _, _ in TARGETS)
    # Beside them: torch's fused AdamW, the step inside backward, and every peer.
    assert {"fp32-fused", "step-in-backward", "peer/torchao-4bit", "peer/bnb-8bit"} <= set(ROWS)
    assert ROWS["fp32-fused"].optimizer == "fused"


@pytest.mark.slow
def test_convergence_smoke(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "bench.convergence", "--smoke", "--out", str(tmp_path)]
    cmd += ["--rows", ",".join(SMOKE_ROWS)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for name in ("convergence.md", "convergence.json", "convergence.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    result = json.loads((tmp_path / "convergence.json").read_text())
    assert tuple(result["meta"]) == META_KEYS and result["meta"]["threads"] == 1
    seeds, steps = result["seeds"], result["config"]["steps"]
    assert len(seeds) == 2 and len(result["pretrained"]) == 2
    assert [r["name"] for r in result["rows"]] == SMOKE_ROWS
    assert len(result["runs"]) == len(SMOKE_ROWS) * len(seeds)

    vocab = result["corpus"]["vocab_size"]
    # Every row runs, or says which library or option it lacks here; none fails.
    assert [r for r in result["runs"] if "error" in r] == []
    absent = {r["row"] for r in result["runs"] if "unsupported" in r}
    assert absent <= {"step-in-backward", "peer/flashoptim"}
    ok = [r for r in result["runs"] if "unsupported" not in r]
    assert {r["row"] for r in ok} >= {REFERENCE, "bf16", *(t[0] for t in TARGETS)}
    for r in ok:
        assert len(r["train_loss"]) == steps
        assert all(math.isfinite(x) for x in r["train_loss"])
        assert r["final_val_loss"] < math.log(vocab)
        assert r["val_curve"][0][0] == 0 and r["val_curve"][-1][0] == steps
        d = r["diag"]
        # (peers and the step inside backward take no mpfunc stats: stale/lost unmeasured)
        unmeasured = r["row"].startswith("peer/") or r["row"] == "step-in-backward"
        measured = ("unchanged",) if unmeasured else ("stale", "lost")
        assert d["per_step"] and all(0.0 <= d[k] <= 1.0 for k in ("unchanged", *measured))
        assert r["bytes_per_param"] > 0 and len(r["fp32_sha256"]) == 64
        # The peak holds what is held, and the grads (fp32 or bf16) unless freed in backward.
        mem = r["memory_per_param"]
        grad = 4 if ROWS[r["row"]].model_dtype == "float32" else 2
        assert mem["persistent"] == pytest.approx(r["bytes_per_param"], abs=0.01)
        if r["row"] == "step-in-backward":  # grads freed leaf by leaf: below a grad tree
            assert mem["persistent"] - 0.01 <= mem["peak"] < mem["persistent"] + grad, mem
        else:
            assert mem["persistent"] + grad - 0.01 <= mem["peak"] < mem["total"], r["row"]

    runs = {(r["row"], r["seed"]): r for r in ok}
    for s in seeds:
        # Persistent bytes from the tensors held: fp32 AdamW 12, pure bf16 6, and the
        # strategies' shares below the master-weight path.
        assert runs[REFERENCE, s]["bytes_per_param"] == pytest.approx(12, abs=0.05)
        assert runs["bf16", s]["bytes_per_param"] == pytest.approx(6, abs=0.05)
        assert runs["remainder/f32", s]["bytes_per_param"] == pytest.approx(12.125, abs=0.05)
        assert runs["stochastic/u8", s]["bytes_per_param"] < 4.3
        # Peaks by hand: fused AdamW and mpfunc's one pass add the grads and nothing else.
        assert runs["fp32-fused", s]["memory_per_param"]["peak"] == pytest.approx(16, abs=0.05)
        assert runs["fp32/f32", s]["memory_per_param"]["peak"] == pytest.approx(16, abs=0.05)
        held = runs["stochastic/u8", s]["bytes_per_param"]
        assert runs["stochastic/u8", s]["memory_per_param"]["peak"] == pytest.approx(
            held + 2, abs=0.05
        )
        # Pure bf16 loses every stale update; fp32 masters keep them.
        assert runs["bf16", s]["diag"]["lost"] == runs["bf16", s]["diag"]["unchanged"]
        assert runs["remainder/f32", s]["diag"]["lost"] < runs["bf16", s]["diag"]["lost"]

        # Remainder rows carry an fp32 twin stepped on the same grads, compared every step.
        twin = runs["remainder/f32", s]["twin"]
        assert twin["steps"] == steps and twin["params_differ_at_ties"] <= twin["params_differ"]
        assert runs[REFERENCE, s]["twin"] is None

    summary = {e["row"]: e for e in result["summary"]}
    assert set(summary) == set(SMOKE_ROWS)
    assert summary["remainder/f32"]["identical_to"] is True
    for e in summary.values():
        assert e["seeds"] or e["unsupported"], e["row"]
    assert [t["row"] for t in result["targets"]] == [t[0] for t in TARGETS]
    md = (tmp_path / "convergence.md").read_text()
    assert "gap to fp32" in md and "Targets" in md and "| peak B/param |" in md
    for row in absent:
        assert f"`{row}`: " in md

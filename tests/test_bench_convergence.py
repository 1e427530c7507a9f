"""Smoke test of the convergence study, so that ``bench.convergence`` cannot rot.

Runs ``python -m bench.convergence --smoke`` in a subprocess and checks the
outputs; a dozen steps prove the plumbing, not the convergence.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from bench.common.meta import META_KEYS

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_convergence_smoke(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "bench.convergence", "--smoke", "--threads", "1"]
    proc = subprocess.run(
        [*cmd, "--out", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    for name in ("convergence.md", "convergence.json", "convergence.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    result = json.loads((tmp_path / "convergence.json").read_text())
    assert tuple(result["meta"]) == META_KEYS and result["meta"]["threads"] == 1
    assert result["device"] == "cpu"

    runs = {r["mode"]: r for r in result["runs"]}
    assert set(runs) == {"fp32", "bf16", "mixed"}
    steps = result["config"]["steps"]
    vocab = result["corpus"]["vocab_size"]
    for r in runs.values():
        assert len(r["train_loss"]) == steps
        assert all(math.isfinite(x) for x in r["train_loss"])
        # Learning happened: below the loss of a uniform guess, and below the first step.
        assert r["final_val_loss"] < math.log(vocab)
        assert r["train_loss"][-1] < r["train_loss"][0]
        assert r["val_curve"][0][0] == 0 and r["val_curve"][-1][0] == steps
    assert runs["fp32"]["stale"] is None
    for mode in ("bf16", "mixed"):
        stale = runs[mode]["stale"]
        assert 0.0 <= stale["stale_fraction"] <= 1.0 and stale["nonzero"] > 0
    # Pure bf16 loses every stale update; mixed keeps them in its fp32 masters.
    assert runs["bf16"]["stale"]["lost"] == runs["bf16"]["stale"]["stale"]
    assert runs["mixed"]["stale"]["lost_fraction"] < runs["bf16"]["stale"]["lost_fraction"]
    assert result["corpus"]["train_chars"] > 0 and result["corpus"]["val_chars"] > 0
    assert "gap to fp32" in (tmp_path / "convergence.md").read_text()

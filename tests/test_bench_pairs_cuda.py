"""``python -m bench.pairs_cuda`` runs end to end on the CPU (its code path; CUDA where lent)."""

from __future__ import annotations

import json
from pathlib import Path

from bench.pairs_cuda.__main__ import BASE, STATES, STRATEGIES, main


def test_pairs_cuda_smoke_on_the_cpu(tmp_path: Path) -> None:
    args = ["--smoke", "--device", "cpu", "--compile", "", "--out", str(tmp_path)]
    assert main(args) == 0
    result = json.loads((tmp_path / "pairs_cuda.json").read_text())
    names = [r["name"] for r in result["rows"]]
    assert names[0] == BASE and len(names) == 3 + len(STRATEGIES) * len(STATES)
    assert not result["failed"] and all(r["ratio"] > 0 for r in result["rows"])
    assert all(r["bytes_per_param"] > 0 for r in result["rows"])
    # The CPU against itself: every pair's numerics check finds no difference.
    for name, row in result["check"].items():
        assert row["eager vs cpu"]["differ"] == 0, (name, row)
    assert "### Numerics" in (tmp_path / "pairs_cuda.md").read_text()

"""``python -m bench.pairs`` runs end to end (smoke sizes) and reports every pair."""

from __future__ import annotations

import json
from pathlib import Path

from bench.pairs.__main__ import PAIRS, main


def test_pairs_smoke_reports_every_pair_and_the_load(tmp_path: Path) -> None:
    assert main(["--smoke", "--threads", "1", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "pairs.json").read_text())
    (part,) = result["parts"]
    names = [r["name"] for r in part["rows"]]
    assert names[0] == "torch fused fp32 AdamW"
    assert len(names) == 1 + len(PAIRS)
    assert all(r["ratio"] > 0 for r in part["rows"])
    assert set(part["load_avg"]) == {"start", "end"}
    md = (tmp_path / "pairs.md").read_text()
    assert "mpfunc stochastic + uint8" in md and "Load average" in md

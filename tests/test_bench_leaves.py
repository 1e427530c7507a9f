"""``python -m bench.leaves`` runs end to end (smoke sizes) and reports every pair."""

from __future__ import annotations

import json
from pathlib import Path

from bench.leaves.__main__ import FORMATS, STRATEGIES, main


def test_leaves_smoke_reports_every_pair_and_the_load(tmp_path: Path) -> None:
    argv = ["--smoke", "--leaves", "40", "--out", str(tmp_path)]
    assert main(argv) == 0
    result = json.loads((tmp_path / "leaves.json").read_text())
    assert result["leaves"] == 40
    assert [(r["strategy"], r["state"]) for r in result["rows"]] == [
        (s, f) for s in STRATEGIES for f in FORMATS
    ]
    assert all(r["first_step_s"] > 0 and len(r["later_steps_s"]) == 3 for r in result["rows"])
    assert set(result["load_avg"]) == {"start", "end"}
    md = (tmp_path / "leaves.md").read_text()
    assert "| stochastic | uint8 |" in md and "Load average" in md

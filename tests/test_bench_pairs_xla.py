"""``python -m bench.pairs_xla`` runs end to end (smoke sizes) and reports every pair."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.pairs_xla.__main__ import STATES, STRATEGIES, main


@pytest.mark.xla
def test_pairs_xla_smoke_reports_every_pair_and_the_load(
    xla_device: object, tmp_path: Path
) -> None:
    assert main(["--smoke", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "pairs_xla.json").read_text())
    (part,) = result["parts"]
    names = [r["name"] for r in part["rows"]]
    assert names[0].startswith("torch AdamW")
    assert names[1].startswith("torch_xla syncfree AdamW")
    assert len(names) == 2 + len(STRATEGIES) * len(STATES)
    assert all(r["trace_ratio"] > 0 and r["step_ratio"] > 0 for r in part["rows"])
    # after warm-up: no compile, one graph per step, for every contender
    assert all(r["compiles"] == 0 and r["graphs_per_step"] == 1 for r in part["rows"])
    assert set(part["load_avg"]) == {"start", "end"}
    assert "mpfunc stochastic + uint8" in (tmp_path / "pairs_xla.md").read_text()

"""``python -m bench.leaves`` runs end to end (smoke sizes) and reports every pair."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

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


def test_calls_counts_flattens_and_hops(capsys: pytest.CaptureFixture[str]) -> None:
    from bench.leaves import calls

    assert calls.main(["--leaves", "3", "--numel", "64", "--pairs", "remainder/uint8"]) == 0
    out = capsys.readouterr().out
    assert "| remainder/uint8 |" in out and "load average" in out
    step = calls._setup("remainder", "uint8", 3, 64, calls.torch.device("cpu"))
    first = calls.count(step)
    later = calls.count(step)
    # Each of the step's trees is flattened once per call: masters, grads, and the state's
    # step counts and two moments; once DTensor is imported (torch_xla imports it), the
    # kernel's group too (_dtensor.local_group, looking for shards).
    assert 5 <= later["flattens"] <= 6 and first["flattens"] == later["flattens"]
    assert first["hops"] > later["hops"] > 0 and first["modules"] > 1

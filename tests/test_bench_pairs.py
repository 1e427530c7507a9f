"""``python -m bench.pairs`` runs end to end (smoke sizes) and reports every pair."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.pairs.__main__ import BASE, PAIRS, main


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


@pytest.mark.parametrize("optimizer", ["sgd", "lion"])
def test_pairs_smoke_sgd_and_lion_rows(tmp_path: Path, optimizer: str) -> None:
    args = ["--smoke", "--threads", "1", "--optimizer", optimizer, "--out", str(tmp_path)]
    assert main(args) == 0
    result = json.loads((tmp_path / "pairs.json").read_text())
    (part,) = result["parts"]
    names = [r["name"] for r in part["rows"]]
    assert names[0] == BASE[optimizer] == part["base"]
    assert len(names) == (1 if optimizer == "sgd" else 2) + len(PAIRS)
    assert all(r["ratio"] > 0 for r in part["rows"])
    assert f"mpfunc stochastic + uint8 ({optimizer})" in (tmp_path / "pairs.md").read_text()


def test_pairs_option_times_only_the_pairs_named(tmp_path: Path) -> None:
    args = ["--smoke", "--threads", "1", "--pairs", "stochastic+uint8", "--out", str(tmp_path)]
    assert main(args) == 0
    (part,) = json.loads((tmp_path / "pairs.json").read_text())["parts"]
    assert [r["name"] for r in part["rows"]] == [BASE["adamw"], "mpfunc stochastic + uint8"]
    with pytest.raises(SystemExit):
        main(["--smoke", "--pairs", "stochastic+int8", "--out", str(tmp_path)])

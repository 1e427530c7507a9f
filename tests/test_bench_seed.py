"""The seed benchmark runs end to end at smoke size and writes sane outputs.

One ``python -m bench.seed --smoke`` run on cpu and xla (about 30 s on 2 cores), shared by
the tests below; plus a check of the target logic on a made-up result.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench import _seed_report
from bench._seed_model import MODES

REPO = Path(__file__).resolve().parent.parent
XLA = importlib.util.find_spec("torch_xla") is not None or bool(
    os.environ.get("MPFUNC_REQUIRE_XLA")
)
DEVICES = ["cpu", "xla"] if XLA else ["cpu"]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("seed")
    env = {**os.environ, "PJRT_DEVICE": os.environ.get("PJRT_DEVICE", "CPU")}
    cmd = [sys.executable, "-m", "bench.seed", "--smoke", "--devices", ",".join(DEVICES)]
    proc = subprocess.run(
        [*cmd, "--out", str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr[-4000:]}"
    return out, proc.stdout


def _json(out: Path) -> dict[str, Any]:
    result: dict[str, Any] = json.loads((out / "seed.json").read_text())
    return result


@pytest.mark.slow
def test_outputs_exist_and_table_is_printed(smoke: tuple[Path, str]) -> None:
    out, stdout = smoke
    table = (out / "seed.md").read_text()
    assert stdout == table
    png = (out / "seed.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000
    for device in DEVICES:
        assert f"## {device} (" in table
    for mode in MODES:
        rows = [line for line in table.splitlines() if line.startswith(f"| {mode} |")]
        assert len(rows) == len(DEVICES), rows
        assert all("failed" not in row for row in rows)
    assert "## Targets" in table


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_every_sample_is_sane(smoke: tuple[Path, str], device: str) -> None:
    result = _json(smoke[0])
    assert result["machine"]["cpu_count"] >= 1 and result["command"]
    dev = result["devices"][device]
    blocks, steps = result["schedule"]["blocks"], result["schedule"]["steps"]
    for mode in MODES:
        r = dev["modes"][mode]
        assert "error" not in r, r.get("error")
        assert [s["block"] for s in r["samples"]] == list(range(blocks))
        for s in r["samples"]:
            assert 0 < s["step_s"] < 60 and len(s["host_s"]) == steps
            assert math.isfinite(s["loss"])
        # Same fixed batch every step: training must make progress in every mode.
        assert r["samples"][-1]["loss"] < r["setup"]["warmup_loss"]
        assert r["memory"]["peak_bytes"] > 0
        summary = dev["summary"][mode]
        assert summary["x_fp32"] > 0 and summary["median_s"] > 0
        if device == "xla":
            assert summary["graphs_per_step"] >= 1
            assert summary["compiles"] >= 0
    # mpfunc and the per-tensor baseline do the same fp32-master AdamW on the same data.
    losses = {m: dev["modes"][m]["samples"][-1]["loss"] for m in ("pertensor", "mpfunc")}
    assert losses["mpfunc"] == pytest.approx(losses["pertensor"], rel=1e-2)


def test_targets_held_missed_and_unmeasured() -> None:
    def device(**summary: float) -> dict[str, Any]:
        return {"summary": {"mpfunc": summary}, "modes": {}}

    result = {
        "devices": {
            "cpu": device(x_pertensor=0.9, x_bf16=1.2),
        }
    }
    rows = {(t["device"], t["target"]): t for t in _seed_report.targets(result)}
    assert rows[("cpu", "mpfunc step ≤ 0.95× pertensor")]["held"] is True
    bf16 = next(t for (d, name), t in rows.items() if d == "cpu" and "bf16" in name)
    assert bf16["held"] is False and bf16["measured"] == "1.20×"
    assert all(t["held"] is None for (d, _), t in rows.items() if d == "xla")

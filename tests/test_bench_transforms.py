"""Smoke test of the transform microbenchmarks, so that ``bench.transforms`` cannot rot.

Runs ``python -m bench.transforms --smoke`` in a subprocess (as users run it) and
checks that every output exists and holds sane numbers, not that they are fast.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.common.meta import META_KEYS

REPO = Path(__file__).resolve().parents[1]
TRANSFORMS = {
    "grads_to_fp32",
    "grads_to_fp32_",
    "masters_to_model",
    "masters_to_model_",
    *(f"apply_update{u} {k}" for u in ("", "_") for k in ("sgd", "adam", "adamw")),
}


def _run(out: Path, *args: str) -> dict:
    env = {**os.environ, "PJRT_DEVICE": "CPU"}
    cmd = [sys.executable, "-m", "bench.transforms", "--smoke", "--threads", "1", "--out", str(out)]
    proc = subprocess.run(
        [*cmd, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    for name in ("transforms.md", "transforms.json", "transforms.png"):
        assert (out / name).stat().st_size > 0, name
    assert (out / "transforms.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return json.loads((out / "transforms.json").read_text())


def _check(result: dict, device: str) -> None:
    records = [r for r in result["results"] if r["device"] == device]
    assert [r for r in records if r["error"]] == []
    mpfunc_rows = {r["transform"] for r in records if r["variant"] == "mpfunc"}
    assert mpfunc_rows == TRANSFORMS
    for r in records:
        assert len(r["samples_s"]) >= 3
        assert all(s > 0 for s in r["samples_s"])
        assert r["median_s"] > 0 and r["gbps"] > 0 and r["roofline"] > 0
        assert r["bytes_per_elem"] in (6, 8, 12, 20, 28)
    for test in ("copy", "add"):
        assert result["bandwidth"][device][test]["gbps"] > 0
    assert {"size", "count"} <= {s for r in records for s in r["sweeps"]}


@pytest.mark.slow
def test_transforms_smoke_cpu(tmp_path: Path) -> None:
    result = _run(tmp_path)
    _check(result, "cpu")
    baselines = {r["variant"] for r in result["results"]}
    assert {"loop", "_foreach_copy_", "flat slices", "torch.optim fused"} <= baselines
    assert len(result["targets"]) == 7  # 4 from before issue 11, 3 for the mixed step
    assert tuple(result["meta"]) == META_KEYS and result["meta"]["threads"] == 1
    assert result["settings"]["model_dtype"] == "bfloat16"
    md = (tmp_path / "transforms.md").read_text()
    assert "## Measured memory bandwidth" in md and "| apply_update_ adamw | mpfunc |" in md


@pytest.mark.slow
@pytest.mark.xla
def test_transforms_smoke_xla(tmp_path: Path, xla_device: object) -> None:
    result = _run(tmp_path, "--device", "xla")
    records = result["results"]
    assert records and [r for r in records if r["error"]] == []
    assert {r["transform"] for r in records if r["variant"] == "mpfunc"} >= {
        "grads_to_fp32_",
        "masters_to_model_",
        "apply_update_ adamw",
    }
    # After two warm-up calls, the timed calls reuse the compiled graphs.
    assert [r["compiles_timed"] for r in records] == [0] * len(records)
    assert "xla: time vs tensor count" in (tmp_path / "transforms.md").read_text()

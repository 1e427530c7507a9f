"""The dp_scaling benchmark runs end to end at smoke size and its counts are exact.

One ``python -m bench.dp_scaling --smoke`` run (1 and 2 ranks on gloo, about 30 s on 2
cores), shared by the tests below. Collective counts, payload bytes and masters+state
bytes follow from the model, so they are checked exactly; times and RSS only for sanity.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench.common.meta import META_KEYS
from bench.dp_scaling import report

REPO = Path(__file__).resolve().parent.parent
MODES = ("unsharded", "sharded", "pertensor")
WORLDS = ("1", "2")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, dict[str, Any]]:
    out = tmp_path_factory.mktemp("dp_scaling")
    cmd = [sys.executable, "-m", "bench.dp_scaling", "--smoke", "--timeout", "60"]
    proc = subprocess.run(
        [*cmd, "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr[-4000:]}"
    result: dict[str, Any] = json.loads((out / "dp_scaling.json").read_text())
    return out, proc.stdout, result


@pytest.mark.slow
def test_outputs_exist_and_table_is_printed(smoke: tuple[Path, str, dict[str, Any]]) -> None:
    out, stdout, result = smoke
    table = (out / "dp_scaling.md").read_text()
    assert stdout == table
    png = (out / "dp_scaling.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000
    for world in WORLDS:
        for mode in MODES:
            rows = [r for r in table.splitlines() if r.startswith(f"| {world} | 1 | {mode} |")]
            assert len(rows) == 1 and "failed" not in rows[0], rows
    assert sorted(result["worlds"]) == list(WORLDS)
    meta = result["meta"]
    assert tuple(meta) == META_KEYS and meta["threads"] == 1
    assert meta["command"].startswith("python -m bench.dp_scaling")
    assert meta["machine"]["cpu_count"] >= 1
    assert not list((out / "logs").glob("store-*")), "file stores must be removed"


@pytest.mark.slow
@pytest.mark.parametrize("world", WORLDS)
def test_samples_and_counts(smoke: tuple[Path, str, dict[str, Any]], world: str) -> None:
    result = smoke[2]
    w = int(world)
    params, tensors = result["parameters"], result["tensors"]
    blocks, steps = result["schedule"]["blocks"], result["schedule"]["steps"]
    summary = result["worlds"][world]["summary"]
    for mode in MODES:
        r = result["worlds"][world]["modes"][mode]
        assert "error" not in r, r.get("error")
        assert [s["block"] for s in r["samples"]] == list(range(blocks))
        for s in r["samples"]:
            assert len(s["ranks"]) == w and len(s["step_s"]) == steps
            assert all(0 < t < 60 for t in s["step_s"])
        assert [x["tensors"] for x in r["setup"]] == [tensors] * w
        assert [x["parameters"] for x in r["setup"]] == [params] * w
        s = summary[mode]
        assert s["calls_agree"] and s["median_s"] > 0
        assert s["final_loss"] < s["warmup_loss"]  # one fixed batch: training progresses
        assert all(b > 0 for b in s["peak_rss_bytes"])
    # Counted inside the ranks: the smoke model's fp32 grads fit one 25 MiB bucket.
    # mpfunc skips communication on a single rank; the per-tensor baseline does not.
    assert summary["pertensor"]["calls_per_step"] == {"all_reduce": tensors}
    fp32_grads, bf16_params = 4 * params, 2 * params
    assert summary["pertensor"]["payload_bytes_per_step"] == fp32_grads
    if w == 1:
        assert summary["unsharded"]["calls_per_step"] == {}
        assert summary["sharded"]["calls_per_step"] == {}
    else:
        assert summary["unsharded"]["calls_per_step"] == {"all_reduce": 1}
        # One reduce to each owner (its leaves fit one bucket), one broadcast from each.
        assert summary["sharded"]["calls_per_step"] == {"reduce": w, "broadcast": w}
        assert summary["unsharded"]["payload_bytes_per_step"] == fp32_grads
        assert summary["sharded"]["payload_by_kind_per_step"] == {
            "reduce": fp32_grads,
            "broadcast": bf16_params,
        }
    for mode in MODES:
        sent = summary[mode]["sent_bytes_per_step"]
        if w == 1:
            assert sent < 1024  # no peers, nothing on the wire
        elif mode == "sharded":
            # Each rank sends the grads it does not own to their owner.
            assert sent >= 0.3 * fp32_grads
        else:
            # A ring all-reduce over 2 ranks sends each rank's whole buffer once.
            assert sent >= 0.9 * fp32_grads
    # Masters + AdamW state (exp_avg, exp_avg_sq, a 0-d step per leaf): exact.
    full = 12 * params + 4 * tensors
    for mode in ("unsharded", "pertensor"):
        assert summary[mode]["state_bytes"] == [full] * w
    sharded = summary["sharded"]["state_bytes"]
    assert sum(sharded) == full
    if w > 1:
        assert max(sharded) < full


@pytest.mark.slow
def test_every_mode_and_world_trains_alike(smoke: tuple[Path, str, dict[str, Any]]) -> None:
    # Same global batch, same steps: only the reduction order and bf16 rounding differ.
    losses = [s["final_loss"] for d in smoke[2]["worlds"].values() for s in d["summary"].values()]
    assert max(losses) == pytest.approx(min(losses), rel=1e-2)


@pytest.mark.slow
def test_oversubscription_is_noted(smoke: tuple[Path, str, dict[str, Any]]) -> None:
    result = json.loads(json.dumps(smoke[2]))
    result["meta"]["machine"]["usable_cores"] = 1
    table = report.markdown(result)
    assert "measure data-parallel *overhead*" in table and "With 2 ranks" in table
    result["meta"]["machine"]["usable_cores"] = 64
    assert "*overhead*" not in report.markdown(result)

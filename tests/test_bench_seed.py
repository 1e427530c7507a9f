"""The seed benchmark runs end to end at smoke size and writes sane outputs.

One ``python -m bench.seed --smoke`` run on cpu and xla (about 70 s on 2 idle cores),
shared by the tests below; plus checks of the target logic on a made-up result and of
where output goes by default.
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

from bench.common.meta import META_KEYS
from bench.seed import report
from bench.seed.__main__ import _parse
from bench.seed.config import MODES, runs_on

REPO = Path(__file__).resolve().parent.parent
XLA = importlib.util.find_spec("torch_xla") is not None or bool(
    os.environ.get("MPFUNC_REQUIRE_XLA")
)
DEVICES = ["cpu", "xla"] if XLA else ["cpu"]
# Every mode but two of the three torch.compile'd torchao peers (a minute of compiling each
# on 2 cores); torchao's 4-bit AdamW stays, the peer closest to mpfunc's smallest state.
SMOKE_MODES = [m for m in MODES if m not in ("peer-torchao-8bit", "peer-torchao-bf16sr")]


# Session scope: conftest runs the [xla] items after the CPU half, and a module-scoped
# fixture would then run the benchmark twice.
@pytest.fixture(scope="session")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("seed")
    env = {**os.environ, "PJRT_DEVICE": os.environ.get("PJRT_DEVICE", "CPU")}
    cmd = [sys.executable, "-m", "bench.seed", "--smoke", "--devices", ",".join(DEVICES)]
    cmd += ["--modes", ",".join(SMOKE_MODES)]
    proc = subprocess.run(
        [*cmd, "--out", str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=540
    )
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr[-4000:]}"
    return out, proc.stdout


def _json(out: Path) -> dict[str, Any]:
    result: dict[str, Any] = json.loads((out / "seed.json").read_text())
    return result


def _ran(result: dict[str, Any], device: str) -> list[str]:
    """The modes that ran on ``device``: those whose library or option is missing here
    (``unsupported``, with the reason) are listed, not run."""
    dev = result["devices"][device]["modes"]
    return [m for m in dev if "unsupported" not in dev[m]]


@pytest.mark.slow
def test_outputs_exist_and_table_is_printed(smoke: tuple[Path, str]) -> None:
    out, stdout = smoke
    table = (out / "seed.md").read_text()
    assert stdout == table
    png = (out / "seed.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000
    for device in DEVICES:
        assert f"## {device} (" in table
    result = _json(out)
    for mode in SMOKE_MODES:
        rows = [line for line in table.splitlines() if line.startswith(f"| {mode} |")]
        assert len(rows) == sum(mode in _ran(result, d) for d in DEVICES), rows
        assert all("failed" not in row for row in rows)
    for d in DEVICES:
        for mode, r in result["devices"][d]["modes"].items():
            if "unsupported" in r:
                assert f"`{mode}` not run here: " in table
    assert "| peak MiB | held B/param | peak B/param |" in table
    assert "## Targets" in table
    if "xla" in DEVICES:
        assert "| trace ms | update ms | execute ms |" in table


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_every_sample_is_sane(smoke: tuple[Path, str], device: str) -> None:
    result = _json(smoke[0])
    meta = result["meta"]
    assert tuple(meta) == META_KEYS
    assert meta["machine"]["cpu_count"] >= 1 and meta["command"].startswith("python -m bench.seed")
    assert meta["threads"] >= 1 and meta["versions"]["torch"]
    dev = result["devices"][device]
    blocks, steps = result["schedule"]["blocks"], result["schedule"]["steps"]
    assert list(dev["modes"]) == [m for m in SMOKE_MODES if runs_on(m, device)]
    # Only a missing library or option may keep a mode from running, never a failure.
    assert {m for m in dev["modes"] if m not in _ran(result, device)} <= {
        "mpfunc-step-in-backward",
        "peer-flashoptim",
    }
    modes = _ran(result, device)
    for mode in modes:
        r = dev["modes"][mode]
        assert "error" not in r, r.get("error")
        assert [s["block"] for s in r["samples"]] == list(range(blocks))
        for s in r["samples"]:
            assert 0 < s["step_s"] < 60 and len(s["host_s"]) == steps
            assert len(s["trace_s"]) == len(s["sync_s"]) == len(s["update_s"]) == steps
            assert all(t > 0 for t in s["trace_s"]) and all(t >= 0 for t in s["sync_s"])
            # The optimizer's part of each step: timed, and within the step's trace.
            assert all(0 < u < t for u, t in zip(s["update_s"], s["trace_s"]))
            assert math.isfinite(s["loss"])
        # Same fixed batch every step: training must make progress in every mode.
        assert r["samples"][-1]["loss"] < r["setup"]["warmup_loss"]
        assert r["memory"]["peak_bytes"] > 0
        summary = dev["summary"][mode]
        assert summary["x_fp32"] > 0 and summary["median_s"] > 0
        assert summary["trace_s"] > 0 and summary["execute_s"] < summary["median_s"]
        if device == "xla":
            assert summary["graphs_per_step"] >= 1
            assert summary["compiles"] >= 0
    _check_memory(dev, modes, device)
    setups = {m: dev["modes"][m]["setup"] for m in modes}
    if device == "xla":
        assert setups["syncfree"]["optimizer"].startswith("torch_xla.amp.syncfree.AdamW")
    else:
        assert setups["pertensor-fused"]["optimizer"] == "torch.optim.AdamW (fused)"
        assert setups["pertensor"]["optimizer"] != "torch.optim.AdamW (fused)"
    # Modes that do the same AdamW on the same data and weights end at the same loss: mpfunc
    # and the per-tensor baseline (fp32 masters), and each fused twin and its recipe; on
    # XLA, syncfree's fused op and torch.optim on the fp32 model.
    losses = {m: dev["modes"][m]["samples"][-1]["loss"] for m in modes}
    same = [("pertensor", "mpfunc")]
    same += [("fp32", "syncfree")] if device == "xla" else [("fp32", "fp32-fused")]
    same += [("pertensor", "pertensor-fused")] if device != "xla" else []
    for a, b in same:
        assert losses[b] == pytest.approx(losses[a], rel=1e-2), (a, b)


def _check_memory(dev: dict[str, Any], modes: list[str], device: str) -> None:
    """Held and peak bytes per param against what each mode keeps, counted by hand."""
    held = {m: dev["summary"][m]["persistent_per_param"] for m in modes}
    # Params, masters and state (0-d step counters and 8-bit scales add a little at this
    # size: 1,000s of params in 15 tensors).
    expect = {"fp32": 12, "bf16": 6, "pertensor": 2 + 4 + 4 + 8, "flat": 2 + 4 + 4 + 8}
    expect |= {"mpfunc": 2 + 4 + 8, "mpfunc-kahan": 2 + 2 + 4}
    expect |= {"mpfunc-remainder": 2 + 2 + 0.125 + 8}  # its tie bits: one per element
    for m, want in expect.items():
        assert want <= held[m] < want + 0.1, (m, held[m])
    assert 2 + 2.125 <= held["mpfunc-stochastic"] < 4.4
    if device == "xla":
        assert all("step_peak_per_param" not in dev["summary"][m] for m in modes)
        return
    peak = {m: dev["summary"][m]["step_peak_per_param"] for m in modes}
    for m in modes:
        # A step holds every grad at once (in the model's dtype) unless it frees them
        # inside backward; the peak never falls below what is held.
        grad = 4 if m.startswith(("fp32", "autocast")) else 2
        if m != "mpfunc-step-in-backward":
            assert peak[m] >= held[m] + grad - 0.01, (m, peak[m], held[m])
        assert peak[m] < held[m] + 3 * grad + 4, (m, peak[m], held[m])
    # One fused kernel, in place: the grads are all it adds; mpfunc's one pass likewise.
    assert peak["fp32-fused"] == pytest.approx(held["fp32-fused"] + 4, abs=0.05)
    assert peak["mpfunc"] == pytest.approx(held["mpfunc"] + 2, abs=0.05)


def test_targets_held_missed_and_unmeasured() -> None:
    def device(**summary: float) -> dict[str, Any]:
        return {"summary": {"mpfunc": summary}, "modes": {}}

    result = {
        "devices": {
            "cpu": device(x_pertensor=0.9, x_bf16=1.2),
        }
    }
    rows = {(t["device"], t["target"]): t for t in report.targets(result)}
    assert rows[("cpu", "mpfunc step ≤ 0.95× pertensor")]["held"] is True
    bf16 = next(t for (d, name), t in rows.items() if d == "cpu" and "bf16" in name)
    assert bf16["held"] is False and bf16["measured"] == "1.20×"
    assert all(t["held"] is None for (d, _), t in rows.items() if d == "xla")
    xla = report.targets({"devices": {"xla": device(update_x_pertensor=0.2, x_flat=0.6)}})
    held = {t["target"]: t["held"] for t in xla}
    assert held["mpfunc update trace ≤ 0.25× pertensor's"] is True
    assert held["mpfunc step ≤ 0.5× flat"] is False


def test_output_goes_outside_the_repository_unless_out_says() -> None:
    default = _parse([]).out.resolve()
    assert REPO not in default.parents, default
    committed = REPO / "bench" / "results" / "seed"
    assert _parse(["--out", str(committed)]).out == committed


def test_modes_per_device() -> None:
    assert [m for m in MODES if runs_on(m, "xla")] == [
        "fp32",
        "bf16",
        "flat",
        "pertensor",
        "mpfunc",
        "mpfunc-remainder",
        "mpfunc-kahan",
        "mpfunc-stochastic",
        "mpfunc-step-in-backward",
        "autocast",
        "syncfree",
    ]
    cpu = [m for m in MODES if runs_on(m, "cpu")]
    assert "syncfree" not in cpu and cpu.index("fp32-fused") == cpu.index("fp32") + 1
    assert {m for m in cpu if m.endswith("-fused")} == {
        f"{m}-fused" for m in ("fp32", "bf16", "flat", "pertensor", "autocast")
    }
    assert {"peer-optimi-kahan", "peer-bnb-8bit", "peer-torchao-4bit"} <= set(cpu)

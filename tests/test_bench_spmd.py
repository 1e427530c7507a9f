"""The spmd benchmark runs end to end at smoke size and its counts are exact.

One ``python -m bench.spmd --smoke`` run (1, 2 and 4 virtual XLA:CPU devices, three modes,
about 30 s of CPU), shared by the tests below. Graph counts and bytes per device follow
from the model and ``mark_sharding_``'s rule, so they are checked exactly; times only for
sanity.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench.common.meta import META_KEYS
from bench.spmd.config import MODES, PRESETS
from mpfunc.parallel import _sharding

REPO = Path(__file__).resolve().parent.parent
DEVICES = ("1", "2", "4")

pytestmark = [pytest.mark.slow, pytest.mark.xla]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, dict[str, Any]]:
    if importlib.util.find_spec("torch_xla") is None:
        pytest.skip("torch_xla is not installed")
    out = tmp_path_factory.mktemp("spmd")
    cmd = [sys.executable, "-m", "bench.spmd", "--smoke", "--timeout", "240"]
    proc = subprocess.run(
        [*cmd, "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr[-4000:]}"
    result: dict[str, Any] = json.loads((out / "spmd.json").read_text())
    return out, proc.stdout, result


def expected_bytes(devices: int) -> dict[str, tuple[int, int]]:
    """Per mode: (masters+state, params) bytes on each device under mark_sharding_'s rule."""
    import torch

    from bench.common.model import Model

    shapes = [p.shape for p in Model(PRESETS["smoke"]).parameters()]

    def split(shape: torch.Size, itemsize: int, sharded: bool) -> int:
        spec = _sharding.partition_spec(shape, "data", devices, _sharding.MIN_NUMEL)
        whole = shape.numel() * itemsize
        return whole // devices if sharded and any(a is not None for a in spec) else whole

    # AdamW: an fp32 master and two fp32 moments like it, and a 0-d fp32 step count.
    state = {s: sum(3 * split(x, 4, s) + 4 for x in shapes) for s in (False, True)}
    params = {s: sum(split(x, 2, s) for x in shapes) for s in (False, True)}
    return {
        "replicated": (state[False], params[False]),
        "zero1": (state[True], params[False]),
        "fsdp": (state[True], params[True]),
    }


def test_outputs_exist_and_table_is_printed(smoke: tuple[Path, str, dict[str, Any]]) -> None:
    out, stdout, result = smoke
    table = (out / "spmd.md").read_text()
    assert stdout == table
    assert (out / "spmd.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    for n in DEVICES:
        for mode in MODES:
            rows = [r for r in table.splitlines() if r.startswith(f"| {n} | {mode} |")]
            assert len(rows) == 1, rows
    assert sorted(result["devices"], key=int) == list(DEVICES)
    assert tuple(result["meta"]) == META_KEYS
    assert result["meta"]["command"].startswith("python -m bench.spmd")
    assert not list((out / "logs").glob("hlo-*")), "XLA's dumps must be removed"


@pytest.mark.parametrize("n", DEVICES)
def test_counts_and_bytes(smoke: tuple[Path, str, dict[str, Any]], n: str) -> None:
    d = smoke[2]["devices"][n]
    assert d["devices"] == int(n)
    want = expected_bytes(int(n))
    for mode in MODES:
        s, r = d["summary"][mode], d["modes"][mode]
        assert (s["graphs_per_step"], s["compiles"], s["transfers"]) == (1, 0, 0), mode
        # Every device holds the same bytes, exactly what the rule predicts.
        assert set(r["device_bytes"]) == {f"CPU:{i}" for i in range(int(n))}
        assert set(r["device_bytes"].values()) == {want[mode][0]}, mode
        assert set(r["param_device_bytes"].values()) == {want[mode][1]}, mode
        assert all(0 < t < 60 for t in r["step_s"])
        assert s["final_loss"] < s["warmup_loss"]  # one fixed batch: training progresses
    if n == "1":
        assert d["summary"]["replicated"]["collectives"] == {}
    else:
        assert d["summary"]["zero1"]["state_fraction"] < 1 / int(n) + 0.1
        for mode in MODES:  # the partitioner sums the grads over the batch's shards
            assert d["summary"][mode]["collectives"]["all-reduce"]["count"] > 0, mode


def test_every_count_trains_alike(smoke: tuple[Path, str, dict[str, Any]]) -> None:
    # Same batch, same steps: only the order of the partitioned sums differs.
    losses = [s["final_loss"] for d in smoke[2]["devices"].values() for s in d["summary"].values()]
    assert max(losses) == pytest.approx(min(losses), rel=1e-2)

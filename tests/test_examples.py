"""The examples run, at a tiny size, on the CPU and on XLA (as the README shows them)."""

from __future__ import annotations

import math
import pathlib

import pytest
import torch
from support.examples import EXAMPLES, load


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_train_loop(device: torch.device, dtype: str, capsys: pytest.CaptureFixture[str]) -> None:
    loss = load("train_loop").main(
        ["--device", device.type, "--dtype", dtype, "--steps", "30", "--hidden", "32"]
    )
    out = capsys.readouterr().out
    assert "step    0" in out and "step   29" in out
    first = float(out.split("loss ")[1].split()[0])
    assert math.isfinite(loss) and loss < first, out


def test_train_loop_saves_and_resumes(
    device: torch.device, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ex = load("train_loop")
    ck = str(tmp_path / "run.pt")
    common = ["--device", device.type, "--dtype", "fp16", "--hidden", "32", "--ckpt", ck]
    ex.main([*common, "--steps", "10"])
    ex.main([*common, "--steps", "10"])
    out = capsys.readouterr().out
    assert "saved" in out and "resumed from" in out and "at step 10" in out
    assert "step   19" in out


def test_data_parallel_under_torchrun(tmp_path: pathlib.Path) -> None:
    """The README's torchrun command, at a tiny size: 2 gloo ranks, sharded masters."""
    import os
    import subprocess
    import sys

    for extra in ([], ["--unsharded"]):
        run = subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc_per_node",
                "2",
                str(EXAMPLES / "data_parallel.py"),
                "--steps",
                "30",
                *extra,
            ],
            capture_output=True,
            text=True,
            timeout=180,
            env=dict(os.environ, OMP_NUM_THREADS="1"),
        )
        assert run.returncode == 0, run.stderr[-3000:]
        losses = [
            float(line.split("loss ")[1]) for line in run.stdout.splitlines() if "loss" in line
        ]
        assert losses[-1] < losses[0], run.stdout
        (summary,) = [ln for ln in run.stdout.splitlines() if "master+state" in ln]
        owned = [int(n) for n in summary.split(": ")[1].split()]
        assert len(owned) == 2
        if not extra:  # sharded: the ranks split the masters and state between them
            assert max(owned) < 0.75 * sum(owned)


def test_functional_call(capsys: pytest.CaptureFixture[str]) -> None:
    loss = load("functional_call").main(["--steps", "60"])
    out = capsys.readouterr().out
    first = float(out.split("loss ")[1].split()[0])
    assert math.isfinite(loss) and loss < first, out

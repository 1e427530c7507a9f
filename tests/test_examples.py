"""The examples run, at a tiny size, on the CPU and on XLA (as the README shows them)."""

from __future__ import annotations

import importlib.util
import math
import pathlib
from types import ModuleType

import pytest
import torch

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


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


def test_functional_call(capsys: pytest.CaptureFixture[str]) -> None:
    loss = load("functional_call").main(["--steps", "60"])
    out = capsys.readouterr().out
    first = float(out.split("loss ")[1].split()[0])
    assert math.isfinite(loss) and loss < first, out

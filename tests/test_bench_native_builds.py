"""``python -m bench.native_builds`` runs end to end (smoke sizes, the build against itself)."""

from __future__ import annotations

import pytest

from bench.native_builds.__main__ import main
from tests.support.native import native_module


def test_native_builds_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    native_module()  # skips where the build cannot run
    assert main(["--smoke", "--pairs", "stochastic+uint8,fp32+uint4"]) == 0
    out = capsys.readouterr().out
    assert "| stochastic+uint8 |" in out and "| fp32+uint4 |" in out and "load average" in out

"""Every ```python block of README.md runs, as written (tests/support/readme.py).

Each block is one test case, found afresh from the README on every run, so a new
block is tested the moment it is written; the placeholders a block may use, and the
markers that declare them, are described in tests/support/readme.py.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest
import torch
from support import readme

import mpfunc

# --- the tests -------------------------------------------------------------------------------

ALL = readme.blocks(readme.README.read_text())


def _id(b: readme.Block) -> str:
    first = next((ln for ln in b.code.splitlines() if ln.strip()), "")
    return f"line{b.line}-" + re.sub(r"\W+", "_", first)[:30].strip("_")


def test_the_readme_has_python_blocks() -> None:
    assert len(ALL) >= 3, ALL  # the parser still finds them


@pytest.mark.parametrize("block", ALL, ids=[_id(b) for b in ALL])
def test_readme_block_runs(
    block: readme.Block, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # files a block writes (run.pt) land here
    if block.marker.startswith("skip"):
        pytest.skip(f"README.md:{block.line}: {block.marker}")
    if block.marker.startswith("distributed"):
        _run_distributed(block, tmp_path)
        return
    ns = readme.namespace(block.marker)
    before = (
        {n: t.clone() for n, t in ns["masters"].items() if isinstance(t, torch.Tensor)}
        if "masters" in ns
        else None
    )
    readme.run_block(block, ns)
    if before and "apply_update_(" in block.code:  # a step trained something
        assert any(not torch.equal(t, ns["masters"][n]) for n, t in before.items())
    if "masters_from_remainders(" in block.code:  # the exact masters, every one of them
        want = mpfunc.masters_state_dict(ns["masters"])
        assert want and sorted(ns["fp32"]) == sorted(want)
        assert all(torch.equal(ns["fp32"][k].view(torch.int32), v.view(torch.int32))
                   for k, v in want.items())  # fmt: skip


_DIST = """
import datetime, sys, torch, torch.distributed as dist
sys.path.insert(0, {tests!r})
from support import readme as t
dist.init_process_group("gloo", init_method="file://{store}", rank=0, world_size=1,
                        timeout=datetime.timedelta(seconds=30))
try:
    block = t.Block(*__import__("json").loads({block!r}))
    ns = t.namespace(block.marker)
    ns.update(rank=0, world_size=1)
    t.run_block(block, ns)
finally:
    dist.destroy_process_group()
"""


def _run_distributed(block: readme.Block, tmp: pathlib.Path) -> None:
    script = _DIST.format(
        tests=str(pathlib.Path(__file__).parent),
        store=str(tmp / "store"),
        block=json.dumps(list(block)),
    )
    run = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        cwd=tmp,
    )
    assert run.returncode == 0, f"README.md:{block.line}:\n{run.stderr[-3000:]}"


def test_markers_are_understood() -> None:
    """A typo in a marker must not silently change how a block runs."""
    for b in ALL:
        if b.marker:
            assert re.match(r"(skip\b.+|distributed\b|uses\b)", b.marker), (b.line, b.marker)
            readme._uses(b.marker)

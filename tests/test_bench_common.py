"""The shared benchmark package: layout rules, the metadata block and worker processes.

Cheap: no benchmark runs here (the smoke tests in ``test_bench_<name>.py`` do that).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.common import procs
from bench.common.meta import META_KEYS, Run, default_out
from bench.common.report import header

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "bench"
BENCHMARKS = ("seed", "transforms", "convergence", "dp_scaling")


def _bench_imports(path: Path) -> set[str]:
    """The ``bench.*`` modules a file imports (absolute imports; bench uses no others)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            assert node.level == 0, f"{path}: relative import"
            names |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
    return {n for n in names if n == "bench" or n.startswith("bench.")}


def test_one_folder_per_benchmark_with_entry_worker_and_report() -> None:
    for name in BENCHMARKS:
        folder = BENCH / name
        for module in ("__init__", "__main__", "worker", "report"):
            assert (folder / f"{module}.py").is_file(), f"{name}/{module}.py"
    # The old flat modules are gone: each benchmark is its folder.
    for name in BENCHMARKS:
        assert not (BENCH / f"{name}.py").exists() and not (BENCH / f"_{name}_report.py").exists()
    assert not (BENCH / "_procs.py").exists()


def test_no_benchmark_imports_another() -> None:
    for name in BENCHMARKS:
        for path in (BENCH / name).glob("*.py"):
            for imported in _bench_imports(path):
                parts = imported.split(".")
                assert len(parts) > 1 and parts[1] in ("common", name), (
                    f"{path.relative_to(REPO)} imports {imported}"
                )
    for path in (BENCH / "common").glob("*.py"):
        assert all(i.startswith("bench.common") for i in _bench_imports(path)), path


def test_parents_and_light_modules_do_not_import_torch() -> None:
    # The parents that only drive worker processes stay light; so do the shared modules
    # they use, and --render-only of the in-process benchmarks.
    code = (
        "import sys\n"
        "import bench.seed.__main__, bench.dp_scaling.__main__\n"
        "import bench.transforms.__main__, bench.convergence.__main__\n"
        "import bench.common.procs, bench.common.meta, bench.common.report\n"
        "import bench.seed.report, bench.dp_scaling.report\n"
        "import bench.transforms.report, bench.convergence.report\n"
        "heavy = sorted(m for m in ('torch', 'torch_xla', 'mpfunc') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=60)


def test_metadata_block() -> None:
    meta = Run("seed", ["--smoke", "--out", "/tmp/a b"]).finish(threads=3)
    assert tuple(meta) == META_KEYS
    assert meta["command"] == "python -m bench.seed --smoke --out '/tmp/a b'"
    assert meta["threads"] == 3 and meta["wall_s"] >= 0
    assert meta["machine"]["cpu_count"] >= 1 and meta["versions"]["torch"]
    commit = meta["git"]["commit"]
    assert commit is None or (len(commit) == 40 and int(commit, 16) >= 0)
    lines = header(meta)
    assert lines[0].startswith("Command: `python -m bench.seed --smoke")
    assert "3 torch threads" in lines[1]


def test_default_output_is_outside_the_repository() -> None:
    for name in BENCHMARKS:
        out = default_out(name).resolve()
        assert REPO not in out.parents and out.name == name


# ---- worker processes --------------------------------------------------------------------


class Echo:
    """A worker for the tests below; ``run(steps)`` misbehaves on request."""

    def __init__(self, fail: bool = False) -> None:
        if fail:
            raise RuntimeError("no such device here")
        print("echo: hello from the worker")  # must land in the log, not in the pipe

    def setup(self, msg: dict[str, Any]) -> dict[str, Any]:
        return {"pid": os.getpid(), "x": msg["x"]}

    def run(self, steps: int) -> dict[str, Any]:
        if steps == -1:
            os._exit(3)
        if steps == -2:
            time.sleep(60)
        if steps == -3:
            raise ValueError("bad steps")
        return {"steps": steps}

    def finish(self) -> dict[str, Any]:
        return {"done": True}


FACTORY = f"{__name__}:Echo"


@pytest.fixture(scope="module")
def server() -> Iterator[None]:
    procs.preload([__name__])
    yield
    procs.shutdown()


def _worker(tmp_path: Path, fail: bool = False) -> procs.WorkerProcess:
    return procs.WorkerProcess(FACTORY, (fail,), tmp_path / "w.log", 60, name="w1")


@pytest.mark.usefixtures("server")
def test_worker_round_trip(tmp_path: Path) -> None:
    w = _worker(tmp_path)
    info = w.call({"cmd": "setup", "x": 7})
    assert info == {"pid": info["pid"], "x": 7} and info["pid"] != os.getpid()
    assert procs.ready([w], 0.1) == []
    w.send({"cmd": "run", "steps": 5})
    assert procs.ready([w], 30) == [w]
    assert w.recv() == {"steps": 5}
    assert w.call({"cmd": "finish"}) == {"done": True}
    w.close()
    w.wait()
    assert w.proc.exitcode == 0
    assert "hello from the worker" in (tmp_path / "w.log").read_text()


@pytest.mark.usefixtures("server")
def test_worker_failures_are_errors_not_hangs(tmp_path: Path) -> None:
    w = _worker(tmp_path, fail=True)
    with pytest.raises(procs.WorkerError, match="w1: RuntimeError: no such device here"):
        w.call({"cmd": "setup", "x": 0})
    assert w.init_failed
    w.wait()

    w = _worker(tmp_path)
    w.call({"cmd": "setup", "x": 0})
    with pytest.raises(procs.WorkerError, match="w1: ValueError: bad steps"):
        w.call({"cmd": "run", "steps": -3})
    assert not w.init_failed
    w.wait()
    assert w.proc.exitcode == 1  # it returned 1 after the error reply, without exiting hard

    w = _worker(tmp_path)
    w.call({"cmd": "setup", "x": 0})
    with pytest.raises(procs.WorkerError, match=r"w1 exited early \(exit 3\)"):
        w.call({"cmd": "run", "steps": -1})
    with pytest.raises(procs.WorkerError, match="exited early"):
        w.send({"cmd": "run", "steps": 1})

    w = _worker(tmp_path)
    w.call({"cmd": "setup", "x": 0})
    w.timeout = 0.5
    t0 = time.perf_counter()
    with pytest.raises(procs.WorkerError, match="no reply in 0 s"):
        w.call({"cmd": "run", "steps": -2})
    assert time.perf_counter() - t0 < 30
    assert not w.proc.is_alive()

"""Launching one process per rank of a gloo test, never waiting past a timeout."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

WORKER = pathlib.Path(__file__).resolve().parent.parent / "workers" / "dp_worker.py"


def launch(
    scenario: str,
    world: int,
    out: pathlib.Path,
    timeout: float = 120,
    worker: pathlib.Path = WORKER,
    **env: str,
) -> list[subprocess.CompletedProcess[str]]:
    """Runs WORLD ranks of SCENARIO of WORKER (a script in tests/workers) and returns their
    results, never waiting past TIMEOUT."""
    out.mkdir(parents=True, exist_ok=True)
    store = out / f"store-{scenario}-{world}"
    if store.exists():
        store.unlink()
    full_env = dict(os.environ, MPFUNC_STORE=str(store), OMP_NUM_THREADS="1", **env)
    procs = [
        subprocess.Popen(
            [sys.executable, str(worker), scenario, str(r), str(world), str(out)],
            env=full_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(world)
    ]
    results = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=timeout)
            results.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return results


TEARDOWN_ABORT = "terminate called without an active exception"


def finished(r: subprocess.CompletedProcess[str]) -> bool:
    """Whether rank R's scenario ran to the end on every rank: its exit status is 0, or it
    aborted inside torch's process-group teardown after the worker's final barrier (the
    worker leaves a done-SCENARIO-rankR file there; see dp_worker.main)."""
    if r.returncode == 0:
        return True
    scenario, rank, out = r.args[2], r.args[3], r.args[5]
    done = pathlib.Path(out, f"done-{scenario}-rank{rank}").exists()
    return done and r.stderr.rstrip().endswith(TEARDOWN_ABORT)


def check_ok(results: list[subprocess.CompletedProcess[str]]) -> None:
    for r in results:
        assert finished(r), f"rank failed: {r.args}\n{r.stderr[-3000:]}"

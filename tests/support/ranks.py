"""Launching one process per rank of a gloo test, never waiting past a timeout."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

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
    # The ranks import the mpfunc of this checkout, not whatever an editable install of the
    # environment points at (a git worktree sharing another checkout's venv).
    root = str(WORKER.parents[2])
    path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    full_env = dict(
        os.environ, MPFUNC_STORE=str(store), OMP_NUM_THREADS="1", PYTHONPATH=path, **env
    )
    # Each rank writes its output to files, never to a pipe that nobody reads while the
    # parent waits (a full pipe would block the rank and look like a hang).
    logs = [
        (out / f"{scenario}-rank{r}.stdout", out / f"{scenario}-rank{r}.stderr")
        for r in range(world)
    ]
    procs = []
    for r, (o, e) in enumerate(logs):
        with o.open("w") as stdout, e.open("w") as stderr:
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(worker), scenario, str(r), str(world), str(out)],
                    env=full_env,
                    stdout=stdout,
                    stderr=stderr,
                )
            )
    deadline = time.monotonic() + timeout
    hung = []
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            hung.append(p)
    # A rank still running past the deadline prints its Python stacks (the worker registers
    # faulthandler on SIGUSR1), then is killed, so that the failure says where it waited.
    for p in hung:
        p.send_signal(signal.SIGUSR1)
    if hung:
        time.sleep(2)
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
    results = [
        subprocess.CompletedProcess(p.args, p.returncode, o.read_text(), e.read_text())
        for p, (o, e) in zip(procs, logs)
    ]
    if hung:
        done = sorted(x.name for x in out.glob(f"done-{scenario}-rank*"))
        report = "\n".join(
            f"--- rank {r} (exit {res.returncode}{', hung' if procs[r] in hung else ''}):\n"
            f"{res.stderr[-4000:]}"
            for r, res in enumerate(results)
        )
        raise AssertionError(
            f"{scenario} on {world} ranks passed its {timeout:.0f} s limit; "
            f"done markers: {done}\n{report}"
        )
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

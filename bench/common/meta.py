"""The metadata block every result JSON carries, and where results are written.

Every benchmark's JSON has a top-level ``"meta"`` with the keys of ``META_KEYS``: what
ran (benchmark, command), when (date, wall time), on which code (git commit, and whether
tracked files had changes), on which machine and software (CPU, cores, memory, L3; python,
torch, torch_xla, mpfunc versions), with how many torch threads, under which runtime
environment variables, and how busy the machine was (load average at start and end).

Output goes to a folder under the system's temporary directory unless ``--out`` says
otherwise: the committed results in ``bench/results/<benchmark>`` change only when someone
refreshes them on purpose, with ``--out bench/results/<benchmark>``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.common.machine import git_state, load_avg, machine_info, versions

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "bench" / "results"
META_KEYS = (
    "benchmark",
    "command",
    "date",
    "git",
    "machine",
    "versions",
    "threads",
    "env",
    "load_avg",
    "wall_s",
)
# Environment variables that change what a run measures (runtime, threads, collectives).
ENV_PREFIXES = ("PJRT_", "XLA_", "TPU_", "OMP_", "MKL_", "GLOO_", "CUDA_VISIBLE_DEVICES")


def default_out(benchmark: str) -> Path:
    """Where a run writes unless ``--out`` is given: outside the repository."""
    return Path(tempfile.gettempdir()) / "mpfunc-bench" / benchmark


def add_out_argument(parser: argparse.ArgumentParser, benchmark: str) -> None:
    """The ``--out`` option every benchmark shares."""
    parser.add_argument(
        "--out",
        type=Path,
        default=default_out(benchmark),
        help=f"output folder (default: %(default)s; to refresh the committed results: "
        f"--out bench/results/{benchmark})",
    )


class Run:
    """One run's metadata: command, date and load are taken now, the rest by ``finish``."""

    def __init__(self, benchmark: str, argv: Sequence[str] | None) -> None:
        args = list(sys.argv[1:] if argv is None else argv)
        self.benchmark = benchmark
        self.command = shlex.join(["python", "-m", f"bench.{benchmark}", *args])
        self.date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        self.t0 = time.perf_counter()
        self.load_start = load_avg()

    def finish(self, *, threads: int | None) -> dict[str, Any]:
        """The ``"meta"`` block, with the wall time so far.

        Args:
            threads: torch intra-op threads of the process(es) that ran the measured work;
                None where they differed (the result then says per part).

        Returns:
            A dict with exactly the keys of ``META_KEYS``.
        """
        meta = {
            "benchmark": self.benchmark,
            "command": self.command,
            "date": self.date,
            "git": git_state(REPO),
            "machine": machine_info(),
            "versions": versions(),
            "threads": threads,
            "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES)},
            "load_avg": {"start": self.load_start, "end": load_avg()},
            "wall_s": time.perf_counter() - self.t0,
        }
        assert tuple(meta) == META_KEYS
        return meta

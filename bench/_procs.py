"""Worker processes driven over a pipe, shared by the seed and dp_scaling benchmarks.

The parent sends one JSON command a line on the worker's stdin and reads one JSON
reply a line from its stdout (``{"ok": true, ...}`` or ``{"ok": false, "error": ...}``);
the worker's own prints go to stderr, which the parent sends to a log file. Every
read is bounded by a timeout, so a stuck or dead worker is an error, not a hang.

This module imports neither torch nor anything heavy: the parents stay light.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

REPO = Path(__file__).resolve().parent.parent


class WorkerError(RuntimeError):
    pass


class PipeProcess:
    """One worker process and its pipe. ``name`` prefixes its error messages."""

    def __init__(
        self,
        cmd: list[str],
        log: Path,
        timeout: float,
        name: str = "worker",
        env: dict[str, str] | None = None,
    ) -> None:
        self.name, self.timeout, self.log_path = name, timeout, log
        self._log = open(log, "w")  # noqa: SIM115 -- outlives __init__; closed in wait()
        self.proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self._log, text=True,
        )  # fmt: skip
        # Set when the worker reports that it could not even start (e.g. no device).
        self.init_failed = False

    def send(self, msg: dict[str, Any]) -> None:
        stdin = self.proc.stdin
        assert stdin is not None
        try:
            stdin.write(json.dumps(msg) + "\n")
            stdin.flush()
        except BrokenPipeError:
            raise WorkerError(self._died("exited early")) from None

    def recv(self) -> dict[str, Any]:
        stdout = self.proc.stdout
        assert stdout is not None
        ready, _, _ = select.select([stdout], [], [], self.timeout)
        if not ready:
            self.proc.kill()
            raise WorkerError(self._died(f"no reply in {self.timeout:.0f} s"))
        line = stdout.readline()
        if not line:
            raise WorkerError(self._died("exited early"))
        reply: dict[str, Any] = json.loads(line)
        if not reply.pop("ok"):
            self.init_failed = bool(reply.get("init_failed"))
            error = str(reply.get("error")).strip().splitlines()[-1]
            raise WorkerError(error if self.name == "worker" else f"{self.name}: {error}")
        return reply

    def call(self, msg: dict[str, Any]) -> dict[str, Any]:
        self.send(msg)
        return self.recv()

    def _died(self, what: str) -> str:
        self._reap()
        tail = self.log_path.read_text().strip().splitlines()[-3:]
        return f"{self.name} {what} (exit {self.proc.returncode}): " + " | ".join(tail)

    def _reap(self) -> None:
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def close(self) -> None:
        """Close the pipe; the worker exits at end of input. See also ``wait``."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            with contextlib.suppress(BrokenPipeError):
                self.proc.stdin.close()

    def wait(self) -> None:
        self._reap()
        self._log.close()


class Progress:
    """Progress lines on stderr, with the elapsed time."""

    def __init__(self, stream: IO[str], label: str) -> None:
        self.stream, self.label, self.t0 = stream, label, time.perf_counter()

    def __call__(self, text: str) -> None:
        elapsed = time.perf_counter() - self.t0
        self.stream.write(f"[{self.label} {elapsed:6.1f}s] {text}\n")
        self.stream.flush()


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f}ms" if seconds >= 0.01 else f"{seconds * 1e3:.2f}ms"


def serve(make_worker: Callable[[], Any], *, exit_hard_on_error: bool) -> int:
    """The worker side: answers ``setup``, ``run`` and ``finish`` commands until stdin ends.

    ``make_worker()`` builds the object whose ``setup(msg)``, ``run(steps)`` and
    ``finish()`` answer them; if it fails, every command is answered with
    ``init_failed``. After ``finish`` the process exits at once, skipping interpreter
    and runtime teardown (seconds for torch_xla): nothing needs cleaning up and the
    parent waits for every worker to exit. ``exit_hard_on_error`` ends the process
    right after an error reply too (ranks: peers blocked in a collective then fail at
    the group's timeout); otherwise the worker returns 1.
    """
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # the worker's own prints go to stderr, the log

    def reply(obj: dict[str, Any]) -> None:
        proto.write(json.dumps(obj) + "\n")
        proto.flush()

    worker: Any = None
    init_error: str | None = None
    try:
        worker = make_worker()
    except Exception:
        init_error = traceback.format_exc()
    for line in sys.stdin:
        msg = json.loads(line)
        if worker is None:
            reply({"ok": False, "init_failed": True, "error": init_error})
            return 1
        try:
            if msg["cmd"] == "setup":
                reply({"ok": True, **worker.setup(msg)})
            elif msg["cmd"] == "run":
                reply({"ok": True, **worker.run(msg["steps"])})
            elif msg["cmd"] == "finish":
                reply({"ok": True, **worker.finish()})
                sys.stderr.flush()
                os._exit(0)
            else:
                raise ValueError(f"unknown command {msg['cmd']!r}")
        except Exception:
            traceback.print_exc()
            reply({"ok": False, "error": traceback.format_exc()})
            if exit_hard_on_error:
                sys.stderr.flush()
                os._exit(1)
            return 1
    return 0

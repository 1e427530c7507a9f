"""Worker processes driven over a pipe, for the benchmarks that isolate modes in processes.

Each worker is a process of its own (its own memory, allocator caches, XLA graph cache and
metrics), forked from a server process that has already imported the heavy modules
(``preload``): starting one costs milliseconds instead of the seconds that importing torch
and torch_xla again would take. The parent sends one command (a dict) at a time and reads
exactly one reply, ``{"ok": True, ...}`` or ``{"ok": False, "error": ...}``. The worker's
own prints, and those of every library it uses, go to its log file. Every read is bounded by
a timeout, so a stuck or dead worker is an error, not a hang.

The worker side is ``serve``: it builds the worker object and answers ``setup``, ``run``
and ``finish`` with its methods of the same names.

This module imports neither torch nor anything heavy: the parents stay light.
"""

from __future__ import annotations

import importlib
import multiprocessing
import multiprocessing.connection
import os
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from multiprocessing import forkserver
from pathlib import Path
from typing import IO, Any

_preloaded: tuple[str, ...] | None = None


class WorkerError(RuntimeError):
    pass


def preload(modules: Sequence[str]) -> None:
    """Fork the workers started from now on from a server that has imported ``modules``.

    A server whose modules differ is stopped first, so that, e.g., the cpu workers of a run
    never carry torch_xla while its xla workers start with it imported. Call it only when no
    worker is starting. Where the server cannot be restarted (``_stop`` is private to
    multiprocessing), the old one stays: workers then import what it lacks themselves,
    which is slower but measures the same.
    """
    global _preloaded
    wanted = tuple(modules)
    if wanted == _preloaded:
        return
    if _preloaded is not None:
        stop = getattr(forkserver._forkserver, "_stop", None)
        if stop is None:
            return
        stop()
    forkserver.set_forkserver_preload(list(wanted))
    _preloaded = wanted


def shutdown() -> None:
    """Stop the preloaded server, if it can be stopped (exiting the parent stops it too).

    Stopping waits for it, so its CPU time and its workers' count as the parent's children's.
    """
    global _preloaded
    stop = getattr(forkserver._forkserver, "_stop", None)
    if _preloaded is not None and stop is not None:
        stop()
        _preloaded = None


class WorkerProcess:
    """One worker process and its pipe. ``name`` prefixes its error messages.

    Args:
        factory: ``"module:callable"``; the worker calls it with ``args`` to build the object
            that answers the commands (imported there, never in the parent).
        args: plain values for ``factory``.
        log: file that receives the worker's stdout and stderr.
        timeout: seconds to wait for each reply.
        name: how errors name the worker.
        exit_hard_on_error: end the worker right after an error reply (ranks: peers blocked
            in a collective then fail at the group's timeout instead of waiting for it).

    Raises:
        WorkerError: the process could not be started.
    """

    def __init__(
        self,
        factory: str,
        args: tuple[Any, ...],
        log: Path,
        timeout: float,
        *,
        name: str = "worker",
        exit_hard_on_error: bool = False,
    ) -> None:
        self.name, self.timeout, self.log_path = name, timeout, log
        # Set when the worker reports that it could not even start (e.g. no device).
        self.init_failed = False
        ctx = multiprocessing.get_context("forkserver")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=_child_main,
            args=(child, str(log), factory, args, exit_hard_on_error),
            name=f"bench {name}",
        )
        try:
            self.proc.start()
        except Exception as e:
            raise WorkerError(f"{name} could not start: {e}") from e
        finally:
            child.close()  # the worker holds the only copy: its exit ends our reads

    def send(self, msg: dict[str, Any]) -> None:
        try:
            self.conn.send(msg)
        except OSError:  # BrokenPipeError and friends: the worker is gone
            raise WorkerError(self._died("exited early")) from None

    def recv(self) -> dict[str, Any]:
        if not self.conn.poll(self.timeout):
            self.kill()
            raise WorkerError(self._died(f"no reply in {self.timeout:.0f} s"))
        try:
            reply: dict[str, Any] = self.conn.recv()
        except (EOFError, OSError):
            raise WorkerError(self._died("exited early")) from None
        if not reply.pop("ok"):
            self.init_failed = bool(reply.get("init_failed"))
            error = str(reply.get("error")).strip().splitlines()[-1]
            raise WorkerError(error if self.name == "worker" else f"{self.name}: {error}")
        return reply

    def call(self, msg: dict[str, Any]) -> dict[str, Any]:
        self.send(msg)
        return self.recv()

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()

    def _died(self, what: str) -> str:
        self._reap()
        try:
            tail = self.log_path.read_text().strip().splitlines()[-3:]
        except OSError:
            tail = []
        return f"{self.name} {what} (exit {self.proc.exitcode}): " + " | ".join(tail)

    def _reap(self) -> None:
        self.proc.join(timeout=30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()

    def close(self) -> None:
        """Close the pipe; the worker exits when it sees the end. See also ``wait``."""
        self.conn.close()

    def wait(self) -> None:
        self._reap()


def ready(workers: Sequence[WorkerProcess], timeout: float) -> list[WorkerProcess]:
    """The workers among ``workers`` with a reply waiting (or dead), within ``timeout``."""
    by_conn = {id(w.conn): w for w in workers}
    return [
        by_conn[id(c)] for c in multiprocessing.connection.wait([w.conn for w in workers], timeout)
    ]


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


def _child_main(
    conn: multiprocessing.connection.Connection,
    log: str,
    factory: str,
    args: tuple[Any, ...],
    exit_hard_on_error: bool,
) -> None:
    """The worker process: points stdout and stderr at the log, then serves the pipe."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    module, _, attr = factory.partition(":")

    def make() -> Any:
        return getattr(importlib.import_module(module), attr)(*args)

    code = serve(conn, make, exit_hard_on_error=exit_hard_on_error)
    _exit(code)


def _exit(code: int) -> None:
    # Skip interpreter and runtime teardown (seconds for torch_xla): nothing needs cleaning
    # up, and the parent waits for every worker to exit.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def serve(
    conn: multiprocessing.connection.Connection,
    make_worker: Callable[[], Any],
    *,
    exit_hard_on_error: bool,
) -> int:
    """The worker side: answers ``setup``, ``run`` and ``finish`` until the pipe closes.

    ``make_worker()`` builds the object whose ``setup(msg)``, ``run(steps)`` and
    ``finish()`` answer them; if it fails, the first command is answered with
    ``init_failed``. After ``finish`` the process exits at once. ``exit_hard_on_error``
    ends the process right after an error reply too; otherwise ``serve`` returns 1.
    """

    def reply(obj: dict[str, Any]) -> None:
        conn.send(obj)

    worker: Any = None
    init_error: str | None = None
    try:
        worker = make_worker()
    except Exception:
        init_error = traceback.format_exc()
        traceback.print_exc()
    while True:
        try:
            msg = conn.recv()
        except EOFError:  # the parent closed the pipe (or died)
            return 0
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
                _exit(0)
            else:
                raise ValueError(f"unknown command {msg['cmd']!r}")
        except Exception:
            traceback.print_exc()
            reply({"ok": False, "error": traceback.format_exc()})
            if exit_hard_on_error:
                _exit(1)
            return 1

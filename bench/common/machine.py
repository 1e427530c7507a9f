"""Facts about the machine and this process, read without importing torch."""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import platform
import re
import subprocess
from pathlib import Path
from typing import Any

PACKAGES = ("torch", "torch_xla", "mpfunc")


def status_kib(field: str) -> int | None:
    """A ``kB`` field of ``/proc/self/status`` (``VmRSS``, ``VmHWM``), or None off Linux."""
    try:
        with open("/proc/self/status") as f:
            match = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.MULTILINE)
    except OSError:
        return None
    return int(match.group(1)) if match else None


def usable_cores() -> int:
    """Cores this process may run on (its affinity), or the machine's count off Linux."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def load_avg() -> float | None:
    """The 1-minute load average: other work on the machine skews every timing."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def machine_info() -> dict[str, Any]:
    """CPU model, core counts, memory, L3 cache size and OS."""
    info: dict[str, Any] = {
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "usable_cores": usable_cores(),
        "memory_gib": None,
        "l3_cache": None,
        "platform": platform.platform(),
    }
    with contextlib.suppress(OSError):
        names = re.findall(
            r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.MULTILINE
        )
        if names:
            info["cpu"] = names[0].strip()
    with contextlib.suppress(OSError):
        kib = re.search(r"^MemTotal:\s+(\d+) kB", Path("/proc/meminfo").read_text(), re.MULTILINE)
        if kib:
            info["memory_gib"] = round(int(kib.group(1)) / 2**20, 1)
    with contextlib.suppress(OSError):
        l3 = Path("/sys/devices/system/cpu/cpu0/cache/index3/size").read_text().strip()
        info["l3_cache"] = l3 or None
    return info


def versions() -> dict[str, str | None]:
    """Python and the installed torch, torch_xla and mpfunc (None: not installed)."""
    out: dict[str, str | None] = {"python": platform.python_version()}
    for package in PACKAGES:
        try:
            out[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            out[package] = None
    return out


def git_state(repo: Path) -> dict[str, Any]:
    """The checked-out commit and whether tracked files differ from it (None: unknown)."""

    def git(*args: str) -> str | None:
        try:
            # --no-optional-locks: a status must not rewrite the index under other work.
            done = subprocess.run(
                ["git", "--no-optional-locks", *args],
                cwd=repo,
                capture_output=True,
                text=True,
                timeout=30,
            )
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no") if commit else None
    return {"commit": commit, "dirty": None if status is None else bool(status)}

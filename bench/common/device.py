"""The ``Device`` helper: a device to time on, how to wait for it, its counters and memory."""

from __future__ import annotations

import contextlib
import os
import resource
from collections.abc import Iterator
from typing import Any

import torch

from bench.common.machine import status_kib

KINDS = ("cpu", "xla", "cuda")


class Device:
    """What a benchmark needs from a device: syncs, XLA counters and a peak-memory gauge.

    Args:
        kind: ``"cpu"``, ``"xla"`` or ``"cuda"``.

    Raises:
        ValueError: an unknown kind.
        RuntimeError, ImportError: the device cannot be opened here.
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.hw = kind  # XLA: the hardware behind it (CPU, TPU, CUDA)
        self.name = kind  # for the reader: the CUDA card's name, XLA's hardware
        if kind == "xla":
            import torch_xla
            import torch_xla.core.xla_model as xm
            import torch_xla.debug.metrics as met

            self._xla, self._xm, self._met = torch_xla, xm, met
            self.device = torch_xla.device()
            self.hw = self.name = str(xm.xla_device_hw(self.device))
        elif kind == "cuda":
            if not torch.cuda.is_available():
                raise RuntimeError("no CUDA device is available")
            self.device = torch.device("cuda")
            torch.cuda.init()
            self.name = torch.cuda.get_device_name()
        elif kind == "cpu":
            self.device = torch.device("cpu")
        else:
            raise ValueError(f"unknown device {kind!r}; expected one of {', '.join(KINDS)}")
        self.baseline_rss = (status_kib("VmRSS") or 0) * 1024
        self.memory_kind = self._memory_kind()

    def end_step(self) -> None:
        """End a traced step: on XLA, cut the graph and launch it (without waiting)."""
        if self.kind == "xla":
            self._xla.sync()

    def wait(self) -> None:
        """Wait until the device has finished all work launched so far."""
        if self.kind == "xla":
            self._xm.wait_device_ops()
        elif self.kind == "cuda":
            torch.cuda.synchronize()

    def sync(self) -> None:
        """``end_step`` then ``wait``: the work asked for so far is done when it returns."""
        if self.kind == "xla":
            self._xla.sync(wait=True)
        else:
            self.wait()

    def counters(self) -> dict[str, int]:
        """XLA compiles, graph executions and device-to-host transfers so far ({} off XLA)."""
        if self.kind != "xla":
            return {}

        def calls(name: str) -> int:
            data = self._met.metric_data(name)
            return 0 if data is None else int(data[0])

        return {
            "compiles": calls("CompileTime"),
            "executions": calls("ExecuteTime"),
            "transfers_to_host": calls("TransferFromDeviceTime"),
        }

    def compiles(self) -> int | None:
        """XLA graph compilations so far; None off XLA."""
        return self.counters()["compiles"] if self.kind == "xla" else None

    # Peak memory. CUDA: the caching allocator's max_memory_allocated. XLA on TPU/GPU: the
    # runtime's peak_bytes_used. CPU: the caller measures peak tensor bytes itself (see
    # bench.seed.worker). XLA:CPU exposes no allocator statistics ("GetAllocatorStats is
    # not supported") and keeps its buffers in process memory, so there we use the
    # resident-set high-water mark (VmHWM), reset by writing "5" to /proc/self/clear_refs:
    # unlike ru_maxrss it excludes imports, model building and compilation before the
    # reset; we report it above the RSS the process had when the Device was made.
    def _memory_kind(self) -> str:
        if self.kind == "cuda":
            return "max_memory_allocated"
        if self.kind == "cpu":
            return "peak tensor bytes (profiler)"
        if self.hw != "CPU":
            return "xla peak_bytes_used"
        return "peak RSS over baseline (VmHWM)" if _can_reset_rss() else "peak RSS (ru_maxrss)"

    def reset_peak(self) -> None:
        """Restart the peak gauges (CUDA allocator, VmHWM) from the current usage."""
        if self.kind == "cuda":
            torch.cuda.reset_peak_memory_stats()
        if _can_reset_rss():
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")

    def rss_peak_bytes(self) -> int:
        """Peak RSS since ``reset_peak``, or over the process's life where it cannot be reset."""
        if _can_reset_rss():
            return (status_kib("VmHWM") or 0) * 1024
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def allocator_peak_bytes(self) -> int | None:
        """The allocator's peak bytes on CUDA and on XLA's TPU/GPU; None elsewhere."""
        if self.memory_kind == "max_memory_allocated":
            return int(torch.cuda.max_memory_allocated())
        if self.memory_kind == "xla peak_bytes_used":
            info: dict[str, Any] = dict(self._xm.get_memory_info(self.device))
            return int(info.get("peak_bytes_used", 0))
        return None


def _can_reset_rss() -> bool:
    return status_kib("VmHWM") is not None and os.access("/proc/self/clear_refs", os.W_OK)


@contextlib.contextmanager
def torch_threads(n: int | None) -> Iterator[int]:
    """Run the block with ``n`` torch intra-op threads (None: torch's own), then restore.

    Yields the thread count in effect.
    """
    before = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(before)

"""One seed-benchmark mode on one device, in its own process, driven over a pipe.

Run by ``bench.seed`` as ``python -m bench._seed_worker --device D --mode M``. Commands
arrive one JSON object per line on stdin and each gets exactly one JSON line back:

- ``{"cmd": "setup", "config": {...}, "warmup": W, ...}``: build the mode, run the W
  warm-up steps, reset the peak-memory gauge;
- ``{"cmd": "run", "steps": K}``: time K steps (one block);
- ``{"cmd": "finish"}``: report peak memory and exit.

The replies use a private copy of the original stdout; fd 1 is pointed at stderr so that
anything a library prints cannot corrupt the protocol. If the device cannot be opened, the
first reply says so with ``"init_failed": true``.
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import resource
import sys
import time
import warnings
from typing import Any, Callable

import torch

from bench._procs import serve
from bench._seed_model import ModelConfig, make_step


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            match = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.MULTILINE)
    except OSError:
        return None
    return int(match.group(1)) if match else None


class Device:
    """What the worker needs from a device: sync, counters, and a peak-memory gauge."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.hw = kind
        self.name = kind
        if kind == "xla":
            import torch_xla
            import torch_xla.core.xla_model as xm
            import torch_xla.debug.metrics as met

            self._xla, self._xm, self._met = torch_xla, xm, met
            self.device = torch_xla.device()
            self.hw = self.name = str(xm.xla_device_hw(self.device))
        elif kind == "cuda":
            self.device = torch.device("cuda")
            torch.cuda.init()
            self.name = torch.cuda.get_device_name()
        elif kind == "cpu":
            self.device = torch.device("cpu")
        else:
            raise ValueError(f"unknown device {kind!r}; expected cpu, xla or cuda")
        self.baseline_rss = (_status_kib("VmRSS") or 0) * 1024
        self.memory_kind = self._memory_kind()

    def end_step(self) -> None:
        if self.kind == "xla":
            self._xla.sync()

    def wait(self) -> None:
        if self.kind == "xla":
            self._xm.wait_device_ops()
        elif self.kind == "cuda":
            torch.cuda.synchronize()

    def counters(self) -> dict[str, int]:
        """XLA compiles, graph executions and device-to-host transfers so far."""
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

    # Peak memory, in the table: CUDA: the caching allocator's max_memory_allocated. XLA on
    # TPU/GPU: the runtime's peak_bytes_used. CPU: peak tensor bytes, measured over one extra
    # step after the timed blocks (see `_cpu_tensor_peak`). XLA:CPU exposes no allocator
    # statistics ("GetAllocatorStats is not supported") and keeps its buffers in process
    # memory, so there we use the resident-set high-water mark (VmHWM), reset after warm-up
    # by writing "5" to /proc/self/clear_refs: unlike ru_maxrss it excludes imports, model
    # building and XLA compilation, and covers exactly the measured steps; we report it
    # above the RSS the process had before building the model. The RSS figures are in the
    # JSON for every device.
    def _memory_kind(self) -> str:
        if self.kind == "cuda":
            return "max_memory_allocated"
        if self.kind == "cpu":
            return "peak tensor bytes (profiler)"
        if self.hw != "CPU":
            return "xla peak_bytes_used"
        return "peak RSS over baseline (VmHWM)" if self._can_reset_rss() else "peak RSS (ru_maxrss)"

    @staticmethod
    def _can_reset_rss() -> bool:
        return _status_kib("VmHWM") is not None and os.access("/proc/self/clear_refs", os.W_OK)

    def reset_peak(self) -> None:
        if self.kind == "cuda":
            torch.cuda.reset_peak_memory_stats()
        if self._can_reset_rss():
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")

    def rss_peak_bytes(self) -> int:
        """Peak RSS since reset_peak, or over the process's life where it cannot be reset."""
        if self._can_reset_rss():
            return (_status_kib("VmHWM") or 0) * 1024
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _live_cpu_tensor_bytes() -> int:
    """Bytes of every cpu tensor storage alive now (views counted once)."""
    storages: dict[int, int] = {}
    with warnings.catch_warnings():
        # isinstance() on every live object pokes at deprecated module attributes.
        warnings.simplefilter("ignore")
        tensors = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
    for obj in tensors:
        if obj.device.type == "cpu":
            try:
                storage = obj.untyped_storage()
            except (RuntimeError, NotImplementedError):
                continue
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _cpu_tensor_peak(step: Callable[[], torch.Tensor]) -> int:
    """Peak bytes of live cpu tensors during one step: what the step really needs.

    The RSS of an eager CPU process also holds whatever glibc's malloc keeps cached after
    frees, which depends on the order of past allocations more than on the mode. So we
    count tensors: the storages alive when the step starts, plus the highest running total
    of the allocations and frees the profiler records during the step. Two steps are
    profiled and the second is measured, so that every free in it has a recorded allocation.
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
        gc.collect()
        live = _live_cpu_tensor_bytes()
        with torch.profiler.record_function("seed:measured-step"):
            step()
    events = prof.profiler.kineto_results.events()  # type: ignore[union-attr]
    marker = next(e for e in events if e.name() == "seed:measured-step")
    memory = sorted(
        (e.start_ns(), e.nbytes())
        for e in events
        if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU
    )
    total = peak = 0
    for t, nbytes in memory:
        if t >= marker.start_ns():
            total += nbytes
            peak = max(peak, total)
    return live + peak


class Worker:
    def __init__(self, device: Device, mode: str) -> None:
        self.dev = device
        self.mode = mode
        self.step: Callable[[], torch.Tensor] | None = None

    def _steps(self, n: int) -> tuple[list[float], torch.Tensor]:
        assert self.step is not None
        host: list[float] = []
        loss = torch.zeros(())
        for _ in range(n):
            t = time.perf_counter()
            loss = self.step()
            self.dev.end_step()
            host.append(time.perf_counter() - t)
        return host, loss

    def setup(self, msg: dict[str, Any]) -> dict[str, Any]:
        t0 = time.perf_counter()
        cfg = ModelConfig(**msg["config"])
        self.step, optimizer = make_step(
            self.mode,
            cfg,
            self.dev.device,
            torch_optim=msg.get("torch_optim", "default"),
            seed=msg.get("seed", 0),
        )
        self.dev.end_step()
        self.dev.wait()
        build_s = time.perf_counter() - t0
        warm_s, warm_compiles = [], []
        loss = torch.zeros(())
        for _ in range(msg["warmup"]):
            c0 = self.dev.counters()
            t = time.perf_counter()
            _, loss = self._steps(1)
            self.dev.wait()
            warm_s.append(time.perf_counter() - t)
            warm_compiles.append(self.dev.counters().get("compiles", 0) - c0.get("compiles", 0))
        warm_loss = float(loss)
        gc.collect()
        self.dev.reset_peak()
        return {
            "build_s": build_s,
            "warmup_s": warm_s,
            "warmup_compiles": warm_compiles,
            "warmup_loss": warm_loss,
            "optimizer": optimizer,
            "hw": self.dev.hw,
            "device_name": self.dev.name,
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
        }

    def run(self, steps: int) -> dict[str, Any]:
        self.dev.wait()
        c0 = self.dev.counters()
        t0 = time.perf_counter()
        host, loss = self._steps(steps)
        self.dev.wait()
        seconds = time.perf_counter() - t0
        c1 = self.dev.counters()
        # Read the loss only after the counters, so its transfer is not counted.
        return {
            "step_s": seconds / steps,
            "host_s": host,
            "counters": {k: c1[k] - c0[k] for k in c1},
            "loss": float(loss),
        }

    def finish(self) -> dict[str, Any]:
        self.dev.wait()
        rss_peak = self.dev.rss_peak_bytes()
        mem: dict[str, Any] = {
            "memory_kind": self.dev.memory_kind,
            "rss_peak_bytes": rss_peak,
            "rss_baseline_bytes": self.dev.baseline_rss,
            "rss_peak_life_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        }
        kind = self.dev.memory_kind
        if kind == "max_memory_allocated":
            mem["peak_bytes"] = int(torch.cuda.max_memory_allocated())
        elif kind == "xla peak_bytes_used":
            info: dict[str, Any] = dict(self.dev._xm.get_memory_info(self.dev.device))
            mem["peak_bytes"] = int(info.get("peak_bytes_used", 0))
        elif kind == "peak tensor bytes (profiler)":
            assert self.step is not None
            mem["peak_bytes"] = _cpu_tensor_peak(self.step)
        else:
            mem["peak_bytes"] = rss_peak - self.dev.baseline_rss
        return mem


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench._seed_worker")
    parser.add_argument("--device", required=True)
    parser.add_argument("--mode", required=True)
    args = parser.parse_args(argv)

    return serve(lambda: Worker(Device(args.device), args.mode), exit_hard_on_error=False)


if __name__ == "__main__":
    sys.exit(main())

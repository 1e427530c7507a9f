"""One seed-benchmark mode on one device, in its own process, driven over a pipe.

``bench.seed`` starts it through ``bench.common.procs`` as ``Worker(device, mode)`` and
sends it commands, one reply each:

- ``{"cmd": "setup", "config": {...}, "warmup": W, ...}``: build the mode, run the W
  warm-up steps, reset the peak-memory gauge (or answer ``{"unsupported": why}`` when the
  mode's library or option is not installed here);
- ``{"cmd": "run", "steps": K}``: time K steps (one block);
- ``{"cmd": "finish"}``: report peak memory, the bytes the mode keeps between steps and,
  on cpu and cuda, its measured peak with activations apart (``bench.common.memory``),
  and exit.

If the device cannot be opened, the first reply says so with ``"init_failed": true``.

Each step is timed in two parts: *trace*, from the step's start until just before it is
ended (``torch_xla.sync()`` on XLA: the Python work of building the lazy graph, which on
a real TPU is most of a host-bound step), and *sync*, the ``end_step`` call itself (on
XLA: lowering, hashing and launching the graph). Within the trace, *update* is the
optimizer's part (``steps.UPDATE``: after backward, to the params written back). The
block's time, device synced at both ends, gives the step time; whatever of it is not
trace is the execute time.
"""

from __future__ import annotations

import gc
import resource
import time
import warnings
from collections.abc import Callable
from typing import Any

# torch.optim imports torch._dynamo (about 900 modules) when it builds its first optimizer;
# importing it here makes the preloaded server pay that once for every worker.
import torch
import torch._dynamo

from bench.common.device import Device
from bench.common.memory import measure_step, persistent_bytes
from bench.common.model_config import ModelConfig
from bench.seed.steps import UPDATE, Mode, Unsupported, make_step


def _live_cpu_tensor_bytes() -> int:
    """Bytes of every cpu tensor storage alive now (views counted once)."""
    storages: dict[int, int] = {}
    with warnings.catch_warnings():
        # isinstance() on every live object pokes at deprecated module attributes.
        warnings.simplefilter("ignore")
        tensors = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
    for obj in tensors:
        if obj.device.type == "cpu":
            try:  # fake tensors (torch.compile's, kept by a compiled peer) have no data
                storage = obj.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
            except (RuntimeError, NotImplementedError):
                continue
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
    """Answers the parent's commands for one mode on one device."""

    def __init__(self, device: str, mode: str) -> None:
        self.dev = Device(device)
        self.mode = mode
        self.step: Callable[[], torch.Tensor] | None = None
        self.built: Mode | None = None

    def _steps(self, n: int) -> tuple[list[float], list[float], list[float], torch.Tensor]:
        """Runs ``n`` steps; returns each one's trace, update and sync seconds (the update:
        the host time of its optimizer part, ``steps.UPDATE``), and the last loss."""
        assert self.step is not None
        trace: list[float] = []
        update: list[float] = []
        sync: list[float] = []
        loss = torch.zeros(())
        for _ in range(n):
            t0 = time.perf_counter()
            loss = self.step()
            t1 = time.perf_counter()
            self.dev.end_step()
            sync.append(time.perf_counter() - t1)
            trace.append(t1 - t0)
            update.append(UPDATE.seconds)
        return trace, update, sync, loss

    def setup(self, msg: dict[str, Any]) -> dict[str, Any]:
        t0 = time.perf_counter()
        cfg = ModelConfig(**msg["config"])
        try:
            self.built = make_step(
                self.mode,
                cfg,
                self.dev.device,
                torch_optim=msg.get("torch_optim", "default"),
                seed=msg.get("seed", 0),
            )
        except Unsupported as e:
            return {"unsupported": str(e)}
        self.step, optimizer = self.built.step, self.built.optimizer
        self.dev.end_step()
        self.dev.wait()
        build_s = time.perf_counter() - t0
        warm_s, warm_compiles = [], []
        loss = torch.zeros(())
        for _ in range(msg["warmup"]):
            c0 = self.dev.counters()
            t = time.perf_counter()
            _, _, _, loss = self._steps(1)
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
        trace, update, sync, loss = self._steps(steps)
        self.dev.wait()
        seconds = time.perf_counter() - t0
        c1 = self.dev.counters()
        # Read the loss only after the counters, so its transfer is not counted.
        return {
            "step_s": seconds / steps,
            "trace_s": trace,
            "update_s": update,
            "sync_s": sync,
            "host_s": [a + b for a, b in zip(trace, sync)],
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
        allocator = self.dev.allocator_peak_bytes()
        if allocator is not None:
            mem["peak_bytes"] = allocator
        elif self.dev.memory_kind == "peak tensor bytes (profiler)":
            assert self.step is not None
            mem["peak_bytes"] = _cpu_tensor_peak(self.step)
        else:
            mem["peak_bytes"] = rss_peak - self.dev.baseline_rss
        # Bytes per param: kept between steps, and the step's peak with activations apart.
        assert self.built is not None
        n = sum(p.numel() for p in self.built.params)
        mem["params"] = n
        mem["persistent_bytes"] = persistent_bytes(*self.built.held())
        if self.dev.kind in ("cpu", "cuda"):
            step = measure_step(self.built.step, self.built.held(), self.dev.kind)
            mem["step"] = step._asdict()
            mem["persistent_bytes"] = step.persistent
        return mem

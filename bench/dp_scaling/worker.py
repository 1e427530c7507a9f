"""One rank of one dp_scaling mode, in its own process, driven over a pipe.

``bench.dp_scaling`` starts it through ``bench.common.procs`` as ``Rank(mode, rank, world,
store, threads)`` and sends it commands, one reply each:

- ``{"cmd": "setup", "config": {...}, "warmup": N, ...}``: join the gloo group through
  the file store, build the model and the mode, run N warm-up steps;
- ``{"cmd": "run", "steps": K}``: a barrier, then K timed and counted steps (one block);
- ``{"cmd": "finish"}``: report memory and exit.

The modes are those of ``bench.dp_scaling.config``; the per-tensor baseline lives here,
never in mpfunc.

Measurement. ``CollectiveCounter`` wraps ``torch.distributed``'s collectives in this
process, so every call that mpfunc or the baseline makes during a block is counted with
the bytes of the tensor the rank hands over. Bytes really sent are the growth of
``wchar`` in ``/proc/self/io`` over the block: gloo writes its messages to TCP sockets
with ``write``/``writev``, which the kernel counts there (nothing else writes during a
block).
"""

from __future__ import annotations

import datetime
import functools
import resource
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import mpfunc
from bench.common.machine import status_kib
from bench.common.model import Model, fp32_loss
from bench.common.model_config import ModelConfig
from bench.dp_scaling.config import BETAS, EPS, LR, MODES, WEIGHT_DECAY

# Collectives counted, and where each takes the tensor this rank hands over:
# (positional index, keyword name).
COLLECTIVES = {
    "all_reduce": (0, "tensor"),
    "broadcast": (0, "tensor"),
    "reduce": (0, "tensor"),
    "all_gather": (1, "tensor"),
    "all_gather_into_tensor": (1, "input_tensor"),
    "reduce_scatter_tensor": (1, "input"),
    "all_to_all_single": (1, "input"),
}


def _io() -> dict[str, int] | None:
    """This process's I/O counters (all threads), or None where /proc has none."""
    try:
        with open("/proc/self/io") as f:
            return {k: int(v) for k, v in (line.split(": ") for line in f.read().splitlines())}
    except (OSError, ValueError):
        return None


def _nbytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(o) for o in obj)
    return 0


class CollectiveCounter:
    """Counts the calls and payload bytes of torch.distributed's collectives while active.

    The wrappers replace the module's attributes, which is what mpfunc (``_dist()`` returns
    the module) and the baseline look up at every call.
    """

    def __init__(self) -> None:
        self.active = False
        self.calls: dict[str, int] = {}
        self.bytes: dict[str, int] = {}
        for name, where in COLLECTIVES.items():
            original = getattr(dist, name, None)
            if original is not None:
                setattr(dist, name, self._wrap(name, where, original))

    def _wrap(
        self, name: str, where: tuple[int, str], original: Callable[..., Any]
    ) -> Callable[..., Any]:
        pos, key = where

        @functools.wraps(original)
        def counted(*args: Any, **kwargs: Any) -> Any:
            if self.active:
                tensor = args[pos] if len(args) > pos else kwargs.get(key)
                self.calls[name] = self.calls.get(name, 0) + 1
                self.bytes[name] = self.bytes.get(name, 0) + _nbytes(tensor)
            return original(*args, **kwargs)

        return counted

    def start(self) -> None:
        self.calls, self.bytes, self.active = {}, {}, True

    def stop(self) -> tuple[dict[str, int], dict[str, int]]:
        self.active = False
        return dict(self.calls), dict(self.bytes)


class Rank:
    """Answers the parent's commands for one rank of one mode.

    ``threads`` sets torch's intra-op threads (and one inter-op thread) before anything
    runs: the workers fork from a server that has imported torch, so a per-rank
    ``OMP_NUM_THREADS`` would come too late.
    """

    def __init__(self, mode: str, rank: int, world: int, store: str, threads: int) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; expected one of {', '.join(MODES)}")
        torch.set_num_threads(threads)
        torch.set_num_interop_threads(1)
        self.mode, self.rank, self.world, self.store = mode, rank, world, store
        self.counter = CollectiveCounter()
        self.step: Callable[[], torch.Tensor] | None = None
        self.tree: dict[str, Any] = {}
        self.baseline_rss = 0

    def setup(self, msg: dict[str, Any]) -> dict[str, Any]:
        t0 = time.perf_counter()
        dist.init_process_group(
            "gloo",
            init_method=f"file://{self.store}",
            rank=self.rank,
            world_size=self.world,
            timeout=datetime.timedelta(seconds=msg["timeout"]),
        )
        join_s = time.perf_counter() - t0
        self.baseline_rss = (status_kib("VmRSS") or 0) * 1024
        cfg = ModelConfig(**msg["config"])
        if cfg.batch % self.world:
            raise ValueError(f"global batch {cfg.batch} does not split over {self.world} ranks")
        torch.manual_seed(msg["seed"])
        model = Model(cfg).to(torch.bfloat16)  # same initial weights on every rank
        model.train()
        # One fixed global batch, so the loss must fall; each rank trains on its slice.
        gen = torch.Generator().manual_seed(msg["seed"] + 1)
        tokens = torch.randint(cfg.vocab, (cfg.batch, cfg.seq), generator=gen)
        targets = torch.randint(cfg.vocab, (cfg.batch, cfg.seq), generator=gen)
        per = cfg.batch // self.world
        tokens, targets = (t[self.rank * per : (self.rank + 1) * per] for t in (tokens, targets))
        params = dict(model.named_parameters())
        mpfunc.verify_replicas(params)
        reduce_dtype = {"fp32": torch.float32, "bf16": None}[msg["reduce_dtype"]]
        self.step, owned = self._make_step(
            model, params, tokens, targets, reduce_dtype, msg["bucket_bytes"]
        )
        build_s = time.perf_counter() - t0 - join_s
        warm_s = []
        loss = torch.zeros(())
        for _ in range(msg["warmup"]):
            t = time.perf_counter()
            loss = self.step()
            warm_s.append(time.perf_counter() - t)
        return {
            "join_s": join_s,
            "build_s": build_s,
            "warmup_s": warm_s,
            "warmup_loss": float(loss),
            "threads": torch.get_num_threads(),
            "tensors": len(params),
            "parameters": sum(p.numel() for p in params.values()),
            "owned_tensors": owned,
        }

    def _make_step(
        self,
        model: torch.nn.Module,
        params: dict[str, torch.Tensor],
        tokens: torch.Tensor,
        targets: torch.Tensor,
        reduce_dtype: torch.dtype | None,
        bucket_bytes: int,
    ) -> tuple[Callable[[], torch.Tensor], int]:
        """The mode's training step, and how many leaves this rank keeps masters for."""
        opt = mpfunc.adamw(lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
        world = self.world

        def local_grads() -> tuple[torch.Tensor, dict[str, torch.Tensor | None]]:
            loss = fp32_loss(model(tokens), targets)
            loss.backward()
            return loss.detach(), {n: p.grad for n, p in params.items()}

        def fp32(tree: Any) -> Any:
            # reduce_dtype bf16 returns bf16 grads; the masters take fp32.
            return tree if reduce_dtype == torch.float32 else mpfunc.grads_to_fp32(tree)

        if self.mode == "sharded":
            plan = mpfunc.shard_plan(params, world)
            mine = mpfunc.shard(params, plan, self.rank)  # None where another rank owns it
            masters = mpfunc.init_master(mine)
            state = opt.init(masters)
            self.tree = {"masters": masters, "opt": state}

            def sharded() -> torch.Tensor:
                loss, grads = local_grads()
                # Each grad goes only to its owner: about half an all-reduce's traffic.
                mine_g = mpfunc.reduce_grads_to_owners(
                    grads, plan, reduce_dtype=reduce_dtype, bucket_bytes=bucket_bytes
                )
                g32 = fp32(mine_g)
                mpfunc.apply_update_(masters, g32, state, opt)
                mpfunc.masters_to_model_(masters, mine)
                mpfunc.broadcast_params_(params, plan, bucket_bytes=bucket_bytes)
                model.zero_grad(set_to_none=True)
                return loss

            owned = len(mpfunc.state_dict(masters))
            return sharded, owned

        masters = mpfunc.init_master(params)
        state = opt.init(masters)
        self.tree = {"masters": masters, "opt": state}

        if self.mode == "unsharded":

            def unsharded() -> torch.Tensor:
                loss, grads = local_grads()
                reduced = mpfunc.all_reduce_grads(
                    grads, reduce_dtype=reduce_dtype, bucket_bytes=bucket_bytes
                )
                mpfunc.apply_update_(masters, fp32(reduced), state, opt)
                mpfunc.masters_to_model_(masters, params)
                model.zero_grad(set_to_none=True)
                return loss

            return unsharded, len(params)

        rdtype = reduce_dtype or torch.bfloat16

        def pertensor() -> torch.Tensor:
            # The baseline: one collective per grad tensor, in the same reduce dtype.
            loss, grads = local_grads()
            reduced = {}
            with torch.no_grad():
                for name, g in grads.items():
                    assert g is not None
                    t = g.to(rdtype)  # a new fp32 tensor, or the bf16 grad itself
                    dist.all_reduce(t, op=dist.ReduceOp.SUM)
                    reduced[name] = t.div_(world)
            mpfunc.apply_update_(masters, fp32(reduced), state, opt)
            mpfunc.masters_to_model_(masters, params)
            model.zero_grad(set_to_none=True)
            return loss

        return pertensor, len(params)

    def run(self, steps: int) -> dict[str, Any]:
        assert self.step is not None
        dist.barrier()  # every rank starts the block together; not counted
        io0 = _io()
        self.counter.start()
        times = []
        loss = torch.zeros(())
        t0 = time.perf_counter()
        for _ in range(steps):
            t = time.perf_counter()
            loss = self.step()
            times.append(time.perf_counter() - t)
        block_s = time.perf_counter() - t0
        calls, nbytes = self.counter.stop()
        io1 = _io()
        sent = write_calls = None
        if io0 is not None and io1 is not None:
            sent = io1["wchar"] - io0["wchar"]
            write_calls = io1["syscw"] - io0["syscw"]
        return {
            "block_s": block_s,
            "step_s": times,
            "calls": calls,
            "payload_bytes": nbytes,
            "sent_bytes": sent,
            "write_calls": write_calls,
            "loss": float(loss),
        }

    def finish(self) -> dict[str, Any]:
        sd = mpfunc.state_dict(self.tree)
        return {
            "state_bytes": sum(t.numel() * t.element_size() for t in sd.values()),
            "state_tensors": len(sd),
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "baseline_rss_bytes": self.baseline_rss,
            "rss_bytes": (status_kib("VmRSS") or 0) * 1024,
        }

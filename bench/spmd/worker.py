"""One device count of the spmd benchmark, in its own process (SPMD is process-wide).

``python -m bench.spmd.worker SETUP_JSON OUT_JSON``, started by ``bench.spmd`` with
``PJRT_DEVICE=CPU CPU_NUM_DEVICES=N`` and ``XLA_FLAGS=--xla_dump_to=DIR
--xla_dump_hlo_as_text``. It calls ``torch_xla.runtime.use_spmd()``, builds every mode of
the setup (``bench.spmd.config``) on a 1-D mesh ``data`` over the N devices, warms each up,
then runs ``blocks`` blocks in which every mode takes ``steps`` timed steps in turn
(starting from a different mode each block), and writes one JSON.

Measured per mode:

* step time: ``torch_xla.sync()`` and ``wait_device_ops()`` inside each step's time (the
  graph runs to completion);
* torch_xla's counters over the measured steps: compiles, graph executions, transfers;
* bytes per device of params and of masters+state, from the device buffers
  (``bench.common.spmd.device_bytes``);
* the step graph's collectives: the partitioned program XLA compiled for the step (the
  largest module dumped during the mode's warm-up, ``*after_optimizations.txt``), each
  ``all-reduce``/``all-gather``/``reduce-scatter``/``collective-permute``/``all-to-all``
  with the bytes of its result.
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path
from typing import Any

import torch

import mpfunc
from bench.common import spmd
from bench.common.model import Model, fp32_loss
from bench.common.model_config import ModelConfig
from bench.spmd.config import BETAS, EPS, LR, WEIGHT_DECAY

COLLECTIVE = re.compile(
    r"= (\w+)\[([\d,]*)\][^ ]* (all-reduce|all-gather|reduce-scatter|collective-permute|"
    r"all-to-all)(?:-start)?\("
)
ITEMSIZE = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "s64": 8, "f64": 8, "pred": 1}
COUNTERS = {
    "compiles": "CompileTime",
    "executions": "ExecuteReplicatedTime",
    "to_host": "TransferFromDeviceTime",
    "to_device": "TransferToDeviceTime",
}


def collectives(hlo: str) -> dict[str, dict[str, int]]:
    """Each collective kind in an HLO module's text: how many, and the bytes they yield."""
    out: dict[str, dict[str, int]] = {}
    for dtype, dims, kind in COLLECTIVE.findall(hlo):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        entry = out.setdefault(kind, {"count": 0, "bytes": 0})
        entry["count"] += 1
        entry["bytes"] += n * ITEMSIZE.get(dtype, 4)
    return out


class Mode:
    """One mode's model, masters, state and step, built on ``mesh``."""

    def __init__(self, mode: str, cfg: ModelConfig, seed: int, mesh: Any, device: Any) -> None:
        import torch_xla.distributed.spmd as xs

        torch.manual_seed(seed)
        self.model = Model(cfg).to(torch.bfloat16).to(device)
        self.params = dict(self.model.named_parameters())
        if mode == "fsdp":
            mpfunc.mark_sharding_(self.params, mesh, "data")
        self.masters = mpfunc.init_master(self.params)
        if mode == "zero1":
            mpfunc.mark_sharding_(self.masters, mesh, "data")
        self.opt = mpfunc.adamw(lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
        self.state = self.opt.init(self.masters)
        self.g32 = mpfunc.init_grads(self.masters)
        gen = torch.Generator().manual_seed(seed + 1)
        # One fixed global batch, sharded over the devices: the loss must fall.
        self.tokens = torch.randint(cfg.vocab, (cfg.batch, cfg.seq), generator=gen).to(device)
        self.targets = torch.randint(cfg.vocab, (cfg.batch, cfg.seq), generator=gen).to(device)
        for t in (self.tokens, self.targets):
            xs.mark_sharding(t, mesh, ("data", None))
        self.loss = torch.zeros(())

    def step(self) -> None:
        loss = fp32_loss(self.model(self.tokens), self.targets)
        loss.backward()
        grads = {n: p.grad for n, p in self.params.items()}
        mpfunc.grads_to_fp32_(grads, self.g32)
        mpfunc.apply_update_(self.masters, self.g32, self.state, self.opt)
        mpfunc.masters_to_model_(self.masters, self.params)
        self.model.zero_grad(set_to_none=True)
        self.loss = loss.detach()


def main(argv: list[str]) -> int:
    setup: dict[str, Any] = json.loads(argv[0])
    out = Path(argv[1])
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.debug.metrics as met
    import torch_xla.runtime as xr

    torch.set_num_threads(setup["threads"])
    xr.use_spmd()
    mesh, device = spmd.mesh(), torch_xla.device()
    n = xr.global_runtime_device_count()
    dump = Path(setup["hlo_dir"])

    def sync() -> None:
        torch_xla.sync()
        xm.wait_device_ops()

    def counters() -> dict[str, int]:
        return {k: int((met.metric_data(v) or [0])[0]) for k, v in COUNTERS.items()}

    def modules() -> set[Path]:
        return set(dump.glob("*after_optimizations.txt")) if dump.is_dir() else set()

    cfg = ModelConfig(**setup["config"])
    results: dict[str, dict[str, Any]] = {}
    modes: dict[str, Mode] = {}
    for name in setup["modes"]:
        t0 = time.perf_counter()
        modes[name] = m = Mode(name, cfg, setup["seed"], mesh, device)
        sync()
        before = modules()
        warm = []
        for _ in range(setup["warmup"]):
            t = time.perf_counter()
            m.step()
            sync()
            warm.append(time.perf_counter() - t)
        compiled = sorted(modules() - before, key=lambda p: p.stat().st_size)
        graph = collectives(compiled[-1].read_text()) if compiled else None
        results[name] = {
            "setup_s": time.perf_counter() - t0 - sum(warm),
            "warmup_s": warm,
            "warmup_loss": float(m.loss.cpu()),
            "collectives": graph,
            "step_modules": len(compiled),
            "step_s": [],
            "counts": dict.fromkeys(COUNTERS, 0),
        }
    names = list(modes)
    for b in range(setup["blocks"]):
        for name in names[b % len(names) :] + names[: b % len(names)]:
            m, r = modes[name], results[name]
            c0 = counters()
            for _ in range(setup["steps"]):
                t = time.perf_counter()
                m.step()
                sync()
                r["step_s"].append(time.perf_counter() - t)
            for k, v in counters().items():
                r["counts"][k] += v - c0[k]
    for name, m in modes.items():
        r = results[name]
        r["final_loss"] = float(m.loss.cpu())
        held = mpfunc.state_dict({"masters": m.masters, "opt": m.state})
        r["device_bytes"] = spmd.device_bytes(held.values())
        r["full_bytes"] = spmd.full_bytes(held.values())
        r["param_device_bytes"] = spmd.device_bytes(m.params.values())
        r["param_full_bytes"] = spmd.full_bytes(m.params.values())
        r["specs"] = {k: spmd.spec(v) for k, v in m.masters.items()}
        r["param_specs"] = {k: spmd.spec(v) for k, v in m.params.items()}
    out.write_text(
        json.dumps({"devices": n, "threads": torch.get_num_threads(), "modes": results}, indent=1)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""FSDP2 (``fully_shard``) with mpfunc's fp32 masters for the local shards only.

FSDP2 shards the bf16 model: each parameter is a DTensor whose local shard is
1/world_size of it, all-gathered for forward and backward, and every grad arrives
reduce-scattered, as a DTensor shard. mpfunc's transforms take those DTensors as
they are and work on the local shards: each rank keeps fp32 masters and AdamW state
for its own shard only (ZeRO-3 memory, from the real engine), and rounds them into
its shard of the bf16 params, which FSDP2 gathers at the next forward.

    torchrun --standalone --nproc_per_node 2 examples/fsdp2_train.py
"""

from __future__ import annotations

import argparse
import datetime
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import mpfunc

GLOBAL_BATCH = 16
LR = 3e-3


def make_model() -> nn.Sequential:
    """The same bf16 model on every rank (and in the single-process reference)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(),
                          nn.Linear(64, 10))  # fmt: skip
    return model.to(torch.bfloat16)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s global batch: bf16 inputs, class targets from a fixed teacher."""
    teacher = torch.randn(32, 10, generator=torch.Generator().manual_seed(1))
    x = torch.randn(GLOBAL_BATCH, 32, generator=torch.Generator().manual_seed(1000 + step))
    return x.to(torch.bfloat16), (x @ teacher).argmax(-1)


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(x).float(), y)  # bf16 forward, fp32 loss


def train(steps: int) -> dict[str, Any]:
    """The FSDP2 loop on this rank; returns the full masters and params (gathered)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    model = make_model()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)  # one all-gather per layer
    fully_shard(model, mesh=mesh)

    params = dict(model.named_parameters())  # DTensors: this rank's shards of bf16 params
    masters = mpfunc.init_master(params)  # fp32 DTensors, local shards only
    g32_buf = mpfunc.init_grads(params)  # fp32 grads, shaped like the shards
    opt = mpfunc.adamw(lr=LR, weight_decay=0.01)
    state = opt.init(masters)

    per = GLOBAL_BATCH // world
    losses = []
    for step in range(steps):
        x, y = batch(step)
        loss = loss_fn(model, x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per])
        loss.backward()  # FSDP2 reduce-scatters: each rank gets its shard of the mean grad
        grads = {n: p.grad for n, p in params.items()}
        g32 = mpfunc.grads_to_fp32_(grads, g32_buf)
        mpfunc.apply_update_(masters, g32, state, opt, skip=~mpfunc.all_finite(g32))
        mpfunc.masters_to_model_(masters, params)  # into this rank's bf16 shards
        model.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        if rank == 0 and (step % 10 == 0 or step == steps - 1):
            print(f"step {step:4d} loss {losses[-1]:.4f}", flush=True)

    local = mpfunc.state_dict({"masters": masters, "opt": state})
    local_bytes = sum(t.to_local().nbytes if hasattr(t, "to_local") else t.nbytes
                      for t in local.values())  # fmt: skip
    return {
        "masters": {n: m.full_tensor() for n, m in masters.items()},
        "params": {n: p.detach().full_tensor() for n, p in params.items()},
        "local_shapes": {n: tuple(m.to_local().shape) for n, m in masters.items()},
        "local_bytes": local_bytes,
        "losses": losses,
    }


def reference(steps: int, world: int) -> dict[str, Any]:
    """One process, no FSDP: the same mpfunc loop on the whole model, each step's grad the
    mean of the ``world`` micro-batch grads (what FSDP2's reduce-scatter computes)."""
    model = make_model()
    params = dict(model.named_parameters())
    masters = mpfunc.init_master(params)
    opt = mpfunc.adamw(lr=LR, weight_decay=0.01)
    state = opt.init(masters)
    per = GLOBAL_BATCH // world
    for step in range(steps):
        x, y = batch(step)
        acc = mpfunc.init_grads(params)
        for r in range(world):
            loss_fn(model, x[r * per : (r + 1) * per], y[r * per : (r + 1) * per]).backward()
            mpfunc.accumulate_grads_(acc, {n: p.grad for n, p in params.items()})
            model.zero_grad(set_to_none=True)
        # FSDP2 reduces bf16 grads: the fp32 mean rounded once to bf16.
        grads = {n: (g / world).to(torch.bfloat16) for n, g in acc.items()}
        mpfunc.apply_update_(masters, mpfunc.grads_to_fp32(grads), state, opt)
        mpfunc.masters_to_model_(masters, params)
    return {"masters": masters, "params": {n: p.detach() for n, p in params.items()}}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--out", help="each rank saves its results to OUT.rankN")
    args = ap.parse_args(argv)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    try:
        result = train(args.steps)
        if args.out:
            torch.save(result, f"{args.out}.rank{dist.get_rank()}")
        print(f"rank {dist.get_rank()}: masters+state {result['local_bytes']} bytes", flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

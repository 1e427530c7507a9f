"""Data-parallel mixed-precision training on XLA with SPMD: one process drives every device.

torch_xla's SPMD mode shards tensors over a device mesh and lets XLA's partitioner insert
the collectives; mpfunc's transforms run inside the step's one graph and keep each
tensor's sharding. Three patterns, one ``--mode`` each:

* ``dp``: the batch is sharded over the mesh axis ``data``; params, fp32 masters and AdamW
  state are replicated. The partitioner sums the grads over the batch's shards: no mpfunc
  collective, no ``all_reduce_grads``.
* ``zero1``: as ``dp``, but ``mpfunc.mark_sharding_`` shards the masters (and so the
  state ``opt.init`` makes and the fp32 grad buffers) over ``data``: each device holds
  about 1/n of them, while the bf16 params stay replicated for the forward.
* ``fsdp``: the params are sharded too, and the masters and state inherit it.

On a TPU host (``PJRT_DEVICE=TPU``) it uses the TPU's devices; on a CPU, virtual ones::

    PJRT_DEVICE=CPU CPU_NUM_DEVICES=4 python examples/spmd_train.py --mode dp zero1 fsdp
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
import torch_xla
import torch_xla.distributed.spmd as xs
import torch_xla.runtime as xr
from torch import nn

import mpfunc


def per_device_bytes(tensors: list[torch.Tensor]) -> dict[str, int]:
    """Bytes each device holds for ``tensors``: every shard as it lies on its device."""
    out: dict[str, int] = {}
    for shards in torch_xla._XLAC._get_local_shards(tensors):
        for data, device in shards:
            out[device] = out.get(device, 0) + data.numel() * data.element_size()
    return out


def train(mode: str, steps: int, mesh: xs.Mesh) -> float:
    device = torch_xla.device()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32))
    model = model.to(torch.bfloat16).to(device)
    params = dict(model.named_parameters())
    if mode == "fsdp":
        mpfunc.mark_sharding_(params, mesh, "data")
    masters = mpfunc.init_master(params)  # each master is sharded like its param
    if mode == "zero1":
        mpfunc.mark_sharding_(masters, mesh, "data")
    opt = mpfunc.adamw(lr=3e-3, weight_decay=0.01)
    state = opt.init(masters)  # each moment sharded like its master
    g32 = mpfunc.init_grads(masters)  # fp32 grad buffers, sharded like the masters
    teacher = torch.randn(32, 32, generator=torch.Generator().manual_seed(1))

    loss = torch.zeros(())
    for step in range(steps):
        gen = torch.Generator().manual_seed(step)
        x = torch.randn(64, 32, generator=gen)
        y = torch.tanh(x @ teacher)
        x, y = x.to(torch.bfloat16).to(device), y.to(device)
        xs.mark_sharding(x, mesh, ("data", None))  # the batch: 1/n per device
        xs.mark_sharding(y, mesh, ("data", None))
        loss = nn.functional.mse_loss(model(x).float(), y)
        loss.backward()
        loss = loss.detach()
        grads = {n: p.grad for n, p in params.items()}  # summed over the batch by XLA
        mpfunc.grads_to_fp32_(grads, g32)
        mpfunc.apply_update_(masters, g32, state, opt)
        mpfunc.masters_to_model_(masters, params)  # params keep their own sharding
        model.zero_grad(set_to_none=True)
        torch_xla.sync()  # one graph per step
        if step % 10 == 0 or step == steps - 1:
            print(f"{mode:5s} step {step:4d} loss {loss.item():.4f}")  # .item() waits

    held = [t for t in mpfunc.state_dict({"masters": masters, "opt": state}).values()]
    mine = per_device_bytes(held)
    full = sum(t.numel() * t.element_size() for t in held)
    print(f"{mode:5s} masters+state bytes per device: {' '.join(map(str, mine.values()))} "
          f"of {full}")  # fmt: skip
    return float(loss)


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--mode", nargs="+", choices=("dp", "zero1", "fsdp"), default=["zero1"])
    args = ap.parse_args(argv)
    xr.use_spmd()  # before any XLA tensor exists
    n = xr.global_runtime_device_count()
    mesh = xs.Mesh(np.arange(n), (n,), ("data",))
    print(f"{n} devices, mesh axis 'data'")
    return {mode: train(mode, args.steps, mesh) for mode in args.mode}


if __name__ == "__main__":
    main()

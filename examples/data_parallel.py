"""Data-parallel mixed-precision training with sharded fp32 masters, under torchrun.

Every rank holds the bf16 model; each rank holds fp32 masters and AdamW state only
for the leaves it owns (``shard_plan``), about 1/world_size of them. A step:
backward on the local batch, each bf16 grad reduced (summed in fp32) to its owner,
the owners update their masters, and the owners' new bf16 params are broadcast to
every replica.

    torchrun --standalone --nproc_per_node 2 examples/data_parallel.py
    torchrun --standalone --nproc_per_node 2 examples/data_parallel.py --unsharded
"""

from __future__ import annotations

import argparse
import datetime
import os

import torch
import torch.distributed as dist
from torch import nn

import mpfunc


def main(argv: list[str] | None = None) -> float:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--unsharded", action="store_true", help="full masters on every rank")
    args = ap.parse_args(argv)

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{int(os.environ['LOCAL_RANK'])}" if backend == "nccl" else "cpu")

    torch.manual_seed(0)  # the same initial model on every rank
    model = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 10))
    model = model.to(torch.bfloat16).to(device)
    params = dict(model.named_parameters())
    mpfunc.verify_replicas(params)  # a clear error on every rank if the models differ

    plan = mpfunc.shard_plan(params, world if not args.unsharded else 1)
    mine = 0 if args.unsharded else rank
    masters = mpfunc.init_master(mpfunc.shard(params, plan, mine))  # only my leaves
    opt = mpfunc.adamw(lr=3e-3, weight_decay=0.01)
    state = opt.init(masters)
    teacher = torch.randn(32, 10, generator=torch.Generator().manual_seed(1))

    loss = torch.zeros(())
    for step in range(args.steps):
        gen = torch.Generator().manual_seed(1000 * step + rank)  # each rank: its own data
        x = torch.randn(64, 32, generator=gen)
        y = (x @ teacher).argmax(-1)
        loss = nn.functional.cross_entropy(
            model(x.to(torch.bfloat16).to(device)).float(), y.to(device)
        )
        loss.backward()
        loss = loss.detach()

        grads = {n: p.grad for n, p in params.items()}
        if args.unsharded:  # every rank needs every grad: one bucketed all-reduce (mean)
            g32 = mpfunc.all_reduce_grads(grads, reduce_dtype=torch.float32)
        else:  # each grad goes only to its owner: about half the traffic
            g32 = mpfunc.reduce_grads_to_owners(grads, plan, reduce_dtype=torch.float32)
        finite = mpfunc.all_finite(g32)
        if not args.unsharded:
            # g32 holds this rank's leaves only: one skip decision for every rank (a rank
            # skipping alone would leave the model half stepped). A global-norm clip needs
            # the same: the sum of the ranks' squared norms.
            flag = finite.to(torch.float32)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            finite = flag > 0
        mpfunc.apply_update_(masters, g32, state, opt, skip=~finite)
        mpfunc.masters_to_model_(masters, mpfunc.shard(params, plan, mine))
        if not args.unsharded:
            mpfunc.broadcast_params_(params, plan)  # owners -> every replica
        model.zero_grad(set_to_none=True)
        if rank == 0 and (step % 25 == 0 or step == args.steps - 1):
            print(f"step {step:4d} loss {float(loss):.4f}", flush=True)

    owned = sum(t.numel() for t in mpfunc.state_dict({"m": masters, "s": state}).values())
    per_rank = [torch.zeros((), dtype=torch.int64) for _ in range(world)]
    # A name, not a temporary: the tensor must outlive the group. Before torch 2.8, a gloo
    # worker thread that drops the last reference to a Python-made tensor waits for the
    # GIL, which destroy_process_group holds: a deadlock at exit (pytorch#154976).
    mine_count = torch.tensor(owned)
    dist.all_gather(per_rank, mine_count)  # one line from rank 0, not interleaved prints
    if rank == 0:
        counts = " ".join(str(int(n)) for n in per_rank)
        print(f"master+state elements per rank: {counts}", flush=True)
    dist.destroy_process_group()
    return float(loss)


if __name__ == "__main__":
    main()

"""One rank of the data-parallel tests: ``python tests/dp_worker.py SCENARIO RANK WORLD DIR``.

Each rank joins a gloo group through a file store in DIR, runs the scenario, and
saves what the parent test compares to DIR. Collectives time out after 20 s, so a
dead peer surfaces as an error, never a hang.
"""

from __future__ import annotations

import datetime
import os
import sys
from typing import Any

import torch
import torch.distributed as dist

import mpfunc

GLOBAL_BATCH = 16
STEPS = 4


def make_model(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 16), torch.nn.Tanh(),
        torch.nn.Linear(16, 4),
    ).to(dtype)  # fmt: skip


def batch(
    step: int, rank: int, world: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of a step, and this rank's equal slice of it."""
    gen = torch.Generator().manual_seed(500 + step)
    x = torch.randn(GLOBAL_BATCH, 8, generator=gen)
    y = torch.randn(GLOBAL_BATCH, 4, generator=gen)
    per = GLOBAL_BATCH // world
    return x[rank * per : (rank + 1) * per].to(dtype), y[rank * per : (rank + 1) * per]


def make_opt() -> mpfunc.Optimizer:
    return mpfunc.adamw(lr=1e-2, weight_decay=0.01)


def local_grads(model: torch.nn.Module, step: int, rank: int, world: int) -> dict[str, Any]:
    dtype = next(model.parameters()).dtype
    x, y = batch(step, rank, world, dtype)
    loss = torch.nn.functional.mse_loss(model(x).float(), y)
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    return grads


def train_unsharded(
    dtype: torch.dtype, rank: int, world: int, steps: int, distributed: bool = True
) -> dict[str, Any]:
    """Full masters on every rank; ``distributed=False`` is the single-process reference."""
    model = make_model(dtype)
    params = dict(model.named_parameters())
    masters = mpfunc.init_master(params)
    opt = make_opt()
    state = opt.init(masters)
    for step in range(steps):
        grads = local_grads(model, step, rank, world)
        if distributed:
            g32 = mpfunc.all_reduce_grads(grads, reduce_dtype=torch.float32)
        else:
            g32 = mpfunc.grads_to_fp32(grads)
        mpfunc.apply_update_(masters, g32, state, opt)
        mpfunc.masters_to_model_(masters, params)
        model.zero_grad(set_to_none=True)
    return {"masters": masters, "params": {n: p.detach() for n, p in params.items()}}


class Sharded:
    """Sharded fp32 masters: each rank keeps masters and state for its own leaves."""

    def __init__(self, dtype: torch.dtype, rank: int, world: int, owners: bool = False) -> None:
        # owners: reduce each grad to its owner only (reduce_grads_to_owners) instead of
        # all-reducing every grad and keeping this rank's share.
        self.rank, self.world, self.owners = rank, world, owners
        self.model = make_model(dtype)
        self.params = dict(self.model.named_parameters())
        self.plan = mpfunc.shard_plan(self.params, world)
        self.masters = mpfunc.init_master(mpfunc.shard(self.params, self.plan, rank))
        self.opt = make_opt()
        self.state = self.opt.init(self.masters)

    def train(self, start: int, stop: int) -> None:
        for step in range(start, stop):
            grads = local_grads(self.model, step, self.rank, self.world)
            if self.owners:
                g32 = mpfunc.reduce_grads_to_owners(grads, self.plan, reduce_dtype=torch.float32)
            else:
                reduced = mpfunc.all_reduce_grads(grads, reduce_dtype=torch.float32)
                g32 = mpfunc.shard(reduced, self.plan, self.rank)
            mpfunc.apply_update_(self.masters, g32, self.state, self.opt)
            mpfunc.masters_to_model_(self.masters, mpfunc.shard(self.params, self.plan, self.rank))
            mpfunc.broadcast_params_(self.params, self.plan)  # owners -> every replica
            self.model.zero_grad(set_to_none=True)

    def tree(self) -> dict[str, Any]:
        return {"masters": self.masters, "opt": self.state}

    def state_bytes(self) -> int:
        sd = mpfunc.state_dict(self.tree())
        return sum(t.numel() * t.element_size() for t in sd.values())


def scenario_train(rank: int, world: int, out: str) -> None:
    mpfunc.verify_replicas(dict(make_model(torch.bfloat16).named_parameters()))
    result = {
        "fp32": train_unsharded(torch.float32, rank, world, STEPS),
        "bf16": train_unsharded(torch.bfloat16, rank, world, STEPS),
    }
    sh = Sharded(torch.bfloat16, rank, world)
    sh.train(0, STEPS)
    result["sharded"] = {
        "masters": sh.masters,
        "params": {n: p.detach() for n, p in sh.params.items()},
    }
    result["sharded_bytes"] = sh.state_bytes()
    result["plan"] = sh.plan
    ow = Sharded(torch.bfloat16, rank, world, owners=True)
    ow.train(0, STEPS)
    result["owners"] = {
        "masters": ow.masters,
        "params": {n: p.detach() for n, p in ow.params.items()},
    }
    torch.save(result, f"{out}/train-rank{rank}.pt")


def scenario_save(rank: int, world: int, out: str) -> None:
    """Sharded fp32 training for K steps, then a DCP checkpoint of the sharded state."""
    import torch.distributed.checkpoint as dcp

    sh = Sharded(torch.float32, rank, world, owners=True)
    sh.train(0, int(os.environ["K"]))
    sd = mpfunc.state_dict({**sh.tree(), "params": sh.params})
    dcp.save(sd, checkpoint_id=f"{out}/dcp")


def scenario_resume(rank: int, world: int, out: str) -> None:
    """Loads the DCP checkpoint under this world size's plan, trains to N, saves."""
    import torch.distributed.checkpoint as dcp

    sh = Sharded(torch.float32, rank, world, owners=True)
    like = {**sh.tree(), "params": sh.params}
    sd = {k: v.clone() for k, v in mpfunc.state_dict(like).items()}
    dcp.load(sd, checkpoint_id=f"{out}/dcp")
    tree = mpfunc.load_state_dict(like, sd)
    sh.masters, sh.state = tree["masters"], tree["opt"]
    with torch.no_grad():
        for n, p in sh.params.items():
            p.copy_(tree["params"][n])
    sh.train(int(os.environ["K"]), int(os.environ["N"]))
    torch.save({n: p.detach() for n, p in sh.params.items()}, f"{out}/resumed-rank{rank}.pt")


def scenario_mismatch(rank: int, world: int, out: str) -> None:
    """Rank 1 builds a different model; every rank must get the same clear error."""
    params = dict(make_model(torch.bfloat16).named_parameters())
    if rank == 1:
        params["extra.weight"] = torch.zeros(3)
    try:
        mpfunc.verify_replicas(params)
    except ValueError as e:
        with open(f"{out}/error-rank{rank}.txt", "w") as f:
            f.write(str(e))
        return
    raise SystemExit("verify_replicas accepted different trees")


def scenario_dead(rank: int, world: int, out: str) -> None:
    """Rank 1 dies before the first collective; rank 0 must fail, not hang."""
    if rank == 1:
        os._exit(17)
    grads = {"w": torch.ones(4)}
    mpfunc.all_reduce_grads(grads)
    raise SystemExit("the all-reduce returned although a rank was dead")


SCENARIOS = {
    "train": scenario_train,
    "save": scenario_save,
    "resume": scenario_resume,
    "mismatch": scenario_mismatch,
    "dead": scenario_dead,
}


def main() -> None:
    name, rank, world, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    store = os.environ.get("MPFUNC_STORE", f"{out}/store")
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=20),
    )
    try:
        SCENARIOS[name](rank, world, out)
    finally:
        if name != "dead":
            dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

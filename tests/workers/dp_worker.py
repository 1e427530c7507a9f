"""One rank of the data-parallel tests: ``python tests/dp_worker.py SCENARIO RANK WORLD DIR``.

Each rank joins a gloo group through a file store in DIR, runs the scenario, and
saves what the parent test compares to DIR. Collectives time out after 20 s, so a
dead peer surfaces as an error, never a hang.
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import pathlib
import signal
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
        torch.nn.Linear(8, 32),
        torch.nn.Tanh(),
        torch.nn.Linear(32, 16),
        torch.nn.Tanh(),
        torch.nn.Linear(16, 4),
    ).to(dtype)


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
    """Rank 1 builds a different model; every rank must get the same clear error. First,
    a rank outside a group gets a clear error from the collectives, nothing written (it
    got "cannot create weak reference to 'int' object")."""
    import torch.distributed as dist

    g = dist.new_group([0])
    if rank == 1:
        grads = {"w": _ones(4, rank=rank)}
        snap = _snapshot(grads)
        for call in (mpfunc.all_reduce_grads, mpfunc.all_reduce_grads_):
            try:
                call(grads, group=g)
            except ValueError as e:
                if "group: expected a process group this rank belongs to" not in str(e):
                    raise
            else:
                raise SystemExit(f"{call.__name__} took a group without this rank")
        if not _unchanged(grads, snap):
            raise SystemExit("a refused all_reduce_grads_ wrote")
    # A mean of fp16 grads near fp16's largest value: divided before the sum, as DDP does
    # (the sum of two ranks' 40000 was inf).
    big = {"w": torch.full((8,), 40000.0, dtype=torch.float16)}
    for reduced in (mpfunc.all_reduce_grads(big), mpfunc.all_reduce_grads_(big)):
        if not torch.equal(reduced["w"], torch.full((8,), 40000.0, dtype=torch.float16)):
            raise SystemExit(f"fp16 mean: {reduced['w']}")
    # reduce_grads_to_owners too (its owner divided the sum: inf; found in review).
    owned = mpfunc.reduce_grads_to_owners(big, {"w": 0})
    if rank == 0 and not torch.equal(owned["w"], big["w"]):
        raise SystemExit(f"fp16 mean to the owner: {owned['w']}")
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


# --- ranks that disagree: every rank must raise the same clear error before any write ---


def _ones(*shape: int, rank: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Values that tell the ranks (and the elements) apart: rank r holds (r + 1) * index."""
    n = 1
    for k in shape:
        n *= k
    return (torch.arange(n, dtype=torch.float64) * (rank + 1)).reshape(shape).to(dtype)


def _snapshot(tree: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, int]]:
    return {k: (t.clone(), t._version) for k, t in tree.items()}


def _unchanged(tree: dict[str, torch.Tensor], snap: dict[str, tuple[torch.Tensor, int]]) -> bool:
    return all(torch.equal(tree[k], t) and tree[k]._version == v for k, (t, v) in snap.items())


def _mismatch_cases(rank: int, world: int) -> dict[str, Any]:
    """Each case runs on both ranks; rank 1's call differs from rank 0's as named."""
    r = rank

    def same_size_other_shapes() -> Any:
        # Same total size (6 elements) and paths: today the ranks sum 'a' with 'b'.
        g = {"a": _ones(4, rank=r), "b": _ones(2, rank=r)}
        if r == 1:
            g = {"a": _ones(2, rank=r), "b": _ones(4, rank=r)}
        return mpfunc.all_reduce_grads(g)

    def same_size_other_paths() -> Any:
        g = {"a": _ones(3, rank=r), ("b" if r == 0 else "c"): _ones(3, rank=r)}
        return mpfunc.all_reduce_grads(g)

    def transposed_shape() -> Any:
        return mpfunc.all_reduce_grads({"w": _ones(2, 3) if r == 0 else _ones(3, 2)})

    def other_sizes() -> Any:  # today: SIGABRT inside gloo
        return mpfunc.all_reduce_grads({"w": _ones(4 + r, rank=r)})

    def other_dtypes() -> Any:  # today: SIGABRT inside gloo
        dtype = torch.float32 if r == 0 else torch.bfloat16
        return mpfunc.all_reduce_grads({"w": _ones(4, rank=r, dtype=dtype)})

    def none_on_one_rank() -> Any:  # today: one rank waits for a collective the other skips
        return mpfunc.all_reduce_grads({"w": _ones(4, rank=r), "b": _ones(2) if r else None})

    def other_op() -> Any:  # today: the replicas silently diverge (a mean and a sum)
        return mpfunc.all_reduce_grads({"w": _ones(4, rank=r)}, op="mean" if r == 0 else "sum")

    def other_reduce_dtype() -> Any:
        rd = None if r == 0 else torch.float32
        return mpfunc.all_reduce_grads(
            {"w": _ones(4, rank=r, dtype=torch.bfloat16)}, reduce_dtype=rd
        )

    def other_buckets() -> Any:  # other bucket sizes cut the wire into other pieces
        g = {"a": _ones(4, rank=r), "b": _ones(4, rank=r)}
        return mpfunc.all_reduce_grads(g, bucket_bytes=16 if r == 0 else 1 << 20)

    def inplace_untouched() -> Any:
        g = {"a": _ones(4, rank=r), "b": _ones(2 + 2 * r, rank=r)}
        snap = _snapshot(g)
        try:
            return mpfunc.all_reduce_grads_(g)
        except ValueError:
            assert _unchanged(g, snap), "all_reduce_grads_ wrote before its error"
            raise

    def owners_other_plans() -> Any:  # today: each owner receives the other's leaf
        g = {"a": _ones(3, rank=r), "b": _ones(3, rank=r)}
        plan = {"a": 0, "b": 1} if r == 0 else {"a": 1, "b": 0}
        return mpfunc.reduce_grads_to_owners(g, plan)

    def owners_out_of_world() -> Any:  # today: leaf 'b' is never reduced
        g = {"a": _ones(3, rank=r), "b": _ones(3, rank=r)}
        return mpfunc.reduce_grads_to_owners(g, {"a": 0, "b": world})

    def owners_other_shapes() -> Any:
        g = {"a": _ones(3 + r, rank=r), "b": _ones(3, rank=r)}
        return mpfunc.reduce_grads_to_owners(g, {"a": 0, "b": 1})

    def broadcast_out_of_world() -> Any:  # today: 'b' is never broadcast, replicas differ
        p = {"a": _ones(3, rank=r), "b": _ones(3, rank=r)}
        snap = _snapshot(p)
        try:
            return mpfunc.broadcast_params_(p, {"a": 0, "b": world + 3})
        except ValueError:
            assert _unchanged(p, snap), "broadcast_params_ wrote before its error"
            raise

    def broadcast_negative_owner() -> Any:
        p = {"a": _ones(3, rank=r), "b": _ones(3, rank=r)}
        return mpfunc.broadcast_params_(p, {"a": 0, "b": -1})

    def broadcast_other_plans() -> Any:
        p = {"a": _ones(3, rank=r), "b": _ones(3, rank=r)}
        snap = _snapshot(p)
        plan = {"a": 0, "b": 1} if r == 0 else {"a": 1, "b": 0}
        try:
            return mpfunc.broadcast_params_(p, plan)
        except ValueError:
            assert _unchanged(p, snap), "broadcast_params_ wrote before its error"
            raise

    def broadcast_other_dtypes() -> Any:
        dtype = torch.bfloat16 if r == 0 else torch.float16
        p = {"a": _ones(3, rank=r, dtype=dtype)}
        return mpfunc.broadcast_params_(p, {"a": 0})

    def broadcast_no_owner() -> Any:  # a tensor the plan gives no owner
        p = {"a": _ones(3, rank=r), "b": _ones(3, rank=r)}
        return mpfunc.broadcast_params_(p, {"a": 0, "b": None})

    def expanded_inplace() -> Any:  # copy_ into it would fail after 'a' was written
        g = {"a": _ones(4, rank=r), "b": torch.ones(1).expand(3)}
        snap = _snapshot(g)
        try:
            return mpfunc.all_reduce_grads_(g)
        except ValueError:
            assert _unchanged(g, snap), "all_reduce_grads_ wrote before its error"
            raise

    def sparse_grad() -> Any:
        return mpfunc.all_reduce_grads({"a": _ones(4, rank=r), "s": _ones(4).to_sparse()})

    def verify_other_shapes() -> Any:
        return mpfunc.verify_replicas({"w": _ones(2, 3) if r == 0 else _ones(3, 2)})

    def matching_after_errors() -> Any:
        # The ranks raised together, so the group is still in step: a good call works.
        return mpfunc.all_reduce_grads({"a": _ones(4, rank=r), "b": _ones(2, rank=r)})

    cases = [
        same_size_other_shapes,
        same_size_other_paths,
        transposed_shape,
        other_sizes,
        other_dtypes,
        none_on_one_rank,
        other_op,
        other_reduce_dtype,
        other_buckets,
        inplace_untouched,
        owners_other_plans,
        owners_out_of_world,
        owners_other_shapes,
        broadcast_out_of_world,
        broadcast_negative_owner,
        broadcast_other_plans,
        broadcast_other_dtypes,
        broadcast_no_owner,
        expanded_inplace,
        sparse_grad,
        verify_other_shapes,
        matching_after_errors,
    ]
    only = os.environ.get("MPFUNC_CASES")  # a comma-separated subset, for debugging
    out: dict[str, Any] = {}
    for case in cases:
        name = case.__name__
        if only and name not in only.split(","):
            continue
        try:
            result = case()
        except (ValueError, TypeError) as e:
            out[name] = {"error": type(e).__name__, "msg": str(e)}
        except AssertionError as e:
            out[name] = {"error": "AssertionError", "msg": str(e)}
        else:
            out[name] = {"result": result}
    return out


def _steady_state(rank: int, world: int) -> dict[str, Any]:
    """How many fingerprint all-gathers each call costs: one per new (tree, settings,
    group), none after. Counted by wrapping torch.distributed.all_gather."""
    calls = {"all_gather": 0}
    real = dist.all_gather

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls["all_gather"] += 1
        return real(*args, **kwargs)

    dist.all_gather = counting
    counts: dict[str, int] = {}

    def run(label: str, fn: Any) -> None:
        before = calls["all_gather"]
        fn()
        counts[label] = calls["all_gather"] - before

    try:
        for step in range(3):
            # A fresh dict of fresh tensors every step, as a training loop makes them.
            run(
                f"all_reduce_{step}",
                lambda: mpfunc.all_reduce_grads(
                    {"w": _ones(4, 3, rank=rank), "b": _ones(3, rank=rank)}
                ),
            )
        run(
            "other_op", lambda: mpfunc.all_reduce_grads({"w": _ones(4, 3), "b": _ones(3)}, op="sum")
        )
        run(
            "other_op_again",
            lambda: mpfunc.all_reduce_grads({"w": _ones(4, 3), "b": _ones(3)}, op="sum"),
        )
        run("other_shape", lambda: mpfunc.all_reduce_grads({"w": _ones(3, 4), "b": _ones(3)}))
        run("inplace", lambda: mpfunc.all_reduce_grads_({"w": _ones(4, 3), "b": _ones(3)}))
        run("inplace_again", lambda: mpfunc.all_reduce_grads_({"w": _ones(4, 3), "b": _ones(3)}))
        plan = {"w": 0, "b": 1}
        for step in range(2):
            run(
                f"owners_{step}",
                lambda: mpfunc.reduce_grads_to_owners({"w": _ones(4, 3), "b": _ones(3)}, plan),
            )
            run(
                f"broadcast_{step}",
                lambda: mpfunc.broadcast_params_({"w": _ones(4, 3), "b": _ones(3)}, plan),
            )
        sub = dist.new_group(list(range(world)))
        for step in range(2):
            run(
                f"subgroup_{step}",
                lambda: mpfunc.all_reduce_grads({"w": _ones(4, 3), "b": _ones(3)}, group=sub),
            )
        run("verify", lambda: mpfunc.verify_replicas({"w": _ones(4, 3)}))
        run("verify_again", lambda: mpfunc.verify_replicas({"w": _ones(4, 3)}))
    finally:
        dist.all_gather = real
    return counts


def _layouts(rank: int, world: int) -> dict[str, Any]:
    """Grads with a transposed and a channels_last layout (and, on rank 1, a contiguous
    copy of one of them): the reduced values, and the layouts that come back."""
    gen = torch.Generator().manual_seed(7)
    base = {
        "t": torch.randn(5, 3, generator=gen),
        "cl": torch.randn(2, 3, 4, 5, generator=gen),
        "c": torch.randn(6, generator=gen),
        "cl2": torch.randn(2, 3, 2, 2, generator=gen),
    }

    def grads() -> dict[str, torch.Tensor]:
        g = {k: v * (rank + 1) for k, v in base.items()}
        g["t"] = g["t"].t().contiguous().t()  # (5, 3) with strides (1, 5)
        g["cl"] = g["cl"].contiguous(memory_format=torch.channels_last)
        # cl2: channels_last on rank 0 only; the wire order must not depend on it.
        if rank == 0:
            g["cl2"] = g["cl2"].contiguous(memory_format=torch.channels_last)
        return g

    out: dict[str, Any] = {"base": base, "world": world}
    g = grads()
    out["inputs"] = {k: v.stride() for k, v in g.items()}
    red = mpfunc.all_reduce_grads(g)
    out["all_reduce"] = {k: (v, v.stride()) for k, v in red.items()}
    red32 = mpfunc.all_reduce_grads(
        {k: v.to(torch.bfloat16, memory_format=torch.preserve_format) for k, v in g.items()},
        reduce_dtype=torch.float32,
    )
    out["all_reduce_bf16_fp32"] = {k: (v, v.stride()) for k, v in red32.items()}
    g2 = grads()
    mpfunc.all_reduce_grads_(g2)
    out["all_reduce_"] = {k: (v, v.stride()) for k, v in g2.items()}
    plan = mpfunc.shard_plan(g, world)
    own = mpfunc.reduce_grads_to_owners(grads(), plan)
    out["plan"] = plan
    out["owners"] = {k: None if v is None else (v, v.stride()) for k, v in own.items()}
    # broadcast_params_ into strided params: each leaf gets its owner's values.
    p = grads()
    mpfunc.broadcast_params_(p, plan)
    out["broadcast"] = {k: (v, v.stride()) for k, v in p.items()}
    return out


def scenario_mismatch_suite(rank: int, world: int, out: str) -> None:
    result: dict[str, Any] = {"cases": _mismatch_cases(rank, world)}
    if not os.environ.get("MPFUNC_CASES"):
        result["steady"] = _steady_state(rank, world)
        result["layouts"] = _layouts(rank, world)
    torch.save(result, f"{out}/suite-rank{rank}.pt")


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
    "mismatch_suite": scenario_mismatch_suite,
    "dead": scenario_dead,
}


def main(scenarios: dict[str, Any] = SCENARIOS) -> None:
    """Joins the group through the file store, runs the scenario named on the command
    line (of ``scenarios``: other workers pass theirs), and leaves once every rank has."""
    name, rank, world, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # launch's stacks on a timeout
    store = os.environ.get("MPFUNC_STORE", f"{out}/store")
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=20),
    )
    try:
        scenarios[name](rank, world, out)
    finally:
        if name != "dead":
            dist.barrier()
    # Every rank finished its scenario (the barrier above): say so, then leave at once.
    # The group is not destroyed: torch's gloo teardown aborted a rank once in a CI run on
    # a loaded 2-core machine ("terminate called without an active exception",
    # pytorch#190489, pytorch#179291), and a later CI run had a rank that never returned
    # (where, unknown: launch now prints a hung rank's stacks). os._exit runs no
    # destructor, and the peers, already past the barrier, use no connection again.
    pathlib.Path(out, f"done-{name}-rank{rank}").touch()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()

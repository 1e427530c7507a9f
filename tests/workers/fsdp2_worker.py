"""One rank of the FSDP2/DTensor test: ``python tests/workers/fsdp2_worker.py all RANK WORLD DIR``.

Joins a gloo group through a file store, checks every transform on DTensor leaves
against the same transform on the full tensors (asserting here, so a failure names
its check in the rank's stderr), then runs ``examples/fsdp2_train.py``'s loop and
saves its gathered results to DIR for the parent test.
"""

from __future__ import annotations

import pathlib
import sys
from typing import Any

import torch

import mpfunc

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # tests/
from support.examples import load
from support.helpers import leaves

STEPS = 8


def _close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    err = float((a.double() - b.double()).abs().max()) if a.numel() else 0.0
    assert err <= 1e-6 * max(float(b.abs().max()) if b.numel() else 0.0, 1e-30), (what, err)


def check_transforms(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    gen = torch.Generator().manual_seed(0)
    # Shapes that split unevenly (5 rows over 2 ranks) and a 0-d leaf (replicated).
    full_p = {
        "a": torch.randn(6, 3, generator=gen),
        "b": torch.randn(5, generator=gen),
        "c": torch.randn(3, 4, generator=gen).t(),
    }
    full_p = {n: t.to(torch.bfloat16) for n, t in full_p.items()}
    full_g = {n: torch.randn(t.shape, generator=gen).to(torch.bfloat16) for n, t in full_p.items()}

    def shard(tree: dict[str, torch.Tensor]) -> dict[str, Any]:
        return {n: distribute_tensor(t, mesh, [Shard(0)]) for n, t in tree.items()}

    params, grads = shard(full_p), shard(full_g)
    full = {n: t.full_tensor() for n, t in params.items()}
    assert all(torch.equal(full[n], full_p[n]) for n in full)

    def same_sharding(tree: dict[str, Any], like: dict[str, Any], what: str) -> None:
        for n, t in tree.items():
            assert isinstance(t, DTensor), (what, n, type(t))
            assert t.placements == like[n].placements, (what, n)
            assert t.to_local().shape == like[n].to_local().shape, (what, n)

    # Buffers shaped like the shards, as DTensors.
    masters = mpfunc.init_master(params)
    same_sharding(masters, params, "init_master")
    same_sharding(mpfunc.init_grads(params), params, "init_grads")
    assert all(m.to_local().dtype == torch.float32 for m in masters.values())

    # Casts, pure and in place (the in-place ones failed in _foreach_copy_ before).
    g32 = mpfunc.grads_to_fp32(grads, scale=4.0)
    same_sharding(g32, params, "grads_to_fp32")
    buf = mpfunc.init_grads(params)
    out = mpfunc.grads_to_fp32_(grads, buf, scale=4.0)
    for n in full_g:
        assert out[n] is buf[n]
        assert torch.equal(out[n].full_tensor(), full_g[n].float() / 4), n
        assert torch.equal(g32[n].full_tensor(), full_g[n].float() / 4), n
    model = mpfunc.masters_to_model(masters, params)
    same_sharding(model, params, "masters_to_model")
    before = {n: p.to_local()._version for n, p in params.items()}
    mpfunc.masters_to_model_(masters, params)
    assert all(p.to_local()._version > before[n] for n, p in params.items())
    acc = mpfunc.accumulate_grads(mpfunc.init_grads(params), grads)
    same_sharding(acc, params, "accumulate_grads")
    mpfunc.accumulate_grads_(acc, grads)
    for n in full_g:
        assert torch.equal(acc[n].full_tensor(), full_g[n].float() * 2), n

    # Optimizer steps on the shards equal the step on the full tensors.
    full_m = mpfunc.init_master(full_p)
    full_g32 = mpfunc.grads_to_fp32(full_g, scale=4.0)
    for opt in (
        mpfunc.adamw(lr=1e-2, weight_decay=0.1),
        mpfunc.adam(lr=torch.tensor(1e-2), impl="foreach"),
        mpfunc.sgd(lr=0.1, momentum=0.9),
        mpfunc.lion(),
    ):
        m, s = mpfunc.init_master(params), opt.init(masters)
        fm, fs = mpfunc.init_master(full_p), opt.init(full_m)
        for _ in range(3):
            mpfunc.apply_update_(m, g32, s, opt, skip=torch.tensor(False))
            fm, fs = mpfunc.apply_update(fm, full_g32, fs, opt)
        pure, _ = mpfunc.apply_update(m, g32, s, opt)
        same_sharding(pure, params, "apply_update")
        mpfunc.apply_update_(m, g32, s, opt, skip=torch.tensor(True))  # changes nothing
        for n in full_p:
            _close(m[n].full_tensor(), fm[n], f"{opt.name} {n}")

    # Reductions are global: the same norm and flag on every rank.
    clipped, norm = mpfunc.clip_by_global_norm(g32, 0.5)
    full_clipped, full_norm = mpfunc.clip_by_global_norm(full_g32, 0.5)
    assert type(norm) is torch.Tensor, type(norm)
    _close(norm, full_norm, "norm")
    same_sharding(clipped, params, "clip_by_global_norm")
    for n in full_p:
        _close(clipped[n].full_tensor(), full_clipped[n], f"clip {n}")
    mixed = {"sharded": g32["a"], "plain": torch.ones(3)}  # a tree of both kinds
    _close(
        mpfunc.clip_by_global_norm(mixed, 1.0)[1],
        torch.linalg.vector_norm(torch.cat([full_g32["a"].flatten(), torch.ones(3)])),
        "mixed norm",
    )
    bad = shard(full_g)
    if rank == world - 1:
        bad["b"].to_local().fill_(float("inf"))  # one rank's shard only
    for tree, expected in ((grads, True), (bad, False)):
        flag = mpfunc.all_finite(tree)
        assert type(flag) is torch.Tensor and bool(flag) is expected, (rank, expected)

    # Shards that do not pair are refused before any write, naming the path.
    replicated = {n: distribute_tensor(t, mesh, [Replicate()]) for n, t in full_g.items()}
    plain = {n: t.to_local() for n, t in grads.items()}
    for other in (replicated, plain):
        version = buf["a"].to_local()._version
        try:
            mpfunc.grads_to_fp32_(other, buf)
        except ValueError as e:
            assert "'out.a'" in str(e), str(e)
            assert other is plain or "sharding" in str(e), str(e)
        else:
            raise AssertionError("mismatched sharding was accepted")
        assert buf["a"].to_local()._version == version


def scenario_all(rank: int, world: int, out: str) -> None:
    check_transforms(rank, world)
    result = load("fsdp2_train").train(STEPS)
    torch.save({**result, "steps": STEPS}, f"{out}/fsdp2-rank{rank}.pt")


# --- "remainder" masters (tie bits) under FSDP2 ------------------------------------------

# (in, out) of each Linear: weights whose last dim is not a multiple of 8 (12, 5: the tie
# bytes of a row end in padding), rows that split unevenly (5 over 2 ranks), biases of 32,
# 16 and 48 elements (16, 8 and 24 a rank) and of 5 and 8 (3 + 2 and 4 + 4: rank 1's
# shard would start inside a tie byte, so those two keep "fp32" masters).
TIE_LAYERS = ((12, 32), (32, 16), (16, 5), (5, 8), (8, 48))
TIE_LR = 2.0**-12  # half an ulp of bf16 values in [2**-4, 2**-3): Lion lands on ties
TIE_STEPS = 6


def tie_model(shapes: tuple[tuple[int, int], ...] = TIE_LAYERS) -> torch.nn.Module:
    """bf16 Linears with every weight and bias +-[2**-4, 2**-3) on the bf16 grid, so that
    Lion's +-lr updates land on exact halves of an ulp."""
    gen = torch.Generator().manual_seed(0)
    layers: list[torch.nn.Module] = []
    for i, o in shapes:
        lin = torch.nn.Linear(i, o)
        with torch.no_grad():
            for p in lin.parameters():
                k = torch.randint(0, 128, p.shape, generator=gen).float()
                sign = torch.randint(0, 2, p.shape, generator=gen).float() * 2 - 1
                p.copy_(sign * (1 + k / 128) * 2.0**-4)
        layers += [lin, torch.nn.Tanh()]
    return torch.nn.Sequential(*layers[:-1]).to(torch.bfloat16)


def _sharded(model: torch.nn.Module, world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return dict(model.named_parameters())


def _tie_batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(700 + step)
    x = torch.randn(8 * world, TIE_LAYERS[0][0], generator=gen)
    y = torch.randn(8 * world, TIE_LAYERS[-1][1], generator=gen)
    return x[8 * rank : 8 * (rank + 1)].to(torch.bfloat16), y[8 * rank : 8 * (rank + 1)]


def _raw(t: Any) -> torch.Tensor:
    """A tensor's (a DTensor's local shard's) bytes."""
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.detach().contiguous().reshape(-1).view(torch.uint8)


def _full(t: Any) -> torch.Tensor:
    """A DTensor's global value (gloo gathers no int16 or uint8: "Invalid scalar type")."""
    from mpfunc.core import _dtensor

    wide = _dtensor.wrap_as(t, t.to_local().to(torch.int32), t.shape)
    return wide.full_tensor().to(t.dtype)


def _same(a: Any, b: Any, what: str) -> None:
    assert torch.equal(_raw(a), _raw(b)), what


def _remainder_or_fp32(path: str, p: torch.Tensor) -> str:
    """The remainder strategy wherever the tie bits can follow the param's sharding."""
    from mpfunc.strategies import _remainder

    return "fp32" if _remainder.sharding_problem(p) is not None else "remainder"


def check_rule(rank: int, world: int) -> None:
    """``_dtensor.extents`` against DTensor's own placement of every length 0..40 (1-d and
    as a last dim, beside a split dim 0), and ``sharding_problem`` against its definition:
    None exactly where every non-empty shard starts at a multiple of 8 elements, and then
    the tie bytes distributed alike hold each rank's own elements' bytes."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from mpfunc.core import _dtensor
    from mpfunc.strategies import _remainder

    mesh = init_device_mesh("cpu", (world,))
    for n in range(41):
        for shape, dim in (((n,), 0), ((3, n), 1)):
            index = torch.arange(n, dtype=torch.float32).expand(shape).contiguous()
            t = distribute_tensor(index, mesh, [Shard(dim)])
            pieces = _dtensor.extents(t, dim)
            assert pieces is not None and len(pieces) == world, (shape, pieces)
            off, length = pieces[rank]
            got = t.to_local().select(0, 0) if dim else t.to_local()  # its elements' indices
            assert got.tolist() == list(range(off, off + length)), (shape, pieces, rank)
            assert sum(k for _, k in pieces) == n, pieces
            aligned = all(o % 8 == 0 for o, k in pieces if k)
            assert (_remainder.sharding_problem(t) is None) == aligned, (shape, pieces)
            if aligned:
                ties = distribute_tensor(
                    torch.zeros(_remainder.tie_shape(shape)), mesh, [Shard(dim)]
                )
                local = _remainder.tie_shape(t.to_local().shape)
                assert tuple(ties.to_local().shape) == local, (shape, local)


def check_refused(rank: int, world: int) -> None:
    """A bias whose shards do not start on a byte of tie bits is refused, naming it."""
    params = _sharded(tie_model(), world)
    try:
        mpfunc.init_master(params, strategy="remainder")
    except ValueError as e:
        msg = str(e)
        assert "'params.4.bias'" in msg and "shards of 2 or 3 elements" in msg, msg
        assert "'fp32' strategy" in msg, msg
    else:
        raise AssertionError("init_master accepted tie bits split inside a byte")
    # Tie bits made as before (p.new_zeros: replicated, the whole param's bytes on every
    # rank) are refused at the step, naming the leaf, before anything is written.
    from mpfunc.strategies import _remainder

    p = params["0.weight"]
    u = mpfunc.init_master({"w": p}, strategy="remainder")["w"]
    old = {"w": u._replace(ties=p.new_zeros(_remainder.tie_shape(p.shape), dtype=torch.uint8))}
    opt = mpfunc.lion(lr=TIE_LR)
    state = opt.init({"w": u})  # (opt.init refuses the old unit too)
    before = [t.to_local()._version for t in old["w"]]
    try:
        mpfunc.apply_update_(old, {"w": torch.ones_like(p)}, state, opt)
    except ValueError as e:
        assert "'masters.w'" in str(e) and "sharded as their param" in str(e), str(e)
        assert [t.to_local()._version for t in old["w"]] == before
    else:
        raise AssertionError("replicated tie bits of a sharded param were accepted")


def train_ties(rank: int, world: int, out: str) -> dict[str, Any]:
    """Lion on two FSDP2 models fed the same batches, "remainder" masters (tie bits) and
    "fp32" masters: bit for bit at every step; then a DCP checkpoint of the remainder run,
    loaded into a fresh one, continues bit for bit."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor

    from mpfunc.strategies import _remainder

    opt = mpfunc.lion(lr=TIE_LR, weight_decay=0.0)
    models = [tie_model(), tie_model()]
    p32, prem = (_sharded(m, world) for m in models)
    m32 = mpfunc.init_master(p32)
    mrem = mpfunc.init_master(prem, strategy=_remainder_or_fp32)
    kinds = {n: type(u).__name__ for n, u in mrem.items()}
    fp32 = sorted(n for n, k in kinds.items() if k != "RemainderMaster")
    assert fp32 == ["4.bias", "6.bias"], kinds
    s32, srem = opt.init(m32), opt.init(mrem)
    for n, u in mrem.items():
        if isinstance(u, tuple):  # the tie bits placed as the param, shard by shard
            assert isinstance(u.ties, DTensor) and u.ties.placements == u.param.placements, n
            assert u.ties.to_local().shape == _remainder.tie_shape(u.param.to_local().shape), n

    def step(i: int, m: dict[str, Any], s: Any, params: dict[str, Any], model: Any) -> None:
        x, y = _tie_batch(i, rank, world)
        torch.nn.functional.mse_loss(model(x).float(), y).backward()
        grads = {n: p.grad for n, p in params.items()}
        mpfunc.apply_update_(m, grads, s, opt, params=params)  # (the fp32 leaf's param)
        model.zero_grad(set_to_none=True)

    def compare(tag: str, ma: dict[str, Any], sa: Any, pa: dict[str, Any]) -> None:
        for n in p32:
            _same(pa[n], p32[n], f"{tag} param {n}")
            u = ma[n]
            if isinstance(u, tuple):
                local = _remainder.join(*(t.to_local() for t in u))
                _same(local, m32[n], f"{tag} master {n}")
                # The global tensors are the whole param's packing: joined, the full master.
                full = _remainder.join(u.param.full_tensor(), _full(u.remainder), _full(u.ties))
                assert torch.equal(_raw(full), _raw(m32[n].full_tensor())), f"{tag} full {n}"
            else:
                _same(u, m32[n], f"{tag} master {n}")
        for a, b in zip(leaves(s32), leaves(sa), strict=True):
            if a is not None or b is not None:
                _same(a, b, f"{tag} state")

    ties = set_bits = 0
    half = TIE_STEPS // 2
    saved: dict[str, torch.Tensor] = {}
    for i in range(TIE_STEPS):
        step(i, m32, s32, p32, models[0])
        step(i, mrem, srem, prem, models[1])
        compare(f"step {i}", mrem, srem, prem)
        for u in mrem.values():
            if isinstance(u, tuple):
                low = u.remainder.to_local().to(torch.int32) & 0xFFFF
                ties += int((low == 0x8000).sum())
                set_bits += int((u.ties.to_local() != 0).sum())
        if i == half - 1:  # a checkpoint of the sharded remainder run (params: the fp32 leaf's)
            tree = {"masters": mrem, "opt": srem, "params": prem}
            dcp.save(mpfunc.state_dict(tree), checkpoint_id=f"{out}/ties-dcp")
            saved = {n: m.full_tensor() for n, m in m32.items()}
    assert ties > 0 and set_bits > 0, (ties, set_bits)

    # Resume: a fresh model (zeros) and masters, loaded in place from the checkpoint (DCP
    # writes into the DTensor shards that mpfunc.state_dict returns), then the last steps:
    # the uninterrupted run's bits.
    fresh = tie_model()
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    pres = _sharded(fresh, world)
    mres = mpfunc.init_master(pres, strategy=_remainder_or_fp32)
    sres = opt.init(mres)
    tree = {"masters": mres, "opt": sres, "params": pres}
    dcp.load(mpfunc.state_dict(tree), checkpoint_id=f"{out}/ties-dcp")
    for i in range(half, TIE_STEPS):
        step(i, mres, sres, pres, fresh)
    for n in prem:
        _same(pres[n], prem[n], f"resumed param {n}")
        for a, b in zip(leaves(mres[n]), leaves(mrem[n]), strict=True):
            _same(a, b, f"resumed master {n}")
    for a, b in zip(leaves(sres), leaves(srem), strict=True):
        if a is not None or b is not None:
            _same(a, b, "resumed state")
    return {"ties": ties, "set_bits": set_bits, "kinds": kinds, "saved_fp32": saved}


def check_master_optimizer(rank: int, world: int, out: str) -> None:
    """``MasterOptimizer(strategy="remainder")`` on FSDP2 params (every leaf's split fits
    whole tie bytes) is ``strategy="fp32"`` bit for bit on exact ties (params, and its
    state's "master" against the joined remainder), and its ``state_dict()`` saved with
    ``torch.save`` on each rank resumes bit for bit."""
    from mpfunc.strategies import _remainder

    shapes = TIE_LAYERS[:2]
    models = [tie_model(shapes) for _ in range(3)]
    params = [list(_sharded(m, world).values()) for m in models]
    opts = [
        mpfunc.MasterOptimizer(ps, mpfunc.lion, strategy=s, lr=TIE_LR, weight_decay=0.0)
        for ps, s in zip(params, ("fp32", "remainder", "remainder"))
    ]

    def step(i: int, k: int) -> None:
        x, y = _tie_batch(i, rank, world)
        torch.nn.functional.mse_loss(models[k](x).float(), y[:, : shapes[-1][1]]).backward()
        opts[k].step()
        opts[k].zero_grad()

    ties = 0
    for i in range(TIE_STEPS):
        step(i, 0)
        step(i, 1)
        for a, b in zip(params[0], params[1]):
            _same(a, b, f"MasterOptimizer step {i}")
            e32, erem = opts[0].state[a], opts[1].state[b]
            joined = _remainder.join(*(t.to_local() for t in (b, erem["remainder"], erem["ties"])))
            _same(joined, e32["master"], f"MasterOptimizer master {i}")
            _same(erem["exp_avg"], e32["exp_avg"], f"MasterOptimizer exp_avg {i}")
            ties += int((erem["ties"].to_local() != 0).sum())
        if i == TIE_STEPS // 2 - 1:
            torch.save(opts[1].state_dict(), f"{out}/opt-rank{rank}.pt")
            with torch.no_grad():
                for a, b in zip(params[2], params[1]):
                    a.to_local().copy_(b.to_local())  # (the model's own checkpoint)
    assert ties > 0
    opts[2].load_state_dict(torch.load(f"{out}/opt-rank{rank}.pt", weights_only=False))
    for i in range(TIE_STEPS // 2, TIE_STEPS):
        step(i, 2)
    for a, b in zip(params[2], params[1]):
        _same(a, b, "MasterOptimizer resumed param")
        for k, v in opts[1].state[b].items():
            _same(opts[2].state[a][k], v, f"MasterOptimizer resumed {k}")


def scenario_ties(rank: int, world: int, out: str) -> None:
    check_rule(rank, world)
    check_refused(rank, world)
    check_master_optimizer(rank, world, out)
    result = train_ties(rank, world, out)
    torch.save(result, f"{out}/ties-rank{rank}.pt")


def scenario_stochastic(rank: int, world: int, out: str) -> None:
    """ "stochastic" masters on Shard(0) DTensors: each shard draws its own bits. Rows ``i``
    and ``i + 4`` of a param are equal, as are their grads, and land on different ranks:
    with the same draws on every rank they stayed equal. The keys advance as unsharded
    keys do (not on a skipped step), alike on every rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    half = torch.randn(4, 256, generator=torch.Generator().manual_seed(0)) * 0.1
    full = torch.cat([half, half]).to(torch.bfloat16)
    keys = {}
    for sharded in (False, True):

        def wrap(t: torch.Tensor, sharded: bool = sharded) -> Any:
            return distribute_tensor(t, mesh, [Shard(0)]) if sharded else t

        params = {"w": wrap(full.clone())}
        masters = mpfunc.init_master(params, strategy="stochastic")
        opt = mpfunc.sgd(lr=1e-3)
        state = opt.init(masters)
        for i in range(12):
            skip = torch.tensor(i == 5)
            mpfunc.apply_update_(masters, {"w": wrap(full.clone())}, state, opt, skip=skip)
        w = params["w"].full_tensor() if sharded else params["w"]
        differ = int((w[:4] != w[4:]).sum())
        if sharded:
            assert differ > 512, differ  # independent rounding of the two halves
        keys[sharded] = int(_raw(masters["w"].key).view(torch.int32))
        # The pure form too: its copies draw per shard as the in-place step does.
        pure = mpfunc.init_master({"w": wrap(full.clone())}, strategy="stochastic")
        pure_state = opt.init(pure)
        for _ in range(6):
            pure, pure_state = mpfunc.apply_update(pure, {"w": wrap(full.clone())}, pure_state, opt)
        w = pure["w"].param.full_tensor() if sharded else pure["w"].param
        if sharded:
            assert int((w[:4] != w[4:]).sum()) > 512, "pure apply_update: shards drew alike"
    assert keys[True] == keys[False], keys
    # Encoded moments of shards are refused at init, naming the leaf (they were made
    # full-size and plain, and the step failed after writing masters and counts).
    sharded = {"w": distribute_tensor(full.clone(), mesh, [Shard(0)])}
    for sd in (torch.uint8, torch.uint4):  # type: ignore[attr-defined]
        for make in (mpfunc.adamw, mpfunc.lion):
            try:
                make(1e-3, state_dtype=sd).init(mpfunc.init_master(sharded))
            except TypeError as e:
                assert "at 'masters.w': expected a plain tensor for state_dtype" in str(e), e
            else:
                raise AssertionError(f"{make.__name__} + {sd}: DTensor masters were taken")
    check_whole_loads_refused(rank, world, mesh, out)
    torch.save({"keys": keys}, f"{out}/stochastic-rank{rank}.pt")


def check_whole_loads_refused(rank: int, world: int, mesh: Any, out: str) -> None:
    """A whole (one process's) checkpoint loaded into DTensor state is refused before any
    write, naming the leaf: ``load_`` wrote the plain step counts and then failed inside
    torch's copy; ``MasterOptimizer.load_state_dict`` compared global shapes and failed
    after writing the first param's step count."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    full = torch.ones(6, 4, dtype=torch.bfloat16)
    opt = mpfunc.adamw(lr=1e-2)
    path = f"{out}/whole-{world}.pt"
    if rank == 0:
        mpfunc.save(path, {"s": opt.init(mpfunc.init_master({"w": full}))})
    torch.distributed.barrier()
    params = {"w": distribute_tensor(full.clone(), mesh, [Shard(0)])}
    masters = mpfunc.init_master(params)
    state = opt.init(masters)
    mpfunc.apply_update_(masters, {"w": torch.ones_like(params["w"])}, state, opt)
    tensors = [t for t in leaves(state) if t is not None]
    held = [_raw(t).clone() for t in tensors]
    try:
        mpfunc.load_(path, {"s": state})
    except ValueError as e:
        assert "'s.exp_avg.w': the tree's leaf must be a plain tensor" in str(e), e
    else:
        raise AssertionError("load_ took a whole checkpoint into DTensor state")
    assert all(torch.equal(a, _raw(t)) for a, t in zip(held, tensors))
    torch.manual_seed(0)
    ref = torch.nn.Linear(4, 6).to(torch.bfloat16)
    ref_opt = mpfunc.MasterOptimizer(ref.parameters(), lr=1e-2)
    for _ in range(2):
        ref(full[:, :4]).float().sum().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 6).to(torch.bfloat16)
    fully_shard(model, mesh=mesh)
    sharded = mpfunc.MasterOptimizer(model.parameters(), lr=1e-2)
    model(full[:, :4]).float().sum().backward()
    sharded.step()
    steps = [float(sharded.state[q]["step"]) for q in model.parameters()]
    try:
        sharded.load_state_dict(ref_opt.state_dict())
    except ValueError as e:
        assert "a DTensor's shards: save and load each rank's state_dict()" in str(e), e
    else:
        raise AssertionError("load_state_dict took a whole state into DTensor state")
    assert [float(sharded.state[q]["step"]) for q in model.parameters()] == steps


if __name__ == "__main__":
    from dp_worker import main  # the same group set-up (file store, timeouts)

    main({"all": scenario_all, "ties": scenario_ties, "stochastic": scenario_stochastic})

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


if __name__ == "__main__":
    from dp_worker import main  # the same group set-up (file store, timeouts)

    main({"all": scenario_all})

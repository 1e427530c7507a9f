"""Data parallel on real gloo process groups: 2 and 4 CPU processes on this machine.

Each test launches one process per rank (tests/workers/dp_worker.py) and bounds the whole
launch with a timeout. The bound for comparisons with single-process fp32
training: max|a - b| <= 1e-5 * max|b| after 4 steps (the reduction order differs,
so fp32 sums differ in the last bits, and AdamW's normalization passes that on).
"""

from __future__ import annotations

import pathlib
from typing import Any

import pytest
import torch
from support.ranks import check_ok, launch
from workers.dp_worker import STEPS, make_model, train_unsharded

import mpfunc

BOUND = 1e-5


def single_process(steps: int) -> dict[str, Any]:
    """The reference: one process, the whole global batch, fp32."""
    return train_unsharded(torch.float32, 0, 1, steps, distributed=False)


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return float((a - b).abs().max()) <= BOUND * float(b.abs().max())


@pytest.mark.parametrize("world", [2, 4])
def test_all_reduce_and_sharded_masters(world: int, tmp_path: pathlib.Path) -> None:
    check_ok(launch("train", world, tmp_path))
    ranks = [torch.load(tmp_path / f"train-rank{r}.pt", weights_only=False) for r in range(world)]
    ref = single_process(STEPS)
    for mode in ("fp32", "bf16", "sharded"):
        # All replicas stay identical, bit for bit.
        for r in ranks[1:]:
            for n, p in r[mode]["params"].items():
                assert torch.equal(p, ranks[0][mode]["params"][n]), (mode, n)
    # All-reduce with full fp32 masters matches single-process training on the whole batch.
    for n, m in ranks[0]["fp32"]["masters"].items():
        assert close(m, ref["masters"][n]), n
    # Sharded masters give the same masters and params as unsharded, bit for bit.
    for r, res in enumerate(ranks):
        owned = {n for n, o in res["plan"].items() if o == r}
        assert {n for n, m in res["sharded"]["masters"].items() if m is not None} == owned
        for n in owned:
            assert torch.equal(res["sharded"]["masters"][n], res["bf16"]["masters"][n]), n
        for n, p in res["sharded"]["params"].items():
            assert torch.equal(p, res["bf16"]["params"][n]), n
    # Reducing each grad only to its owner gives the same masters up to the order of the
    # fp32 sums (bit for bit at 2 ranks, where a sum of two is order-free).
    for res in ranks:
        for n, m in res["owners"]["masters"].items():
            if m is None:
                continue
            if world == 2:
                assert torch.equal(m, res["sharded"]["masters"][n]), n
            else:
                assert close(m, res["sharded"]["masters"][n]), n
        for n, p in res["owners"]["params"].items():
            assert torch.equal(p, ranks[0]["owners"]["params"][n]), n  # replicas agree
    # Each rank holds about 1/world of the masters and optimizer state: leaves are
    # whole, so the most loaded rank exceeds full/world by at most the largest leaf.
    full = sum(b["sharded_bytes"] for b in ranks)
    largest = max(
        full * p.numel() / sum(q.numel() for q in ranks[0]["bf16"]["masters"].values())
        for p in ranks[0]["bf16"]["masters"].values()
    )
    assert max(b["sharded_bytes"] for b in ranks) <= full / world + largest


@pytest.mark.parametrize("before, after", [(2, 4), (4, 1)])
def test_dcp_checkpoint_reshards(before: int, after: int, tmp_path: pathlib.Path) -> None:
    """Sharded state saved with torch.distributed.checkpoint at one world size, loaded
    at another, training continued: equals an uninterrupted run within the bound."""
    k, n = 2, 5
    check_ok(launch("save", before, tmp_path, K=str(k)))
    check_ok(launch("resume", after, tmp_path, K=str(k), N=str(n)))
    ref = single_process(n)
    for r in range(after):
        params = torch.load(tmp_path / f"resumed-rank{r}.pt", weights_only=True)
        for name, p in params.items():
            assert close(p, ref["params"][name]), (r, name)


def test_ranks_with_different_trees_all_get_a_clear_error(tmp_path: pathlib.Path) -> None:
    """Also a rank outside the group passed to the collectives (asserted in the ranks)."""
    check_ok(launch("mismatch", 2, tmp_path, timeout=60))
    for r in range(2):
        msg = (tmp_path / f"error-rank{r}.txt").read_text()
        assert "verify_replicas: the ranks hold different trees" in msg
        assert "extra.weight" in msg or "leaves" in msg


def test_a_dead_rank_is_an_error_not_a_hang(tmp_path: pathlib.Path) -> None:
    results = launch("dead", 2, tmp_path, timeout=90)
    assert results[1].returncode == 17
    assert results[0].returncode != 0
    assert "returned although" not in results[0].stderr


def test_shard_plan_is_balanced_and_deterministic() -> None:
    params = dict(make_model(torch.bfloat16).named_parameters())
    for world in (1, 2, 3, 4):
        plan = mpfunc.shard_plan(params, world)
        assert plan == mpfunc.shard_plan(dict(reversed(list(params.items()))), world)
        loads = [0] * world
        for name, owner in plan.items():
            assert isinstance(owner, int) and 0 <= owner < world
            loads[owner] += params[name].numel()
        biggest = max(p.numel() for p in params.values())
        assert max(loads) - min(loads) <= biggest


def test_all_reduce_needs_an_initialized_group() -> None:
    with pytest.raises(RuntimeError, match="init_process_group"):
        mpfunc.all_reduce_grads({"w": torch.ones(2)})


def test_only_a_teardown_abort_after_the_final_barrier_counts_as_finished(
    tmp_path: pathlib.Path,
) -> None:
    """check_ok forgives exactly one thing: torch's gloo teardown aborting a rank whose
    scenario finished on every rank. A crash before the barrier is still a failure."""
    import subprocess

    from support.ranks import TEARDOWN_ABORT, finished

    def rank(code: int, err: str) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(
            ["py", "w.py", "save", "1", "4", str(tmp_path)], code, "", err
        )

    assert finished(rank(0, ""))
    assert not finished(rank(-6, TEARDOWN_ABORT))  # no marker: it died inside the scenario
    (tmp_path / "done-save-rank1").touch()
    assert finished(rank(-6, "warning\n" + TEARDOWN_ABORT + "\n"))
    assert not finished(rank(1, "Traceback ...\nRuntimeError: boom"))


def test_a_rank_past_the_limit_is_killed_and_its_stack_reported(tmp_path: pathlib.Path) -> None:
    """launch never leaves a process or a pipe behind, and a hang's report says where each
    rank waited (faulthandler's stacks) and which ranks finished."""
    import subprocess
    import textwrap

    from support.ranks import launch

    worker = tmp_path / "sleepy.py"
    worker.write_text(
        textwrap.dedent("""
        import faulthandler, pathlib, signal, sys, time
        faulthandler.register(signal.SIGUSR1, all_threads=True)
        name, rank, out = sys.argv[1], int(sys.argv[2]), sys.argv[4]
        def wait_for_a_peer_forever():
            time.sleep(600)
        if rank == 1:
            wait_for_a_peer_forever()
        pathlib.Path(out, f"done-{name}-rank{rank}").touch()
    """)
    )
    before = subprocess.run(["pgrep", "-f", str(worker)], capture_output=True, text=True)
    with pytest.raises(AssertionError) as err:
        launch("nap", 2, tmp_path, timeout=5, worker=worker)
    msg = str(err.value)
    assert "nap on 2 ranks passed its 5 s limit" in msg
    assert "done markers: ['done-nap-rank0']" in msg
    assert "rank 1 (exit -9, hung)" in msg and "wait_for_a_peer_forever" in msg
    after = subprocess.run(["pgrep", "-f", str(worker)], capture_output=True, text=True)
    assert before.stdout == after.stdout == ""

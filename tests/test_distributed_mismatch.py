"""Ranks that disagree get one clear error, on every rank, before anything is written.

One gloo launch of 2 CPU processes runs every case of ``dp_worker.scenario_mismatch_suite``
in turn (each case on both ranks, rank 1's call differing from rank 0's as the case
says) and saves what each rank got. Before the fingerprint check, the same-size cases
mixed leaves silently, and the size and dtype cases aborted a rank inside gloo
(SIGABRT), which ended the whole launch.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import threading
from typing import Any

import pytest
import torch
from support.ranks import check_ok, launch

import mpfunc

HERE = pathlib.Path(__file__).resolve()
WORLD = 2

# case -> (exception type, substrings every rank's message must hold)
DIFFER = "the ranks hold different trees"
CASES: dict[str, tuple[str, tuple[str, ...]]] = {
    "same_size_other_shapes": (
        "ValueError",
        (f"all_reduce_grads: {DIFFER}", "'a': shape (4,)", "'a': shape (2,)"),
    ),
    "same_size_other_paths": ("ValueError", (DIFFER, "'b': shape (3,)", "'c': shape (3,)")),
    "transposed_shape": ("ValueError", (DIFFER, "shape (2, 3)", "shape (3, 2)")),
    "other_sizes": ("ValueError", (DIFFER, "'w': shape (4,)", "'w': shape (5,)")),
    "other_dtypes": ("ValueError", (DIFFER, "torch.float32", "torch.bfloat16")),
    "none_on_one_rank": ("ValueError", (DIFFER, "'b': None", "'b': shape (2,)")),
    "other_op": ("ValueError", (DIFFER, "op='mean'", "op='sum'")),
    "other_reduce_dtype": (
        "ValueError",
        (DIFFER, "reduce_dtype=None", "reduce_dtype=torch.float32"),
    ),
    "other_buckets": ("ValueError", (DIFFER, "bucket_bytes=16", "bucket_bytes=1048576")),
    "inplace_untouched": ("ValueError", (f"all_reduce_grads_: {DIFFER}",)),
    "owners_other_plans": (
        "ValueError",
        (
            f"reduce_grads_to_owners: {DIFFER}",
            "'a': shape (3,) torch.float32, owner 0",
            "'a': shape (3,) torch.float32, owner 1",
        ),
    ),
    "owners_out_of_world": (
        "ValueError",
        ("reduce_grads_to_owners: at 'plan.b': expected an owner rank in [0, 2), got rank 2",),
    ),
    "owners_other_shapes": ("ValueError", (f"reduce_grads_to_owners: {DIFFER}",)),
    "broadcast_out_of_world": (
        "ValueError",
        ("broadcast_params_: at 'plan.b': expected an owner rank in [0, 2), got rank 5",),
    ),
    "broadcast_negative_owner": ("ValueError", ("at 'plan.b'", "got rank -1")),
    "broadcast_other_plans": ("ValueError", (f"broadcast_params_: {DIFFER}", "owner")),
    "broadcast_other_dtypes": ("ValueError", (DIFFER, "torch.bfloat16", "torch.float16")),
    "broadcast_no_owner": ("ValueError", ("at 'plan.b'", "got None")),
    "expanded_inplace": ("ValueError", ("all_reduce_grads_: at 'grads.b'", "share memory")),
    "sparse_grad": ("TypeError", ("all_reduce_grads: at 'grads.s'", "sparse")),
    "verify_other_shapes": ("ValueError", (f"verify_replicas: {DIFFER}", "shape (2, 3)")),
}


@pytest.fixture(scope="module")
def suite(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("mismatch_suite")
    check_ok(launch("mismatch_suite", WORLD, out, timeout=240))
    return [torch.load(out / f"suite-rank{r}.pt", weights_only=False) for r in range(WORLD)]


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_rank_gets_the_same_clear_error(suite: list[dict[str, Any]], case: str) -> None:
    kind, parts = CASES[case]
    got = [s["cases"][case] for s in suite]
    for r, g in enumerate(got):
        assert g.get("error") == kind, f"rank {r}: {g}"
        for part in parts:
            assert part in g["msg"], f"rank {r}: {part!r} not in {g['msg']!r}"
    assert got[0]["msg"] == got[1]["msg"]  # the same words on every rank


def test_the_group_stays_in_step_after_the_errors(suite: list[dict[str, Any]]) -> None:
    """Every rank raised at the same point, so the next good call pairs up and is right."""
    for s in suite:
        res = s["cases"]["matching_after_errors"]["result"]
        for name, n in (("a", 4), ("b", 2)):
            ranks = [torch.arange(n, dtype=torch.float32) * (r + 1) for r in range(WORLD)]
            assert torch.equal(res[name], (ranks[0] + ranks[1]) / WORLD)


def test_steady_state_adds_no_collective(suite: list[dict[str, Any]]) -> None:
    """One fingerprint all-gather per new (function, tree, settings, group); none after,
    even though every step builds a fresh tree of fresh tensors. ``verify_replicas``
    always compares."""
    want = {
        "all_reduce_0": 1,
        "all_reduce_1": 0,
        "all_reduce_2": 0,
        "other_op": 1,
        "other_op_again": 0,
        "other_shape": 1,
        "inplace": 1,
        "inplace_again": 0,
        "owners_0": 1,
        "broadcast_0": 1,
        "owners_1": 0,
        "broadcast_1": 0,
        "subgroup_0": 1,
        "subgroup_1": 0,
        "verify": 1,
        "verify_again": 1,
    }
    for s in suite:
        assert s["steady"] == want


def _plain_mean(base: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The mean over the ranks (rank r holds (r + 1) * base), summed in fp32 as the
    reduction does; independent of mpfunc."""
    parts = [base * (r + 1) for r in range(WORLD)]
    if dtype is not None:
        parts = [p.to(dtype).float() for p in parts]
    return (parts[0] + parts[1]) / WORLD


@pytest.mark.parametrize("which", ["all_reduce", "all_reduce_bf16_fp32", "all_reduce_"])
def test_reduced_grads_keep_their_layout(suite: list[dict[str, Any]], which: str) -> None:
    """A transposed and a channels_last grad come back with their own strides and the
    plain sum's values (torch's fused CPU Adam pairs grad and param by memory position).
    'cl2' is channels_last on rank 0 only: the wire order does not depend on layouts."""
    for s in suite:
        lay = s["layouts"]
        for name, (value, stride) in lay[which].items():
            assert stride == lay["inputs"][name], (which, name)
            base = lay["base"][name]
            if which == "all_reduce_bf16_fp32":
                assert value.dtype == torch.float32
                assert torch.equal(value, _plain_mean(base, torch.bfloat16)), name
            else:
                assert torch.equal(value, _plain_mean(base)), (which, name)
    assert suite[0]["layouts"]["inputs"]["cl2"] != suite[1]["layouts"]["inputs"]["cl2"]
    assert suite[0]["layouts"]["inputs"]["t"] == (1, 5)


def test_owner_reduction_and_broadcast_keep_layouts(suite: list[dict[str, Any]]) -> None:
    for r, s in enumerate(suite):
        lay = s["layouts"]
        for name, owner in lay["plan"].items():
            got = lay["owners"][name]
            if owner != r:
                assert got is None
                continue
            value, stride = got
            assert stride == lay["inputs"][name], name
            assert torch.equal(value, _plain_mean(lay["base"][name])), name
        for name, (value, stride) in lay["broadcast"].items():
            assert stride == lay["inputs"][name], name
            assert torch.equal(value, lay["base"][name] * (lay["plan"][name] + 1)), name


# --- one process: the plan and rank arguments ------------------------------------------


@pytest.mark.parametrize(
    "world, cls, match",
    [
        (0, ValueError, r"shard_plan: world_size: expected an int >= 1, got 0"),
        (-2, ValueError, r"expected an int >= 1, got -2"),
        (2.0, TypeError, r"expected an int >= 1, got 2.0"),
        (True, TypeError, r"expected an int >= 1, got True"),
    ],
)
def test_shard_plan_checks_world_size(world: Any, cls: type[Exception], match: str) -> None:
    with pytest.raises(cls, match=match):
        mpfunc.shard_plan({"w": torch.ones(2)}, world)


@pytest.mark.parametrize(
    "rank, plan, cls, match",
    [
        (-1, {"a": 0, "b": 1}, ValueError, r"shard: rank: expected an int >= 0, got -1"),
        (1.0, {"a": 0, "b": 1}, TypeError, r"shard: rank: expected an int >= 0, got 1.0"),
        (0, {"a": 0, "b": -1}, ValueError, r"'plan.b': expected an owner rank >= 0, got rank -1"),
        (0, {"a": 0, "b": None}, ValueError, r"at 'plan.b': expected an owner rank >= 0, got None"),
        (0, {"a": 0, "b": "1"}, TypeError, r"at 'plan.b': expected an owner rank >= 0, got str"),
        (0, {"a": 0, "b": True}, TypeError, r"at 'plan.b'.*got bool True"),
        (0, {"a": 0}, ValueError, r"shard: tree and plan must have the same tree structure"),
    ],
)
def test_shard_checks_rank_and_plan(rank: Any, plan: Any, cls: type[Exception], match: str) -> None:
    with pytest.raises(cls, match=match):
        mpfunc.shard({"a": torch.ones(2), "b": torch.ones(3)}, plan, rank)


def test_shard_keeps_none_without_an_owner() -> None:
    """A ``None`` leaf needs no owner (shard_plan gives it none), and a rank that owns
    nothing gets an all-``None`` tree."""
    tree = {"a": torch.ones(2), "b": None}
    plan = mpfunc.shard_plan(tree, 3)
    assert plan == {"a": 0, "b": None}
    assert mpfunc.shard(tree, plan, 0)["a"] is tree["a"]
    assert mpfunc.shard(tree, plan, 2) == {"a": None, "b": None}


# --- XLA: two participants (threads of one process, see tests/test_xla_distributed.py) ---

_LOCK = threading.Lock()
_BARRIERS: list[threading.Barrier] = []
XLA_STEPS, XLA_WARMUP = 4, 2


def _xla_metric(name: str) -> int:
    import torch_xla.debug.metrics as met

    data = met.metric_data(name)
    return 0 if data is None else int(data[0])


def _xla_fn(index: int, out_dir: str) -> None:
    import torch_xla
    import torch_xla.runtime as xr

    with _LOCK:
        if not _BARRIERS:
            _BARRIERS.append(threading.Barrier(xr.addressable_device_count()))
    barrier = _BARRIERS[0]
    dev = torch_xla.device()
    rank = xr.global_ordinal()
    out: dict[str, Any] = {"rank": rank, "world": xr.world_size()}
    # Same total size, other shapes: before the check, the two graphs differed and XLA
    # aborted the process in the all-reduce's rendezvous (on a TPU: a hang or a mix).
    shapes = ((4, 2), (2, 4))[rank]
    g = {"a": torch.ones(shapes[0]).to(dev), "b": torch.ones(shapes[1]).to(dev)}
    try:
        mpfunc.all_reduce_grads(g, reduce_dtype=torch.float32)
        out["mismatch"] = None
    except ValueError as e:
        out["mismatch"] = str(e)
    try:  # verify_replicas compares XLA trees across the participants too
        mpfunc.verify_replicas({"w": torch.ones(shapes[0]).to(dev)})
        out["verify"] = None
    except ValueError as e:
        out["verify"] = str(e)
    barrier.wait()
    # The same tree on both: compared once (step 0), then nothing is added to a step.
    kept = []
    for step in range(XLA_STEPS):
        if step == XLA_WARMUP:
            barrier.wait()
            out["before"] = (_xla_metric("CompileTime"), _xla_metric("TransferFromDeviceTime"))
            barrier.wait()
        grads = {"w": torch.full((3,), float(10 * step + rank + 1)).to(dev), "n": None}
        kept.append(mpfunc.all_reduce_grads(grads)["w"])
        with _LOCK:  # one compile at a time (catch 1 of tests/test_xla_distributed.py)
            torch_xla.sync()
        barrier.wait()
    barrier.wait()
    out["after"] = (_xla_metric("CompileTime"), _xla_metric("TransferFromDeviceTime"))
    barrier.wait()
    out["values"] = [t.cpu() for t in kept]
    torch.save(out, pathlib.Path(out_dir) / f"xla-rank{rank}.pt")


@pytest.mark.xla
def test_xla_participants_with_different_trees_get_a_clear_error(tmp_path: pathlib.Path) -> None:
    """On XLA the fingerprint is host data compared across the participants once per
    tree: a mismatch is the same ValueError on both; a matching tree, once compared,
    adds no compile and no device-to-host transfer to later steps."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "PJRT_", "CPU_NUM"))}
    path = os.pathsep.join(filter(None, [str(HERE.parents[1]), env.get("PYTHONPATH")]))
    env.update(PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(WORLD), OMP_NUM_THREADS="1", PYTHONPATH=path)
    r = subprocess.run(
        [sys.executable, str(HERE), "xla", str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    got = [torch.load(tmp_path / f"xla-rank{k}.pt") for k in range(WORLD)]
    for g in got:
        assert g["world"] == WORLD
        msg = g["mismatch"]
        assert msg is not None and msg.startswith(f"all_reduce_grads: {DIFFER}"), msg
        assert "'a': shape (4,)" in msg and "'a': shape (2,)" in msg
        assert g["verify"] is not None and g["verify"].startswith(f"verify_replicas: {DIFFER}")
        assert g["after"] == g["before"], "a warm step compiled or read back"
        for step, v in enumerate(g["values"]):
            want = torch.full((3,), ((10 * step + 1) + (10 * step + 2)) / WORLD)
            assert torch.equal(v, want)
    assert got[0]["mismatch"] == got[1]["mismatch"]


if __name__ == "__main__":
    import torch_xla.distributed.xla_multiprocessing as xmp

    assert sys.argv[1] == "xla"
    xmp.spawn(_xla_fn, args=(sys.argv[2],))

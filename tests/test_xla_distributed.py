"""``all_reduce_grads`` on XLA with two participants, on the XLA CPU backend.

What works with torch_xla 2.9.0 on a CPU-only machine, and how it is run here:

* **Thread per device (used here).** ``xmp.spawn(fn)`` (``nprocs=None``) with
  ``PJRT_DEVICE=CPU CPU_NUM_DEVICES=2`` starts ONE process with one thread per
  virtual CPU device; ``xr.world_size() == 2`` and ``xm.all_reduce`` is a real
  in-graph all-reduce. (``nprocs=2`` raises ``ValueError: Unsupported nprocs (2)``.)
  Three catches, each handled in the worker below:

  1. Two threads must not compile the same graph at once. XLA:CPU keys an
     all-reduce's rendezvous by the HLO module's unique id when the op has no
     channel id (torch_xla emits none), so two concurrent compiles of one graph
     give ``op_id=0`` and ``op_id=1``, each thread waits for the other, and XLA
     aborts the process: ``Termination timeout for `all reduce
     RendezvousKey{run_id=RunId: 0, global_devices=[0,1], num_local_participants=2,
     collective_op_kind=cross_replica, op_id=0}` of 10 seconds exceeded. Exiting to
     ensure a consistent program state. Expected 2 threads to join the rendezvous,
     but only 1 of them arrived on time.`` (the failure first seen with
     ``xmp.spawn``). ``torch_xla.sync()`` under one lock makes the second thread
     hit the compile cache and run the same executable. Tracing stays outside the
     lock: the first ``all_reduce_grads`` of each tree compares the participants'
     trees, which waits for the peer to make the same call (mpfunc serializes that
     exchange's own compile).
  2. A thread's next step (its transfers and ``sync()``) waits for its previous
     graph to finish, and that graph's all-reduce waits for the peer; so a thread
     must not hold the lock of catch 1 while the peer has yet to launch the same
     step, and ``xm.wait_device_ops()`` (which waits for every local device) must
     not run while the peer has yet to launch. Either hangs until XLA aborts. The
     worker lines the threads up with a ``threading.Barrier`` after every step.
  3. XLA:CPU's all-reduce has no bf16: ``ValueError: AllReduce for datatype 'bf16'
     is not supported`` at ``sync()``. bf16 grads need ``reduce_dtype=torch.float32``
     there (fp16, fp32 and fp64 reduce in their own dtype). TPUs reduce bf16.

* **Several processes: not supported on CPU.** The PJRT CPU client has no
  cross-process runtime, and ``xmp.spawn`` starts one process for CPU. Under
  ``python -m torch.distributed.run --nproc_per_node 2`` with
  ``dist.init_process_group('xla', init_method='xla://')`` each process reports
  rank 0, world size 1 and one device ``CPU:0``, and ``xm.all_reduce`` is a no-op:
  each keeps its own values, silently. Setting ``PJRT_LOCAL_PROCESS_COUNT=2`` and
  ``PJRT_LOCAL_PROCESS_RANK`` changes nothing (both still rank 0, so the second
  store fails: ``EADDRINUSE``). ``test_separate_processes_do_not_join`` pins this.

* **SPMD.** ``xr.use_spmd()`` with ``CPU_NUM_DEVICES=2`` gives a 2-device mesh,
  but ``xr.world_size() == 1``: the reduction is implied by the sharding, and
  ``all_reduce_grads`` is the identity (it must not count twice). Checked below.

Every launch is a subprocess with a timeout; a rendezvous failure aborts after
XLA's own 10 s, never a hang.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import threading
from typing import Any

import optree
import pytest
import torch
from support.helpers import leaves

import mpfunc

pytestmark = pytest.mark.xla

HERE = pathlib.Path(__file__).resolve()
WORLD = 2
WARMUP, STEPS = 2, 3
# One graph per step holds every case. Each (call, dtype group) is one list all-reduce:
# the mixed case has a bf16 and an fp32 group, and on XLA ``bucket_bytes`` is not used.
CASES = (
    "mixed_fp32_mean",
    "fp16_sum",
    "bf16_inplace_fp32",
    "fp32_mean_small_buckets",
    "fp16_mean_near_max",
)
ALL_REDUCES_PER_STEP = 6


def count(name: str) -> int:
    import torch_xla.debug.metrics as met

    data = met.metric_data(name)
    return 0 if data is None else int(data[0])


def fallbacks() -> dict[str, int]:
    import torch_xla.debug.metrics as met

    return {n: int(met.counter_value(n)) for n in met.counter_names() if n.startswith("aten::")}


def case_inputs(case: str, rank: int, step: int) -> Any:
    """Participant ``rank``'s grads for ``case`` at ``step`` (CPU; deterministic)."""
    gen = torch.Generator().manual_seed(1000 * step + 100 * rank + CASES.index(case))

    def r(*shape: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.randn(shape, generator=gen).to(dtype)

    bf, hf, f = torch.bfloat16, torch.float16, torch.float32
    if case == "mixed_fp32_mean":
        return {"w": r(3, 5, dtype=bf), "b": [r(7, dtype=bf), None], "s": r(dtype=f)}
    if case == "fp16_sum":
        return {"w": r(4, 2, dtype=hf), "none": None, "b": (r(3, dtype=hf), r(2, 2, dtype=hf))}
    if case == "bf16_inplace_fp32":
        return [r(6, dtype=bf), None, {"k": r(2, 3, dtype=bf)}]
    if case == "fp16_mean_near_max":
        # Every participant's sum of two such grads overflows fp16; their mean does not.
        big = torch.tensor([40000.0, -40000.0, 65504.0, 1.0]) * (1 + rank)
        return {"h": big.clamp(-65504, 65504).to(hf), "small": r(3, dtype=hf)}
    return {"a": r(5, dtype=f), "b": r(4, 4, dtype=f), "c": None, "d": r(9, dtype=f)}


def run_case(case: str, grads: Any) -> Any:
    if case == "mixed_fp32_mean":
        return mpfunc.all_reduce_grads(grads, reduce_dtype=torch.float32)
    if case == "fp16_sum":
        return mpfunc.all_reduce_grads(grads, op="sum")
    if case == "bf16_inplace_fp32":
        return mpfunc.all_reduce_grads_(grads, reduce_dtype=torch.float32)
    if case == "fp16_mean_near_max":
        return mpfunc.all_reduce_grads(grads)
    return mpfunc.all_reduce_grads(grads, bucket_bytes=16)


def reference(case: str, step: int, world: int) -> list[Any]:
    """The CPU reference: every participant's leaves summed (and averaged) in the
    reduce dtype, then returned in the dtype the call promises."""
    per_rank = [leaves(case_inputs(case, r, step)) for r in range(world)]
    out: list[Any] = []
    for parts in zip(*per_rank):
        if parts[0] is None:
            out.append(None)
            continue
        rdtype = (
            torch.float32 if case in ("mixed_fp32_mean", "bf16_inplace_fp32") else parts[0].dtype
        )
        if case == "fp16_mean_near_max":  # fp16: each divided first, as DDP does
            total = parts[0] / world
            for p in parts[1:]:
                total = total + p / world
            out.append(total)
            continue
        total = parts[0].to(rdtype)
        for p in parts[1:]:
            total = total + p.to(rdtype)
        if case != "fp16_sum":
            total = total * (1.0 / world)
        out.append(total.to(parts[0].dtype) if case == "bf16_inplace_fp32" else total)
    return out


def to(tree: Any, device: torch.device) -> Any:
    return optree.tree_map(lambda t: t.to(device), tree, namespace="mpfunc")


# ---------------------------------------------------------------------------
# The two-participant worker: one process, one thread per XLA CPU device.

_LOCK = threading.Lock()
_BARRIERS: list[threading.Barrier] = []


def _barrier() -> threading.Barrier:
    """One barrier for the threads of this (spawned) process, made by the first caller."""
    import torch_xla.runtime as xr

    with _LOCK:
        if not _BARRIERS:
            _BARRIERS.append(threading.Barrier(xr.addressable_device_count()))
    return _BARRIERS[0]


def _two_device_fn(index: int, out_dir: str) -> None:
    import torch_xla
    import torch_xla.runtime as xr

    barrier = _barrier()
    dev = torch_xla.device()
    rank, world = xr.global_ordinal(), xr.world_size()
    outs: list[dict[str, list[Any]]] = []
    info: dict[str, Any] = {"rank": rank, "world": world, "mpfunc_fallbacks": {}}

    for step in range(WARMUP + STEPS):
        if step == WARMUP:
            barrier.wait()  # both threads warmed up
            info["before"] = (count("CompileTime"), count("TransferFromDeviceTime"))
            barrier.wait()
        # Tracing runs in both threads at once: the first call of each case compares the
        # participants' trees (mpfunc's fingerprint exchange), which waits for the peer's
        # same call, so no lock may be held across it.
        grads = {c: to(case_inputs(c, rank, step), dev) for c in CASES}
        before = fallbacks()
        res = {c: leaves(run_case(c, grads[c])) for c in CASES}
        after = fallbacks()
        for n, v in after.items():
            if v != before.get(n, 0):
                info["mpfunc_fallbacks"][n] = v - before.get(n, 0)
        if step == 0:
            live = [t for c in CASES for t in res[c] if t is not None]
            hlo = torch_xla._XLAC._get_xla_tensors_hlo(live)
            info["all_reduces"] = hlo.count(" all-reduce(")
        # Catch 1: one thread compiles at a time, so both run one executable.
        with _LOCK:
            torch_xla.sync()
        # Catch 2: both threads launch step k before either starts step k + 1. (A
        # thread that took the lock first would wait, holding it, for its step k to
        # finish, which waits for the peer's step k, which waits for the lock.)
        barrier.wait()
        outs.append(res)
    barrier.wait()
    info["after"] = (count("CompileTime"), count("TransferFromDeviceTime"))
    barrier.wait()
    host = [{c: [None if t is None else t.cpu() for t in res[c]] for c in CASES} for res in outs]

    # Catch 3, last because it is an error: bf16 reduced in bf16.
    bf = to(case_inputs("bf16_inplace_fp32", rank, 0), dev)
    kept = mpfunc.all_reduce_grads(bf)  # kept alive, so sync() compiles it
    with _LOCK:
        try:
            torch_xla.sync()
            info["bf16_error"] = None
        except ValueError as e:
            info["bf16_error"] = str(e)
        del kept
    torch.save({"info": info, "outs": host}, pathlib.Path(out_dir) / f"rank{rank}.pt")


def _main_two_devices(out_dir: str) -> None:
    import torch_xla.distributed.xla_multiprocessing as xmp

    xmp.spawn(_two_device_fn, args=(out_dir,))


def _main_spmd(out_dir: str) -> None:
    """A batch-sharded linear model on a 2-device mesh; saves its grads and what
    ``all_reduce_grads`` makes of them."""
    import numpy as np
    import torch_xla
    import torch_xla.runtime as xr

    xr.use_spmd()
    import torch_xla.distributed.spmd as xs

    n = xr.global_runtime_device_count()
    mesh = xs.Mesh(np.arange(n), (n,), ("data",))
    torch.manual_seed(0)
    w0, b0 = torch.randn(3, 5), torch.randn(3)
    w = w0.to("xla").requires_grad_()
    b = b0.to("xla").requires_grad_()
    saved: list[Any] = []
    compiles = transfers = -1
    for step in range(WARMUP + STEPS):
        if step == WARMUP:
            compiles, transfers = count("CompileTime"), count("TransferFromDeviceTime")
        gen = torch.Generator().manual_seed(step)
        x_cpu = torch.randn(8, 5, generator=gen)
        x = x_cpu.to("xla")
        xs.mark_sharding(x, mesh, ("data", None))
        ((x @ w.T + b).square().mean()).backward()
        grads = {"w": w.grad, "b": b.grad, "none": None}
        red = mpfunc.all_reduce_grads(grads, reduce_dtype=torch.float32)
        torch_xla.sync()
        saved.append((x_cpu, grads["w"], grads["b"], red["w"], red["b"]))
        w.grad = b.grad = None
    info = {
        "devices": n,
        "world": xr.world_size(),
        "new_compiles": count("CompileTime") - compiles,
        "new_transfers": count("TransferFromDeviceTime") - transfers,
    }
    host = [tuple(t.cpu() for t in s) for s in saved]
    torch.save({"info": info, "w0": w0, "b0": b0, "steps": host}, pathlib.Path(out_dir) / "spmd.pt")


def _main_probe(out_dir: str) -> None:
    """One of two processes a launcher would start: what does torch_xla see?"""
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    rank = int(os.environ["PJRT_LOCAL_PROCESS_RANK"])
    t = torch.full((4,), float(rank + 1), device=torch_xla.device())
    xm.all_reduce(xm.REDUCE_SUM, [t])
    torch_xla.sync()
    seen = {
        "world": xr.world_size(),
        "ordinal": xr.global_ordinal(),
        "devices": xr.global_runtime_device_count(),
        "reduced": t.cpu().tolist(),
    }
    torch.save(seen, pathlib.Path(out_dir) / f"probe{rank}.pt")


# ---------------------------------------------------------------------------
# Launching.


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "PJRT_", "CPU_NUM"))}
    path = os.pathsep.join(filter(None, [str(HERE.parents[1]), env.get("PYTHONPATH")]))
    env.update(PJRT_DEVICE="CPU", OMP_NUM_THREADS="1", PYTHONPATH=path, **extra)
    return env


def _launch(mode: str, out: pathlib.Path, timeout: float, **extra: str) -> None:
    r = subprocess.run(
        [sys.executable, str(HERE), mode, str(out)],
        env=_env(**extra),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert r.returncode == 0, f"{mode} failed ({r.returncode}):\n{r.stderr[-4000:]}"


@pytest.fixture(scope="module")
def two_devices(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("xla_two_devices")
    _launch("two-devices", out, timeout=120, CPU_NUM_DEVICES=str(WORLD))
    return [torch.load(out / f"rank{r}.pt") for r in range(WORLD)]


def test_two_devices_match_the_cpu_reference(two_devices: list[dict[str, Any]]) -> None:
    """Every participant gets the CPU sum or mean of all participants' grads, bit for
    bit (two addends round once), in the promised dtype, with ``None`` kept."""
    assert sorted(d["info"]["rank"] for d in two_devices) == list(range(WORLD))
    for d in two_devices:
        assert d["info"]["world"] == WORLD
        for step, res in enumerate(d["outs"]):
            for case in CASES:
                want = reference(case, step, WORLD)
                got = res[case]
                assert len(got) == len(want)
                for i, (g, w) in enumerate(zip(got, want)):
                    where = f"rank {d['info']['rank']} step {step} {case} leaf {i}"
                    if w is None:
                        assert g is None, where
                        continue
                    assert g.dtype == w.dtype, where
                    assert torch.equal(g, w), f"{where}: {g} != {w}"


def test_two_devices_reduce_in_graph_without_recompiles(
    two_devices: list[dict[str, Any]],
) -> None:
    """One all-reduce per call and dtype group in the step's graph; after warm-up,
    no new compile, no device-to-host transfer, no ``aten::`` fallback."""
    info = two_devices[0]["info"]
    assert info["all_reduces"] == ALL_REDUCES_PER_STEP
    assert info["after"][0] == info["before"][0], "a measured step compiled a new graph"
    assert info["after"][1] == info["before"][1], "a step read a tensor back to the host"
    for d in two_devices:
        assert d["info"]["mpfunc_fallbacks"] == {}


def test_bf16_reduced_in_bf16_is_rejected_by_xla_cpu(two_devices: list[dict[str, Any]]) -> None:
    """A limit of XLA:CPU, not of mpfunc: a clear error at compile time, not a hang.
    If a later torch_xla lifts it, this test says so and can check bf16 values."""
    for d in two_devices:
        assert d["info"]["bf16_error"] == "AllReduce for datatype 'bf16' is not supported"


def test_spmd_grads_are_already_reduced(tmp_path: pathlib.Path) -> None:
    """Under SPMD the batch-sharded grads equal the full-batch CPU grads, and
    ``all_reduce_grads`` leaves them as they are (world size 1: no double count)."""
    _launch("spmd", tmp_path, timeout=120, CPU_NUM_DEVICES=str(WORLD))
    saved = torch.load(tmp_path / "spmd.pt")
    info = saved["info"]
    assert (info["devices"], info["world"]) == (WORLD, 1)
    assert info["new_compiles"] == 0 and info["new_transfers"] == 0
    for x, gw, gb, rw, rb in saved["steps"]:
        w = saved["w0"].clone().requires_grad_()
        b = saved["b0"].clone().requires_grad_()
        ((x @ w.T + b).square().mean()).backward()
        assert w.grad is not None and b.grad is not None
        torch.testing.assert_close(gw, w.grad, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(gb, b.grad, rtol=1e-5, atol=1e-6)
        assert torch.equal(rw, gw) and torch.equal(rb, gb)


def test_separate_processes_do_not_join(tmp_path: pathlib.Path) -> None:
    """Pins a torch_xla 2.9 limit: two CPU processes (as a launcher would start them)
    each see a world of one, and ``xm.all_reduce`` leaves each its own values. If this
    fails, multi-process CPU collectives arrived and the tests above can use them."""
    procs = [
        subprocess.Popen(
            [sys.executable, str(HERE), "probe", str(tmp_path)],
            env=_env(PJRT_LOCAL_PROCESS_COUNT=str(WORLD), PJRT_LOCAL_PROCESS_RANK=str(r)),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(WORLD)
    ]
    try:
        for p in procs:
            _, err = p.communicate(timeout=90)
            assert p.returncode == 0, err[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for r in range(WORLD):
        seen = torch.load(tmp_path / f"probe{r}.pt")
        assert seen == {"world": 1, "ordinal": 0, "devices": 1, "reduced": [r + 1.0] * 4}


# ---------------------------------------------------------------------------
# One participant, in this process.


@pytest.mark.parametrize("forced", [False, True], ids=["no-op", "forced-all-reduce"])
def test_world_of_one_is_identity_in_graph(
    xla_device: torch.device, forced: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """World size 1: sum and mean equal the input. torch_xla drops the collective
    then; ``XLA_ALWAYS_ALLREDUCE=1`` keeps a real one in the graph (fp32 only: see
    the bf16 limit above). Warm, a step compiles nothing and reads nothing back."""
    import torch_xla
    import torch_xla.runtime as xr

    assert xr.world_size() == 1
    if forced:
        monkeypatch.setenv("XLA_ALWAYS_ALLREDUCE", "1")
    rdtype = torch.float32 if forced else None
    steps: list[tuple[Any, Any, Any]] = []
    before = after = (0, 0)
    for step in range(WARMUP + STEPS):
        if step == WARMUP:
            before = (count("CompileTime"), count("TransferFromDeviceTime"))
        host = case_inputs("mixed_fp32_mean", 0, step)
        grads = to(host, xla_device)
        mean = mpfunc.all_reduce_grads(grads, reduce_dtype=rdtype)
        total = mpfunc.all_reduce_grads(grads, op="sum", reduce_dtype=rdtype)
        if step == 0:
            live = [t for t in leaves(mean) + leaves(total) if t is not None]
            hlo = torch_xla._XLAC._get_xla_tensors_hlo(live)
            assert hlo.count(" all-reduce(") == (4 if forced else 0)
        torch_xla.sync()
        steps.append((host, mean, total))
    after = (count("CompileTime"), count("TransferFromDeviceTime"))
    assert after[0] == before[0], "a measured step compiled a new graph"
    assert after[1] == before[1], "a step read a tensor back to the host"
    for host, mean, total in steps:
        for h, m, s in zip(leaves(host), leaves(mean), leaves(total)):
            if h is None:
                assert m is None and s is None
                continue
            want = h if rdtype is None else h.to(rdtype)
            assert torch.equal(m.cpu(), want) and torch.equal(s.cpu(), want)


if __name__ == "__main__":
    mode, out_dir = sys.argv[1], sys.argv[2]
    {"two-devices": _main_two_devices, "spmd": _main_spmd, "probe": _main_probe}[mode](out_dir)

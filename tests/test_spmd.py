"""XLA SPMD: data parallelism and sharded masters on torch_xla's own sharding engine.

SPMD is process-wide in torch_xla, so the XLA checks run in fresh processes
(``tests/workers/spmd_worker.py``) on ``PJRT_DEVICE=CPU`` with 4 virtual devices, then 2
for the resumed run; the tests below assert on what they report. The cases (mode x
optimizer, see ``CASES`` there) train a bf16 MLP on a batch sharded over the mesh axis
``data``: ``dp`` (everything else replicated), ``zero1`` (masters, state and fp32 grad
buffers sharded by ``mpfunc.mark_sharding_``, params replicated) and ``fsdp`` (params
sharded, the rest inherits).

The bound for comparisons with one device (the CPU, eager, whole batch), after N steps:
max|masters - reference| <= 1e-3 * max|reference| per leaf. The model computes in fp32
from bf16 params, so the partitioner's reduction over batch shards differs from one device
only in the order of fp32 sums; the rest of the difference is a bf16 param that rounds the
other way (one ulp, 2^-8 relative) and what the optimizer makes of it (measured: 1e-4
after 7 steps, 3e-4 after 10). Two cases compare coarser values, with their own bounds:
8-bit moments (1e-2: a moment one code apart moves a step by up to ~10%; measured 3.3e-3)
and the strategies whose masters are the bf16 params themselves, compared as params
(2^-5, eight bf16 ulps of the largest element; measured 8e-4 kahan, 1.6e-3 none, 3.1e-3
remainder, 1.7e-2 stochastic, whose rounding draws follow the value being rounded).

Per-device memory is measured from the device buffers: ``_get_local_shards`` returns every
shard as it lies on its device, and each device's shard bytes are summed
(``bench.common.spmd.device_bytes``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys
import types
from typing import Any

import pytest
import torch

import mpfunc
from mpfunc.parallel import _sharding

REPO = pathlib.Path(__file__).resolve().parent.parent
WORKER = REPO / "tests" / "workers" / "spmd_worker.py"
BOUND = 1e-3
BOUND_UINT8 = 1e-2
BOUND_PARAMS = 2**-5
STRATEGIES = ("remainder", "kahan", "stochastic", "none")
R4 = "{replicated}"


def spmd_process(args: list[str], devices: int) -> subprocess.CompletedProcess[str]:
    """Runs ``python ARGS`` with ``devices`` virtual XLA:CPU devices; fails on an error."""
    if importlib.util.find_spec("torch_xla") is None:
        if os.environ.get("MPFUNC_REQUIRE_XLA") == "1":
            pytest.fail("torch_xla is required (MPFUNC_REQUIRE_XLA=1) but does not import")
        pytest.skip("torch_xla is not installed")
    # LLVM's optimizations off: XLA:CPU compiles each step graph ~3x faster. The SPMD
    # partitioner (shardings, collectives) runs before and is unaffected.
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()
    env = dict(
        os.environ,
        PJRT_DEVICE="CPU",
        CPU_NUM_DEVICES=str(devices),
        OMP_NUM_THREADS="1",
        XLA_FLAGS=flags,
    )
    proc = subprocess.run(
        [sys.executable, *args], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, f"{args} failed:\n{proc.stderr[-4000:]}"
    return proc


def run_worker(scenario: str, devices: int, out: pathlib.Path) -> dict[str, Any]:
    spmd_process([str(WORKER), scenario, str(out)], devices)
    result: dict[str, Any] = json.loads((out / f"{scenario}.json").read_text())
    return result


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("spmd")
    return {"train": run_worker("train", 4, out), "resume": run_worker("resume", 2, out)}


def cases(runs: dict[str, Any]) -> dict[str, Any]:
    result: dict[str, Any] = runs["train"]["cases"]
    return result


@pytest.mark.xla
def test_every_transform_keeps_shardings(runs: dict[str, Any]) -> None:
    # Checked after init, after each transform of every step (the annotation) and after
    # each step's sync (the buffers): params, masters, state, step counts, grad buffers.
    for name, c in cases(runs).items():
        assert c["bad_specs"] == [], (name, c["bad_specs"][:10])
    assert runs["resume"]["bad_specs"] == []


@pytest.mark.xla
def test_shardings_observed(runs: dict[str, Any]) -> None:
    sharded = {
        "fc1.weight": "{devices=[4,1]0,1,2,3}",
        "fc1.bias": R4,  # 64 elements: under mark_sharding_'s 1024
        "fc2.weight": "{devices=[4,1]0,1,2,3}",
        "fc2.bias": R4,
        "fc3.weight": "{devices=[1,4]0,1,2,3}",  # (16, 64): the larger dimension
        "fc3.bias": R4,
    }
    replicated = dict.fromkeys(sharded, R4)
    c = cases(runs)
    for name, masters, params in [
        ("dp-adamw", replicated, replicated),
        ("zero1-adamw", sharded, replicated),  # ZeRO-1: params come back replicated
        ("zero1-adamw-pure", sharded, replicated),
        ("fsdp-adamw", sharded, sharded),
    ]:
        assert c[name]["specs"] == masters, name
        assert c[name]["param_specs"] == params, name
        assert c[name]["params_are_rounded_masters"], name


@pytest.mark.xla
def test_sharding_rule(runs: dict[str, Any]) -> None:
    assert runs["train"]["rule"] == {
        "odd": R4,  # (33, 35): no dimension divides by 4
        "small": R4,  # 64 elements
        "zero_d": R4,
        "long": "{devices=[1,4]0,1,2,3}",  # (4, 1024): the largest dimension
        "tie": "{devices=[4,1]0,1,2,3}",  # (32, 32): the first of equals
    }


@pytest.mark.xla
def test_one_graph_per_step_no_compiles_no_transfers(runs: dict[str, Any]) -> None:
    want = {
        "CompileTime": 0,
        "ExecuteReplicatedTime": 5,  # 5 measured steps, one graph each
        "TransferFromDeviceTime": 0,
        "TransferToDeviceTime": 0,
    }
    for name, c in cases(runs).items():
        assert c["counts"] == want, name


@pytest.mark.xla
def test_matches_one_device(runs: dict[str, Any]) -> None:
    c = cases(runs)
    assert {f"fsdp-adamw-{s}" for s in STRATEGIES} <= set(c)  # each master strategy
    for name, r in c.items():
        if r["compared"] == "params":
            bound = BOUND_PARAMS
        else:
            bound = BOUND_UINT8 if name.endswith("uint8") else BOUND
        assert r["err_vs_cpu"] <= bound, (name, r["err_vs_cpu"])
    # Sharding the masters and state changes no bit: the update is elementwise.
    assert c["zero1-adamw"]["err_vs_cpu"] == c["dp-adamw"]["err_vs_cpu"]
    assert c["zero1-adamw-pure"]["err_vs_cpu"] == c["dp-adamw"]["err_vs_cpu"]


@pytest.mark.xla
def test_memory_per_device(runs: dict[str, Any]) -> None:
    for name, c in cases(runs).items():
        per = c["device_bytes"]
        assert sorted(per) == [f"CPU:{i}" for i in range(4)], name
        assert set(per.values()) == {c["expected_device_bytes"]}, (name, per)
        ratio = c["expected_device_bytes"] / c["full_bytes"]
        if name.startswith("dp"):
            assert ratio == 1, name
        else:  # about 1/4: only the biases, 8-bit scales (under 1024 elements), step
            # counts and RNG keys are whole
            assert 0.25 < ratio < 0.29, (name, ratio)


@pytest.mark.xla
def test_checkpoint_resumes_on_two_devices(runs: dict[str, Any]) -> None:
    r = runs["resume"]
    assert r["devices"] == 2
    assert r["loads_agree"]  # torch.distributed.checkpoint and mpfunc.load_
    assert r["specs"]["fc1.weight"] == "{devices=[2,1]0,1}"
    assert r["specs"]["fc3.weight"] == "{devices=[1,2]0,1}"
    assert r["steps"] == 10
    assert r["err_vs_cpu"] <= BOUND


@pytest.mark.xla
def test_example() -> None:
    """examples/spmd_train.py, each pattern at a tiny size: loss falls, and the sharded
    patterns hold about 1/4 of the masters and state on each device."""
    example = str(REPO / "examples" / "spmd_train.py")
    out = spmd_process([example, "--steps", "20", "--mode", "dp", "zero1", "fsdp"], 4).stdout
    for mode in ("dp", "zero1", "fsdp"):
        losses = [
            float(ln.split("loss ")[1])
            for ln in out.splitlines()
            if ln.startswith(mode) and "loss" in ln
        ]
        assert len(losses) == 3 and losses[-1] < 0.8 * losses[0], (mode, out)
        (line,) = [ln for ln in out.splitlines() if ln.startswith(mode) and "per device" in ln]
        held, full = line.split(": ")[1].split(" of ")
        per = [int(b) for b in held.split()]
        assert len(per) == 4 and len(set(per)) == 1, line
        assert per[0] / int(full) == 1 if mode == "dp" else 0.25 < per[0] / int(full) < 0.3


# Run under SPMD with 4 devices: a pending tensor re-marked (torch_xla re-annotates it)
# beside a computed one whose sharding would change (torch_xla refuses that one).
REMARK = """
import json, sys
import numpy as np, torch, torch_xla, torch_xla.runtime as xr
xr.use_spmd()
import torch_xla.distributed.spmd as xs
import mpfunc
spec = torch_xla._XLAC._get_xla_sharding_spec
data = xs.Mesh(np.arange(4), (4,), ("data",))
grid = xs.Mesh(np.arange(4), (2, 2), ("data", "model"))
d = torch_xla.device()
host = {"a": torch.randn(64, 64), "b": torch.randn(64, 32)}
tree = {k: t.to(d) for k, t in host.items()}
mpfunc.mark_sharding_(tree, data, "data")
torch_xla.sync()
mpfunc.mark_sharding_(tree, data, "data")  # the same shardings again: nothing to do
tree["a"].add_(1)  # pending again: torch_xla would re-annotate this one
before = {k: spec(t) for k, t in tree.items()}
try:
    mpfunc.mark_sharding_(tree, grid, "model")
    error = None
except ValueError as e:
    error = str(e)
after = {k: spec(t) for k, t in tree.items()}
mpfunc.mark_sharding_({"a": tree["a"]}, grid, "model")  # a pending tensor: still re-marked
torch_xla.sync()
same = torch.equal(tree["a"].cpu(), host["a"] + 1) and torch.equal(tree["b"].cpu(), host["b"])
out = {"error": error, "before": before, "after": after, "a": spec(tree["a"]), "same": same}
json.dump(out, sys.stdout)
"""


@pytest.mark.xla
def test_mark_sharding_says_a_computed_tensor_cannot_change_its_sharding() -> None:
    """torch_xla refuses to change the sharding of a tensor that holds data ("Existing
    annotation must be cleared first" and a protobuf dump). mark_sharding_ says which leaf,
    its sharding and the one asked for, and what to do, before annotating any leaf; the
    same sharding again is a no-op, and a pending tensor is re-annotated as before."""
    r = json.loads(spmd_process(["-c", REMARK], 4).stdout)
    assert r["error"] is not None, r
    assert re.fullmatch(
        r"mark_sharding_: at 'tree\.b': expected a tensor without a sharding, or one sharded "
        r"as this call shards it \(\{devices=\[2,1,2\]0,2,1,3 last_tile_dim_replicate\}\), "
        r"got a computed tensor already sharded as \{devices=\[4,1\]0,1,2,3\}\. torch_xla "
        r"cannot change the sharding of a tensor that holds data: leave it as it is, or call "
        r"torch_xla\.distributed\.spmd\.clear_sharding\(t\) on it first",
        r["error"],
    ), r["error"]
    assert r["after"] == r["before"], "a leaf was annotated before the refusal"
    assert r["a"] == "{devices=[2,1,2]0,2,1,3 last_tile_dim_replicate}"
    assert r["same"], "a value changed"


# --- without SPMD (this process) ----------------------------------------------------------


def test_partition_spec_rule() -> None:
    spec = _sharding.partition_spec
    assert spec((64, 32), "d", 4, 1024) == ("d", None)
    assert spec((16, 64), "d", 4, 1024) == (None, "d")
    assert spec((32, 32), "d", 4, 1024) == ("d", None)
    assert spec((33, 35), "d", 4, 1024) == (None, None)
    assert spec((64,), "d", 4, 1024) == (None,)
    assert spec((64,), "d", 4, 0) == ("d",)
    assert spec((), "d", 4, 0) == ()
    assert spec((2, 4096), "d", 8, 0) == (None, "d")
    assert spec((64, 64), "d", 1, 0) == (None, None)


MESH = types.SimpleNamespace(axis_names=("data",), mesh_shape=(4,))


@pytest.mark.parametrize(
    ("mesh", "axis", "kw", "err", "match"),
    [
        (object(), "data", {}, TypeError, "mesh: expected a torch_xla"),
        (MESH, "model", {}, ValueError, r"axis: expected one of the mesh's axes \('data',\)"),
        (MESH, 1, {}, ValueError, "an index below 1"),
        (MESH, "data", {"min_numel": -1}, ValueError, "min_numel"),
        (MESH, "data", {}, TypeError, r"at 'tree.w': expected a tensor on the XLA device"),
    ],
)
def test_mark_sharding_refuses(
    mesh: Any, axis: Any, kw: dict[str, Any], err: type[Exception], match: str
) -> None:
    tree = {"w": torch.zeros(8, 8)}
    with pytest.raises(err, match=match):
        mpfunc.mark_sharding_(tree, mesh, axis, **kw)


@pytest.mark.xla
def test_mark_sharding_needs_spmd(xla_device: torch.device) -> None:
    with pytest.raises(RuntimeError, match="use_spmd"):
        mpfunc.mark_sharding_({"w": torch.zeros(8, 8, device=xla_device)}, MESH, "data")


def test_no_op_without_spmd(device: torch.device) -> None:
    a, b = torch.zeros(4, 4, device=device), torch.ones(4, 4, device=device)
    assert _sharding.like_(a, b) is a
    with _sharding.kept(iter([a, b])):
        a.add_(1)
    assert not _sharding.active()


def _dump_hlo(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker's step graphs as text under ``tmp_path / "hlo"`` (each graph's final
    HLO only), where the worker counts their collectives."""
    monkeypatch.setenv("MPFUNC_HLO_DUMP", str(tmp_path / "hlo"))
    monkeypatch.setenv(
        "XLA_FLAGS",
        f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={tmp_path / 'hlo'} "
        "--xla_dump_hlo_as_text --xla_dump_hlo_pass_re=^$",
    )


@pytest.mark.xla
def test_tie_bits_follow_the_param_where_the_bytes_split_evenly(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A remainder's tie bytes (8 elements of the last dim a byte) take the param's
    sharding where every shard of the last dim holds whole bytes; then the step's graph
    has no collective at all. Where a shard would start inside a byte, the tie bytes'
    last dim is replicated (the other dims split as the param's) and the step still
    exchanges bits (measured below: packing elements of two devices into one byte cannot
    be done without); the results equal the CPU's bit for bit either way, ties included."""
    _dump_hlo(tmp_path, monkeypatch)
    r = run_worker("ties", 4, tmp_path)
    for name, c in r.items():
        assert c["equal"] and c["ties_set"] > 0, (name, c)
    # Even: the tie bytes split as the param, no collective in the step.
    assert r["rows"]["ties_spec"] == r["rows"]["param_spec"] == "{devices=[4,1]0,1,2,3}"
    assert r["last_even"]["ties_spec"] == r["last_even"]["param_spec"] == "{devices=[1,4]0,1,2,3}"
    for name in ("rows", "last_even"):
        assert r[name]["collectives"] == {}, (name, r[name]["collectives"])
    # Uneven: the last dim replicated; the rows still split where the param's are.
    assert r["last_odd"]["ties_spec"] == r["vector_odd"]["ties_spec"] == R4
    assert r["two_axes_odd"]["param_spec"] == "{devices=[2,2]0,1,2,3}"
    assert r["two_axes_odd"]["ties_spec"] == "{devices=[2,1,2]0,1,2,3 last_tile_dim_replicate}"
    for name in ("last_odd", "vector_odd", "two_axes_odd"):
        assert r[name]["collectives"], name  # (not avoidable: see the docstring)


@pytest.mark.xla
def test_uint4_codes_follow_a_dim0_split(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """4-bit moments are flat (codes two a byte and bf16 block scales, in the master's
    row-major element order). Where the master is split along dim 0 alone, evenly, with a
    multiple of 32 elements a device, each device's rows are one flat range: ``opt.init``
    splits codes and scales the same way, and the steps' graphs have no collective. A split
    of another dim leaves them replicated (each step then all-gathers the new codes and
    scales). Codes and scales equal the CPU's bit for bit either way."""
    _dump_hlo(tmp_path, monkeypatch)
    r = run_worker("uint4", 4, tmp_path)
    for name, c in r.items():
        assert c["codes_equal"] and c["master_err"] <= BOUND, (name, c)
    rows, cols = r["rows"], r["columns"]
    assert rows["master_spec"] == "{devices=[4,1]0,1,2,3}"
    assert rows["codes_spec"] == rows["scale_spec"] == "{devices=[4]0,1,2,3}"
    assert rows["collectives"] == {}, rows["collectives"]
    assert cols["codes_spec"] == cols["scale_spec"] == R4
    assert cols["collectives"], cols  # (the measured cost of replicated codes)

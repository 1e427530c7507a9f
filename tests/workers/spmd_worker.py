"""The XLA SPMD tests' worker: ``python tests/workers/spmd_worker.py SCENARIO OUT``.

SPMD is process-wide in torch_xla (``use_spmd()`` must come before the first XLA tensor,
and the rest of the suite runs without it), so tests/test_spmd.py runs this in a fresh
process with ``PJRT_DEVICE=CPU CPU_NUM_DEVICES=N``. It writes ``OUT/SCENARIO.json`` (and
checkpoints); the test asserts on what it reports.

* ``train`` (4 devices): every case of ``CASES`` trains a small bf16 MLP whose global
  batch is sharded over the mesh axis ``data``, recording each tree's sharding spec after
  each transform (before the step's sync: the annotation; after it: the buffers), the
  compiles, graph executions and host transfers of the measured steps, the bytes each
  device holds for masters and state (``bench.common.spmd.device_bytes``), and the
  largest difference from the same training on the CPU (one device, eager). One case also
  saves its masters and state with ``torch.distributed.checkpoint`` and ``mpfunc.save``.
* ``resume`` (2 devices): loads both checkpoints onto a 2-device mesh, trains on, and
  compares with the CPU run continued.
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any, NamedTuple

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE.parent.parent)]  # tests/ (support), repo (bench)

import mpfunc  # noqa: E402

WARMUP, MEASURED = 2, 5
STEPS = WARMUP + MEASURED  # the train scenario's steps; resume runs RESUMED more
RESUMED = 3
BATCH = 16
SHAPES = {
    "fc1.weight": (64, 32),  # split along dim 0
    "fc1.bias": (64,),  # under 1024 elements: replicated
    "fc2.weight": (64, 64),
    "fc2.bias": (64,),
    "fc3.weight": (16, 64),  # split along dim 1, the larger
    "fc3.bias": (16,),
}
OPTS = {
    "sgd": lambda: mpfunc.sgd(lr=5e-2, momentum=0.9, weight_decay=1e-4),
    "adam": lambda: mpfunc.adam(lr=1e-2, weight_decay=1e-4),
    "adamw": lambda: mpfunc.adamw(lr=1e-2, weight_decay=1e-2),
    "adamw-bf16": lambda: mpfunc.adamw(lr=1e-2, weight_decay=1e-2, state_dtype=torch.bfloat16),
    # 8-bit moments need whole 32-element blocks: small biases keep fp32 moments.
    "adamw-uint8": lambda: mpfunc.partition(
        {
            "q": mpfunc.adamw(lr=1e-2, weight_decay=1e-2, state_dtype=torch.uint8),
            "f": mpfunc.adamw(lr=1e-2, weight_decay=1e-2),
        },
        lambda path, p: "q" if p.numel() >= 32 else "f",
    ),
}


class Case(NamedTuple):
    """One training of the train scenario.

    mode: ``dp`` (params, masters and state replicated: plain data parallel),
    ``zero1`` (params replicated; masters, state and the fp32 grad buffers sharded by
    ``mpfunc.mark_sharding_``) or ``fsdp`` (params sharded too; the masters inherit).
    """

    mode: str
    opt: str
    pure: bool = False  # the pure transforms instead of the in-place twins
    checkpoint: bool = False  # save masters and state after the last step
    strategy: str = "fp32"  # init_master's; the others keep the param itself in the master


# A new optimizer or master strategy is one more line.
CASES = [
    Case("dp", "adamw"),
    Case("zero1", "sgd"),
    Case("zero1", "adam"),
    Case("zero1", "adamw", checkpoint=True),
    Case("zero1", "adamw", pure=True),
    Case("fsdp", "adamw"),
    Case("zero1", "adamw-bf16"),
    Case("zero1", "adamw-uint8"),  # 8-bit codes like the master; scales marked by the rule
    *(Case("fsdp", "adamw", strategy=s) for s in ("remainder", "kahan", "stochastic", "none")),
]


def case_name(c: Case) -> str:
    strategy = "" if c.strategy == "fp32" else f"-{c.strategy}"
    return f"{c.mode}-{c.opt}{strategy}" + ("-pure" if c.pure else "")


def init_params() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        n: (torch.randn(s, generator=gen) * (0.3 if len(s) > 1 else 0.1)).bfloat16()
        for n, s in SHAPES.items()
    }


def batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [
        (torch.randn(BATCH, 32, generator=gen).bfloat16(), torch.randn(BATCH, 16, generator=gen))
        for _ in range(n)
    ]


def loss_fn(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    # bf16 params, fp32 compute: the partitioner then sums the grads over the batch's
    # shards in fp32 (before the cast to the params' bf16), so the comparison with one
    # device measures mpfunc under SPMD, not how bf16 partial sums round.
    p = {n: t.float() for n, t in params.items()}
    h = torch.tanh(x.float() @ p["fc1.weight"].T + p["fc1.bias"])
    h = torch.tanh(h @ p["fc2.weight"].T + p["fc2.bias"])
    out = h @ p["fc3.weight"].T + p["fc3.bias"]
    return torch.nn.functional.mse_loss(out, y)


def cpu_reference(opt_name: str, steps: int, strategy: str = "fp32") -> dict[str, torch.Tensor]:
    """The same training on one device: the CPU, eager, the whole batch. Returns the fp32
    masters, or for the other strategies the params (what their masters hold)."""
    params = {n: t.requires_grad_() for n, t in init_params().items()}
    masters = mpfunc.init_master(params, strategy=strategy)
    opt = OPTS[opt_name]()
    state = opt.init(masters)
    for x, y in batches(steps):
        loss_fn(params, x, y).backward()
        grads = {n: p.grad for n, p in params.items()}
        mpfunc.apply_update_(masters, grads, state, opt, params=params)
        for p in params.values():
            p.grad = None
    return masters if strategy == "fp32" else {n: p.detach() for n, p in params.items()}


def rel_err(a: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    """max over leaves of max|a - ref| / max|ref|."""
    return max(
        float((a[n].detach().cpu().double() - r.double()).abs().max() / r.abs().max())
        for n, r in ref.items()
    )


class Run:
    """The process's SPMD set-up: mesh, devices and torch_xla's counters."""

    def __init__(self) -> None:
        import torch_xla
        import torch_xla.core.xla_model as xm
        import torch_xla.runtime as xr

        xr.use_spmd()
        from bench.common import spmd

        self.xla, self.xm, self.spmd = torch_xla, xm, spmd
        self.n = xr.global_runtime_device_count()
        self.mesh = spmd.mesh()
        self.device = torch_xla.device()

    def sync(self) -> None:
        self.xla.sync()
        self.xm.wait_device_ops()

    def count(self, name: str) -> int:
        import torch_xla.debug.metrics as met

        data = met.metric_data(name)
        return 0 if data is None else int(data[0])

    def to_device(self, t: torch.Tensor, sharded: bool) -> torch.Tensor:
        import torch_xla.distributed.spmd as xs

        out = t.to(self.device)
        if sharded:
            xs.mark_sharding(out, self.mesh, ("data",) + (None,) * (t.dim() - 1))
        return out

    def expected(self, t: torch.Tensor, sharded: bool) -> str:
        """The spec a leaf should have: ``mark_sharding_``'s rule, or replicated."""
        from mpfunc.parallel import _sharding

        if not sharded:
            return "{replicated}"
        pspec = _sharding.partition_spec(t.shape, "data", self.n, _sharding.MIN_NUMEL)
        return self.spmd.expected_spec(t.shape, pspec, self.n)

    def expected_bytes(self, t: torch.Tensor, sharded: bool) -> int:
        """A leaf's bytes on each device: split evenly where ``expected`` shards it."""
        split = "devices=" in self.expected(t, sharded)
        return t.numel() * t.element_size() // (self.n if split else 1)

    def tie_bytes_change(self, unit: Any, sharded: bool) -> int:
        """A remainder's tie bits are split as its param (each shard padded to whole rows of
        the split), where ``expected_bytes`` splits them by their own size: the change."""
        if not isinstance(unit, mpfunc.RemainderMaster):
            return 0
        t = unit.ties
        spec = self.expected(unit.param, sharded)
        if "devices=" not in spec:
            return -self.expected_bytes(t, sharded) + t.numel() * t.element_size()
        tiles = [int(x) for x in spec.split("[")[1].split("]")[0].split(",")]
        per = 1
        for size, n in zip(t.shape, tiles):
            per *= -(-size // n)
        return per * t.element_size() - self.expected_bytes(t, sharded)

    def check(self, where: str, tree: Any, sharded: bool, bad: list[str]) -> None:
        """Appends every leaf of ``tree`` whose spec is not the expected one."""
        leaves, _ = mpfunc.core._tree.flatten(tree)
        paths = mpfunc.core._tree.leaf_paths(tree)
        for i, (path, t) in enumerate(zip(paths, leaves)):
            if t is None:
                continue
            want = self.expected(t, sharded)
            if path.endswith(".ties"):  # a remainder's tie bits: split as its param
                want = self.expected(leaves[i - 2], sharded)
            got = self.spmd.spec(t) or ("{replicated}" if t.dim() == 0 else "")  # one layout
            if got != want:
                bad.append(f"{where}: {path}: expected {want}, got {got or 'no annotation'}")


def check_state(run: Any, when: str, state: Any, sharded: bool, bad: list[str]) -> None:
    """Moments sharded like the masters, step counts replicated; a partition's state (the
    8-bit case keeps small leaves in fp32) is a dict of states."""
    for sub in state.values() if isinstance(state, dict) else [state]:
        run.check(f"{when}: state", sub._replace(step=None), sharded, bad)
        run.check(f"{when}: state.step", sub.step, False, bad)


def train_case(run: Run, case: Case, out: Path) -> dict[str, Any]:
    start = time.perf_counter()
    params_sharded = case.mode == "fsdp"
    masters_sharded = case.mode in ("zero1", "fsdp")
    cpu = init_params()
    params = {n: run.to_device(t, False) for n, t in cpu.items()}
    if params_sharded:
        mpfunc.mark_sharding_(params, run.mesh, "data")
    for p in params.values():
        p.requires_grad_()
    data = [(run.to_device(x, True), run.to_device(y, True)) for x, y in batches(STEPS)]
    masters = mpfunc.init_master(params, strategy=case.strategy)
    if masters_sharded and not params_sharded:
        mpfunc.mark_sharding_(masters, run.mesh, "data")
    gbuf = mpfunc.init_grads(params)
    if masters_sharded and not params_sharded:
        mpfunc.mark_sharding_(gbuf, run.mesh, "data")
    opt = OPTS[case.opt]()
    state = opt.init(masters)
    if case.opt.endswith("uint8") and masters_sharded:
        # opt.init gives the 8-bit codes their master's sharding; the per-block scales
        # have another shape: mark_sharding_ splits them by its rule.
        mpfunc.mark_sharding_(state, run.mesh, "data")
    run.sync()
    bad: list[str] = []
    for when in ("init", "init synced"):
        run.check(f"{when}: params", params, params_sharded, bad)
        run.check(f"{when}: masters", masters, masters_sharded, bad)
        check_state(run, when, state, masters_sharded, bad)
        run.check(f"{when}: grad buffers", gbuf, masters_sharded, bad)
    counts: dict[str, int] = {}
    names = (
        "CompileTime",
        "ExecuteReplicatedTime",
        "TransferFromDeviceTime",
        "TransferToDeviceTime",
    )
    for k, (x, y) in enumerate(data):
        if k == WARMUP:
            counts = {n: run.count(n) for n in names}
        loss_fn(params, x, y).backward()
        grads = {n: p.grad for n, p in params.items()}
        if case.strategy != "fp32":  # the single call: bf16 grads in, params written
            mpfunc.apply_update_(masters, grads, state, opt, params=params)
            for p in params.values():
                p.grad = None
        elif case.pure:
            g32 = mpfunc.grads_to_fp32(grads)
            for n, g in g32.items():  # each fp32 grad has its grad's sharding (if any yet)
                got, want = run.spmd.spec(g), run.spmd.spec(grads[n])
                if got != want:
                    bad.append(f"step {k} grads_to_fp32: {n}: expected {want}, got {got}")
            masters, state = mpfunc.apply_update(masters, g32, state, opt)
            new = mpfunc.masters_to_model(masters, params)
            params = {n: t.requires_grad_() for n, t in new.items()}
        else:
            g32 = mpfunc.grads_to_fp32_(grads, gbuf)
            run.check(f"step {k} grads_to_fp32_", g32, masters_sharded, bad)
            mpfunc.apply_update_(masters, g32, state, opt)
            mpfunc.masters_to_model_(masters, params)
            for p in params.values():
                p.grad = None
        label = "apply_update" if case.pure else "apply_update_"
        run.check(f"step {k} {label}: masters", masters, masters_sharded, bad)
        check_state(run, f"step {k} {label}", state, masters_sharded, bad)
        label = "masters_to_model" if case.pure else "masters_to_model_"
        run.check(f"step {k} {label}: params", params, params_sharded, bad)
        run.sync()
        run.check(f"step {k} synced: params", params, params_sharded, bad)
        run.check(f"step {k} synced: masters", masters, masters_sharded, bad)
        check_state(run, f"step {k} synced", state, masters_sharded, bad)
    deltas = {n: run.count(n) - counts[n] for n in names}
    leaves = [t for t in mpfunc.core._tree.flatten((masters, state))[0] if t is not None]
    per_device = run.spmd.device_bytes(leaves)
    result = {
        "bad_specs": bad,
        "counts": deltas,
        "device_bytes": per_device,
        "full_bytes": run.spmd.full_bytes(leaves),
        "expected_device_bytes": sum(run.expected_bytes(t, masters_sharded) for t in leaves)
        + sum(run.tie_bytes_change(u, masters_sharded) for u in masters.values()),
        "specs": {
            n: run.spmd.spec(mpfunc.core._tree.flatten(t)[0][-1]) for n, t in masters.items()
        },
        "param_specs": {n: run.spmd.spec(t) for n, t in params.items()},
        "compared": "masters" if case.strategy == "fp32" else "params",
        "err_vs_cpu": rel_err(
            masters if case.strategy == "fp32" else params,
            cpu_reference(case.opt, STEPS, case.strategy),
        ),
        "params_are_rounded_masters": case.strategy != "fp32"
        or all(torch.equal(params[n].detach().cpu(), masters[n].cpu().bfloat16()) for n in masters),
    }
    if case.checkpoint:
        save_checkpoints({"masters": masters, "opt": state}, out)
    result["wall_s"] = time.perf_counter() - start
    return result


def save_checkpoints(tree: Any, out: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch_xla.experimental.distributed_checkpoint import SPMDSavePlanner

    with warnings.catch_warnings():
        # DCP without a process group saves from this one process, and says so.
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(mpfunc.state_dict(tree), checkpoint_id=str(out / "dcp"), planner=SPMDSavePlanner())
    mpfunc.save(out / "mpfunc.pt", tree)


def sharding_rule(run: Run) -> dict[str, str]:
    """The specs ``mark_sharding_`` gives awkward shapes (annotations only: no compile)."""
    shapes = {"odd": (33, 35), "small": (8, 8), "zero_d": (), "long": (4, 1024), "tie": (32, 32)}
    tree = {n: torch.zeros(s, device=run.device) for n, s in shapes.items()}
    mpfunc.mark_sharding_(tree, run.mesh, "data")
    return {n: run.spmd.spec(t) for n, t in tree.items()}


def train(run: Run, out: Path) -> dict[str, Any]:
    return {
        "devices": run.n,
        "rule": sharding_rule(run),
        "cases": {case_name(c): train_case(run, c, out) for c in CASES},
    }


def resume(run: Run, out: Path) -> dict[str, Any]:
    """Both checkpoints of the zero1-adamw case, onto this process's mesh; then train on."""
    import torch.distributed.checkpoint as dcp
    from torch_xla.experimental.distributed_checkpoint import SPMDLoadPlanner

    opt = OPTS["adamw"]()
    trees = []
    for _ in range(2):
        params = {n: run.to_device(t, False) for n, t in init_params().items()}
        masters = mpfunc.mark_sharding_(mpfunc.init_master(params), run.mesh, "data")
        trees.append((params, {"masters": masters, "opt": opt.init(masters)}))
    run.sync()
    (params, tree), (_, other) = trees
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(mpfunc.state_dict(tree), checkpoint_id=str(out / "dcp"), planner=SPMDLoadPlanner())
    mpfunc.load_(out / "mpfunc.pt", other)
    run.sync()
    bad: list[str] = []
    masters, state = tree["masters"], tree["opt"]
    for name, t in (("dcp", tree), ("mpfunc.load_", other)):
        run.check(f"{name}: masters", t["masters"], True, bad)
        run.check(f"{name}: state", t["opt"]._replace(step=None), True, bad)
        run.check(f"{name}: state.step", t["opt"].step, False, bad)
    same = all(
        torch.equal(a.cpu(), b.cpu())
        for a, b in zip(mpfunc.state_dict(tree).values(), mpfunc.state_dict(other).values())
    )
    mpfunc.masters_to_model_(masters, params)
    for p in params.values():
        p.requires_grad_()
    data = [(run.to_device(x, True), run.to_device(y, True)) for x, y in batches(STEPS + RESUMED)]
    gbuf = mpfunc.init_grads(masters)
    for x, y in data[STEPS:]:
        loss_fn(params, x, y).backward()
        g32 = mpfunc.grads_to_fp32_({n: p.grad for n, p in params.items()}, gbuf)
        mpfunc.apply_update_(masters, g32, state, opt)
        mpfunc.masters_to_model_(masters, params)
        for p in params.values():
            p.grad = None
        run.sync()
    run.check("resumed: masters", masters, True, bad)
    run.check("resumed: params", params, False, bad)
    return {
        "devices": run.n,
        "bad_specs": bad,
        "loads_agree": same,
        "specs": {
            n: run.spmd.spec(mpfunc.core._tree.flatten(t)[0][-1]) for n, t in masters.items()
        },
        "steps": float(state.step["fc1.weight"].cpu()),
        "err_vs_cpu": rel_err(masters, cpu_reference("adamw", STEPS + RESUMED)),
    }


# --- a remainder's tie bits under SPMD: their sharding and the step's collectives ---------

# (shape, mesh shape, partition spec) of each param: the tie bytes pack 8 elements of the
# last dim, so a split of that dim fits them only where each shard holds a multiple of 8.
TIE_CASES = {
    "rows": ((64, 36), (4,), (0, None)),  # the last dim not split
    "last_even": ((16, 64), (4,), (None, 0)),  # 16 a device: 2 bytes each
    "last_odd": ((16, 36), (4,), (None, 0)),  # 9 a device: bytes shared by two devices
    "vector_odd": ((36,), (4,), (0,)),
    "two_axes_odd": ((16, 36), (2, 2), (0, 1)),  # rows split evenly, the last dim 18 each
}
COLLECTIVES = ("all-gather(", "all-reduce(", "all-to-all(", "collective-permute(",
               "reduce-scatter(")  # fmt: skip


def _collectives(folder: Path, seen: set[str]) -> dict[str, int]:
    """The collectives in the step graphs XLA compiled since ``seen`` was taken (its
    after-optimization dumps, partitioned: one per device program), by kind."""
    found: dict[str, int] = {}
    for f in sorted(folder.glob("*SyncTensorsGraph*after_optimizations.txt")):
        if f.name in seen:
            continue
        seen.add(f.name)
        text = f.read_text()
        for op in COLLECTIVES:
            if op in text:
                found[op[:-1]] = found.get(op[:-1], 0) + text.count(" " + op)
    return found


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.cpu().contiguous().reshape(-1).view(torch.uint8)


def ties(run: Run, out: Path) -> dict[str, Any]:
    """Each case of ``TIE_CASES``: remainder masters for one sharded bf16 param, three SGD
    steps whose updates land on exact ties; the tie bits' spec, the collectives of the
    graphs compiled for it, and whether params, remainders and tie bits equal the CPU's."""
    import numpy as np
    import torch_xla.distributed.spmd as xs

    dump = Path(os.environ["MPFUNC_HLO_DUMP"])
    seen: set[str] = set()
    opt = mpfunc.sgd(lr=2.0**-8)
    result: dict[str, Any] = {}
    for name, (shape, mesh_shape, pspec) in TIE_CASES.items():
        mesh = xs.Mesh(np.arange(run.n), mesh_shape)
        gen = torch.Generator().manual_seed(len(result))
        cpu = (1 + torch.randint(0, 128, shape, generator=gen).float() / 128).to(torch.bfloat16)
        grads = [(torch.randint(0, 2, shape, generator=gen) * 2 - 1).to(torch.bfloat16)
                 for _ in range(3)]  # fmt: skip

        def marked(t: torch.Tensor, mesh: Any = mesh, pspec: Any = pspec) -> torch.Tensor:
            out = t.to(run.device)
            xs.mark_sharding(out, mesh, pspec)
            return out

        p = marked(cpu)
        m = mpfunc.init_master({"p": p}, strategy="remainder")
        s = opt.init(m)
        run.sync()
        _collectives(dump, seen)  # the set-up's graphs: not the step's
        for g in grads:
            mpfunc.apply_update_(m, {"p": marked(g)}, s, opt)
            run.sync()
        steps = _collectives(dump, seen)
        ref = mpfunc.init_master({"p": cpu.clone()}, strategy="remainder")
        ref_s = opt.init(ref)
        for g in grads:
            mpfunc.apply_update_(ref, {"p": g}, ref_s, opt)
        unit = m["p"]
        result[name] = {
            "param_spec": run.spmd.spec(unit.param),
            "ties_spec": run.spmd.spec(unit.ties),
            "collectives": steps,
            "equal": all(torch.equal(_raw(a), _raw(b)) for a, b in zip(unit, ref["p"])),
            "ties_set": int((ref["p"].ties != 0).sum()),
        }
    return result


# (shape, partition spec) of each master with 4-bit AdamW moments, on a mesh of 4.
U4_CASES = {
    "rows": ((64, 64), (0, None)),  # 16 rows a device: 1024 elements, 512 code bytes
    "columns": ((16, 64), (None, 0)),  # a device's elements are not one flat range
}


def uint4(run: Run, out: Path) -> dict[str, Any]:
    """Each case of ``U4_CASES``: fp32 masters sharded as given, AdamW with 4-bit moments
    (``opt.init`` made on the device), three steps; the codes' and scales' specs, the
    collectives of the steps' graphs, whether codes and scales equal the CPU's bit for
    bit, and the masters' difference from the CPU's."""
    import numpy as np
    import torch_xla.distributed.spmd as xs

    dump = Path(os.environ["MPFUNC_HLO_DUMP"])
    seen: set[str] = set()
    mesh = xs.Mesh(np.arange(run.n), (run.n,))
    opt = mpfunc.adamw(lr=1e-2, weight_decay=1e-2, state_dtype=torch.uint4)  # type: ignore[attr-defined]
    result: dict[str, Any] = {}
    for name, (shape, pspec) in U4_CASES.items():
        gen = torch.Generator().manual_seed(len(result))
        cpu = torch.randn(shape, generator=gen)
        grads = [torch.randn(shape, generator=gen) for _ in range(3)]

        def marked(t: torch.Tensor, pspec: Any = pspec) -> torch.Tensor:
            out = t.to(run.device)
            xs.mark_sharding(out, mesh, pspec)
            return out

        m = {"w": marked(cpu)}
        s = opt.init(m)
        run.sync()
        _collectives(dump, seen)
        for g in grads:
            mpfunc.apply_update_(m, {"w": marked(g)}, s, opt)
            run.sync()
        steps = _collectives(dump, seen)
        ref = {"w": cpu.clone()}
        ref_s = opt.init(ref)
        for g in grads:
            mpfunc.apply_update_(ref, {"w": g}, ref_s, opt)
        got = [m["w"], *(t for q in (s.exp_avg["w"], s.exp_avg_sq["w"]) for t in q)]
        want = [ref["w"], *(t for q in (ref_s.exp_avg["w"], ref_s.exp_avg_sq["w"]) for t in q)]
        result[name] = {
            "master_spec": run.spmd.spec(m["w"]),
            "codes_spec": run.spmd.spec(s.exp_avg["w"].codes),
            "scale_spec": run.spmd.spec(s.exp_avg_sq["w"].scale),
            "collectives": steps,
            # Codes and scales bit for bit; the fp32 masters within the XLA bound (XLA:CPU
            # contracts the AdamW update differently: 1 ulp here, sharded or not).
            "codes_equal": all(torch.equal(_raw(a), _raw(b)) for a, b in zip(got[1:], want[1:])),
            "master_err": rel_err({"w": m["w"]}, {"w": ref["w"]}),
        }
    return result


def main(argv: list[str]) -> int:
    scenario, out = argv[0], Path(argv[1])
    assert os.environ.get("PJRT_DEVICE") == "CPU", "run with PJRT_DEVICE=CPU CPU_NUM_DEVICES=N"
    run = Run()
    scenarios = {"train": train, "resume": resume, "ties": ties, "uint4": uint4}
    result = scenarios[scenario](run, out)
    (out / f"{scenario}.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

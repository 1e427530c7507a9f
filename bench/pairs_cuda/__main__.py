"""Every (master strategy, state format) pair of one AdamW step on a CUDA device, beside torch's.

The CUDA counterpart of ``bench.pairs``: one process, contenders interleaved round by round,
each row the median over rounds of its step time divided by torch's fused fp32 AdamW
(``torch.optim.AdamW(fused=True)`` on an fp32 tree of the same shapes) in the same round,
with the 25th-75th percentile of those ratios. A step is timed from the host, the device
synchronized before and after: what a training loop pays, Python included. mpfunc steps
take bf16 grads and leave bf16 params (the ``"fp32"`` pairs write the rounded params too).

Rows: torch's fused and foreach fp32 AdamW and fused AdamW on bf16 params (pure bf16);
each mpfunc pair eager (mpfunc's torch path on CUDA: torch's fused kernel for ``"fp32"``
masters with fp32 state, the foreach path otherwise); and, with ``--compile``, the pairs
named there with the whole ``apply_update_`` call wrapped in ``torch.compile`` (inductor,
Triton kernels), compiled before the timed rounds. B/param is measured: the bytes of the
params, masters and state the step keeps, divided by the params.

It also checks each pair's numerics on the device (``--check``, on by default): three steps
of a small tree with odd sizes and layouts, on the CPU and on the device from the same
start, compared bit for bit (masters, params, state); the compiled steps are compared with
the eager device steps. A row says how many elements differ and by how many units in the
last place at most.

    python -m bench.pairs_cuda --out /tmp/pc                     # on a machine with CUDA
    python -m bench.pairs_cuda --smoke --device cpu --out /tmp/p  # the code path, seconds
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch

import mpfunc
from bench.common import meta as meta_mod
from bench.common.machine import load_avg
from bench.common.report import header, ratio_rows, write_json

BF16 = torch.bfloat16
U8 = torch.uint8
U4: torch.dtype = torch.uint4  # type: ignore[attr-defined]
STRATEGIES = ("fp32", "remainder", "kahan", "stochastic", "none")
STATES: tuple[torch.dtype | None, ...] = (None, BF16, U8, U4)
BASE = "torch fused fp32 AdamW"
DEFAULT_COMPILE = "kahan+bfloat16,stochastic+uint8,fp32+fp32"

Step = Callable[[], Any]


def _name(strategy: str, sd: torch.dtype | None) -> str:
    return f"{strategy}+{'fp32' if sd is None else str(sd).removeprefix('torch.')}"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _nbytes(*trees: Any) -> int:
    """Bytes of the distinct storages the trees' tensors hold."""
    seen: dict[int, int] = {}
    for tree in trees:
        for t in mpfunc.core._tree.flatten(tree)[0]:  # type: ignore[attr-defined]
            if isinstance(t, torch.Tensor):
                s = t.untyped_storage()
                seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def _torch_step(shapes: list[tuple[int, ...]], device: torch.device, kind: str) -> Step:
    dtype = BF16 if kind == "bf16" else torch.float32
    ps = [torch.nn.Parameter(torch.randn(s, device=device, dtype=dtype)) for s in shapes]
    for p in ps:
        p.grad = torch.randn(p.shape, device=device, dtype=dtype) * 1e-2
    fused = kind != "foreach"
    opt = torch.optim.AdamW(ps, lr=1e-3, fused=fused, foreach=not fused)
    return opt.step


class _Pair:
    """One pair's tree on a device: params, masters, state, grads, and its step."""

    def __init__(
        self,
        shapes: Sequence[tuple[int, ...]],
        strategy: str,
        sd: torch.dtype | None,
        device: torch.device,
        seed: int = 0,
        layouts: bool = False,
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        params = {}
        for i, s in enumerate(shapes):
            x = torch.randn(s, generator=gen).to(BF16)
            if layouts and x.ndim == 2 and i % 2:
                x = x.t().contiguous().t()  # a transposed leaf
            params[f"p{i}"] = x.to(device)
        self.grads = [
            {k: (torch.randn(v.shape, generator=gen) * 1e-2).to(BF16).to(device) for k, v in
             params.items()}
            for _ in range(3)
        ]  # fmt: skip
        self.params = params
        self.masters = mpfunc.init_master(params, strategy=strategy)
        self.opt = mpfunc.adamw(1e-3, weight_decay=0.01, state_dtype=sd)
        self.state = self.opt.init(self.masters)
        self.kw = {"params": params} if strategy == "fp32" else {}
        self.n = 0

    def step(self) -> None:
        g = self.grads[self.n % len(self.grads)]
        self.n += 1
        mpfunc.apply_update_(self.masters, g, self.state, self.opt, **self.kw)

    def compiled(self) -> Step:
        fn = torch.compile(
            lambda m, g, s, kw: mpfunc.apply_update_(m, g, s, self.opt, **kw), dynamic=False
        )

        def step() -> None:
            g = self.grads[self.n % len(self.grads)]
            self.n += 1
            fn(self.masters, g, self.state, self.kw)

        return step

    def leaves(self) -> list[torch.Tensor]:
        tree = (self.params, self.masters, self.state)
        flat = mpfunc.core._tree.flatten(tree)[0]  # type: ignore[attr-defined]
        return [t for t in flat if isinstance(t, torch.Tensor)]


def _ulps(a: torch.Tensor, b: torch.Tensor) -> tuple[int, int]:
    """(elements whose bits differ, the largest difference in units in the last place)."""
    a, b = a.detach().cpu(), b.detach().cpu()
    if a.dtype.is_floating_point and a.element_size() in (2, 4):
        ints = {2: torch.int16, 4: torch.int32}[a.element_size()]
        ia, ib = a.contiguous().view(ints).long(), b.contiguous().view(ints).long()
        both_nan = torch.isnan(a) & torch.isnan(b)
        diff = ((ia - ib).abs()).masked_fill(both_nan, 0)
        return int((diff != 0).sum()), int(diff.max()) if diff.numel() else 0
    ne = a.view(-1) != b.view(-1)
    diff = (a.view(-1).long() - b.view(-1).long()).abs() if a.numel() else torch.zeros(1)
    return int(ne.sum()), int(diff.max()) if a.numel() else 0


def _compare(x: _Pair, y: _Pair) -> dict[str, Any]:
    """Bits that differ, and mpfunc's bound: ``max|a - b| / max|b|`` per float tensor."""
    differ, worst, total, rel = 0, 0, 0, 0.0
    for a, b in zip(x.leaves(), y.leaves()):
        n, u = _ulps(a, b)
        differ, worst, total = differ + n, max(worst, u), total + a.numel()
        if a.dtype.is_floating_point and a.numel():
            fa, fb = a.detach().cpu().double(), b.detach().cpu().double()
            ok = torch.isfinite(fa) & torch.isfinite(fb)
            m = float(fb[ok].abs().max()) if bool(ok.any()) else 0.0
            if m > 0:
                rel = max(rel, float((fa - fb)[ok].abs().max()) / m)
    return {"elements": total, "differ": differ, "max_ulps": worst, "max_rel": rel}


CHECK_SHAPES = [(64, 33), (257,), (8, 8), (1000,), ()]


def _check(device: torch.device, compile_names: set[str]) -> dict[str, Any]:
    """Three steps on the CPU and on ``device`` from one start: how many bits differ."""
    out: dict[str, Any] = {}
    for strategy in STRATEGIES:
        for sd in STATES:
            name = _name(strategy, sd)
            shapes = CHECK_SHAPES if sd not in (U8, U4) else [s for s in CHECK_SHAPES if s][:4]
            row: dict[str, Any] = {}
            try:
                cpu = _Pair(shapes, strategy, sd, torch.device("cpu"), seed=1, layouts=True)
                dev = _Pair(shapes, strategy, sd, device, seed=1, layouts=True)
                for _ in range(3):
                    cpu.step()
                    dev.step()
                _sync(device)
                row["eager vs cpu"] = _compare(dev, cpu)
                if name in compile_names:
                    comp = _Pair(shapes, strategy, sd, device, seed=1, layouts=True)
                    step = comp.compiled()
                    for _ in range(3):
                        step()
                    _sync(device)
                    row["compiled vs eager"] = _compare(comp, dev)
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                traceback.print_exc(limit=2, file=sys.stderr)
            out[name] = row
            print(f"check {name}: {row}", flush=True)
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    run_meta = meta_mod.Run("pairs_cuda", args.argv)
    device = torch.device(args.device)
    shapes = [(args.numel // args.tensors,)] * args.tensors
    numel = sum(math.prod(s) for s in shapes)
    compile_names = set(filter(None, args.compile.split(",")))
    result: dict[str, Any] = {"device": str(device), "numel": numel, "tensors": len(shapes)}
    if device.type == "cuda":
        result["gpu"] = torch.cuda.get_device_name(device)
    load0 = load_avg()
    contenders: dict[str, tuple[float | None, Step]] = {
        BASE: (12.0, _torch_step(shapes, device, "fused")),
        "torch foreach fp32 AdamW": (12.0, _torch_step(shapes, device, "foreach")),
        "torch fused bf16 AdamW (pure bf16)": (6.0, _torch_step(shapes, device, "bf16")),
    }
    failed: dict[str, str] = {}
    compile_s: dict[str, float] = {}
    for strategy in STRATEGIES:
        for sd in STATES:
            name = _name(strategy, sd)
            try:
                pair = _Pair(shapes, strategy, sd, device)
                nbytes = _nbytes(pair.params, pair.masters, pair.state) / numel
                contenders[f"mpfunc {name}"] = (nbytes, pair.step)
                if name in compile_names:
                    cpair = _Pair(shapes, strategy, sd, device)
                    step = cpair.compiled()
                    t0 = time.perf_counter()
                    step()
                    _sync(device)
                    compile_s[name] = time.perf_counter() - t0
                    contenders[f"mpfunc {name} compiled"] = (nbytes, step)
            except Exception as e:
                failed[f"mpfunc {name}"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                traceback.print_exc(limit=2, file=sys.stderr)
    for _, step in contenders.values():  # warm-up: first-call checks and plans
        step()
        step()
    _sync(device)
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(args.rounds):
        for name, (_, step) in contenders.items():
            _sync(device)
            t = time.perf_counter()
            step()
            _sync(device)
            times[name].append(time.perf_counter() - t)
    rows = ratio_rows(times, {k: v[0] for k, v in contenders.items()}, BASE)
    result.update(
        rows=rows,
        failed=failed,
        compile_s=compile_s,
        load_avg={"start": load0, "end": load_avg()},
        rounds=args.rounds,
    )
    print(render_rows(result), flush=True)
    if args.check:
        result["check"] = _check(device, compile_names)
    return {"meta": run_meta.finish(threads=None), **result}


def render_rows(result: dict[str, Any]) -> str:
    lines = [
        f"### {result['numel']:,} params in {result['tensors']} tensors on "
        f"{result.get('gpu', result['device'])}, medians of {result['rounds']} rounds",
        "",
        f"| contender | B/param | ms (median) | ratio to {BASE} | 25-75% |",
        "|---|--:|--:|--:|---|",
    ]
    for r in result["rows"]:
        b = r["bytes_per_param"]
        lines.append(
            f"| {r['name']} | {'' if b is None else f'{b:.3g}'} | {r['median_ms']:.3f} | "
            f"{r['ratio']:.2f} | {r['ratio_q25']:.2f}-{r['ratio_q75']:.2f} |"
        )
    for name, why in result["failed"].items():
        lines.append(f"| {name} | | | did not run | {why} |")
    if result.get("compile_s"):
        lines += ["", "First compiled call (s): " + ", ".join(
            f"{k} {v:.1f}" for k, v in result["compile_s"].items())]  # fmt: skip
    return "\n".join(lines) + "\n"


def render(result: dict[str, Any]) -> str:
    out = ["# One AdamW step per (strategy, state format) on CUDA", "", *header(result["meta"])]
    out += ["", render_rows(result)]
    if "check" in result:
        out += [
            "### Numerics: three steps of a small tree (sizes 64x33 transposed, 257, 8x8, "
            "1000, 0-d) from one start",
            "",
            "| pair | device eager vs CPU: elements differing / of | max ulps | "
            "max abs diff / max abs | compiled vs eager: differing | max ulps |",
            "|---|--:|--:|--:|--:|--:|",
        ]
        for name, row in result["check"].items():
            if "error" in row:
                out.append(f"| {name} | error: {row['error']} | | | | |")
                continue
            e, c = row["eager vs cpu"], row.get("compiled vs eager")
            out.append(
                f"| {name} | {e['differ']} / {e['elements']} | {e['max_ulps']} | "
                f"{e['max_rel']:.2g} | "
                + (f"{c['differ']} | {c['max_ulps']} |" if c else "– | – |")
            )
    return "\n".join(out) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.pairs_cuda", description=__doc__)
    p.add_argument("--device", default="cuda")
    p.add_argument("--numel", type=int, default=128 * 2**20)
    p.add_argument("--tensors", type=int, default=32)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--compile", default=DEFAULT_COMPILE, help="pairs to also run compiled")
    p.add_argument("--no-check", dest="check", action="store_false")
    p.add_argument("--smoke", action="store_true", help="a small tree, 2 rounds")
    meta_mod.add_out_argument(p, "pairs_cuda")
    args = p.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)
    if args.smoke:
        args.numel, args.tensors, args.rounds = 4096, 4, 2
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("bench.pairs_cuda: no CUDA device here", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    result = run(args)
    write_json(args.out / "pairs_cuda.json", result)
    (args.out / "pairs_cuda.md").write_text(render(result))
    print(f"wrote {args.out / 'pairs_cuda.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

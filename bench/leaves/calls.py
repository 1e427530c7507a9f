"""What one ``apply_update_`` costs in Python, counted rather than timed: tree flattens, mpfunc
modules entered and module-to-module hops, Python calls, and the thread's CPU time.

Counts do not move with the machine's load, so they show a change in per-call Python work
where timings on a shared machine cannot. Per (strategy, state format), on ``--leaves``
bf16 leaves of ``--numel`` elements (AdamW, bf16 grads; the ``"fp32"`` pairs write the
rounded params too), for the first call (every check and the plan in full) and a later one
(on the CPU, the memo's path; XLA checks in full every call):

* ``flattens``: calls into optree's C++ walk (``optree._C.flatten``, also what
  ``tree_map`` and path reads use) and Python walks through ``_tree`` under
  ``torch.compile``;
* ``modules``: distinct ``mpfunc`` modules whose functions ran;
* ``hops``: Python calls from a function of one ``mpfunc`` module into another's;
* ``calls``: Python function calls in all (mpfunc, torch and optree);
* ``cpu_ms``: the calling thread's CPU time without the profile hook (``time.thread_time``:
  time the thread waited for a core on a loaded machine is not counted); the later call's
  is the best of 5.

    python -m bench.leaves.calls                              # CPU, 100 leaves, seconds
    python -m bench.leaves.calls --leaves 10000 --numel 1000  # the many-leaves case
    PJRT_DEVICE=CPU python -m bench.leaves.calls --device xla # XLA, 101 leaves
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any

import torch

import mpfunc
from bench.common.machine import load_avg

BF16 = torch.bfloat16
FORMATS: dict[str, torch.dtype | None] = {"fp32": None, "bf16": BF16, "uint8": torch.uint8}
DEFAULT_PAIRS = "fp32/fp32,remainder/fp32,kahan/bf16,fp32/uint8,remainder/uint8,stochastic/uint8"


def _module(frame: FrameType | None) -> str | None:
    return None if frame is None else frame.f_globals.get("__name__")


def count(fn: Callable[[], Any]) -> dict[str, Any]:
    """Runs ``fn`` once under ``sys.setprofile`` and returns its counts."""
    flattens = calls = hops = 0
    modules: set[str] = set()
    import optree

    c_flatten = optree._C.flatten

    def hook(frame: FrameType, event: str, arg: Any) -> None:
        nonlocal flattens, calls, hops
        if event == "c_call":
            if arg is c_flatten:
                flattens += 1
            return
        if event != "call":
            return
        calls += 1
        mod = _module(frame)
        if mod is None or not mod.startswith("mpfunc"):
            return
        modules.add(mod)
        if mod == "mpfunc.core._tree" and frame.f_code.co_name == "_walk":
            back = _module(frame.f_back)
            if back != mod:  # a top-level Python walk (torch.compile's flatten)
                flattens += 1
        caller = _module(frame.f_back)
        if caller is not None and caller.startswith("mpfunc") and caller != mod:
            hops += 1

    sys.setprofile(hook)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return {"flattens": flattens, "modules": len(modules), "hops": hops, "calls": calls}


def _setup(strategy: str, state: str, leaves: int, numel: int, device: Any) -> Callable[[], Any]:
    gen = torch.Generator().manual_seed(0)
    params = {f"p{i}": torch.randn(numel, generator=gen).to(BF16).to(device) for i in range(leaves)}
    grads = {k: (torch.randn(numel, generator=gen) * 1e-2).to(BF16).to(device) for k in params}
    masters = mpfunc.init_master(params, strategy=strategy)
    opt = mpfunc.adamw(1e-3, state_dtype=FORMATS[state])
    st = opt.init(masters)
    kw = {"params": params} if strategy == "fp32" else {}
    return lambda: mpfunc.apply_update_(masters, grads, st, opt, **kw)


def _settle(device: Any) -> None:
    if device.type == "xla":
        import torch_xla
        import torch_xla.core.xla_model as xm

        torch_xla.sync()
        xm.wait_device_ops()


def _cpu_ms(step: Callable[[], Any], device: Any) -> float:
    t = time.thread_time()
    step()
    out = (time.thread_time() - t) * 1e3
    _settle(device)
    return out


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    if args.device == "xla":
        import torch_xla

        device = torch_xla.device()
    else:
        device = torch.device("cpu")
    torch.set_num_threads(args.threads)
    _setup("fp32", "fp32", 2, 64, device)()  # imports and one-time probes, not counted
    _settle(device)
    rows = []
    for pair in args.pairs.split(","):
        strategy, state = pair.split("/")
        step = _setup(strategy, state, args.leaves, args.numel, device)
        first = count(step)
        _settle(device)
        step()
        _settle(device)
        later = count(step)
        _settle(device)
        cpu = min(_cpu_ms(step, device) for _ in range(5))
        rows.append({"pair": pair, "first": first, "later": later, "later_cpu_ms": cpu})
    return rows


def render(rows: list[dict[str, Any]], args: argparse.Namespace, load: tuple[Any, Any]) -> str:
    lines = [
        f"{args.leaves:,} leaves of {args.numel} elements on {args.device}, "
        f"{args.threads} thread(s); load average {load[0]} -> {load[1]}",
        "",
        "| pair | first: flattens | modules | hops | calls | later: flattens | modules | hops "
        "| calls | later cpu ms |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for r in rows:
        f, g = r["first"], r["later"]
        lines.append(
            f"| {r['pair']} | {f['flattens']} | {f['modules']} | {f['hops']} | {f['calls']} | "
            f"{g['flattens']} | {g['modules']} | {g['hops']} | {g['calls']} | "
            f"{r['later_cpu_ms']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.leaves.calls", description=__doc__.splitlines()[0]
    )
    p.add_argument("--leaves", type=int, default=None, help="default 100 (CPU), 101 (XLA)")
    p.add_argument("--numel", type=int, default=1000)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", choices=("cpu", "xla"), default="cpu")
    p.add_argument("--pairs", default=DEFAULT_PAIRS, help="strategy/state,...")
    args = p.parse_args(argv)
    if args.leaves is None:
        args.leaves = 101 if args.device == "xla" else 100
    load0 = load_avg()
    rows = run(args)
    print(render(rows, args, (load0, load_avg())))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Checks the bf16 + remainder + tie bit encoding over all 2^32 fp32 bit patterns.

    python -m bench.remainder [--chunk-bits 22] [--threads 1] [--device cpu] [--triples]

For every pattern x, in chunks of 2^chunk_bits (ascending int32 order):

* ``join(split(x))`` has x's bits (mismatches must be 0);
* the remainder is x's low 16 bits;
* the param against ``x.to(torch.bfloat16)``: equal for every non-NaN x; NaN masters are
  counted by what their param is (NaN, anything else);
* the tie bit: set exactly at the ties that rounded up (low half 0x8000, high half odd)
  and at the NaNs whose payload lies wholly in the low half;
* with ``--device xla``: the round trip on the XLA device, and its param, remainder and
  tie bits against the CPU path's, bit for bit (the other checks need the CPU path's
  counts);
* with ``--triples``, ``split(join(p, r, t)) == (p, r, t)`` for every triple split makes
  (implied by the first check: see the summary it prints).

Prints progress, then the counts and the expected ones, and exits 1 on any surprise.
Standalone: imports only torch and mpfunc. Peak memory is about 25 chunk-sized int32
buffers (--chunk-bits 22, the default: ~0.45 GB).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

# The checkout's mpfunc, never an installed copy: this script checks the code beside it.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from mpfunc.strategies import _remainder

TOTAL = 1 << 32

# What the encoding promises, counted over all 2^32 patterns (both signs).
EXPECTED = {
    "join_mismatch": 0,
    "remainder_not_low_half": 0,
    "split_join_mismatch": 0,
    "param_not_tensor_to": 0,  # non-NaN masters
    # tie bits: the odd high halves 0x0001..0x7F7F at low half 0x8000, and the NaNs with
    # high half 0x7F80 (payload 0x0001..0xFFFF), per sign
    "tie_bits_set": 2 * (0x7F80 // 2 + 0xFFFF),
    "tie_bit_wrong": 0,
    "nan_param_nan": 2 * (128 * 65536 - 1),
    "nan_param_other": 0,
    "xla_differs_from_cpu": 0,
}


def run_chunk_xla(start: int, n: int, device: torch.device, counts: dict[str, int]) -> None:
    """XLA: ``join(split(x)) == x`` on the device, and the device's param, remainder and
    tie bits bit-identical to the CPU path's (which the CPU run classifies in full)."""
    import torch_xla

    x = torch.arange(start, start + n, dtype=torch.int32)
    master = x.view(torch.float32)
    param, rem, ties = _remainder.split(master.to(device))
    back = _remainder.join(param, rem, ties)
    torch_xla.sync()
    cpu_param, cpu_rem, cpu_ties = _remainder.split(master)
    out = {
        "join_mismatch": _count(_bits32(back.cpu()) != x),
        "xla_differs_from_cpu": _count(
            (_bits16(param.cpu()) != _bits16(cpu_param)) | (rem.cpu() != cpu_rem)
        )
        + _count(ties.cpu() != cpu_ties),
    }
    for k, v in out.items():
        counts[k] = counts.get(k, 0) + v


def run_chunk(
    start: int, n: int, device: torch.device, counts: dict[str, int], triples: bool
) -> None:
    """Adds one chunk's counts: the int32 patterns ``start .. start + n - 1``."""
    x = torch.arange(start, start + n, dtype=torch.int32, device=device)
    master = x.view(torch.float32)
    param, rem, ties = _remainder.split(master)
    back = _remainder.join(param, rem, ties)
    p16 = _bits16(param)

    out = {
        "join_mismatch": _count(_bits32(back) != x),
        "remainder_not_low_half": _count(rem.to(torch.int32) != ((x << 16) >> 16)),
    }

    nan = torch.isnan(master)
    rne = _bits16(master.to(torch.bfloat16))
    out["param_not_tensor_to"] = _count((p16 != rne) & ~nan)
    low, high = x & 0xFFFF, (x >> 16) & 0x7FFF
    want = ((low == 0x8000) & ((high & 1) == 1) & ~nan) | (nan & (high == 0x7F80))
    bit = _remainder.unpack_ties(ties, x.shape).bool()
    out["tie_bits_set"] = _count(bit)
    out["tie_bit_wrong"] = _count(bit != want)
    pm = torch.isnan(param)
    out["nan_param_nan"] = _count(nan & pm)
    out["nan_param_other"] = _count(nan & ~pm)

    for k, v in out.items():
        counts[k] = counts.get(k, 0) + v
    if not triples:
        return
    p2, r2, t2 = _remainder.split(back)
    mismatch = _count((_bits16(p2) != p16) | (r2 != rem)) + _count(t2 != ties)
    counts["split_join_mismatch"] = counts.get("split_join_mismatch", 0) + mismatch


def _count(mask: torch.Tensor) -> int:
    return int(mask.sum())


def _bits32(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


def _bits16(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chunk-bits", type=int, default=22, help="log2 of the chunk size")
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1: on a shared, oversubscribed machine more OpenMP "
        "threads ran 10-50x slower; 0 keeps torch's default)",
    )
    ap.add_argument(
        "--device",
        default="cpu",
        help="cpu or cuda: every check; xla (PJRT_DEVICE=CPU for XLA:CPU): the round trip "
        "on the device and its bits against the CPU path",
    )
    ap.add_argument("--first", type=int, default=0, help="start at this chunk (smoke runs)")
    ap.add_argument("--limit", type=int, default=0, help="check only this many chunks (smoke)")
    ap.add_argument(
        "--triples",
        action="store_true",
        help="also check split(join(p, r, t)) == (p, r, t) for every split triple (implied: "
        "see the summary)",
    )
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "xla":
        import torch_xla

        device = torch.device(torch_xla.device())
    else:
        device = torch.device(args.device)
    n = 1 << args.chunk_bits
    first = args.first
    chunks = TOTAL // n - first
    if args.limit:
        chunks = min(chunks, args.limit)
    counts: dict[str, int] = {}
    print(f"checking {_remainder.__file__}, {chunks} chunks of 2^{args.chunk_bits}", flush=True)
    t0 = time.perf_counter()
    for c in range(chunks):
        start = -(1 << 31) + (first + c) * n
        if device.type == "xla":
            run_chunk_xla(start, n, device, counts)
        else:
            run_chunk(start, n, device, counts, args.triples)
        if c % max(1, chunks // 32) == 0 or c == chunks - 1:
            el = time.perf_counter() - t0
            print(
                f"chunk {c + 1}/{chunks}  {el:7.1f} s  eta {el / (c + 1) * (chunks - c - 1):7.1f} s"
                f"  join mismatches {counts['join_mismatch']}",
                flush=True,
            )
    elapsed = time.perf_counter() - t0
    threads = torch.get_num_threads()
    print(f"\n{chunks * n} patterns in {elapsed:.1f} s on {device} ({threads} threads)")
    full = chunks * n == TOTAL
    bad = False
    for k, v in counts.items():
        exp = EXPECTED[k]
        ok = v == exp if full or exp == 0 else True
        bad |= not ok
        note = "" if full or exp == 0 else " (partial run: not compared)"
        print(f"  {k:24s} {v:12d}  expected {exp:12d}  {'ok' if ok else 'MISMATCH'}{note}")
    if full and counts["join_mismatch"] == 0 and "split_join_mismatch" not in counts:
        print(
            "  split(join(p, r, t)) == (p, r, t) for every triple split makes follows:\n"
            "  join(split(x)) == x for all 2^32 x makes split injective, and join its left\n"
            "  inverse on split's image (--triples checks it directly)."
        )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

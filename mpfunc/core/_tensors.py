"""Tensor utilities every layer uses: lazy devices, grouping positions by key, bounded
foreach runs, and copies that own their buffer on every device."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch

from mpfunc.core._compile import compiling

__all__ = [
    "FOREACH_CHUNK_NUMEL",
    "chunks",
    "compute_dtype",
    "fresh_copy",
    "group_indices",
    "is_lazy",
    "pick",
    "widened",
]

# One foreach call on an eager device touches at most this many elements, so the
# temporaries it allocates (e.g. Adam's denominator) stay below ~64 MiB in fp32.
FOREACH_CHUNK_NUMEL = 1 << 24


def is_lazy(device: torch.device) -> bool:
    """True for devices that trace graphs (XLA), where every op becomes a graph node."""
    return device.type in ("xla", "lazy")


def group_indices(
    keys: Sequence[tuple[object, ...] | None],
) -> dict[tuple[object, ...], list[int]]:
    """Groups positions by key, in first-seen order; ``None`` keys are left out."""
    groups: dict[tuple[object, ...], list[int]] = {}
    for i, key in enumerate(keys):
        if key is not None:
            groups.setdefault(key, []).append(i)
    return groups


def chunks(
    idx: list[int],
    tensors: Sequence[torch.Tensor | None],
    device: torch.device,
    limit: int | None = None,
) -> Iterator[list[int]]:
    """Splits ``idx`` into runs of at most ``FOREACH_CHUNK_NUMEL`` elements (one run on lazy
    devices). A single tensor larger than the limit forms a run of its own."""
    if is_lazy(device):
        yield idx
        return
    limit = FOREACH_CHUNK_NUMEL if limit is None else limit
    run: list[int] = []
    total = 0
    for i in idx:
        t = tensors[i]
        n = t.numel() if t is not None else 0
        if run and total + n > limit:
            yield run
            run, total = [], 0
        run.append(i)
        total += n
    if run:
        yield run


def pick(seq: Sequence[Any], idx: Sequence[int]) -> list[Any]:
    return [seq[i] for i in idx]


def fresh_copy(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A detached copy of ``t`` in ``dtype`` and ``t``'s layout, in a buffer of its own on
    every device.

    On XLA, ``copy_`` and ``.to(copy=True)`` of an unchanged dtype leave the copy holding
    the source's device data; the first in-place write of either then donates that
    buffer, and reading the other fails ("Trying to access XLA data ... while an async
    operation is in flight"). ``clone`` and a dtype conversion trace a real node.
    """
    t = t.detach()
    if t.dtype == dtype:
        return t.clone(memory_format=torch.preserve_format)
    return t.to(dtype=dtype, copy=True)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a leaf's step computes in, from its face's ``dtype`` (an "fp32" master, or
    a strategy unit's param): float64 for float64 (an "fp32" master, or a "none" param,
    which ``_strategy_none._load`` widens to float64: the only strategies that take one),
    else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def widened(p: torch.Tensor) -> torch.Tensor:
    """``p.float()`` of a bfloat16 or float16 ``p``, the same bits, read from ``p``'s bits
    where torch.compile traces: inductor folds ``x.to(bf16).float()`` into ``x`` (2.9, CPU),
    which dropped a ``"kahan"`` master's whole compensation and coded 8-bit moments against
    unrounded block scales in a compiled step (found in review, 2026-12-05). A bfloat16 is
    the top half of its float32; a float16's magnitude bits, shifted into place and scaled
    by 2**112, give its value exactly (subnormals included), infinities and NaNs set apart,
    the sign put back: every one of the 2 x 65,536 patterns gives ``p.float()``'s bits
    (``tests/test_compile_precision.py``). Eager code takes ``p.float()`` itself."""
    if not compiling() or p.dtype not in (torch.bfloat16, torch.float16):
        return p.float()
    h = p.view(torch.int16).to(torch.int32)
    if p.dtype == torch.bfloat16:
        return (h << 16).view(torch.float32)
    mag = h & 0x7FFF
    bits = (mag << 13).view(torch.float32).mul(2.0**112).view(torch.int32)
    # Infinities, and NaNs with their payload and the quiet bit set, as the conversion sets it.
    bits = torch.where(mag >= 0x7C00, (mag << 13) | 0x7F800000, bits)
    bits = torch.where(mag > 0x7C00, bits | 0x00400000, bits)
    return (bits | ((h & 0x8000) << 16)).view(torch.float32)

"""Grouping leaves by (device, dtype) for foreach and fused kernels.

torch's multi-tensor kernels take lists whose tensors share one device and one
dtype. This module makes those lists, decides which implementation a group
gets, and bounds the size of each foreach call on eager devices so that the
temporaries a foreach chain allocates stay a constant, not a model's worth.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Literal

import torch

__all__ = [
    "FOREACH_CHUNK_NUMEL",
    "Impl",
    "chunks",
    "copy_grouped_",
    "fused_supported",
    "group_indices",
    "is_lazy",
    "resolve_impl",
]

Impl = Literal["auto", "fused", "foreach", "reference"]
IMPLS: tuple[str, ...] = ("auto", "fused", "foreach", "reference")

# One foreach call on an eager device touches at most this many elements, so
# the temporaries it allocates (e.g. Adam's denominator) stay below ~64 MiB in
# fp32 whatever the model size. Lazy devices (XLA) trace a graph and fuse the
# temporaries away, so they are not chunked.
FOREACH_CHUNK_NUMEL = 1 << 24

_FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _fused_devices() -> tuple[str, ...]:
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

        return tuple(_get_fused_kernels_supported_devices())
    except ImportError:  # pragma: no cover - older torch
        return ("cuda", "cpu")


_FUSED_DEVICES = _fused_devices()


def is_lazy(device: torch.device) -> bool:
    """True for devices that trace graphs (XLA), where every op becomes a graph node."""
    return device.type in ("xla", "lazy")


def fused_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch has a fused optimizer kernel for this device and dtype."""
    return device.type in _FUSED_DEVICES and dtype in _FUSED_DTYPES


def resolve_impl(impl: str, device: torch.device, dtype: torch.dtype, has_fused: bool) -> str:
    """Picks the implementation for one (device, dtype) group.

    ``auto`` takes the fused kernel where torch has one, else the foreach path.
    """
    if impl == "auto":
        return "fused" if has_fused and fused_supported(device, dtype) else "foreach"
    if impl == "fused" and not (has_fused and fused_supported(device, dtype)):
        raise ValueError(
            f"impl='fused': expected a device and dtype with a fused torch kernel "
            f"({', '.join(_FUSED_DEVICES)}; {', '.join(str(d) for d in _FUSED_DTYPES)}), "
            f"got {dtype} on {device}. Use impl='auto' or 'foreach'."
        )
    return impl


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
    idx: list[int], tensors: Sequence[torch.Tensor | None], device: torch.device
) -> Iterator[list[int]]:
    """Splits ``idx`` into runs of at most ``FOREACH_CHUNK_NUMEL`` elements (one run on lazy
    devices). A single tensor larger than the limit forms a run of its own."""
    if is_lazy(device):
        yield idx
        return
    run: list[int] = []
    total = 0
    for i in idx:
        t = tensors[i]
        n = t.numel() if t is not None else 0
        if run and total + n > FOREACH_CHUNK_NUMEL:
            yield run
            run, total = [], 0
        run.append(i)
        total += n
    if run:
        yield run


def copy_grouped_(
    dst: Sequence[torch.Tensor],
    src: Sequence[torch.Tensor],
    keys: Sequence[tuple[object, ...] | None] | None = None,
) -> None:
    """``dst[i].copy_(src[i])`` for all i, one foreach call per (device, dtype, dtype) group.

    ``copy_`` rounds to nearest even exactly as ``Tensor.to`` does. ``keys`` may pass
    the groups' (device, dst dtype, src dtype) when the caller already has them.
    """
    if keys is None:
        keys = [(d.device, d.dtype, s.dtype) for d, s in zip(dst, src)]
    with torch.no_grad():
        for idx in group_indices(keys).values():
            torch._foreach_copy_([dst[i] for i in idx], [src[i] for i in idx])

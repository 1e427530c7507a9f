"""XLA SPMD helpers shared by the spmd benchmark and its tests: the mesh, the sharding a
tensor's device buffers really have, and the bytes each device holds.

Import only in a process that has called ``torch_xla.runtime.use_spmd()``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch


def mesh(devices: int | None = None, axis: str = "data") -> Any:
    """A 1-D mesh named ``axis`` over every device (or the first ``devices``)."""
    import numpy as np
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr

    n = xr.global_runtime_device_count() if devices is None else devices
    return xs.Mesh(np.arange(n), (n,), (axis,))


def spec(t: torch.Tensor) -> str:
    """torch_xla's sharding spec of ``t``: ``"{devices=[4,1]0,1,2,3}"``, ``"{replicated}"``,
    or ``""`` for a tensor not yet computed and never annotated."""
    import torch_xla

    return str(torch_xla._XLAC._get_xla_sharding_spec(t))  # type: ignore[attr-defined]


def expected_spec(shape: Sequence[int], pspec: Sequence[Any], devices: int) -> str:
    """The spec string torch_xla prints for a 1-D mesh of ``devices`` and a partition spec
    (``("data", None)``...): one tiled dimension, or ``{replicated}``."""
    tiles = [devices if a is not None else 1 for a in pspec]
    if devices == 1 or all(t == 1 for t in tiles):
        return "{replicated}"
    return "{devices=[" + ",".join(map(str, tiles)) + "]" + ",".join(map(str, range(devices))) + "}"


def device_bytes(tensors: Iterable[torch.Tensor | None]) -> dict[str, int]:
    """Bytes each device holds for ``tensors``, from their device buffers: torch_xla's
    ``_get_local_shards`` returns every shard as it lies on its device (padded where a
    split is uneven), and each is counted where it lies. Reads the shards back to the
    host: call it outside measured steps, after a sync."""
    import torch_xla
    import torch_xla.core.xla_model as xm

    xlac: Any = torch_xla._XLAC  # type: ignore[attr-defined]
    ts = [t for t in tensors if t is not None]
    torch_xla.sync()
    xm.wait_device_ops()
    out: dict[str, int] = {}
    for shards in xlac._get_local_shards(ts):
        for data, where in shards:
            out[where] = out.get(where, 0) + data.numel() * data.element_size()
    return dict(sorted(out.items()))


def full_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of ``tensors`` unsharded (one whole copy)."""
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)

"""DTensor leaves (FSDP2, tensor parallel): elementwise work runs on the local shards.

A DTensor is a wrapper: its ``data_ptr()`` is 0, foreach ops over DTensors go through
sharding propagation (and some, such as ``_foreach_copy_``, find no mesh), and a DTensor
mixed with a plain tensor (a tensor lr, a ``skip`` flag) is refused. mpfunc's
elementwise kernels (casts, optimizer steps, accumulation) therefore run on each
DTensor's local tensor (``to_local()`` without a copy): an elementwise op on matching
shards is the op on the global tensor. Pure functions wrap their results back into
DTensors with the input's mesh and placements, so a tree of DTensors stays one.

Reductions over the whole tree (``clip_by_global_norm``, ``all_finite``) keep DTensor's
own dispatch, which reduces across the mesh, and return plain tensors that hold the
global value on every rank.

No DTensor can exist unless ``torch.distributed.tensor`` is imported, so the checks here
cost one dictionary lookup when it is not, and mpfunc never imports it itself.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Sequence
from typing import Any

import torch

__all__ = [
    "describe_sharding",
    "dtensor_type",
    "extents",
    "full",
    "is_dtensor",
    "local",
    "local_group",
    "locals_",
    "placement_problem",
    "same_sharding",
    "sharding_key",
    "wrap_as",
    "wrap_like",
]


def _module() -> Any:
    """torch's DTensor module if loaded (public from torch 2.5, ``_tensor`` before), else None."""
    return sys.modules.get("torch.distributed.tensor") or sys.modules.get(
        "torch.distributed._tensor"
    )


def dtensor_type() -> Any:
    """The DTensor class if torch's DTensor module is loaded (no DTensor exists otherwise)."""
    cls = getattr(_module(), "DTensor", None)
    return cls if isinstance(cls, type) else None


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a DTensor (one dictionary lookup when none can exist)."""
    cls = dtensor_type()
    return cls is not None and isinstance(t, cls)


def local(t: Any) -> Any:
    """``t``'s local shard if ``t`` is a DTensor (a view, no copy), else ``t``."""
    cls = dtensor_type()
    if cls is not None and isinstance(t, cls):
        return t._local_tensor  # what to_local() returns, without an autograd node
    return t


def locals_(tensors: Sequence[Any]) -> list[Any]:
    """``local`` of each element (``None`` stays ``None``)."""
    cls = dtensor_type()
    if cls is None:
        return list(tensors)
    return [t._local_tensor if isinstance(t, cls) else t for t in tensors]


def wrap_like(ref: Any, t: torch.Tensor) -> Any:
    """``t`` (a local result) as a DTensor with ``ref``'s mesh and placements when ``ref``
    is a DTensor; ``t`` itself otherwise."""
    cls = dtensor_type()
    if cls is None or not isinstance(ref, cls):
        return t
    spec = ref._spec
    return cls.from_local(
        t, spec.mesh, spec.placements, run_check=False, shape=ref.shape, stride=ref.stride()
    )


def wrap_as(ref: Any, t: torch.Tensor, shape: Sequence[int]) -> Any:
    """``t`` (this rank's shard) as a DTensor of global ``shape`` (contiguous strides) with
    ``ref``'s mesh and placements: a packed buffer beside a DTensor ``ref``. The caller
    makes sure that ``t`` is the shard those placements give this rank (``extents``)."""
    cls = dtensor_type()
    spec = ref._spec
    shape = tuple(shape)
    stride = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        stride[d] = stride[d + 1] * max(shape[d + 1], 1)
    return cls.from_local(
        t, spec.mesh, spec.placements, run_check=False, shape=shape, stride=tuple(stride)
    )


def extents(t: Any, dim: int, size: int | None = None) -> list[tuple[int, int]] | None:
    """Every shard's ``(offset, length)`` along ``dim`` of the DTensor ``t`` (of a tensor
    of ``size`` elements along ``dim`` placed as ``t``, if given), in mesh order: each
    ``Shard(dim)`` placement splits every piece as ``torch.chunk`` does (chunks of
    ``ceil(n / mesh size)``, empty ones last), as DTensor places its shards. ``None`` if a
    placement splits ``dim`` some other way (a ``Shard`` subclass such as FSDP2 + TP's
    strided shards). Computed from the global shape alone, so every rank gets the same."""
    Shard = _module().Shard  # (loaded: t is a DTensor)
    spec = t._spec
    pieces = [(0, int(t.shape[dim]) if size is None else size)]
    for i, placement in enumerate(spec.placements):
        if not isinstance(placement, Shard) or placement.dim % t.dim() != dim:
            continue
        if type(placement) is not Shard:
            return None
        k = spec.mesh.size(i)
        split = []
        for off, n in pieces:
            c = -(-n // k)
            split += [(off + min(j * c, n), min((j + 1) * c, n) - min(j * c, n)) for j in range(k)]
        pieces = split
    return pieces


def shard_index(t: Any) -> int:
    """Which shard of the DTensor ``t`` this rank holds, as one number: 0 for a replicated
    one; ranks holding the same shard (replicas along other mesh dims) get the same."""
    Shard = _module().Shard  # (loaded: t is a DTensor)
    spec = t._spec
    coord = spec.mesh.get_coordinate()
    if coord is None:
        return 0
    index = 0
    for i, placement in enumerate(spec.placements):
        if isinstance(placement, Shard):
            index = index * spec.mesh.size(i) + coord[i]
    return index


def same_sharding(a: Any, b: Any) -> str | None:
    """``None`` if ``a`` and ``b`` pair shard for shard (both plain tensors, or DTensors on
    one mesh with one placement), else what ``b`` should have been, for an error."""
    cls = dtensor_type()
    if cls is None:
        return None
    da, db = isinstance(a, cls), isinstance(b, cls)
    if not da and not db:
        return None
    if da != db:
        kind = "a DTensor" if da else "a plain tensor"
        return f"{kind}, as the reference leaf (elementwise work pairs local shards)"
    placed = placement_problem(a, b)
    if placed is not None:
        return placed
    if a._local_tensor.shape != b._local_tensor.shape:
        return f"a local shard of shape {tuple(a._local_tensor.shape)}"
    return None


def placement_problem(a: Any, b: Any) -> str | None:
    """``None`` if the DTensor ``b`` has the mesh and placements of the DTensor ``a``
    (whatever its shape), else what it should have had, for an error."""
    sa, sb = a._spec, b._spec
    if sa.mesh != sb.mesh or tuple(sa.placements) != tuple(sb.placements):
        return f"a DTensor on {sa.mesh} with placements {tuple(sa.placements)}"
    return None


def describe_sharding(t: Any) -> str:
    cls = dtensor_type()
    if cls is None or not isinstance(t, cls):
        return f"a plain tensor of shape {tuple(t.shape)}"
    spec = t._spec
    return (
        f"a DTensor on {spec.mesh} with placements {tuple(spec.placements)}, local shard of "
        f"shape {tuple(t._local_tensor.shape)}"
    )


def local_group(group: Any) -> Any:
    """A kernel's ``Group`` (a NamedTuple of lists, a state NamedTuple, lr, skip) with every
    DTensor replaced by its local shard; the same object when there is none."""
    cls = dtensor_type()
    if cls is None:
        return group
    from mpfunc.core import _tree

    if not _may_hold(group, cls):
        return group
    leaves, spec = _tree.flatten(group)
    if not any([isinstance(t, cls) for t in leaves]):  # (no generator frame per leaf)
        return group
    return _tree.unflatten(spec, [t._local_tensor if isinstance(t, cls) else t for t in leaves])


# What a kernel's group holds besides lists, tuples (NamedTuples, units) and dicts.
_SCALARS = (torch.Tensor, type(None), bool, int, float, str, torch.device, torch.dtype)


def _may_hold(x: Any, cls: type) -> bool:
    """Whether ``x`` (lists, tuples and dicts of tensors, as a kernel's group) may hold an
    instance of ``cls``: False only when none of its items is one. Container by container,
    from the set of its items' types (read in C; a list of units is joined in C and read
    the same way): torch imports DTensor with torch._dynamo, which any torch.optim step and
    torch_xla import, so a group of 10,000 plain leaves must not be walked by optree per
    step for nothing (that doubled a step at 10,000 leaves). An item of another type (a node
    optree knows and this does not) answers True: the caller's walk decides."""
    containers = (list, tuple, dict)
    todo = [x]
    while todo:
        c = todo.pop()
        items = c.values() if isinstance(c, dict) else c
        kinds = set(map(type, items))
        if any(issubclass(k, cls) for k in kinds):
            return True
        if not all(issubclass(k, (*containers, *_SCALARS)) for k in kinds):
            return True
        if not kinds:
            continue
        if all(issubclass(k, tuple) for k in kinds):  # units (or tuples) only
            todo.append(list(itertools.chain.from_iterable(items)))
        elif any(issubclass(k, containers) for k in kinds):
            todo.extend([v for v in items if isinstance(v, containers)])
    return False


def sharding_key(t: Any) -> object:
    """``None`` for a plain tensor; a DTensor's (mesh, placements): reductions group by it,
    since DTensors on different meshes cannot be stacked."""
    cls = dtensor_type()
    if cls is None or not isinstance(t, cls):
        return None
    return (t._spec.mesh, tuple(t._spec.placements))


def full(t: torch.Tensor) -> torch.Tensor:
    """A reduction's result as a plain tensor holding the global value on every rank (one
    collective if ``t`` is a partial DTensor); a plain tensor as it is."""
    cls = dtensor_type()
    if cls is not None and isinstance(t, cls):
        return t.full_tensor()  # type: ignore[no-any-return]
    return t

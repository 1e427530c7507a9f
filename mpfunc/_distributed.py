"""Data parallel: bucketed gradient all-reduce and sharded fp32 masters.

Built on the real engines: ``torch.distributed`` (gloo on CPU, NCCL on GPU) for
eager tensors and torch_xla's in-graph collectives for XLA tensors. Parameters
are never split: a shard plan assigns whole leaves to ranks, so every master
keeps its shape. Flattening happens for communication only, in bounded buckets,
so the number of collectives grows with bytes, not with the number of tensors.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from mpfunc import _checks, _tree

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "all_reduce_grads",
    "all_reduce_grads_",
    "broadcast_params_",
    "reduce_grads_to_owners",
    "shard",
    "shard_plan",
    "verify_replicas",
]

# One collective carries at most this many bytes (the same default as DDP's buckets).
DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024
_OPS = ("mean", "sum")


def _dist() -> Any:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "mpfunc: torch.distributed is not initialized; call "
            "torch.distributed.init_process_group (e.g. under torchrun) first"
        )
    return dist


def _world(group: Any) -> int:
    return int(_dist().get_world_size(group))


def _buckets(
    idx: Sequence[int], tensors: Sequence[torch.Tensor], itemsize: int, bucket_bytes: int
) -> list[list[int]]:
    """Consecutive runs of leaves whose bytes (at ``itemsize``) stay within a bucket;
    a leaf larger than a bucket travels alone."""
    out: list[list[int]] = []
    run: list[int] = []
    size = 0
    for i in idx:
        n = tensors[i].numel() * itemsize
        if run and size + n > bucket_bytes:
            out.append(run)
            run, size = [], 0
        run.append(i)
        size += n
    if run:
        out.append(run)
    return out


def _check_grads(fn: str, grads: Any, op: str, reduce_dtype: Any) -> tuple[list[Any], Any]:
    if op not in _OPS:
        raise ValueError(f"{fn}: op: expected one of {', '.join(_OPS)}, got {op!r}")
    if reduce_dtype is not None and (
        not isinstance(reduce_dtype, torch.dtype) or not reduce_dtype.is_floating_point
    ):
        raise TypeError(
            f"{fn}: reduce_dtype: expected None or a floating dtype, got {reduce_dtype!r}"
        )
    leaves, spec = _tree.flatten(grads)
    _checks.check_tensor_or_none(fn, "grads", grads, leaves)
    for i, g in enumerate(leaves):
        if g is not None and not g.is_floating_point():
            _checks.fail(
                TypeError, fn, _tree.leaf_path(grads, i, "grads"), "a floating-point grad",
                _checks.describe(g),
            )  # fmt: skip
    return leaves, spec


def _reduce(
    leaves: list[Any],
    group: Any,
    op: str,
    reduce_dtype: torch.dtype | None,
    bucket_bytes: int,
) -> list[Any]:
    """Returns the reduced value of every leaf (``None`` stays ``None``), in the reduce
    dtype; XLA leaves are reduced in place by torch_xla and returned as themselves."""
    out: list[Any] = [None] * len(leaves)
    keys: dict[tuple[Any, ...], list[int]] = {}
    for i, g in enumerate(leaves):
        if g is not None:
            keys.setdefault((g.device, g.dtype), []).append(i)
    for (device, dtype), idx in keys.items():
        rdtype = reduce_dtype or dtype
        if device.type == "xla":
            _reduce_xla(leaves, idx, group, op, rdtype, out)
            continue
        dist = _dist()
        world = _world(group)
        if world == 1:  # nothing to exchange: a copy in the reduce dtype
            for i in idx:
                out[i] = leaves[i].to(rdtype, copy=True)
            continue
        itemsize = torch.empty((), dtype=rdtype).element_size()
        for run in _buckets(idx, leaves, itemsize, bucket_bytes):
            flat, pieces = _pack(leaves, run, rdtype)
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
            if op == "mean":
                flat.div_(world)
            for i, piece in zip(run, pieces):
                out[i] = piece
    return out


def _owned_runs(
    leaves: Sequence[Any],
    owners: Sequence[Any],
    rank: int,
    wire_dtype: torch.dtype | None,
    bucket_bytes: int,
) -> Iterator[tuple[list[int], torch.dtype]]:
    """The buckets of ``rank``'s leaves, per (device, dtype) group, each with the dtype it
    travels in (``wire_dtype``, else the leaves' own). Every rank computes the same list
    for every owner, so the collectives line up."""
    groups: dict[tuple[Any, ...], list[int]] = {}
    for i, (t, owner) in enumerate(zip(leaves, owners)):
        if t is not None and owner == rank:
            groups.setdefault((t.device, t.dtype), []).append(i)
    for (_, dtype), idx in groups.items():
        wire = wire_dtype or dtype
        itemsize = torch.empty((), dtype=wire).element_size()
        for run in _buckets(idx, leaves, itemsize, bucket_bytes):
            yield run, wire


def _pack(
    leaves: Sequence[torch.Tensor], run: list[int], dtype: torch.dtype
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One contiguous buffer for a bucket (flattened for the wire only), filled leaf by
    leaf with the cast folded into the copy, and each leaf's shaped view into it."""
    first = leaves[run[0]]
    flat = torch.empty(sum(leaves[i].numel() for i in run), dtype=dtype, device=first.device)
    pieces = []
    offset = 0
    for i in run:
        n = leaves[i].numel()
        piece = flat[offset : offset + n].view(leaves[i].shape)
        piece.copy_(leaves[i])
        pieces.append(piece)
        offset += n
    return flat, pieces


def _reduce_xla(
    leaves: list[Any], idx: list[int], group: Any, op: str, rdtype: torch.dtype, out: list[Any]
) -> None:
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    if group is not None:
        raise ValueError(
            "all_reduce_grads: group: expected None for XLA tensors (torch_xla reduces over "
            f"its own replicas), got {group!r}"
        )
    import torch.distributed as dist

    if (
        dist.is_available()
        and dist.is_initialized()
        and dist.get_world_size() > 1
        and xr.world_size() == 1
        and not xr.is_spmd()  # type: ignore[no-untyped-call]
    ):
        # Under torchrun with a runtime that sees one participant, xm.all_reduce would
        # silently return each process's own grads.
        raise RuntimeError(
            f"all_reduce_grads: torch.distributed has {dist.get_world_size()} ranks but the "
            "XLA runtime sees 1 participant, so an XLA all-reduce would do nothing; launch "
            "with torch_xla's launcher (xmp.spawn) so the runtime sees every device"
        )
    scale = 1.0 / xr.world_size() if op == "mean" else 1.0
    tensors = [
        leaves[i].to(rdtype) if leaves[i].dtype != rdtype else leaves[i].clone() for i in idx
    ]
    # A list all-reduce is one in-graph collective over all of them; no host sync.
    xm.all_reduce(xm.REDUCE_SUM, tensors, scale=scale)
    for i, t in zip(idx, tensors):
        out[i] = t


def all_reduce_grads(
    grads: Any,
    group: Any = None,
    op: str = "mean",
    reduce_dtype: torch.dtype | None = None,
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> Any:
    """All-reduces a grad tree across ``group`` and returns the reduced tree.

    Leaves are coalesced per (device, dtype) into buckets of at most
    ``bucket_bytes`` and each bucket is one ``torch.distributed.all_reduce``; on
    XLA, one in-graph ``xm.all_reduce`` over the list. ``None`` stays ``None``.

    Args:
      grads: a tree of floating tensors or ``None`` (the same tree on every rank).
      group: a process group (default: the world).
      op: ``"mean"`` (default) or ``"sum"``.
      reduce_dtype: ``None`` reduces in the grads' own dtype, as the recipe does;
        ``torch.float32`` upcasts first, for accuracy, and returns fp32 grads.
      bucket_bytes: the largest bucket, in bytes of the reduce dtype. Not used on XLA,
        where each (device, dtype) group is one list all-reduce that XLA schedules.

    On XLA's CPU backend an all-reduce cannot carry bf16: pass
    ``reduce_dtype=torch.float32`` there (TPUs reduce bf16 natively).

    Returns:
      A new tree of reduced grads, in ``reduce_dtype`` (or the grads' dtypes). Leaves of
      one bucket are views into that bucket's buffer (no second copy is made).

    Raises:
      RuntimeError: torch.distributed is not initialized (eager tensors), or on XLA it
        has several ranks while the XLA runtime sees one participant.
      TypeError, ValueError: a leaf is not a floating tensor or ``None``, or an
        argument is out of range.
    """
    leaves, spec = _check_grads("all_reduce_grads", grads, op, reduce_dtype)
    with torch.no_grad():
        return _tree.unflatten(spec, _reduce(leaves, group, op, reduce_dtype, bucket_bytes))


def all_reduce_grads_(
    grads: Any,
    group: Any = None,
    op: str = "mean",
    reduce_dtype: torch.dtype | None = None,
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> Any:
    """``all_reduce_grads`` written back into the grads' own tensors (in their dtype;
    with ``reduce_dtype=torch.float32`` the sum is taken in fp32 and rounded once).

    Returns:
      ``grads``.
    """
    leaves, _ = _check_grads("all_reduce_grads_", grads, op, reduce_dtype)
    with torch.no_grad():
        reduced = _reduce(leaves, group, op, reduce_dtype, bucket_bytes)
        for g, r in zip(leaves, reduced):
            if g is not None and r is not g:
                g.copy_(r)
    return grads


def reduce_grads_to_owners(
    grads: Any,
    plan: Any,
    group: Any = None,
    op: str = "mean",
    reduce_dtype: torch.dtype | None = None,
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> Any:
    """Reduces each grad to the rank that owns it under ``plan`` (for sharded masters).

    Like ``all_reduce_grads``, but each bucket holds one owner's leaves and goes to
    that owner with ``torch.distributed.reduce``, so a rank receives only the grads it
    updates: about half an all-reduce's traffic.

    Args:
      grads: a tree of floating tensors or ``None`` (the same tree on every rank).
      plan: from ``shard_plan``, the same on every rank.
      group, op, reduce_dtype, bucket_bytes: as in ``all_reduce_grads``.

    Returns:
      The reduced grads this rank owns (in ``reduce_dtype`` or their own dtype), and
      ``None`` for every other leaf: the ``g32`` of this rank's sharded update.

    Raises:
      RuntimeError, TypeError, ValueError: as ``all_reduce_grads``; ``ValueError`` if
        ``plan`` does not match ``grads``.
    """
    fn = "reduce_grads_to_owners"
    leaves, spec = _check_grads(fn, grads, op, reduce_dtype)
    p_leaves, p_spec = _tree.flatten(plan)
    _checks.check_same_structure(fn, "grads", grads, spec, "plan", plan, p_spec)
    dist = _dist()
    world = _world(group)
    me = dist.get_rank(group)
    out: list[Any] = [None] * len(leaves)
    with torch.no_grad():
        for r in range(world):
            dst = r if group is None else dist.get_global_rank(group, r)
            for run, wire in _owned_runs(leaves, p_leaves, r, reduce_dtype, bucket_bytes):
                flat, pieces = _pack(leaves, run, wire)
                if world > 1:
                    dist.reduce(flat, dst=dst, op=dist.ReduceOp.SUM, group=group)
                if r != me:
                    continue
                if op == "mean":
                    flat.div_(world)
                for i, piece in zip(run, pieces):
                    out[i] = piece
    return _tree.unflatten(spec, out)


def shard_plan(params: Any, world_size: int) -> Any:
    """Assigns every tensor leaf, whole, to one of ``world_size`` ranks, balancing bytes.

    Deterministic: leaves are taken largest first (ties by path) and each goes to
    the least-loaded rank (ties to the lowest rank), so every rank computes the same
    plan. No tensor is split, so shapes stay intact.

    Args:
      params: a tree of tensors or ``None``.
      world_size: the number of ranks, >= 1.

    Returns:
      A tree shaped like ``params`` whose leaves are the owning rank (``int``), or
      ``None`` where ``params`` has ``None``.

    Raises:
      TypeError, ValueError: ``world_size`` is not an int >= 1, or a leaf is not a tensor.
    """
    fn = "shard_plan"
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"{fn}: world_size: expected an int >= 1, got {world_size!r}")
    leaves, spec = _tree.flatten(params)
    _checks.check_tensor_or_none(fn, "params", params, leaves)
    paths = _tree.leaf_paths(params)
    order = sorted(
        (i for i, t in enumerate(leaves) if t is not None),
        key=lambda i: (-leaves[i].numel() * leaves[i].element_size(), paths[i]),
    )
    load = [0] * world_size
    owner: list[int | None] = [None] * len(leaves)
    for i in order:
        r = min(range(world_size), key=lambda k: (load[k], k))
        owner[i] = r
        load[r] += leaves[i].numel() * leaves[i].element_size()
    return _tree.unflatten(spec, owner)


def shard(tree: Any, plan: Any, rank: int) -> Any:
    """The part of ``tree`` that ``rank`` owns under ``plan``; ``None`` elsewhere.

    ``init_master(shard(params, plan, rank))`` makes masters (and ``opt.init`` state)
    for this rank's leaves only: about 1/world_size of the memory.

    Raises:
      ValueError: ``tree`` and ``plan`` differ in structure.
    """
    leaves, spec = _tree.flatten(tree)
    p_leaves, p_spec = _tree.flatten(plan)
    _checks.check_same_structure("shard", "tree", tree, spec, "plan", plan, p_spec)
    return _tree.unflatten(spec, [t if r == rank else None for t, r in zip(leaves, p_leaves)])


def broadcast_params_(
    params: Any, plan: Any, group: Any = None, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> Any:
    """Sends each leaf from its owner to every rank, in place, so replicas stay identical.

    After a sharded update each owner holds the new low-precision values of its
    leaves; this broadcasts them, one ``torch.distributed.broadcast`` per owner and
    bucket (leaves flattened for the wire only).

    Args:
      params: the model's parameter tree on this rank, overwritten in place.
      plan: from ``shard_plan(params, world_size)``, the same on every rank.
      group: a process group (default: the world); plan ranks are ranks in it.

    Returns:
      ``params``.
    """
    dist = _dist()
    leaves, spec = _tree.flatten(params)
    p_leaves, p_spec = _tree.flatten(plan)
    _checks.check_same_structure("broadcast_params_", "params", params, spec, "plan", plan, p_spec)
    world = _world(group)
    if world == 1:
        return params
    with torch.no_grad():
        for r in range(world):
            src = r if group is None else dist.get_global_rank(group, r)
            for run, wire in _owned_runs(leaves, p_leaves, r, None, bucket_bytes):
                flat, pieces = _pack(leaves, run, wire)
                dist.broadcast(flat, src=src, group=group)
                for i, piece in zip(run, pieces):
                    leaves[i].copy_(piece)
    return params


def _fingerprint(tree: Any) -> tuple[torch.Tensor, list[str]]:
    leaves, spec = _tree.flatten(tree)
    lines = [str(spec)]
    paths = _tree.leaf_paths(tree)
    for i, t in enumerate(leaves):
        desc = "None" if t is None else f"{tuple(t.shape)} {t.dtype}"
        lines.append(f"{paths[i]}: {desc}")
    digest = hashlib.sha256("\n".join(lines).encode()).digest()
    words = [int.from_bytes(digest[k : k + 7], "little") for k in range(0, 28, 7)]
    return torch.tensor(words, dtype=torch.int64), lines


def verify_replicas(tree: Any, group: Any = None) -> None:
    """Checks, at set-up, that every rank holds a tree of the same structure, shapes and
    dtypes; raises the same clear error on every rank otherwise, never a hang.

    Each rank contributes a fixed-size fingerprint to one ``all_gather``; if they
    differ, the ranks' leaf lists are gathered to name the first difference.

    Raises:
      ValueError: the ranks disagree (on every rank, naming ranks and the first path).
      RuntimeError: torch.distributed is not initialized, or a rank died or timed out
        (the group's timeout bounds the wait).
    """
    dist = _dist()
    world = _world(group)
    mine, lines = _fingerprint(tree)
    everyone = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine, group=group)
    if all(torch.equal(e, everyone[0]) for e in everyone):
        return
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, lines, group=group)
    groups: dict[tuple[str, ...], list[int]] = {}
    for r, ls in enumerate(gathered):
        groups.setdefault(tuple(ls), []).append(r)
    ref = gathered[0]
    detail = "differs"
    for r, ls in enumerate(gathered):
        if ls != ref:
            diff = next(
                (
                    f"rank 0 has {a!r}, rank {r} has {b!r}"
                    for a, b in zip(ref[1:], ls[1:])
                    if a != b
                ),
                f"rank 0 has {len(ref) - 1} leaves, rank {r} has {len(ls) - 1}",
            )
            detail = diff
            break
    raise ValueError(
        f"verify_replicas: the ranks hold different trees (structure, shapes or dtypes): "
        f"{sorted(groups.values())} agree among themselves; first difference: {detail}"
    )

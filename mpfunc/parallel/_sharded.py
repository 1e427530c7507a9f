"""Data parallel with sharded fp32 masters: a shard plan assigns whole leaves to ranks
(``shard_plan``, ``shard``), each grad is reduced to its owner (``reduce_grads_to_owners``)
and each owner broadcasts its updated params (``broadcast_params_``).

Parameters are never split, so every master keeps its shape. The buckets and the ranks'
agreement are ``_all_reduce``'s and ``_replicas``'.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch

from mpfunc.core import _checks, _tree
from mpfunc.parallel import _all_reduce, _replicas
from mpfunc.parallel._all_reduce import DEFAULT_BUCKET_BYTES

__all__ = ["broadcast_params_", "reduce_grads_to_owners", "shard", "shard_plan"]


def _check_plan(
    fn: str,
    tree: Any,
    name: str,
    leaves: Sequence[Any],
    spec: Any,
    plan: Any,
    world: int | None,
) -> list[Any]:
    """The plan's leaves, after checking that the plan has ``tree``'s structure and gives
    every tensor an owner: an int in ``[0, world)`` (``world=None``: any int >= 0)."""
    p_leaves, p_spec = _tree.flatten(plan)
    _checks.check_same_structure(fn, name, tree, spec, "plan", plan, p_spec)
    rule = "an owner rank >= 0" if world is None else f"an owner rank in [0, {world})"
    for i, (t, owner) in enumerate(zip(leaves, p_leaves)):
        if owner is None and t is None:
            continue
        if isinstance(owner, bool) or not isinstance(owner, int):
            cls: type[Exception] = TypeError if owner is not None else ValueError
            got = _checks.describe(owner)
            hint = "every tensor needs an owner; make the plan with shard_plan(params, world)"
        elif owner < 0 or (world is not None and owner >= world):
            cls, got = ValueError, f"rank {owner}"
            hint = "the plan was made for another world size: use shard_plan(params, world)"
        else:
            continue
        _checks.fail(cls, fn, _tree.leaf_path(plan, i, "plan"), rule, got, hint)
    return p_leaves


def _owned_runs(
    leaves: Sequence[Any],
    owners: Sequence[Any],
    rank: int,
    wire_dtype: torch.dtype | None,
    bucket_bytes: int,
) -> Iterator[tuple[list[int], torch.dtype]]:
    """The buckets of ``rank``'s leaves, per (device, dtype) group, each with the dtype it
    travels in (``wire_dtype``, else the leaves' own). Every rank computes the same list
    for every owner (the fingerprint made sure), so the collectives line up."""
    groups: dict[tuple[Any, ...], list[int]] = {}
    for i, (t, owner) in enumerate(zip(leaves, owners)):
        if t is not None and owner == rank:
            groups.setdefault((t.device, t.dtype), []).append(i)
    for (_, dtype), idx in groups.items():
        wire = wire_dtype or dtype
        itemsize = torch.empty((), dtype=wire).element_size()
        for run in _all_reduce.buckets(idx, leaves, itemsize, bucket_bytes):
            yield run, wire


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
    updates: about half an all-reduce's traffic. The first call with a given tree, plan
    and settings compares their fingerprint across the ranks, as ``all_reduce_grads``.

    Args:
      grads: a tree of floating tensors or ``None`` (the same tree on every rank).
      plan: from ``shard_plan``, the same on every rank.
      group, op, reduce_dtype, bucket_bytes: as in ``all_reduce_grads``.

    Returns:
      The reduced grads this rank owns (in ``reduce_dtype`` or their own dtype, each with
      its grad's layout), and ``None`` for every other leaf: the ``g32`` of this rank's
      sharded update.

    Raises:
      RuntimeError, TypeError, ValueError: as ``all_reduce_grads``; ``ValueError`` if
        ``plan`` does not match ``grads``, gives a tensor no owner or an owner outside
        ``[0, world)``, or differs between the ranks.
    """
    fn = "reduce_grads_to_owners"
    leaves, spec, _, metas = _all_reduce.check_grads(fn, grads, op, reduce_dtype)
    _checks.integer(fn, "bucket_bytes", bucket_bytes, ge=1)
    dist = _replicas.require_dist()
    world = _replicas.world_size(group)
    p_leaves = _check_plan(fn, grads, "grads", leaves, spec, plan, world)
    header = _replicas.settings(fn, op=op, reduce_dtype=reduce_dtype, bucket_bytes=bucket_bytes)
    _replicas.agree(
        fn,
        "paths, shapes, dtypes, shard plan or settings",
        (fn, op, reduce_dtype, bucket_bytes, spec, tuple(p_leaves), metas),
        lambda: _replicas.describe_call(header, grads, leaves, spec, p_leaves),
        leaves,
        group,
        on_xla=False,
    )
    me = dist.get_rank(group)
    out: list[Any] = [None] * len(leaves)
    with torch.no_grad():
        for r in range(world):
            dst = r if group is None else dist.get_global_rank(group, r)
            for run, wire in _owned_runs(leaves, p_leaves, r, reduce_dtype, bucket_bytes):
                flat, pieces = _all_reduce.pack(leaves, run, wire)
                # An fp16 mean divides each part first, as all_reduce_grads does (dividing
                # the sum overflowed: two ranks' 40000 reached the owner as inf).
                first = _all_reduce.divides_first(op, flat.dtype)
                if first and world > 1:
                    flat.div_(world)
                if world > 1:
                    dist.reduce(flat, dst=dst, op=dist.ReduceOp.SUM, group=group)
                if r != me:
                    continue
                if op == "mean" and not first:
                    flat.div_(world)
                for i, piece in zip(run, pieces):
                    out[i] = _all_reduce.in_layout(piece, leaves[i])
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
      TypeError: ``world_size`` is not an int, or a leaf is not a tensor or ``None``.
      ValueError: ``world_size`` < 1.
    """
    fn = "shard_plan"
    _checks.integer(fn, "world_size", world_size, ge=1)
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
      TypeError: ``rank`` is not an int, or a plan leaf is neither an int nor ``None``.
      ValueError: ``rank`` < 0; ``tree`` and ``plan`` differ in structure; the plan
        gives a tensor of ``tree`` no owner, or a negative one.
    """
    fn = "shard"
    _checks.integer(fn, "rank", rank, ge=0)
    leaves, spec = _tree.flatten(tree)
    p_leaves = _check_plan(fn, tree, "tree", leaves, spec, plan, None)
    return _tree.unflatten(spec, [t if r == rank else None for t, r in zip(leaves, p_leaves)])


def broadcast_params_(
    params: Any, plan: Any, group: Any = None, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> Any:
    """Sends each leaf from its owner to every rank, in place, so replicas stay identical.

    After a sharded update each owner holds the new low-precision values of its
    leaves; this broadcasts them, one ``torch.distributed.broadcast`` per owner and
    bucket (leaves flattened for the wire only, in logical order whatever their
    strides). The first call with a given tree, plan and ``bucket_bytes`` compares their
    fingerprint across the ranks, as ``all_reduce_grads``.

    Every check (and the ranks' agreement) runs before the first broadcast. Leaves are
    written bucket by bucket as they arrive (a second copy of every param would double
    the memory), so a collective that fails midway (a dead peer) leaves earlier buckets
    written.

    Args:
      params: the model's parameter tree on this rank, overwritten in place.
      plan: from ``shard_plan(params, world_size)``, the same on every rank.
      group: a process group (default: the world); plan ranks are ranks in it.
      bucket_bytes: the largest bucket, in bytes.

    Returns:
      ``params``.

    Raises:
      ValueError: ``plan`` does not match ``params``, gives a tensor no owner or an
        owner outside ``[0, world)``, or the ranks' trees, plans or ``bucket_bytes``
        differ (on every rank); a param is expanded (its elements share memory).
      TypeError: a leaf is not a dense tensor or ``None``.
      RuntimeError: torch.distributed is not initialized.
    """
    fn = "broadcast_params_"
    dist = _replicas.require_dist()
    leaves, spec = _tree.flatten(params)
    _, metas = _all_reduce.check_leaves(fn, params, "params", leaves, floating=False, written=True)
    _checks.integer(fn, "bucket_bytes", bucket_bytes, ge=1)
    world = _replicas.world_size(group)
    p_leaves = _check_plan(fn, params, "params", leaves, spec, plan, world)
    if world == 1:
        return params
    _replicas.agree(
        fn,
        "paths, shapes, dtypes, shard plan or settings",
        (fn, bucket_bytes, spec, tuple(p_leaves), metas),
        lambda: _replicas.describe_call(
            _replicas.settings(fn, bucket_bytes=bucket_bytes), params, leaves, spec, p_leaves
        ),
        leaves,
        group,
        on_xla=False,
    )
    me = dist.get_rank(group)
    with torch.no_grad():
        for r in range(world):
            src = r if group is None else dist.get_global_rank(group, r)
            for run, wire in _owned_runs(leaves, p_leaves, r, None, bucket_bytes):
                # The owner sends its leaves; the others' buffers are only received into.
                flat, pieces = _all_reduce.pack(leaves, run, wire, fill=r == me)
                dist.broadcast(flat, src=src, group=group)
                if r == me:
                    continue
                for i, piece in zip(run, pieces):
                    leaves[i].copy_(piece)
    return params

"""Data parallel: bucketed gradient all-reduce (``all_reduce_grads``/``all_reduce_grads_``).

Built on the real engines: ``torch.distributed`` (gloo on CPU, NCCL on GPU) for
eager tensors and torch_xla's in-graph collectives for XLA tensors. Flattening
happens for communication only, in bounded buckets (``buckets``, ``pack``, shared
with ``_sharded``), so the number of collectives grows with bytes, not with the
number of tensors. Every call first compares its fingerprint across the ranks
(``_replicas.agree``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from mpfunc.core import _checks, _tree
from mpfunc.parallel import _replicas

__all__ = ["DEFAULT_BUCKET_BYTES", "all_reduce_grads", "all_reduce_grads_"]

# One collective carries at most this many bytes (the same default as DDP's buckets).
DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024
_OPS = ("mean", "sum")


def divides_first(op: str, dtype: torch.dtype) -> bool:
    """Whether a reduction of ``op`` in ``dtype`` divides each rank's part by the world size
    before the sum: a mean of fp16, whose range is narrow (as DDP does: two ranks' grads
    near 65504 would sum to inf). Other dtypes divide the sum."""
    return op == "mean" and dtype == torch.float16


# --- checks -----------------------------------------------------------------------------


def check_leaves(
    fn: str, tree: Any, name: str, leaves: Sequence[Any], *, floating: bool, written: bool
) -> tuple[bool, tuple[Any, ...]]:
    """Checks every leaf before anything is communicated or written (``_checks``' rules:
    dense tensors or ``None``; floating grads; no expanded leaf where the call copies
    into it). Returns whether any leaf is an XLA tensor, and every leaf's (shape, dtype)
    or ``None``: the per-leaf part of the fingerprint's cache key."""
    side = _checks.Side(name, tree, list(leaves))
    _checks.check_dense(fn, side)
    if floating:
        _checks.check_leaf_dtypes(fn, side, _checks.FLOAT_DTYPES, "a floating-point grad")
    if written:
        _checks.check_writable(fn, [side])
    metas = tuple(None if t is None else (t.shape, t.dtype) for t in leaves)
    # ``is_xla`` is 7x cheaper than ``t.device.type``: no device object is built.
    return any(t is not None and t.is_xla for t in leaves), metas


def check_grads(
    fn: str, grads: Any, op: str, reduce_dtype: Any, *, written: bool = False
) -> tuple[list[Any], Any, bool, tuple[Any, ...]]:
    _checks.choice(fn, "op", op, _OPS)
    if reduce_dtype is not None and (
        not isinstance(reduce_dtype, torch.dtype) or not reduce_dtype.is_floating_point
    ):
        raise TypeError(
            f"{fn}: reduce_dtype: expected None or a floating dtype, got {reduce_dtype!r}"
        )
    leaves, spec = _tree.flatten(grads)
    has_xla, metas = check_leaves(fn, grads, "grads", leaves, floating=True, written=written)
    return leaves, spec, has_xla, metas


def _check_xla(fn: str, group: Any) -> None:
    """An XLA all-reduce runs over torch_xla's participants: no torch.distributed group,
    and a torch.distributed world must not be larger than the XLA runtime's."""
    if group is not None:
        raise ValueError(
            f"{fn}: group: expected None for XLA tensors (torch_xla reduces over its own "
            f"replicas), got {group!r}"
        )
    import torch.distributed as dist
    import torch_xla.runtime as xr

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
            f"{fn}: torch.distributed has {dist.get_world_size()} ranks but the XLA runtime "
            "sees 1 participant, so an XLA all-reduce would do nothing; launch with "
            "torch_xla's launcher (xmp.spawn) so the runtime sees every device"
        )


# --- communication ----------------------------------------------------------------------


def buckets(
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


def pack(
    leaves: Sequence[torch.Tensor], run: list[int], dtype: torch.dtype, *, fill: bool = True
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One contiguous buffer for a bucket (flattened for the wire only) and each leaf's
    shaped, contiguous view into it; ``fill`` copies the leaves in, casting on the way.

    Every leaf travels in its logical (row-major) order whatever its strides, so ranks
    pair the same elements even when a leaf's layout differs between them."""
    first = leaves[run[0]]
    flat = torch.empty(sum(leaves[i].numel() for i in run), dtype=dtype, device=first.device)
    pieces = []
    offset = 0
    for i in run:
        n = leaves[i].numel()
        piece = flat[offset : offset + n].view(leaves[i].shape)
        if fill:
            piece.copy_(leaves[i])
        pieces.append(piece)
        offset += n
    return flat, pieces


def in_layout(piece: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``piece`` (a contiguous view) with ``like``'s layout (``preserve_format``): the
    view itself when the strides agree, else a copy. Kernels that pair a grad with its
    param by memory position (torch's fused CPU Adam) need the param's strides."""
    if piece.stride() == like.stride():
        return piece
    out = torch.empty_like(like, dtype=piece.dtype)
    if out.stride() == piece.stride():
        return piece
    return out.copy_(piece)


def _reduce(
    leaves: list[Any],
    group: Any,
    op: str,
    reduce_dtype: torch.dtype | None,
    bucket_bytes: int,
    *,
    inplace: bool,
) -> list[Any]:
    """Returns the reduced value of every leaf (``None`` stays ``None``), in the reduce
    dtype; XLA leaves are reduced in place by torch_xla and returned as themselves.
    ``inplace``: the caller copies the results back into the leaves, so they need no
    layout of their own (and a world of one returns the leaves themselves)."""
    out: list[Any] = [None] * len(leaves)
    keys: dict[tuple[Any, ...], list[int]] = {}
    for i, g in enumerate(leaves):
        if g is not None:
            keys.setdefault((g.device, g.dtype), []).append(i)
    for (device, dtype), idx in keys.items():
        rdtype = reduce_dtype or dtype
        if device.type == "xla":
            _reduce_xla(leaves, idx, op, rdtype, out)
            continue
        dist = _replicas.require_dist()
        world = _replicas.world_size(group)
        if world == 1:  # nothing to exchange: a copy in the reduce dtype
            for i in idx:
                out[i] = leaves[i] if inplace else leaves[i].to(rdtype, copy=True)
            continue
        itemsize = torch.empty((), dtype=rdtype).element_size()
        for run in buckets(idx, leaves, itemsize, bucket_bytes):
            flat, pieces = pack(leaves, run, rdtype)
            before = divides_first(op, rdtype)
            if before:
                flat.div_(world)
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
            if op == "mean" and not before:
                flat.div_(world)
            for i, piece in zip(run, pieces):
                out[i] = piece if inplace else in_layout(piece, leaves[i])
    return out


def _reduce_xla(
    leaves: list[Any], idx: list[int], op: str, rdtype: torch.dtype, out: list[Any]
) -> None:
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    world = xr.world_size()
    # As on the eager path: an fp16 mean divides before the sum (torch_xla's ``scale``
    # multiplies the sum, which two participants' grads near 65504 overflow to inf).
    before = divides_first(op, rdtype) and world > 1
    scale = 1.0 / world if op == "mean" and not before else 1.0
    tensors = [
        leaves[i].to(rdtype) if leaves[i].dtype != rdtype else leaves[i].clone() for i in idx
    ]
    if before:
        torch._foreach_div_(tensors, float(world))
    # A list all-reduce is one in-graph collective over all of them; no host sync.
    xm.all_reduce(xm.REDUCE_SUM, tensors, scale=scale)
    for i, t in zip(idx, tensors):
        out[i] = t


# --- the public functions ---------------------------------------------------------------


def _all_reduce_prologue(
    fn: str, grads: Any, group: Any, op: str, reduce_dtype: Any, bucket_bytes: int, written: bool
) -> tuple[list[Any], Any]:
    """Every check of an all-reduce, then the ranks' agreement; returns leaves and spec."""
    leaves, spec, has_xla, metas = check_grads(fn, grads, op, reduce_dtype, written=written)
    _checks.integer(fn, "bucket_bytes", bucket_bytes, ge=1)
    if has_xla:
        _check_xla(fn, group)
    header = _replicas.settings(fn, op=op, reduce_dtype=reduce_dtype, bucket_bytes=bucket_bytes)
    _replicas.agree(
        fn,
        "paths, shapes, dtypes or settings",
        (fn, op, reduce_dtype, bucket_bytes, spec, metas),
        lambda: _replicas.describe_call(header, grads, leaves, spec, None),
        leaves,
        group,
        on_xla=has_xla,
    )
    return leaves, spec


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

    The first call with a given tree (paths, shapes, dtypes) and settings compares a
    fingerprint of both across the ranks: one all-gather of 8 ints (on XLA, one small
    graph of its own, read back once). Later calls with the same tree and settings pay a
    dict lookup, so ranks that each switch to a tree they agreed on before (rank 0 to tree
    X, rank 1 to tree Y, both compared earlier) are not compared again: where the buckets
    line up (same dtypes and sizes) their leaves are summed crosswise, with no error. Call
    with the same tree on every rank, as the collectives require.

    Args:
      grads: a tree of floating tensors or ``None`` (the same tree on every rank).
      group: a process group (default: the world).
      op: ``"mean"`` (default) or ``"sum"``. A mean of fp16 grads is divided by the world
        size before the sum (as DDP does: a sum near fp16's largest value would overflow),
        of other dtypes after it.
      reduce_dtype: ``None`` reduces in the grads' own dtype, as the recipe does;
        ``torch.float32`` upcasts first, for accuracy, and returns fp32 grads.
      bucket_bytes: the largest bucket, in bytes of the reduce dtype. Not used on XLA,
        where each (device, dtype) group is one list all-reduce that XLA schedules.

    On XLA's CPU backend an all-reduce cannot carry bf16: pass
    ``reduce_dtype=torch.float32`` there (TPUs reduce bf16 natively).

    Returns:
      A new tree of reduced grads, in ``reduce_dtype`` (or the grads' dtypes), each with
      its grad's layout (``preserve_format``: a transposed or channels_last grad keeps its
      strides). Contiguous leaves are views into their bucket's buffer (no second copy).

    Raises:
      ValueError: the ranks' trees or settings differ (on every rank, naming the first
        difference); an argument is out of range.
      RuntimeError: torch.distributed is not initialized (eager tensors), or on XLA it
        has several ranks while the XLA runtime sees one participant.
      TypeError: a leaf is not a dense floating tensor or ``None``.
    """
    fn = "all_reduce_grads"
    leaves, spec = _all_reduce_prologue(fn, grads, group, op, reduce_dtype, bucket_bytes, False)
    with torch.no_grad():
        reduced = _reduce(leaves, group, op, reduce_dtype, bucket_bytes, inplace=False)
        return _tree.unflatten(spec, reduced)


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

    Every check (and the ranks' agreement) runs before the first collective, and every
    collective before the first write.

    Returns:
      ``grads``.

    Raises:
      As ``all_reduce_grads``; also ``ValueError`` for an expanded grad (elements that
      share memory cannot be written in place).
    """
    fn = "all_reduce_grads_"
    leaves, _ = _all_reduce_prologue(fn, grads, group, op, reduce_dtype, bucket_bytes, True)
    with torch.no_grad():
        reduced = _reduce(leaves, group, op, reduce_dtype, bucket_bytes, inplace=True)
        for g, r in zip(leaves, reduced):
            if g is not None and r is not g:
                g.copy_(r)
    return grads

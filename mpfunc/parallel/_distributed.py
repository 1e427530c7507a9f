"""Data parallel: bucketed gradient all-reduce and sharded fp32 masters.

Built on the real engines: ``torch.distributed`` (gloo on CPU, NCCL on GPU) for
eager tensors and torch_xla's in-graph collectives for XLA tensors. Parameters
are never split: a shard plan assigns whole leaves to ranks, so every master
keeps its shape. Flattening happens for communication only, in bounded buckets,
so the number of collectives grows with bytes, not with the number of tensors.

Every rank must hand a collective the same tree. A rank whose tree differs would
pair other ranks' elements with the wrong leaves (same total size) or abort inside
the backend (different sizes), so each function first compares a fingerprint of
the call across ranks: one small all-gather the first time a (tree, settings,
group) is seen, a dict lookup after that (``_agree``).
"""

from __future__ import annotations

import hashlib
import threading
import weakref
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any

import torch

from mpfunc.core import _checks, _tree

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


def _dist_ready() -> bool:
    import torch.distributed as dist

    return bool(dist.is_available() and dist.is_initialized())


def _world(group: Any) -> int:
    return int(_dist().get_world_size(group))


# --- the same call on every rank --------------------------------------------------------
#
# A fingerprint is a sha256 of a few text lines: the call's settings, one line per leaf
# (path, shape, dtype and, for the sharded functions, owner) and the tree structure. The
# ranks all-gather it as 8 int32 words; only when they differ do they gather the lines,
# to name the first difference. Which (call, tree) a rank has already agreed on is cached
# per process group by VALUE: the key holds the tree spec, every leaf's shape and dtype,
# the plan and the settings, never an object id (a new tree can reuse a dead one's id).
# The cache of a group is dropped with the group (weak keys), so a re-initialized world
# compares again. Every rank of a group inserts the same keys in the same order (they
# agreed on each), so the bounded FIFO evicts the same keys everywhere.
#
# What the cache cannot see: a rank whose tree changes while its peers keep a tree they
# have already agreed on. That rank compares (one all-gather) while the peers start their
# first bucket, and the backend fails as it did before this check. In data parallel the
# trees change together on every rank (one model); ``verify_replicas`` never caches.

_CACHE_LIMIT = 256  # (call, tree) keys remembered per group
_EAGER_AGREED: weakref.WeakKeyDictionary[Any, dict[Hashable, None]] = weakref.WeakKeyDictionary()
_XLA_AGREED: dict[int, dict[Hashable, None]] = {}  # per XLA participant (global ordinal)
# Two participants that are threads of one process must compile the exchange graph one
# after the other, so the second hits the compile cache and both run one executable
# (tests/test_xla_distributed.py, catch 1); the wait for the peer happens outside it.
_XLA_LOCK = threading.Lock()


def _is_xla(t: torch.Tensor) -> bool:
    # ``Tensor.is_xla`` is 7x cheaper than ``t.device.type`` (no device object is built).
    return bool(t.is_xla)  # type: ignore[attr-defined]


def _describe_call(
    header: str, tree: Any, leaves: Sequence[Any], spec: Any, owners: Sequence[Any] | None
) -> list[str]:
    """The lines a fingerprint hashes (built only on a cache miss: it walks the paths)."""
    paths = _tree.leaf_paths(tree)
    lines = [header]
    for i, t in enumerate(leaves):
        desc = "None" if t is None else f"shape {tuple(t.shape)} {t.dtype}"
        if owners is not None:
            desc += f", owner {owners[i]!r}"
        lines.append(f"{paths[i]!r}: {desc}")
    lines.append(f"tree structure {spec}")
    return lines


def _digest(lines: Sequence[str]) -> torch.Tensor:
    raw = hashlib.sha256("\n".join(lines).encode()).digest()
    return torch.frombuffer(bytearray(raw), dtype=torch.int32).clone()


def _remember(seen: dict[Hashable, None], key: Hashable) -> None:
    seen[key] = None
    if len(seen) > _CACHE_LIMIT:
        del seen[next(iter(seen))]  # the oldest: the same key on every rank


def _disagreement(fn: str, subject: str, gathered: Sequence[Sequence[str]]) -> ValueError:
    """The error every rank raises: which ranks agree, and the first line that differs."""
    groups: dict[tuple[str, ...], list[int]] = {}
    for r, lines in enumerate(gathered):
        groups.setdefault(tuple(lines), []).append(r)
    ref = gathered[0]
    r = next((k for k, lines in enumerate(gathered) if list(lines) != list(ref)), 0)
    other = gathered[r]
    detail = next(
        (f"rank 0 has {a}, rank {r} has {b}" for a, b in zip(ref, other) if a != b),
        f"rank 0 has {len(ref) - 2} leaves, rank {r} has {len(other) - 2}",
    )
    return ValueError(
        f"{fn}: the ranks hold different trees ({subject}), so the collectives would pair "
        f"one rank's leaves with another's, or fail inside the backend: ranks "
        f"{sorted(groups.values())} agree among themselves; first difference: {detail}"
    )


def _eager_device(leaves: Sequence[Any], group: Any) -> torch.device:
    """Where the fingerprint travels: the device of the tensors this call communicates
    (so the backend takes it), else the CPU, or the current GPU for an NCCL-only group."""
    for t in leaves:
        if t is not None and not _is_xla(t):
            return torch.device(t.device)
    if str(_dist().get_backend(group)) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _agree(
    fn: str,
    subject: str,
    key: Hashable | None,
    lines: Callable[[], list[str]],
    leaves: Sequence[Any],
    group: Any,
    *,
    on_xla: bool,
) -> None:
    """Raises the same ``ValueError`` on every rank unless every rank made this call with
    the same fingerprint. ``key`` (the function, its settings, the tree spec, the plan,
    every leaf's shape and dtype) is what the cache remembers: a key already agreed on
    costs a dict lookup, and ``key=None`` always compares. ``on_xla``: the call
    communicates XLA leaves in-graph, so they compare across the XLA participants;
    everything else compares across ``group``."""
    on_eager = any(t is not None and not _is_xla(t) for t in leaves) if on_xla else True
    if on_xla:
        _agree_xla(fn, subject, key, lines, leaves)
    if on_eager and (_dist_ready() or any(t is not None for t in leaves)):
        # A tree without tensors still compares when a group exists: a peer whose tree
        # has some would otherwise wait in a collective this rank never starts.
        _agree_eager(fn, subject, key, lines, leaves, group)


def _agree_eager(
    fn: str,
    subject: str,
    key: Hashable | None,
    lines: Callable[[], list[str]],
    leaves: Sequence[Any],
    group: Any,
) -> None:
    dist = _dist()
    world = _world(group)
    if world == 1:
        return
    pg = dist.group.WORLD if group is None else group
    seen = _EAGER_AGREED.get(pg)
    if key is not None and seen is not None and key in seen:
        return
    text = lines()
    mine = _digest(text).to(_eager_device(leaves, group))
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine, group=group)
    if all(torch.equal(e, everyone[0]) for e in everyone[1:]):
        if key is not None:
            _remember(_EAGER_AGREED.setdefault(pg, {}), key)
        return
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, text, group=group)
    raise _disagreement(fn, subject, gathered)


def _agree_xla(
    fn: str,
    subject: str,
    key: Hashable | None,
    lines: Callable[[], list[str]],
    leaves: Sequence[Any],
) -> None:
    """The XLA participants' comparison. The fingerprint is host data (metadata only); the
    exchange is a small graph of its own (one int32 all-reduce) read back to the host, so
    it waits for every participant once: the first time each key is seen. Steady-state
    steps add nothing to the step's graph and read nothing back."""
    import torch_xla.runtime as xr

    world = xr.world_size()
    if world == 1:  # one participant, or SPMD (the reduction is in the sharding)
        return
    seen = _XLA_AGREED.setdefault(xr.global_ordinal(), {})
    if key is not None and key in seen:
        return
    device = next(t.device for t in leaves if t is not None and _is_xla(t))
    text = lines()
    words = _xla_gather(_digest(text), device)
    if all(torch.equal(w, words[0]) for w in words[1:]):
        if key is not None:
            _remember(seen, key)
        return
    data = torch.tensor(list("\n".join(text).encode()), dtype=torch.int32)
    sizes = _xla_gather(torch.tensor([data.numel()], dtype=torch.int32), device)[:, 0]
    padded = torch.zeros(int(sizes.max()), dtype=torch.int32)
    padded[: data.numel()] = data
    rows = _xla_gather(padded, device)
    gathered = [bytes(rows[r, : int(sizes[r])].tolist()).decode().split("\n") for r in range(world)]
    raise _disagreement(fn, subject, gathered)


def _xla_gather(row: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Every participant's ``row`` (int32, same length everywhere), as a host tensor of
    shape ``(world, len)``. Runs as its own graph: the step's pending graph is neither
    executed nor cut (the collective starts a fresh all-reduce token, and the caller's
    token is restored), so the first step still compiles as one graph."""
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    buf = torch.zeros((xr.world_size(), row.numel()), dtype=torch.int32)
    buf[xr.global_ordinal()] = row  # a sum of rows where each holds one: a gather
    xlac: Any = torch_xla._XLAC  # type: ignore[attr-defined]
    dev = str(device)
    with _XLA_LOCK:
        saved = xlac._get_all_reduce_token(dev)
        xlac._set_all_reduce_token(dev, None)
        try:
            t = buf.to(device)
            xm.all_reduce(xm.REDUCE_SUM, [t])
            # Compile and launch only this graph; the wait below is outside the lock.
            xlac._xla_sync_multi([t], devices=[], wait=False)
        finally:
            xlac._set_all_reduce_token(dev, saved)
    return t.cpu()


# --- checks -----------------------------------------------------------------------------


def _check_leaves(
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


def _check_grads(
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
    has_xla, metas = _check_leaves(fn, grads, "grads", leaves, floating=True, written=written)
    return leaves, spec, has_xla, metas


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


def _pack(
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


def _in_layout(piece: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
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
        dist = _dist()
        world = _world(group)
        if world == 1:  # nothing to exchange: a copy in the reduce dtype
            for i in idx:
                out[i] = leaves[i] if inplace else leaves[i].to(rdtype, copy=True)
            continue
        itemsize = torch.empty((), dtype=rdtype).element_size()
        for run in _buckets(idx, leaves, itemsize, bucket_bytes):
            flat, pieces = _pack(leaves, run, rdtype)
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
            if op == "mean":
                flat.div_(world)
            for i, piece in zip(run, pieces):
                out[i] = piece if inplace else _in_layout(piece, leaves[i])
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
    for every owner (the fingerprint made sure), so the collectives line up."""
    groups: dict[tuple[Any, ...], list[int]] = {}
    for i, (t, owner) in enumerate(zip(leaves, owners)):
        if t is not None and owner == rank:
            groups.setdefault((t.device, t.dtype), []).append(i)
    for (_, dtype), idx in groups.items():
        wire = wire_dtype or dtype
        itemsize = torch.empty((), dtype=wire).element_size()
        for run in _buckets(idx, leaves, itemsize, bucket_bytes):
            yield run, wire


def _reduce_xla(
    leaves: list[Any], idx: list[int], op: str, rdtype: torch.dtype, out: list[Any]
) -> None:
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    scale = 1.0 / xr.world_size() if op == "mean" else 1.0
    tensors = [
        leaves[i].to(rdtype) if leaves[i].dtype != rdtype else leaves[i].clone() for i in idx
    ]
    # A list all-reduce is one in-graph collective over all of them; no host sync.
    xm.all_reduce(xm.REDUCE_SUM, tensors, scale=scale)
    for i, t in zip(idx, tensors):
        out[i] = t


# --- the public functions ---------------------------------------------------------------


def _settings(fn: str, **kw: Any) -> str:
    return f"{fn}({', '.join(f'{k}={v!r}' for k, v in kw.items())})"


def _all_reduce_prologue(
    fn: str, grads: Any, group: Any, op: str, reduce_dtype: Any, bucket_bytes: int, written: bool
) -> tuple[list[Any], Any]:
    """Every check of an all-reduce, then the ranks' agreement; returns leaves and spec."""
    leaves, spec, has_xla, metas = _check_grads(fn, grads, op, reduce_dtype, written=written)
    _checks.integer(fn, "bucket_bytes", bucket_bytes, ge=1)
    if has_xla:
        _check_xla(fn, group)
    header = _settings(fn, op=op, reduce_dtype=reduce_dtype, bucket_bytes=bucket_bytes)
    _agree(
        fn,
        "paths, shapes, dtypes or settings",
        (fn, op, reduce_dtype, bucket_bytes, spec, metas),
        lambda: _describe_call(header, grads, leaves, spec, None),
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
    dict lookup.

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
    leaves, spec, _, metas = _check_grads(fn, grads, op, reduce_dtype)
    _checks.integer(fn, "bucket_bytes", bucket_bytes, ge=1)
    dist = _dist()
    world = _world(group)
    p_leaves = _check_plan(fn, grads, "grads", leaves, spec, plan, world)
    header = _settings(fn, op=op, reduce_dtype=reduce_dtype, bucket_bytes=bucket_bytes)
    _agree(
        fn,
        "paths, shapes, dtypes, shard plan or settings",
        (fn, op, reduce_dtype, bucket_bytes, spec, tuple(p_leaves), metas),
        lambda: _describe_call(header, grads, leaves, spec, p_leaves),
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
                flat, pieces = _pack(leaves, run, wire)
                if world > 1:
                    dist.reduce(flat, dst=dst, op=dist.ReduceOp.SUM, group=group)
                if r != me:
                    continue
                if op == "mean":
                    flat.div_(world)
                for i, piece in zip(run, pieces):
                    out[i] = _in_layout(piece, leaves[i])
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
    dist = _dist()
    leaves, spec = _tree.flatten(params)
    _, metas = _check_leaves(fn, params, "params", leaves, floating=False, written=True)
    _checks.integer(fn, "bucket_bytes", bucket_bytes, ge=1)
    world = _world(group)
    p_leaves = _check_plan(fn, params, "params", leaves, spec, plan, world)
    if world == 1:
        return params
    _agree(
        fn,
        "paths, shapes, dtypes, shard plan or settings",
        (fn, bucket_bytes, spec, tuple(p_leaves), metas),
        lambda: _describe_call(
            _settings(fn, bucket_bytes=bucket_bytes), params, leaves, spec, p_leaves
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
                flat, pieces = _pack(leaves, run, wire, fill=r == me)
                dist.broadcast(flat, src=src, group=group)
                if r == me:
                    continue
                for i, piece in zip(run, pieces):
                    leaves[i].copy_(piece)
    return params


def verify_replicas(tree: Any, group: Any = None) -> None:
    """Checks that every rank holds a tree of the same structure, shapes and dtypes;
    raises the same clear error on every rank otherwise, never a hang.

    Each rank contributes a fixed-size fingerprint to one all-gather; if they differ,
    the ranks' leaf lists are gathered to name the first difference. Unlike the
    fingerprint checks of the collectives, this one is never cached: call it at set-up,
    or whenever the trees may have changed. A tree of XLA tensors compares across the
    XLA participants (torch_xla's runtime), without torch.distributed.

    Raises:
      ValueError: the ranks disagree (on every rank, naming ranks and the first path).
      TypeError: a leaf is not a tensor or ``None``.
      RuntimeError: torch.distributed is not initialized, or a rank died or timed out
        (the group's timeout bounds the wait).
    """
    fn = "verify_replicas"
    leaves, spec = _tree.flatten(tree)
    _checks.check_tensor_or_none(fn, "tree", tree, leaves)
    has_xla = any(t is not None and _is_xla(t) for t in leaves)
    if not has_xla:
        _dist()
    _agree(
        fn,
        "structure, shapes or dtypes",
        None,
        lambda: _describe_call(fn, tree, leaves, spec, None),
        leaves,
        group,
        on_xla=has_xla,
    )

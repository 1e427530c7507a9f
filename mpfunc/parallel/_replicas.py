"""Every rank holds the same tree: ``verify_replicas``, and the fingerprint that each
collective of ``_all_reduce`` and ``_sharded`` compares across the ranks first.

Every rank must hand a collective the same tree. A rank whose tree differs would
pair other ranks' elements with the wrong leaves (same total size) or abort inside
the backend (different sizes), so each function first compares a fingerprint of
the call across ranks: one small all-gather the first time a (tree, settings,
group) is seen, a dict lookup after that (``agree``). Also the torch.distributed
helpers the three modules share (``require_dist``, ``world_size``).
"""

from __future__ import annotations

import hashlib
import threading
import weakref
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch

from mpfunc.core import _checks, _tree

__all__ = [
    "agree",
    "describe_call",
    "is_xla",
    "require_dist",
    "settings",
    "verify_replicas",
    "world_size",
]


def require_dist() -> Any:
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


def world_size(group: Any) -> int:
    return int(require_dist().get_world_size(group))


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


def is_xla(t: torch.Tensor) -> bool:
    # ``Tensor.is_xla`` is 7x cheaper than ``t.device.type`` (no device object is built).
    return bool(t.is_xla)  # type: ignore[attr-defined]


def describe_call(
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
        if t is not None and not is_xla(t):
            return torch.device(t.device)
    if str(require_dist().get_backend(group)) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def agree(
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
    on_eager = any(t is not None and not is_xla(t) for t in leaves) if on_xla else True
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
    dist = require_dist()
    if group is not None and group == getattr(dist.GroupMember, "NON_GROUP_MEMBER", object()):
        # (What new_group returns on a rank it leaves out; torch's collectives then warn
        # and do nothing, which here would return the tree unreduced.)
        raise ValueError(
            f"{fn}: group: expected a process group this rank belongs to, got one that "
            f"leaves out rank {dist.get_rank()} (torch.distributed.new_group returns "
            "GroupMember.NON_GROUP_MEMBER there): call it on the group's ranks only"
        )
    world = world_size(group)
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
    device = next(t.device for t in leaves if t is not None and is_xla(t))
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


def settings(fn: str, **kw: Any) -> str:
    return f"{fn}({', '.join(f'{k}={v!r}' for k, v in kw.items())})"


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
    has_xla = any(t is not None and is_xla(t) for t in leaves)
    if not has_xla:
        require_dist()
    agree(
        fn,
        "structure, shapes or dtypes",
        None,
        lambda: describe_call(fn, tree, leaves, spec, None),
        leaves,
        group,
        on_xla=has_xla,
    )

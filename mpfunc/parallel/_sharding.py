"""XLA SPMD: shardings over a device mesh for masters, optimizer state and buffers.

Under torch_xla's SPMD mode (``torch_xla.runtime.use_spmd()``) one process drives every
device of a mesh, a tensor carries a *sharding* (``torch_xla.distributed.spmd``'s
annotation), and XLA's partitioner splits each graph and inserts the collectives. mpfunc
never splits a tensor itself; this module only keeps the annotations right:

* ``mark_sharding_`` annotates every tensor of a tree along one mesh axis (the rule is
  in its docstring): sharded masters and state, with params replicated (ZeRO-1) or
  sharded too (FSDP/ZeRO-3).
* ``like_`` gives a freshly made tensor the sharding of the tensor it is made like.
  torch_xla does not: ``torch.zeros_like`` of a sharded tensor comes out unannotated,
  and is replicated after the next sync, so ``opt.init`` would make full-size state.
* ``kept`` puts back each tensor's own sharding after mpfunc wrote into it in place.
  torch_xla's ``copy_`` hands the destination the *source's* sharding (a replicated
  param written from a sharded master would come back sharded), and a ``torch.where``
  result copied back (``skip``) carries none. In-place arithmetic keeps it.

Everything here is a no-op, one dictionary lookup, unless torch_xla is imported and SPMD
is on; torch_xla is never imported by this module.
"""

from __future__ import annotations

import contextlib
import re
import sys
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

from mpfunc.core import _checks, _tree

__all__ = [
    "MIN_NUMEL",
    "active",
    "flat_like_",
    "kept",
    "like_",
    "mark_sharding_",
    "partition_spec",
    "tensors",
]

# Leaves with fewer elements stay replicated: a shard of a few KiB saves nothing and costs
# a collective in every step that reads the whole leaf.
MIN_NUMEL = 1024


def active() -> bool:
    """Whether torch_xla runs in SPMD mode (False, cheaply, if torch_xla is not imported)."""
    runtime = sys.modules.get("torch_xla.runtime")
    return runtime is not None and bool(runtime.is_spmd())


def _xlac() -> Any:
    import torch_xla

    return torch_xla._XLAC  # type: ignore[attr-defined]


def _on_xla(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == "xla"


def like_(new: torch.Tensor, src: torch.Tensor, *, packed: int = 0) -> torch.Tensor:
    """Gives ``new`` the SPMD sharding of ``src`` and returns it.

    A no-op (``new`` is returned as is) unless SPMD is on, both are XLA tensors of one
    shape, and ``src`` carries a sharding. With ``packed=k``, ``new`` packs ``k`` of
    ``src``'s elements along the last dim into one (a remainder's tie bytes, ``k=8``): it
    must have ``src``'s rank, every dim but the last is split as ``src``'s, and the last
    dim too where each shard of ``src``'s last dim holds a multiple of ``k`` elements (then
    every device's packed elements are its own elements'); elsewhere ``new``'s last dim
    is replicated (``_packed_sharding``). Annotating a tensor that is not yet computed
    (as ``zeros_like`` returns it) only records the annotation: nothing moves.
    """
    fits = new.dim() == src.dim() if packed else new.shape == src.shape
    if not (active() and _on_xla(new) and _on_xla(src) and fits):
        return new
    xlac = _xlac()
    op = xlac._get_xla_op_sharding(src)
    if op is None:
        return new
    if packed:
        op = _packed_sharding(xlac, src, packed, op)
        if not xlac._get_xla_sharding_spec(new):  # (a fresh buffer, as init_master makes)
            xlac._xla_mark_sharding(new, op)
    elif xlac._get_xla_sharding_spec(new) != xlac._get_xla_sharding_spec(src):
        xlac._xla_mark_sharding(new, op)
    return new


_TILED = re.compile(r"\{devices=\[([0-9,]+)\]([0-9,]+)( last_tile_dim_replicate)?\}")


def _packed_sharding(xlac: Any, src: torch.Tensor, k: int, op: Any) -> Any:
    """The sharding of a tensor that packs ``k`` of ``src``'s elements along its last dim:
    ``op`` (``src``'s) where ``src``'s last dim is not split or each of its shards holds a
    multiple of ``k`` elements; else ``src``'s split of the other dims with the last dim
    replicated (partial replication over the devices that split it). A sharding whose
    spec string is not a plain tile list (a form this does not read) is kept as ``src``'s:
    correct, XLA reshards in the step."""
    m = _TILED.fullmatch(xlac._get_xla_sharding_spec(src))
    if m is None:
        return op  # replicated, or a form this does not read: as src
    tiles = [int(x) for x in m.group(1).split(",")]
    n, parts = int(src.shape[-1]), tiles[src.dim() - 1]
    if parts == 1 or (-(-n // parts)) % k == 0:
        return op
    import numpy as np
    import torch_xla.distributed.spmd as xs

    devices = [int(x) for x in m.group(2).split(",")]
    if sorted(devices) != list(range(len(devices))):
        return _replicated(xlac)
    mesh = xs.Mesh(np.array(devices), tuple(tiles))
    spec = (*range(src.dim() - 1), None)  # mesh axis d splits dim d; the last dim none
    return mesh.get_op_sharding(spec)


def flat_like_(new: torch.Tensor, src: torch.Tensor, per: int) -> torch.Tensor:
    """Gives the 1-d ``new``, which holds ``src``'s elements in row-major order ``per`` to
    an entry (4-bit codes: 2 a byte; their block scales: 32), the split of ``src``'s
    sharding where that split is of dim 0 alone, even, and gives every device a multiple
    of ``per`` elements: then device ``i``'s rows are one flat range of ``src``'s elements,
    and the same range of ``new``. Elsewhere (a split of another dim, uneven, or not
    annotated yet) ``new`` is left as it is: replicated. Returns ``new``."""
    if not (active() and _on_xla(new) and _on_xla(src) and new.dim() == 1 and src.dim() >= 1):
        return new
    xlac = _xlac()
    m = _TILED.fullmatch(xlac._get_xla_sharding_spec(src))
    if m is None or m.group(3) or xlac._get_xla_sharding_spec(new):
        return new
    tiles = [int(x) for x in m.group(1).split(",")]
    k = tiles[0]
    numel = src.numel()
    if any(t != 1 for t in tiles[1:]) or src.shape[0] % k or (numel // k) % per:
        return new
    if new.shape[0] != numel // per:  # (the rows' elements fill whole entries)
        return new
    import numpy as np
    import torch_xla.distributed.spmd as xs

    devices = [int(x) for x in m.group(2).split(",")]
    xlac._xla_mark_sharding(new, xs.Mesh(np.array(devices), (k,)).get_op_sharding((0,)))
    return new


def _replicated(xlac: Any) -> Any:
    # ShardingType.REPLICATED is 0 (torch_xla.distributed.spmd.ShardingType).
    return xlac.OpSharding([], [], [], 0)


def tensors(*trees: Any) -> Iterator[Any]:
    """The leaves of ``trees``, lazily: ``kept`` reads them only under SPMD."""
    for tree in trees:
        yield from _tree.flatten(tree)[0]


@contextlib.contextmanager
def kept(tensors: Iterable[Any]) -> Iterator[None]:
    """Records the shardings of the XLA tensors among ``tensors`` and, after the block,
    re-annotates each one whose sharding the block changed. A tensor without one (not yet
    computed, never annotated) is kept replicated, which is what torch_xla makes of
    unannotated data.
    Costs ~1 µs per tensor under SPMD (~10 µs more per re-annotation), nothing otherwise.
    """
    if not active():
        yield
        return
    xlac = _xlac()
    spec = xlac._get_xla_sharding_spec
    xla = [t for t in tensors if _on_xla(t)]
    before = [(t, spec(t), xlac._get_xla_op_sharding(t)) for t in xla]
    yield
    for t, was, op in before:
        if spec(t) != was or not was:
            xlac._xla_mark_sharding(t, _replicated(xlac) if op is None else op)


def _mesh_axis(fn: str, mesh: Any, axis: object) -> tuple[str | int, int]:
    """``axis`` (a name or an index of ``mesh``'s axes) and its number of devices."""
    names = tuple(getattr(mesh, "axis_names", None) or ())
    shape = tuple(getattr(mesh, "mesh_shape", None) or ())
    if not shape:
        raise TypeError(
            f"{fn}: mesh: expected a torch_xla.distributed.spmd.Mesh, got {_checks.describe(mesh)}"
        )
    if isinstance(axis, str) and axis in names:
        return axis, int(shape[names.index(axis)])
    if isinstance(axis, int) and not isinstance(axis, bool) and 0 <= axis < len(shape):
        return axis, int(shape[axis])
    raise ValueError(
        f"{fn}: axis: expected one of the mesh's axes {names or tuple(range(len(shape)))} "
        f"(a name, or an index below {len(shape)}), got {axis!r}"
    )


def partition_spec(
    shape: Sequence[int], axis: object, size: int, min_numel: int
) -> tuple[Any, ...]:
    """The partition spec ``mark_sharding_`` gives a leaf of ``shape``: ``axis`` on the
    largest dimension that ``size`` divides (the first of equals), ``None`` elsewhere;
    all ``None`` (replicated) for 0-d leaves, leaves under ``min_numel`` elements, and
    leaves with no such dimension."""
    numel = 1
    for n in shape:
        numel *= n
    spec: list[Any] = [None] * len(shape)
    if numel < max(min_numel, 1) or size <= 1:
        return tuple(spec)
    best = -1
    for d, n in enumerate(shape):
        if n % size == 0 and n >= size and (best < 0 or n > shape[best]):
            best = d
    if best >= 0:
        spec[best] = axis
    return tuple(spec)


def mark_sharding_(tree: Any, mesh: Any, axis: str | int, *, min_numel: int = MIN_NUMEL) -> Any:
    """Annotates every tensor of ``tree`` with an SPMD sharding over the mesh axis ``axis``.

    The rule, leaf by leaf: the leaf is split over ``axis`` along its largest dimension
    that the axis size divides (the first of equal ones), and replicated over the other
    mesh axes. It stays replicated when it is 0-d (step counts, seeds), has fewer than
    ``min_numel`` elements (default 1024: a few KiB are not worth a collective), or no
    dimension divides evenly. Uneven splits are never chosen, so every device holds an
    equal, unpadded shard. ``partition_spec`` gives the spec a shape gets.

    ``tree`` may hold masters, optimizer state (NamedTuples of trees), strategy buffers or
    quantized moments: every tensor leaf is annotated, ``None`` leaves are skipped. The
    tensors are annotated in place (``torch_xla.distributed.spmd.mark_sharding``); a tensor
    already on the device is moved once into its new layout, a tensor not yet computed
    only records it. mpfunc's transforms then keep these shardings (``opt.init`` gives
    state the masters' shardings), and the partitioner moves the data.

    Example (ZeRO-1: replicated params, sharded masters and state)::

      mesh = torch_xla.distributed.spmd.Mesh(np.arange(n), (n,), ("data",))
      masters = mpfunc.mark_sharding_(mpfunc.init_master(params), mesh, "data")
      state = opt.init(masters)  # sharded like the masters

    Args:
      tree: a tree of XLA tensors (or ``None``).
      mesh: a ``torch_xla.distributed.spmd.Mesh``.
      axis: the mesh axis to shard over, by name or index.
      min_numel: leaves with fewer elements stay replicated.

    Returns:
      ``tree``, for chaining.

    The same sharding again is a no-op. A leaf not yet computed takes the new one; a leaf
    that holds data and is already sharded otherwise is refused (torch_xla cannot move it:
    ``torch_xla.distributed.spmd.clear_sharding`` it first).

    Raises:
      RuntimeError: SPMD is not on (``torch_xla.runtime.use_spmd()``).
      TypeError: a leaf is not a tensor on the XLA device, or ``mesh`` is not a Mesh.
      ValueError: ``axis`` is not an axis of ``mesh``, ``min_numel`` is negative, or a
        computed leaf is already sharded otherwise.
      Nothing is annotated unless every check passes.
    """
    fn = "mark_sharding_"
    axis, size = _mesh_axis(fn, mesh, axis)
    min_numel = _checks.integer(fn, "min_numel", min_numel, ge=0)
    leaves, _ = _tree.flatten(tree)
    _checks.check_tensor_or_none(fn, "tree", tree, leaves)
    for i, t in enumerate(leaves):
        if t is not None and not _on_xla(t):
            _checks.fail(
                TypeError,
                fn,
                _tree.leaf_path(tree, i, "tree"),
                "a tensor on the XLA device",
                _checks.describe(t),
                "Move the tree to torch_xla.device() first",
            )
    if not active():
        raise RuntimeError(
            f"{fn}: SPMD is off; call torch_xla.runtime.use_spmd() before creating any XLA tensor"
        )
    import torch_xla.distributed.spmd.xla_sharding as xs

    specs: list[Any] = [
        None if t is None else partition_spec(t.shape, axis, size, min_numel) for t in leaves
    ]
    _check_resharding(fn, tree, leaves, specs, lambda t, spec: xs.mark_sharding(t, mesh, spec))
    for t, spec in zip(leaves, specs):
        if t is not None:
            xs.mark_sharding(t, mesh, spec)
    return tree


# ShardingType.REPLICATED and UNKNOWN (torch_xla.distributed.spmd.ShardingType): torch_xla
# re-annotates a tensor holding data only from these (or from no sharding at all).
_FREE = (0, 6)


def _holds_data(xlac: Any, t: torch.Tensor) -> bool:
    """Whether torch_xla holds ``t`` as device data: computed, neither a pending
    computation nor host data waiting for its transfer. Only then does it refuse a new
    sharding. Read from torch_xla's tensor description (no value is read); a description
    it no longer writes this way counts as not holding data (torch_xla decides)."""
    ir = host = None
    for line in xlac._get_xla_tensor_debug_info(t).splitlines():
        if line.startswith("IR: "):
            ir = line[4:]
        elif line.startswith("Tensor on host: "):
            host = line[16:]
    if ir is None or host is None:
        return False
    return host == "None" and (ir == "None" or "xla::device_data" in ir)


def _check_resharding(
    fn: str, tree: Any, leaves: Sequence[Any], specs: Sequence[Any], mark: Any
) -> None:
    """Raises, before any leaf is annotated, for a leaf whose new sharding torch_xla would
    refuse ("Existing annotation must be cleared first"): one that holds data and carries
    a sharding other than the one it would get. The sharding a leaf would get is read from
    a probe of its shape that is never computed (``mark(probe, spec)`` only records it)."""
    xlac = _xlac()
    got: dict[tuple[Any, ...], str] = {}
    for i, (t, spec) in enumerate(zip(leaves, specs)):
        if t is None or xlac._get_xla_sharding_type(t) in (None, *_FREE):
            continue
        if not _holds_data(xlac, t):
            continue
        key = (tuple(t.shape), spec)
        if key not in got:
            probe = torch.empty(t.shape, device=t.device)
            mark(probe, spec)
            got[key] = xlac._get_xla_sharding_spec(probe)
        held = xlac._get_xla_sharding_spec(t)
        if got[key] != held:
            _checks.fail(
                ValueError,
                fn,
                _tree.leaf_path(tree, i, "tree"),
                f"a tensor without a sharding, or one sharded as this call shards it ({got[key]})",
                f"a computed tensor already sharded as {held}",
                "torch_xla cannot change the sharding of a tensor that holds data: leave it as "
                "it is, or call torch_xla.distributed.spmd.clear_sharding(t) on it first",
            )

"""State dicts: ``state_dict``/``load_state_dict`` over any mpfunc tree.

A state dict is a plain ``dict[str, Tensor]`` keyed by dotted pytree paths
(``"masters.layers.0.weight"``, ``"opt.exp_avg.layers.0.weight"``): no pickled
Python objects, so ``torch.load(weights_only=True)`` reads it and
``torch.distributed.checkpoint`` can write it. What is not a tensor (a loss
scale's settings, the tree's structure) comes from the ``like`` tree at load time.
The files that ``save``/``load`` write and read are ``_file``'s.
"""

from __future__ import annotations

import bisect
import ctypes
import heapq
import json
import math
import zlib
from collections.abc import Mapping
from typing import Any

import torch

from mpfunc.core import _checks, _dtensor, _tree
from mpfunc.parallel import _sharding
from mpfunc.strategies import _remainder, _strategy
from mpfunc.strategies._strategy_remainder import RemainderMaster

__all__ = [
    "load_state_dict",
    "load_state_dict_",
    "masters_from_remainders",
    "masters_state_dict",
    "remainders_state_dict",
    "state_dict",
]


MANIFEST_KEY = "__mpfunc_manifest__"


_FORMAT = "mpfunc.checkpoint"


_VERSION = 1


_DIRECT = ("cpu", "cuda")  # devices whose data_ptr is a real address


def _check_unique(fn: str, key: str, seen: Mapping[str, object]) -> None:
    """Two leaves under one key: the second would overwrite the first, silently."""
    if key in seen:
        raise ValueError(
            f"{fn}: two leaves have the same key {key!r}: a dict key containing '.' shadows "
            f"a nested path, or two keys print alike (1 and '1'); rename one"
        )


def _keyed_leaves(fn: str, tree: Any) -> tuple[list[str | None], list[Any], Any]:
    """Each leaf with its dotted path (``None`` for ``None`` leaves), after checking that
    every leaf is a tensor or ``None``, that no two paths collide and that none is the
    reserved manifest key."""
    leaves, spec = _tree.flatten(tree)
    _checks.check_tensor_or_none(fn, "", tree, leaves)
    keys: list[str | None] = []
    seen: dict[str, int] = {}
    paths = _tree.leaf_paths(tree)
    for i, leaf in enumerate(leaves):
        if leaf is None:
            keys.append(None)
            continue
        key = paths[i]
        _check_unique(fn, key, seen)
        if key == MANIFEST_KEY:
            raise ValueError(
                f"{fn}: the key {key!r} is reserved for the checksums of mpfunc's files; "
                f"rename that leaf"
            )
        seen[key] = i
        keys.append(key)
    return keys, leaves, spec


_Meta = tuple[tuple[int, ...], torch.dtype]  # what a key holds: shape and dtype


def _problems(wanted: Mapping[str, torch.Tensor], got: Mapping[str, _Meta]) -> list[str]:
    """Every missing or unexpected key and every shape or dtype mismatch. A dtype is never
    converted on load (pytorch#43706), so a mismatch is a problem, not a cast."""
    problems = [f"missing key {k!r}" for k in wanted if k not in got]
    problems += [f"unexpected key {k!r}" for k in got if k not in wanted]
    for k, t in wanted.items():
        if k not in got:
            continue
        shape, dtype = got[k]
        if shape != tuple(t.shape):
            problems.append(f"{k!r}: expected shape {tuple(t.shape)}, got {shape}")
        if dtype != t.dtype:
            problems.append(f"{k!r}: expected {t.dtype}, got {dtype}")
    return problems


def _raise_problems(fn: str, where: str, problems: list[str]) -> None:
    if problems:
        shown = "; ".join(problems[:20])
        more = f"; and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise ValueError(
            f"{fn}: {where} does not match the tree ({len(problems)} problems): {shown}{more}"
        )


def _kind_problem(t: torch.Tensor, *, plain: bool) -> tuple[str, str] | None:
    """Why a tensor cannot be saved, loaded or written as plain bytes: ``(expected, got)``,
    or ``None``. ``plain`` also refuses tensor subclasses other than ``nn.Parameter``."""
    if t.layout != torch.strided or t.is_quantized:
        return "a dense tensor", _checks.describe(t)
    if t.device.type == "meta":
        return "a tensor with data", f"{_checks.describe(t)} (meta tensors hold no values)"
    if plain and type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
        return "a plain torch.Tensor", f"the tensor subclass {type(t).__name__}"
    return None


def _check_sd(fn: str, sd: object) -> dict[str, torch.Tensor]:
    if not isinstance(sd, dict):
        raise TypeError(f"{fn}: sd: expected a dict of str to tensors, got {type(sd).__name__}")
    bad = [k for k, v in sd.items() if not (isinstance(k, str) and isinstance(v, torch.Tensor))]
    if bad:
        raise TypeError(
            f"{fn}: sd: expected a dict of str to tensors; these entries are not: "
            f"{', '.join(repr(k) for k in bad[:10])}"
        )
    for k, v in sd.items():  # before any value is read (checksums, copies)
        why = _checks.storage_problem(v)
        if why is not None:
            _checks.fail(ValueError, fn, k, *why, _checks.FREED_HINT)
    return sd


def _check_values(
    fn: str,
    where: str,
    keys: list[str | None],
    leaves: list[Any],
    sd: dict[str, torch.Tensor],
    *,
    tree: Any,
    in_place: bool = False,
) -> dict[str, torch.Tensor]:
    """Every check between a tree and a state dict: the manifest when present, then keys,
    shapes, dtypes and kinds, and the values of ``tree``'s loss scales, all problems listed
    together (``in_place``: the tree's leaves are to be written). Returns the dict without
    its manifest."""
    sd = _verify_manifest(fn, where, sd)
    wanted = {k: t for k, t in zip(keys, leaves) if k is not None}
    problems = _problems(wanted, {k: (tuple(v.shape), v.dtype) for k, v in sd.items()})
    for k, t in wanted.items():
        why = _kind_problem(t, plain=False)
        if why is None and in_place and _dtensor.is_dtensor(t):
            # Each rank holds a shard: a whole saved tensor has no one place to go (the
            # copy failed after the plain leaves before it were written).
            why = (
                "a plain tensor (a DTensor's shards load with torch.distributed.checkpoint: "
                "dcp.load(mpfunc.state_dict(tree), checkpoint_id=...))",
                _dtensor.describe_sharding(t),
            )
        if why is not None:
            problems.append(f"{k!r}: the tree's leaf must be {why[0]}, got {why[1]}")
        v = sd.get(k)
        why = None if v is None else _kind_problem(v, plain=True)
        if why is not None:
            problems.append(f"{k!r}: expected {why[0]}, got {why[1]}")
    problems += _scale_problems(tree, keys, leaves, sd)
    _raise_problems(fn, where, problems)
    return sd


def _scale_problems(
    tree: Any, keys: list[str | None], leaves: list[Any], sd: dict[str, torch.Tensor]
) -> list[str]:
    """A saved loss scale that is NaN, infinite, zero or negative: loaded, it would make
    every step's grads NaN or zero with no error. Checked where the value is on the host
    (a file's, a CPU state dict's); a value on a device is not read (a host sync)."""
    scales = {id(t) for t in _tree.positives(tree)}
    problems = []
    for k, t in zip(keys, leaves):
        v = sd.get(k) if k is not None and id(t) in scales else None
        if v is None or v.device.type != "cpu" or v.numel() != 1 or not v.is_floating_point():
            continue
        x = float(v)
        if not (math.isfinite(x) and x > 0):
            problems.append(f"{k!r}: expected a loss scale that is finite and > 0, got {x}")
    return problems


def state_dict(tree: Any) -> dict[str, torch.Tensor]:
    """Flattens any mpfunc tree into ``{dotted path: tensor}``.

    Works for masters, optimizer states, loss scales, or a dict holding all of
    them. ``None`` leaves have no entry. Values are the tree's own tensors,
    detached (not copies), on their devices.

    Raises:
      TypeError: a leaf is neither a tensor nor ``None`` (the dict holds tensors only).
      ValueError: two leaves would get the same key, or a key is ``"__mpfunc_manifest__"``.

    Example::

      sd = mpfunc.state_dict({"masters": masters, "opt": state, "scale": scaler})
      sd["opt.exp_avg.layers.0.weight"]
    """
    keys, leaves, _ = _keyed_leaves("state_dict", tree)
    return {k: t.detach() for k, t in zip(keys, leaves) if k is not None}


def load_state_dict(like: Any, sd: dict[str, torch.Tensor]) -> Any:
    """Returns a new tree shaped like ``like``, on ``like``'s devices, holding ``sd``'s values.

    The whole dict is checked first: missing keys, unexpected keys, and shape, dtype
    or kind (sparse, meta) mismatches are reported together in one error, and nothing
    is returned half-loaded. A dtype is never converted. If ``sd`` holds the manifest
    of a file from ``save`` (a raw ``torch.load`` of it), every tensor is checked
    against its checksum too. ``like`` itself is never modified; to write into
    existing tensors, use ``load_state_dict_``.

    Args:
      like: a tree of the wanted structure (e.g. freshly initialized masters and state).
      sd: a ``dict[str, Tensor]`` from ``state_dict`` or ``torch.load``.

    Returns:
      A tree of ``like``'s structure with fresh tensors.

    Raises:
      TypeError: ``sd`` is not a dict of str to tensors, or ``like`` has a non-tensor leaf.
      ValueError: keys, shapes, dtypes or kinds do not match (all problems listed), or
        a tensor does not match its checksum.
    """
    fn = "load_state_dict"
    sd = _check_sd(fn, sd)
    keys, leaves, spec = _keyed_leaves(fn, like)
    sd = _check_values(fn, "the state dict", keys, leaves, sd, tree=like)
    return _fresh(keys, leaves, spec, sd)


def _fresh(keys: list[str | None], leaves: list[Any], spec: Any, sd: dict[str, Any]) -> Any:
    out: list[Any] = []
    with torch.no_grad():
        for key, t in zip(keys, leaves):
            # like_: the leaf's XLA SPMD sharding (empty_like and copy_ lose it).
            new = None if key is None else torch.empty_like(t).copy_(sd[key])
            out.append(None if new is None else _sharding.like_(new, t))
    return _tree.unflatten(spec, out)


def load_state_dict_(tree: Any, sd: dict[str, torch.Tensor]) -> Any:
    """Copies ``sd``'s values into ``tree``'s own tensors: the in-place twin of
    ``load_state_dict``, and the way to resume.

    Every tensor object stays the same, so anything that holds one keeps seeing the
    restored value: an optimizer built with ``lr=lr_tensor``, a model whose
    parameters are in the tree, a loss scale. Everything is checked before the first
    write, as in ``load_state_dict``, plus what an in-place copy needs: no leaf may
    be expanded (stride 0) or an inference tensor, two leaves may overlap in memory
    only if they are the same tensor with the same saved values, and a value that
    shares memory with another leaf is copied aside before anything is written.

    Args:
      tree: the tree to restore, written in place (masters, optimizer state, loss
        scale, lr tensor, model params...).
      sd: a ``dict[str, Tensor]`` from ``state_dict`` or ``torch.load``.

    Returns:
      ``tree``, for chaining.

    Raises:
      TypeError: ``sd`` is not a dict of str to tensors, or ``tree`` has a non-tensor leaf.
      ValueError: keys, shapes, dtypes or kinds do not match (all problems listed), a
        tensor does not match its checksum, or a leaf cannot be written in place.
        Nothing is written unless every check passes.
    """
    fn = "load_state_dict_"
    sd = _check_sd(fn, sd)
    keys, leaves, _ = _keyed_leaves(fn, tree)
    sd = _check_values(fn, "the state dict", keys, leaves, sd, in_place=True, tree=tree)
    _write_into(fn, keys, leaves, sd)
    return tree


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """The byte range ``[start, end)`` a tensor's elements span, on a device whose
    ``data_ptr`` is a real address (XLA's is not)."""
    start = t.data_ptr()
    if t.numel() == 0:
        return start, start
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return start, start + (last + 1) * t.element_size()


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors are the same elements of the same memory."""
    return a is b or (
        a.device == b.device
        and a.device.type in _DIRECT
        and a.data_ptr() == b.data_ptr()
        and a.dtype == b.dtype
        and a.shape == b.shape
        and a.stride() == b.stride()
    )


def _bits(t: torch.Tensor) -> torch.Tensor:
    return _host_bytes(t).reshape(-1).view(torch.uint8)


def _write_into(
    fn: str, keys: list[str | None], leaves: list[Any], sd: dict[str, torch.Tensor]
) -> None:
    """Checks that every leaf can take its value in place, then copies; nothing is written
    unless every check passes. ``sd`` has been checked against the leaves already."""
    pairs = [(k, t, sd[k]) for k, t in zip(keys, leaves) if k is not None]
    problems = []
    for k, t, _ in pairs:
        if t.is_inference() and not torch.is_inference_mode_enabled():
            problems.append(f"{k!r} is an inference tensor, read-only outside inference mode")
        if any(s == 0 and n > 1 for n, s in zip(t.shape, t.stride())):
            problems.append(f"{k!r} is expanded (stride 0): its elements share memory")
        why = _checks.storage_problem(t)
        if why is not None:
            problems.append(f"{k!r}: expected {why[0]}, got {why[1]} (freed or shrunk)")
    # Two leaves overlapping in memory would overwrite each other: allowed only for one
    # tensor appearing twice (tied) whose two saved values are the same bits. Leaves whose
    # byte ranges interleave without a common element (x[:, :8], x[:, 8:]) are two.
    direct = sorted(
        (*_extent(t), i)
        for i, (_, t, _) in enumerate(pairs)
        if t.device.type in _DIRECT and t.numel() > 0
    )
    open_: list[tuple[int, int]] = []  # (end, index): a heap of the intervals still open
    for start, end, i in direct:
        while open_ and open_[0][0] <= start:
            heapq.heappop(open_)
        for _, j in open_:
            if pairs[i][1].device == pairs[j][1].device:
                problems += _tied(pairs[j], pairs[i])
        heapq.heappush(open_, (end, i))
    first: dict[int, int] = {}  # elsewhere (XLA), only the same object twice is seen
    for i, (_, t, _) in enumerate(pairs):
        if t.device.type not in _DIRECT:
            j = first.setdefault(id(t), i)
            if j != i:
                problems += _tied(pairs[j], pairs[i])
    if problems:
        raise ValueError(f"{fn}: cannot write into the tree: {'; '.join(problems[:20])}")
    # A value in memory that another leaf occupies would change before it is read: copy
    # it aside first. (Leaves that share no element may still interleave: then the ends
    # are not sorted, and every range is looked at.)
    ends = [end for _, end, _ in direct]
    sorted_ends = ends == sorted(ends)
    sources = []
    for _, t, v in pairs:
        if v.device.type in _DIRECT and v.numel() > 0 and not _same_view(t, v):
            lo, hi = _extent(v)
            pos = bisect.bisect_right(ends, lo) if sorted_ends else 0
            while pos < len(direct) and direct[pos][0] < hi:
                if direct[pos][1] > lo and pairs[direct[pos][2]][1].device == v.device:
                    v = v.clone()
                    break
                pos += 1
        sources.append(v)
    with torch.no_grad(), _sharding.kept(t for _, t, _ in pairs):
        for (_, t, _), v in zip(pairs, sources):
            t.copy_(v)


def _tied(
    a: tuple[str, torch.Tensor, torch.Tensor], b: tuple[str, torch.Tensor, torch.Tensor]
) -> list[str]:
    """The problem with two leaves that share memory, if any."""
    if not _same_view(a[1], b[1]):
        if _checks.share_elements(a[1], b[1]) is False:
            return []  # interleaved, no element in common: two tensors
        return [f"{a[0]!r} and {b[0]!r} share memory: one would overwrite the other"]
    if not torch.equal(_bits(a[2]), _bits(b[2])):
        return [f"{a[0]!r} and {b[0]!r} are one tensor, but their saved values differ"]
    return []


def masters_state_dict(
    masters: Any, model: torch.nn.Module | None = None
) -> dict[str, torch.Tensor]:
    """The fp32 masters as a plain CPU ``state_dict`` for an fp32 copy of the model.

    With masters made from ``dict(model.named_parameters())`` the keys are the
    parameter names, so ``fp32_model.load_state_dict(sd, strict=False)`` takes them
    (``strict=False`` because buffers are not masters). The masters are never
    trapped in mpfunc's format. Every strategy exports its exact fp32 master: a
    ``RemainderMaster`` its joined 32 bits, a ``KahanMaster`` param + compensation, the
    others their param widened to fp32.

    With ``model`` (the module to load into), every key is matched against
    ``model.state_dict()`` first, because ``strict=False`` silently skips a key it does
    not know: a ``torch.compile``d module's ``_orig_mod.`` prefix is added (or dropped,
    for masters named after a compiled module) where that finds the entry, and a master
    that matches no entry of its shape raises ``ValueError`` naming it.

    Example::

      fp32_model.load_state_dict(mpfunc.masters_state_dict(masters, fp32_model), strict=False)
    """
    side, _ = _strategy.master_leaves("masters_state_dict", "masters", masters)
    keys = _tree.leaf_paths(masters, units=True)
    sd: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for key, leaf in zip(keys, side.leaves):
            if leaf is None:
                continue
            _check_unique("masters_state_dict", key, sd)
            s = _strategy.by_unit(leaf)
            value = leaf if s is None else s.export(leaf)
            sd[key] = value.detach().cpu().clone()
    if model is None:
        return sd
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"masters_state_dict: model: expected None or a torch.nn.Module, got "
            f"{_checks.describe(model)}"
        )
    return _keys_of(model, sd)


_COMPILED = "_orig_mod."  # torch.compile's OptimizedModule keeps the module under this name


def _keys_of(model: torch.nn.Module, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``sd`` keyed as ``model.state_dict()`` keys its entries, or a ``ValueError``."""
    target = model.state_dict()
    by_name = {k.replace(_COMPILED, ""): k for k in target}
    out: dict[str, torch.Tensor] = {}
    problems = []
    for key, value in sd.items():
        name = by_name.get(key.replace(_COMPILED, ""))
        if name is None:
            problems.append(f"{key!r} (no such entry)")
        elif target[name].shape != value.shape:
            problems.append(
                f"{key!r} (shape {tuple(value.shape)}, the model's {name!r} has "
                f"{tuple(target[name].shape)})"
            )
        else:
            out[name] = value
    if problems:
        sample = ", ".join(repr(k) for k in list(target)[:3]) or "none"
        raise ValueError(
            f"masters_state_dict: expected every master to name an entry of the model's "
            f"state_dict, got {len(problems)} that do not: {', '.join(problems[:10])}"
            f"{' ...' if len(problems) > 10 else ''}. The model's keys look like {sample}: were "
            f"the masters made from this model's named_parameters()?"
        )
    return out


TIES_SUFFIX = "#ties"  # a sidecar's key for a param's tie bits: "<name>#ties"
# A sidecar's key for the CRC-32 of the bf16 param its remainder belongs to (a 0-d int64):
# "<name>#param_crc32". A remainder and tie bits join with any bf16 value, so without it a
# sidecar saved at another step than the model's state_dict gave wrong masters, no error.
CRC_SUFFIX = "#param_crc32"


def _param_crc(p: torch.Tensor) -> int | None:
    """The fingerprint of param ``p`` as its sidecar keeps it (``_crc`` of its host bytes),
    or ``None`` for a DTensor: each rank holds a shard, and the sidecar's plain tensors
    are one value for every rank."""
    if _dtensor.is_dtensor(p):
        return None
    return _crc("", _host_bytes(p))  # not the key: a renamed pair still checks


def remainders_state_dict(masters: Any) -> dict[str, torch.Tensor]:
    """The int16 remainders and uint8 tie bits of ``"remainder"`` masters as a CPU
    ``state_dict``: the small sidecar that makes a model's own bf16 ``state_dict`` a
    lossless fp32 checkpoint (2.125 bytes per param).

    Save it beside ``model.state_dict()``; ``masters_from_remainders`` rebuilds the exact
    fp32 masters from the two. Keys are the parameter names (the remainders), the
    names with ``"#ties"`` appended (the tie bits) and the names with ``"#param_crc32"``
    appended: a 0-d int64 CRC-32 of the bf16 param the remainder belongs to, by which
    ``masters_from_remainders`` refuses a sidecar saved at another step than the params
    (none for a DTensor param, whose shards differ by rank). The CRCs tell steps apart
    only where a param's bf16 bits moved: a sidecar of a step after which no param of the
    model changed a bit (updates under half a bf16 ulp everywhere) is taken, and rebuilds
    that step's masters. Save the two files together. Saving it reads each param to the
    host once.
    """
    side, _ = _strategy.master_leaves("remainders_state_dict", "masters", masters)
    keys = _tree.leaf_paths(masters, units=True)
    out: dict[str, torch.Tensor] = {}
    for k, leaf in zip(keys, side.leaves):
        if isinstance(leaf, RemainderMaster):
            _check_unique("remainders_state_dict", k, out)
            out[k] = leaf.remainder.detach().cpu().clone()
            out[k + TIES_SUFFIX] = leaf.ties.detach().cpu().clone()
            crc = _param_crc(leaf.param.detach())
            if crc is not None:
                out[k + CRC_SUFFIX] = torch.tensor(crc, dtype=torch.int64)
    return out


def masters_from_remainders(
    params: Mapping[str, torch.Tensor], remainders: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The exact fp32 masters held by a bf16 ``state_dict`` and its remainder sidecar.

    Args:
      params: ``{name: bf16 tensor}``, e.g. ``model.state_dict()`` or a file of it.
      remainders: the sidecar from ``remainders_state_dict``: ``{name: int16 tensor}``
        and ``{name + "#ties": uint8 tensor}``; every name must be in ``params``. A
        sidecar without tie bits (written before mpfunc kept them, beside params rounded
        ties away from zero) is read by that rule. A ``"#param_crc32"`` entry must be the
        CRC-32 of the param of its name (a sidecar without one is not checked).

    Returns:
      ``{name: fp32 tensor}`` for every remainder, bit-identical to the masters that were
      saved (``masters_state_dict``).

    Raises:
      KeyError: a remainder has no param, or tie bits or a CRC have no remainder.
        TypeError, ValueError: dtypes or shapes differ, or a param is not the one the
        sidecar was saved beside (its CRC differs).
    """
    fn = "masters_from_remainders"
    suffixes = (TIES_SUFFIX, CRC_SUFFIX)
    names = [k for k in remainders if not k.endswith(suffixes)]
    missing = sorted(set(names) - set(params))
    if missing:
        raise KeyError(f"{fn}: remainders {missing[:5]} have no param of the same name")
    orphans = sorted(
        k for k in remainders
        for suffix in suffixes if k.endswith(suffix) and k[: -len(suffix)] not in remainders
    )  # fmt: skip
    if orphans:
        raise KeyError(f"{fn}: tie bits or CRCs {orphans[:5]} have no remainder of the same name")
    stale = []
    for k in names:  # every param checked before anything is joined
        c = remainders.get(k + CRC_SUFFIX)
        if c is None or not isinstance(params[k], torch.Tensor):
            continue
        if not isinstance(c, torch.Tensor) or c.dtype != torch.int64 or c.dim() != 0:
            raise ValueError(
                f"{fn}: {k + CRC_SUFFIX!r}: expected a 0-d torch.int64 CRC, got "
                f"{_checks.describe(c)}"
            )
        if params[k].dtype == torch.bfloat16 and params[k].shape == remainders[k].shape:
            got = _param_crc(params[k].detach())
            if got is not None and got != int(c):
                stale.append(k)
    if stale:
        raise ValueError(
            f"{fn}: expected each param to be the one its remainder was saved beside, got "
            f"{len(stale)} whose bits differ (CRC-32): {stale[:5]}"
            f"{' ...' if len(stale) > 5 else ''}. Were the model's state_dict and the "
            f"sidecar saved at the same step (remainders_state_dict(masters) right beside "
            f"model.state_dict())?"
        )
    out = {}
    for k in names:
        r, p = remainders[k], params[k]
        if not isinstance(p, torch.Tensor) or p.dtype != torch.bfloat16:
            raise TypeError(
                f"{fn}: {k!r}: expected a torch.bfloat16 param, got {_checks.describe(p)}"
            )
        if not isinstance(r, torch.Tensor) or r.dtype != torch.int16 or r.shape != p.shape:
            raise ValueError(
                f"{fn}: {k!r}: expected a torch.int16 remainder of shape {tuple(p.shape)}, got "
                f"{_checks.describe(r)}"
            )
        p, r = p.detach().cpu(), r.detach().cpu()
        t = remainders.get(k + TIES_SUFFIX)
        if t is None:  # a sidecar from before tie bits
            out[k] = _remainder.join_ties_away(p, r)
            continue
        problem = _remainder.tie_problem(t, p) if isinstance(t, torch.Tensor) else None
        if problem is not None or not isinstance(t, torch.Tensor):
            raise ValueError(f"{fn}: {k + TIES_SUFFIX!r}: {problem or 'expected a tensor'}")
        out[k] = _remainder.join(p, r, t.detach().cpu())
    return out


def _host_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the host, its values laid out contiguously with nothing else in its storage
    (no conj/neg bit, no offset, no elements of a larger tensor it is a view of)."""
    t = t.detach().cpu().resolve_conj().resolve_neg()
    if (
        t.is_contiguous()
        and t.storage_offset() == 0
        and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    ):
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _crc(key: str, t: torch.Tensor) -> int:
    """CRC-32 of a host tensor's key, dtype, shape and bytes (as laid out by
    ``_host_bytes``). Checksums are of this machine's byte order, which is the file's
    on every little-endian machine."""
    head = f"{key}\0{t.dtype}\0{tuple(t.shape)}\0".encode()
    crc = zlib.crc32(head)
    nbytes = t.numel() * t.element_size()
    if nbytes:
        crc = zlib.crc32((ctypes.c_char * nbytes).from_address(t.data_ptr()), crc)
    return crc


def _manifest(host: Mapping[str, torch.Tensor]) -> torch.Tensor:
    doc = {
        "format": _FORMAT,
        "version": _VERSION,
        "crc32": {k: _crc(k, t) for k, t in host.items()},
    }
    data = json.dumps(doc, separators=(",", ":")).encode()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).clone()


def _read_manifest(fn: str, where: str, t: torch.Tensor) -> dict[str, int]:
    bad = f"{fn}: {where}: the checksum manifest ({MANIFEST_KEY!r}) is damaged"
    if t.dtype != torch.uint8 or t.ndim != 1:
        raise ValueError(f"{bad}: expected a 1-d uint8 tensor, got {_checks.describe(t)}")
    t = _host_bytes(t)
    raw = (ctypes.c_char * t.numel()).from_address(t.data_ptr()).raw if t.numel() else b""
    try:
        doc = json.loads(raw.decode())
    except (UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"{bad}: {e}") from None
    if not isinstance(doc, dict) or doc.get("format") != _FORMAT:
        raise ValueError(f"{bad}: not an mpfunc manifest")
    if doc.get("version") != _VERSION:
        raise ValueError(
            f"{fn}: {where}: manifest version {doc.get('version')!r}; this mpfunc reads "
            f"version {_VERSION} (a newer mpfunc wrote it?)"
        )
    crcs = doc.get("crc32")
    if not isinstance(crcs, dict) or not all(
        isinstance(k, str) and type(v) is int and 0 <= v < 2**32 for k, v in crcs.items()
    ):
        raise ValueError(f"{bad}: expected a crc32 table of str to 32-bit ints")
    return crcs


def _verify_manifest(fn: str, where: str, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checks every tensor against the manifest if ``sd`` holds one; returns ``sd`` without
    it."""
    if MANIFEST_KEY not in sd:
        return sd
    crcs = _read_manifest(fn, where, sd[MANIFEST_KEY])
    sd = {k: v for k, v in sd.items() if k != MANIFEST_KEY}
    problems = [f"{k!r} has no checksum" for k in sd if k not in crcs]
    problems += [f"{k!r} has a checksum but no tensor" for k in crcs if k not in sd]
    for k, v in sd.items():
        # A value of the wrong kind is reported by the caller's checks, not hashed here.
        hashable = k in crcs and _kind_problem(v, plain=True) is None
        if hashable and _crc(k, _host_bytes(v)) != crcs[k]:
            problems.append(f"{k!r} does not match its checksum")
    if problems:
        shown = "; ".join(problems[:20])
        more = f"; and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise ValueError(
            f"{fn}: {where} is corrupt ({len(problems)} problems): {shown}{more}; "
            f"nothing was loaded"
        )
    return sd

"""Checkpoints: ``state_dict``/``load_state_dict`` over any mpfunc tree, and atomic,
checksummed, code-free ``save``/``load`` files in torch's own format.

A state dict is a plain ``dict[str, Tensor]`` keyed by dotted pytree paths
(``"masters.layers.0.weight"``, ``"opt.exp_avg.layers.0.weight"``): no pickled
Python objects, so ``torch.load(weights_only=True)`` reads it and
``torch.distributed.checkpoint`` can write it. What is not a tensor (a loss
scale's settings, the tree's structure) comes from the ``like`` tree at load time.

A file from ``save`` is what ``torch.save`` writes for that dict, plus two checks:

* **a manifest**, one more entry under the reserved key ``"__mpfunc_manifest__"``:
  a uint8 tensor of JSON holding the CRC-32 of every tensor (its key, dtype, shape
  and bytes). ``load`` recomputes them on the loaded values, and so does
  ``load_state_dict`` when handed a raw ``torch.load`` of the file.
* **a seal**, the zip archive's comment ``mpfunc-checkpoint v1 crc32=<8 hex digits>``:
  the CRC-32 of every byte before it, as ``torch.save`` wrote them (comment length 0).
  A CRC-32 catches every error confined to 32 consecutive bits, so any single
  corrupted byte anywhere in the file is an error, never a wrong value.

Before ``torch.load`` sees a file, its zip directory and pickle are read without
building or running anything, and every storage it declares is checked against the
bytes its record really holds: ``torch.load`` itself trusts the declared size and reads
past the record (heap memory, or a crash).
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import io
import json
import os
import pickle
import re
import secrets
import stat
import struct
import threading
import zipfile
import zlib
from collections.abc import Mapping
from typing import IO, Any, Union, cast

import torch

from mpfunc.core import _checks, _tree
from mpfunc.parallel import _sharding
from mpfunc.strategies import _remainder, _strategy
from mpfunc.strategies._strategy_remainder import RemainderMaster

try:  # advisory locks mark a temporary file as in use; POSIX only
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "load",
    "load_",
    "load_state_dict",
    "load_state_dict_",
    "masters_from_remainders",
    "masters_state_dict",
    "remainders_state_dict",
    "save",
    "state_dict",
]

# A file path as ``open`` takes it; file objects are refused (see ``_path``).
PathLike = Union[str, bytes, "os.PathLike[str]", "os.PathLike[bytes]"]

MANIFEST_KEY = "__mpfunc_manifest__"
_FORMAT = "mpfunc.checkpoint"
_VERSION = 1
_SEAL_PREFIX = b"mpfunc-checkpoint v1 crc32="
_SEAL_LEN = len(_SEAL_PREFIX) + 8
_EOCD = b"PK\x05\x06"  # zip end-of-central-directory record: 22 bytes + comment
_EOCD_LEN = 22
_LOCAL_HEADER = b"PK\x03\x04"
_CHUNK = 1 << 22
_TMP_TAG = ".mpfunc-tmp-"
_NAME_MAX = 255  # bytes in one file name on every common file system
_PID_DIGITS = 10
_REBUILDERS = ("_rebuild_tensor_v2", "_rebuild_tensor_v3")
_DIRECT = ("cpu", "cuda")  # devices whose data_ptr is a real address


# --- keys and checks ------------------------------------------------------------------------


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
        if key in seen:
            raise ValueError(
                f"{fn}: two leaves have the same key {key!r} (a dict key containing '.' "
                f"shadows a nested path); rename one"
            )
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
    fn: str, where: str, keys: list[str | None], leaves: list[Any], sd: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Every check between a tree and a state dict: the manifest when present, then keys,
    shapes, dtypes and kinds, all problems listed together. Returns the dict without its
    manifest."""
    sd = _verify_manifest(fn, where, sd)
    wanted = {k: t for k, t in zip(keys, leaves) if k is not None}
    problems = _problems(wanted, {k: (tuple(v.shape), v.dtype) for k, v in sd.items()})
    for k, t in wanted.items():
        why = _kind_problem(t, plain=False)
        if why is not None:
            problems.append(f"{k!r}: the tree's leaf must be {why[0]}, got {why[1]}")
        v = sd.get(k)
        why = None if v is None else _kind_problem(v, plain=True)
        if why is not None:
            problems.append(f"{k!r}: expected {why[0]}, got {why[1]}")
    _raise_problems(fn, where, problems)
    return sd


# --- state dicts ----------------------------------------------------------------------------


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
    sd = _check_values(fn, "the state dict", keys, leaves, sd)
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
    sd = _check_values(fn, "the state dict", keys, leaves, sd)
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
    # tensor appearing twice (tied) whose two saved values are the same bits.
    direct = sorted(
        (*_extent(t), i)
        for i, (_, t, _) in enumerate(pairs)
        if t.device.type in _DIRECT and t.numel() > 0
    )
    widest: tuple[int, int, int] | None = None  # the interval reaching furthest so far
    for start, end, i in direct:
        if widest is not None and start < widest[1]:
            j = widest[2]
            if pairs[i][1].device == pairs[j][1].device:
                problems += _tied(pairs[j], pairs[i])
        if widest is None or end > widest[1]:
            widest = (start, end, i)
    first: dict[int, int] = {}  # elsewhere (XLA), only the same object twice is seen
    for i, (_, t, _) in enumerate(pairs):
        if t.device.type not in _DIRECT:
            j = first.setdefault(id(t), i)
            if j != i:
                problems += _tied(pairs[j], pairs[i])
    if problems:
        raise ValueError(f"{fn}: cannot write into the tree: {'; '.join(problems[:20])}")
    # A value in memory that another leaf occupies would change before it is read: copy
    # it aside first. (The leaves do not overlap now, so their ends are sorted too.)
    ends = [end for _, end, _ in direct]
    sources = []
    for _, t, v in pairs:
        if v.device.type in _DIRECT and v.numel() > 0 and not _same_view(t, v):
            lo, hi = _extent(v)
            pos = bisect.bisect_right(ends, lo)
            while pos < len(direct) and direct[pos][0] < hi:
                if pairs[direct[pos][2]][1].device == v.device:
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


def remainders_state_dict(masters: Any) -> dict[str, torch.Tensor]:
    """The int16 remainders of ``"remainder"`` masters as a CPU ``state_dict``: the small
    sidecar that makes a model's own bf16 ``state_dict`` a lossless fp32 checkpoint.

    Save it beside ``model.state_dict()``; ``masters_from_remainders`` rebuilds the exact
    fp32 masters from the two (keys are the parameter names).
    """
    side, _ = _strategy.master_leaves("remainders_state_dict", "masters", masters)
    keys = _tree.leaf_paths(masters, units=True)
    return {
        k: leaf.remainder.detach().cpu().clone()
        for k, leaf in zip(keys, side.leaves)
        if isinstance(leaf, RemainderMaster)
    }


def masters_from_remainders(
    params: Mapping[str, torch.Tensor], remainders: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The exact fp32 masters held by a bf16 ``state_dict`` and its remainder sidecar.

    Args:
      params: ``{name: bf16 tensor}``, e.g. ``model.state_dict()`` or a file of it.
      remainders: ``{name: int16 tensor}`` from ``remainders_state_dict``; every key must
        be in ``params``.

    Returns:
      ``{name: fp32 tensor}`` for every key of ``remainders``, bit-identical to the
      masters that were saved (``masters_state_dict``).

    Raises:
      KeyError: a remainder has no param. TypeError, ValueError: dtypes or shapes differ.
    """
    fn = "masters_from_remainders"
    missing = sorted(set(remainders) - set(params))
    if missing:
        raise KeyError(f"{fn}: remainders {missing[:5]} have no param of the same name")
    out = {}
    for k, r in remainders.items():
        p = params[k]
        if not isinstance(p, torch.Tensor) or p.dtype != torch.bfloat16:
            raise TypeError(
                f"{fn}: {k!r}: expected a torch.bfloat16 param, got {_checks.describe(p)}"
            )
        if not isinstance(r, torch.Tensor) or r.dtype != torch.int16 or r.shape != p.shape:
            raise ValueError(
                f"{fn}: {k!r}: expected a torch.int16 remainder of shape {tuple(p.shape)}, got "
                f"{_checks.describe(r)}"
            )
        out[k] = _remainder.join(p.detach().cpu(), r.detach().cpu())
    return out


# --- checksums ------------------------------------------------------------------------------


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


class _CrcWriter:
    """A write-only file that computes the CRC-32 of everything written through it and
    keeps the last bytes (the zip's end record, to seal it)."""

    def __init__(self, f: IO[bytes]) -> None:
        self.f = f
        self.crc = 0
        self.size = 0
        self.tail = b""

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.crc = zlib.crc32(view, self.crc)
        self.size += len(view)
        self.tail = (self.tail + bytes(view[-_EOCD_LEN:]))[-_EOCD_LEN:]
        return self.f.write(view)

    def flush(self) -> None:
        self.f.flush()


def _seal(f: IO[bytes], w: _CrcWriter) -> None:
    """Appends the seal as the zip archive's comment (torch writes none)."""
    if w.size < _EOCD_LEN or w.tail[:4] != _EOCD or w.tail[20:] != b"\0\0":
        raise RuntimeError("save: torch.save did not end the file with a plain zip end record")
    f.seek(w.size - 2)
    f.write(struct.pack("<H", _SEAL_LEN))
    f.seek(w.size)
    f.write(_SEAL_PREFIX + b"%08x" % w.crc)


def _crc_of(f: io.BufferedReader, start: int, stop: int, crc: int = 0) -> int:
    f.seek(start)
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    left = stop - start
    while left > 0:
        n = f.readinto(view[: min(left, _CHUNK)])
        if not n:
            raise ValueError("the file shrank while it was read")
        crc = zlib.crc32(view[:n], crc)
        left -= n
    return crc


def _check_seal(fn: str, path: str, f: io.BufferedReader, size: int) -> bool:
    """Whether the file carries a seal; raises if it does and the seal does not match."""
    if size < _EOCD_LEN + _SEAL_LEN:
        return False
    f.seek(size - _SEAL_LEN)
    tail = f.read(_SEAL_LEN)
    if not tail.startswith(_SEAL_PREFIX):
        return False
    eocd_at = size - _SEAL_LEN - _EOCD_LEN
    f.seek(eocd_at)
    eocd = f.read(_EOCD_LEN)
    digits = tail[len(_SEAL_PREFIX) :]
    # The comment length must be the seal's, and the CRC is of the file as torch wrote
    # it: the end record with a comment length of 0.
    ok = (
        eocd[:4] == _EOCD
        and eocd[20:] == struct.pack("<H", _SEAL_LEN)
        and re.fullmatch(rb"[0-9a-f]{8}", digits) is not None
        and zlib.crc32(b"\0\0", _crc_of(f, 0, eocd_at + 20)) == int(digits, 16)
    )
    if not ok:
        raise ValueError(
            f"{fn}: {path!r} is corrupt: its bytes do not match the checksum save wrote "
            f"(at least one byte changed since); nothing was loaded"
        )
    return True


# --- reading a file without trusting it -----------------------------------------------------


class _Global:
    """A global the pickle names: never imported, only recorded."""

    def __init__(self, module: str, name: str) -> None:
        self.module = module
        self.name = name

    def __call__(self, *args: Any, **kwargs: Any) -> _Call:
        return _Call(self, args)


class _Call:
    """A call the pickle asks for, recorded and never made."""

    def __init__(self, fn: _Global, args: tuple[Any, ...]) -> None:
        self.fn = fn
        self.args = args

    # What pickle may do to the result of a call (BUILD, SETITEMS, APPENDS): ignored.
    def __setstate__(self, state: Any) -> None:
        pass

    def __setitem__(self, key: Any, value: Any) -> None:
        pass

    def append(self, value: Any) -> None:
        pass

    def extend(self, values: Any) -> None:
        pass


class _StorageRef:
    """One storage the pickle declares, ``('storage', type, key, location, numel)``, with
    the size of the record that holds its bytes."""

    def __init__(self, dtype: torch.dtype, record: str, numel: int, held: int) -> None:
        self.dtype = dtype
        self.record = record
        self.numel = numel
        self.nbytes = numel * dtype.itemsize
        self.held = held


class _Unreadable(Exception):
    """The file is not what torch.save writes for a dict of tensors."""


def _torch_dtype(g: object) -> torch.dtype | None:
    """``torch.float8_e4m3fn`` named in a pickle, as a dtype, or ``None``."""
    if not isinstance(g, _Global) or g.module != "torch":
        return None
    dtype = getattr(torch, g.name, None)
    return dtype if isinstance(dtype, torch.dtype) else None


# The storage classes torch.save names, by element type. The set is closed: newer dtypes
# are saved as a byte storage plus a dtype (``_rebuild_tensor_v3``).
_LEGACY_STORAGES = {
    "DoubleStorage": torch.float64,
    "FloatStorage": torch.float32,
    "HalfStorage": torch.float16,
    "LongStorage": torch.int64,
    "IntStorage": torch.int32,
    "ShortStorage": torch.int16,
    "CharStorage": torch.int8,
    "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool,
    "BFloat16Storage": torch.bfloat16,
    "ComplexDoubleStorage": torch.complex128,
    "ComplexFloatStorage": torch.complex64,
    "QInt8Storage": torch.qint8,
    "QInt32Storage": torch.qint32,
    "QUInt8Storage": torch.quint8,
    "QUInt4x2Storage": torch.quint4x2,
    "QUInt2x4Storage": torch.quint2x4,
}


def _storage_dtype(g: object) -> torch.dtype | None:
    """The element type of a storage class named in a pickle (``torch.FloatStorage``:
    float32; ``torch.UntypedStorage``: bytes), or ``None``."""
    if not isinstance(g, _Global):
        return None
    if g.module in ("torch", "torch.storage") and g.name == "UntypedStorage":
        return torch.uint8
    return _LEGACY_STORAGES.get(g.name) if g.module == "torch" else None


def _is_count(x: object) -> bool:
    return type(x) is int and x >= 0


class _Scanner(pickle.Unpickler):
    """Reads torch's ``data.pkl`` without importing or calling anything: globals become
    names, calls become records, and each storage becomes a ``_StorageRef``."""

    def __init__(self, data: bytes, records: Mapping[str, int], prefix: str) -> None:
        super().__init__(io.BytesIO(data), encoding="utf-8")
        self.records = records
        self.prefix = prefix
        self.storages: list[_StorageRef] = []

    def find_class(self, module_name: str, global_name: str, /) -> Any:
        return _Global(module_name, global_name)

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5):
            raise _Unreadable(f"unexpected persistent id {pid!r:.80}")
        kind, storage_type, key, _location, numel = pid
        if isinstance(kind, bytes):
            kind = kind.decode("ascii", "replace")
        dtype = _storage_dtype(storage_type)
        if kind != "storage" or dtype is None or not isinstance(key, str) or not _is_count(numel):
            raise _Unreadable(f"unexpected persistent id {pid!r:.80}")
        record = f"{self.prefix}data/{key}"
        held = self.records.get(record.lower())
        if held is None:
            raise _Unreadable(f"no record {record!r} for a storage")
        ref = _StorageRef(dtype, record, numel, held)
        self.storages.append(ref)
        return ref


def _tensor_meta(value: object) -> tuple[_Meta, _StorageRef, int]:
    """The shape and dtype of a pickled tensor, its storage, and how many bytes of the
    storage its view reaches. Raises ``_Unreadable`` for anything but a dense tensor
    (``torch._utils._rebuild_tensor_v2``/``v3`` of a storage)."""
    if not (
        isinstance(value, _Call)
        and value.fn.module == "torch._utils"
        and value.fn.name in _REBUILDERS
        and len(value.args) >= 6
    ):
        what = f"a call of {value.fn.module}.{value.fn.name}" if isinstance(value, _Call) else None
        raise _Unreadable(f"expected a tensor, found {what or _checks.describe(value)}")
    storage, offset, size, stride = value.args[:4]
    dtype = storage.dtype if isinstance(storage, _StorageRef) else None
    if value.fn.name == "_rebuild_tensor_v3":  # new dtypes: a byte storage and a dtype
        dtype = _torch_dtype(value.args[6]) if len(value.args) > 6 else None
    if not (
        isinstance(storage, _StorageRef)
        and dtype is not None
        and _is_count(offset)
        and isinstance(size, tuple)
        and isinstance(stride, tuple)
        and len(size) == len(stride)
        and all(_is_count(x) for x in (*size, *stride))
    ):
        raise _Unreadable("a tensor with malformed rebuild arguments")
    numel = 1
    for n in size:
        numel *= n
    reach = 0
    if numel:
        reach = (offset + sum((n - 1) * s for n, s in zip(size, stride)) + 1) * dtype.itemsize
    return (tuple(size), dtype), storage, reach


def _records(f: io.BufferedReader, size: int) -> tuple[str, dict[str, tuple[int, int]]]:
    """The archive folder and each record's ``(start, length)``, keyed by lower-case name,
    after checking that every record is stored, lies inside the file, and is the only
    one of its name (torch finds records by name, ignoring case)."""
    f.seek(0)
    with zipfile.ZipFile(f) as zf:
        infos = zf.infolist()
    if not infos or "/" not in infos[0].filename:
        raise _Unreadable("no torch archive folder")
    prefix = infos[0].filename.split("/", 1)[0] + "/"
    spans: dict[str, tuple[int, int]] = {}
    for info in infos:
        name = info.filename
        if not name.startswith(prefix) or name.lower() in spans:
            raise _Unreadable(f"unexpected or repeated record {name!r}")
        if info.compress_type != zipfile.ZIP_STORED or info.file_size != info.compress_size:
            raise _Unreadable(f"record {name!r} is compressed")
        f.seek(info.header_offset)
        head = f.read(30)
        if len(head) < 30 or head[:4] != _LOCAL_HEADER:
            raise _Unreadable(f"record {name!r} has no local header")
        n_name, n_extra = struct.unpack("<HH", head[26:30])
        start = info.header_offset + 30 + n_name + n_extra
        if start + info.file_size > size:
            raise _Unreadable(f"record {name!r} runs past the end of the file")
        spans[name.lower()] = (start, info.file_size)
    return prefix, spans


def _scan(fn: str, path: str, f: io.BufferedReader, size: int) -> dict[str, _Meta]:
    """Reads the zip directory and the pickle of a torch file without building anything
    and returns each key's shape and dtype.

    Raises ``ValueError`` naming the path (and the key) for anything ``torch.load`` could
    misread: a storage declaring more bytes than its record holds (``torch.load`` would
    read past it: heap memory, or a crash), a view reaching past its storage, records
    outside the file or ambiguous, or a value that is not a plain dense tensor.
    """
    try:
        prefix, spans = _records(f, size)
        pkl = spans.get(f"{prefix}data.pkl".lower())
        if pkl is None:
            raise _Unreadable("no data.pkl")
        f.seek(pkl[0])
        scanner = _Scanner(f.read(pkl[1]), {k: n for k, (_, n) in spans.items()}, prefix)
        top = scanner.load()
        if not isinstance(top, dict) or not all(isinstance(k, str) for k in top):
            raise _Unreadable(f"expected a dict of str to tensors, got {_checks.describe(top)}")
        metas: dict[str, _Meta] = {}
        for key, value in top.items():
            try:
                metas[key], storage, reach = _tensor_meta(value)
            except _Unreadable as e:
                raise _Unreadable(f"{key!r}: {e}") from None
            _check_fits(fn, path, repr(key), storage, reach)
        for storage in scanner.storages:  # any not behind a key (none in a valid file)
            _check_fits(fn, path, "a storage", storage, 0)
        return metas
    except (_Unreadable, zipfile.BadZipFile, pickle.UnpicklingError, EOFError) as e:
        raise ValueError(f"{_unreadable(fn, path)}: {e}") from None
    except NotImplementedError as e:  # zipfile: a version or method it cannot read
        raise ValueError(
            f"{_unreadable(fn, path)}: its zip archive uses a feature torch.save never writes ({e})"
        ) from None
    except (TypeError, AttributeError, IndexError, KeyError, OverflowError, struct.error) as e:
        raise ValueError(f"{_unreadable(fn, path)}: {type(e).__name__}: {e}") from None
    except ValueError as e:
        if str(e).startswith(f"{fn}: "):
            raise
        raise ValueError(f"{_unreadable(fn, path)}: {e}") from None


def _check_fits(fn: str, path: str, what: str, storage: _StorageRef, reach: int) -> None:
    if storage.nbytes > storage.held:
        raise ValueError(
            f"{fn}: {path!r}: {what} declares {storage.numel} elements of {storage.dtype} "
            f"({storage.nbytes} bytes) in record {storage.record!r}, which holds "
            f"{storage.held} bytes; the file is corrupt or forged, and nothing was loaded"
        )
    if reach > storage.nbytes:
        raise ValueError(
            f"{fn}: {path!r}: {what} reaches {reach} bytes into its storage "
            f"{storage.record!r} of {storage.nbytes}; the file is corrupt or forged, and "
            f"nothing was loaded"
        )


def _unreadable(fn: str, path: str) -> str:
    return (
        f"{fn}: {path!r} is not a readable mpfunc checkpoint (truncated, corrupt, or "
        f"holding objects other than tensors, which are refused)"
    )


def _path(fn: str, path: object) -> str:
    """The user's path as a ``str``, checked before anything is read or written.

    ``str``, ``bytes`` and ``os.PathLike`` (of either) are accepted, bytes decoded as the
    ``os`` functions decode them (``os.fsdecode``, lossless). A file object is refused:
    ``save`` writes a temporary file beside its target and renames it into place, and
    ``load`` verifies the file before ``torch.load`` reads it, neither of which a stream
    allows. A path whose last part is empty, ``.`` or ``..`` names a folder, not a file:
    refused, where ``os.path.abspath`` would quietly turn ``"c.pt/"`` into ``"c.pt"``.
    """
    try:
        where: str = os.fsdecode(cast(Any, path))  # os.fspath, then bytes decoded
    except TypeError:
        why = (
            "it writes a temporary file beside the checkpoint and renames it into place"
            if fn == "save"
            else "it verifies the whole file before torch.load reads it"
        )
        raise TypeError(
            f"{fn}: path: expected a str, bytes or os.PathLike naming a file, got "
            f"{_checks.describe(path)}. File objects (open(...), io.BytesIO) are not "
            f"accepted, because {why}: pass the file's path"
        ) from None
    seps = os.sep + (os.altsep or "")
    if not _path_names_file(where):
        last = os.path.basename(where)
        if not where:
            why = "an empty path"
        elif where[-1] in seps:
            name = where.rstrip(seps)
            hint = f"; did you mean {name!r}?" if _path_names_file(name) else ""
            why = f"{where!r}, which ends in a path separator, so it names a folder{hint}"
        else:
            why = f"{where!r}, which ends in {last!r}, so it names a folder"
        raise ValueError(
            f"{fn}: path: expected the path of a file, got {why} (nothing was read or written)"
        )
    return where


def _path_names_file(where: str) -> bool:
    return os.path.basename(where) not in ("", ".", "..")


def _read(
    fn: str, where: str, wanted: Mapping[str, torch.Tensor], unverified: bool
) -> tuple[str, dict[str, torch.Tensor]]:
    """Every check of a file, then ``torch.load``: the seal, the zip and pickle scan (sizes,
    kinds), the keys, shapes and dtypes against ``wanted``, and after loading the manifest.
    ``where`` is the user's path from ``_path``. Returns it and the state dict without its
    manifest."""
    try:
        f = open(where, "rb")  # noqa: SIM115 - closed below, after torch.load
    except FileNotFoundError:
        raise FileNotFoundError(f"{fn}: {where!r} does not exist") from None
    with f:
        size = os.fstat(f.fileno()).st_size
        sealed = _check_seal(fn, where, f, size)
        metas = _scan(fn, where, f, size)
        if not sealed and not unverified:
            raise ValueError(
                f"{fn}: {where!r} has no mpfunc checksum (written by mpfunc 0.1, by torch.save, "
                f"or its checksum is damaged), so a corrupted byte in it could not be "
                f"detected. Re-save it with mpfunc.save, or pass unverified=True to load it "
                f"without the file checksum (sizes, keys, shapes and dtypes are still checked)"
            )
        if sealed and MANIFEST_KEY not in metas:
            raise ValueError(f"{fn}: {where!r} is corrupt: sealed, but it has no manifest")
        metas.pop(MANIFEST_KEY, None)
        _raise_problems(fn, repr(where), _problems(wanted, metas))
        f.seek(0)
        try:
            sd = torch.load(f, map_location="cpu", weights_only=True)
        except Exception as e:  # torch raises many types here: say what it means
            first = str(e).splitlines()[0] if str(e) else ""
            raise ValueError(f"{_unreadable(fn, where)}: {type(e).__name__}: {first}") from e
    if not isinstance(sd, dict):
        raise ValueError(
            f"{fn}: {where!r}: expected a dict of str to tensors, got {type(sd).__name__}"
        )
    return where, sd


def load(path: PathLike, like: Any, *, unverified: bool = False) -> Any:
    """Loads a checkpoint written by ``save`` into a new tree shaped like ``like``.

    Before ``torch.load`` runs, the file's checksum is verified and its zip directory
    and pickle are read without running anything: every storage must fit in the bytes
    its record holds, every value must be a dense tensor, and the keys, shapes and
    dtypes must match ``like`` (all problems listed in one error). The file is then
    read with ``torch.load(weights_only=True)``, so no code in it ever runs, and every
    tensor is checked against its own checksum. Values are restored to ``like``'s
    devices (XLA included), never converted to another dtype. ``like`` is not
    modified: to resume a run, use ``load_``, which writes into the run's own tensors.

    Args:
      path: a file written by ``save``: a ``str``, ``bytes`` or ``os.PathLike`` (not a
        file object).
      like: a tree of the wanted structure (e.g. freshly initialized masters and state).
      unverified: also accept a file without mpfunc's checksum: one written by mpfunc
        0.1 (before checksums) or a plain ``torch.save`` of a state dict. Sizes, kinds,
        keys, shapes and dtypes are still checked, and a manifest that is present is
        still verified; only a corrupted byte could go unnoticed.

    Returns:
      A tree of ``like``'s structure with fresh tensors.

    Raises:
      ValueError: the file is not a readable checkpoint (truncated, random bytes, or
        holding objects other than tensors), is corrupt (a checksum does not match),
        declares more data than it holds, has no checksum (unless ``unverified``), or
        belongs to another tree (every missing/unexpected key and shape/dtype mismatch
        is listed). The message names ``path``. Also when ``path`` ends in a separator,
        ``.`` or ``..`` (it names a folder).
      TypeError: ``path`` is not a ``str``, ``bytes`` or ``os.PathLike`` (a file object).
      FileNotFoundError: ``path`` does not exist.
    """
    fn = "load"
    where = _path(fn, path)
    keys, leaves, spec = _keyed_leaves(fn, like)
    wanted = {k: t for k, t in zip(keys, leaves) if k is not None}
    where, sd = _read(fn, where, wanted, unverified)
    sd = _check_values(fn, repr(where), keys, leaves, _check_file_sd(fn, where, sd))
    return _fresh(keys, leaves, spec, sd)


def load_(path: PathLike, tree: Any, *, unverified: bool = False) -> Any:
    """Loads a checkpoint written by ``save`` into ``tree``'s own tensors: the in-place
    twin of ``load``, and the way to resume a run.

    The file gets every check of ``load``, and the tree every check of
    ``load_state_dict_``, before the first write. Every tensor object stays the same,
    so an optimizer built with ``lr=lr_tensor`` reads the restored lr, and the model's
    params, if in the tree, are restored where the model holds them::

      ckpt = {"masters": masters, "opt": state, "lr": lr, "params": params}
      mpfunc.save("run.pt", ckpt)
      ...                                     # a fresh process builds the same objects
      mpfunc.load_("run.pt", ckpt)            # then trains on, bit-identical

    A loss scale is an immutable value whose tensors are restored in place too.

    Args:
      path: a file written by ``save``, as in ``load``.
      tree: the tree to restore, written in place.
      unverified: as in ``load``.

    Returns:
      ``tree``, for chaining.

    Raises:
      TypeError, ValueError, FileNotFoundError: as ``load``, and as ``load_state_dict_``
        for a leaf that cannot be written in place. Nothing is written unless every check
        passes.
    """
    fn = "load_"
    where = _path(fn, path)
    keys, leaves, _ = _keyed_leaves(fn, tree)
    wanted = {k: t for k, t in zip(keys, leaves) if k is not None}
    where, sd = _read(fn, where, wanted, unverified)
    sd = _check_values(fn, repr(where), keys, leaves, _check_file_sd(fn, where, sd))
    _write_into(fn, keys, leaves, sd)
    return tree


def _check_file_sd(fn: str, where: str, sd: dict[Any, Any]) -> dict[str, torch.Tensor]:
    """A loaded file's dict, checked like an ``sd`` argument, as a ``ValueError``: the file
    is at fault, not the caller."""
    try:
        return _check_sd(fn, sd)
    except TypeError as e:
        raise ValueError(f"{fn}: {where!r}: {str(e).removeprefix(fn + ': sd: ')}") from None


# --- saving ---------------------------------------------------------------------------------

_ACTIVE: set[str] = set()  # this process's temporary files, being written
_ACTIVE_LOCK = threading.Lock()
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)  # POSIX only


def _temp_prefix(base: str) -> str:
    """``.<base>.mpfunc-tmp-``, ``base`` shortened so that a full name fits in 255 bytes."""
    room = _NAME_MAX - len(os.fsencode(f"..{_TMP_TAG}")) - _PID_DIGITS - 1 - 8
    while len(os.fsencode(base)) > room:
        base = base[:-1]
    return f".{base}.{_TMP_TAG[1:]}"


# Every temporary file ``_create_temp`` names, whatever checkpoint it was for.
_TEMP_NAME = re.compile(
    rf"\..+{re.escape(_TMP_TAG)}[0-9]{{1,{_PID_DIGITS}}}-[0-9a-f]{{8}}\Z", re.DOTALL
)


def _remove_stale(folder: str) -> None:
    """Removes the temporary files that saves into ``folder`` left behind when their
    writer died (a job killed mid-save), whatever checkpoint they were for: a killed
    ``save("ckpt-100.pt")`` is cleaned up by the next ``save("ckpt-200.pt")``.

    Only names ``_create_temp`` makes (``.<name>.mpfunc-tmp-<pid>-<8 hex digits>``) that
    are regular files are candidates. Each writer holds an exclusive ``flock`` on its
    temporary file until the file has been renamed into place, and the kernel drops the
    lock when the writer dies (even by SIGKILL). A temporary file whose lock can be
    taken therefore has no live writer, whatever its pid says: pids are reused (a
    restarted job in a container often gets the dead one's pid back) and mean nothing
    across containers or hosts, so ``os.kill(pid, 0)`` would both keep dead files and
    misjudge other hosts' writers. One still locked belongs to a concurrent save and is
    left alone; so are this process's own saves in flight (``_ACTIVE``), and everything
    on a file system without locks.
    """
    if fcntl is None:
        return
    try:
        with os.scandir(folder) as entries:
            names = [e.name for e in entries if _TEMP_NAME.match(e.name)]
    except OSError:
        return
    for name in names:
        tmp = os.path.join(folder, name)
        with _ACTIVE_LOCK:
            if tmp in _ACTIVE:  # another thread's save
                continue
        try:  # O_NOFOLLOW: a symlink is not ours; O_NONBLOCK: a FIFO must not block
            flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | os.O_NONBLOCK | _O_CLOEXEC
            fd = os.open(tmp, flags)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                continue
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if os.path.samestat(os.lstat(tmp), st):  # still the file we locked
                os.unlink(tmp)
        except OSError:
            pass  # locked: a live save owns it; or it went away meanwhile
        finally:
            os.close(fd)


def _create_temp(fn: str, where: str, folder: str, base: str) -> tuple[int, str]:
    """Creates and locks ``.<base>.mpfunc-tmp-<pid>-<random>`` in ``folder``, with the
    permissions ``open()`` would give (0o666 less the umask), as ``torch.save`` does."""
    prefix = _temp_prefix(base)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_CLOEXEC | getattr(os, "O_BINARY", 0)
    for _ in range(100):
        tmp = os.path.join(folder, f"{prefix}{os.getpid()}-{secrets.token_hex(4)}")
        with _ACTIVE_LOCK:
            _ACTIVE.add(tmp)
        try:
            fd = os.open(tmp, flags, 0o666)
        except FileExistsError:
            _forget(tmp)
            continue
        except OSError as e:
            _forget(tmp)
            raise _user_error(fn, where, folder, e) from None
        if fcntl is None:
            return fd, tmp
        # Lock, then make sure no cleaner removed the file between open and lock (it
        # could take the lock in that instant); if one did, start over.
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:  # a file system without locks: no cleaner can take it either
            return fd, tmp
        try:
            if os.path.samestat(os.lstat(tmp), os.fstat(fd)):
                return fd, tmp
        except FileNotFoundError:
            pass
        os.close(fd)
        _forget(tmp)
    raise FileExistsError(f"{fn}: could not create a temporary file in {folder!r} for {where!r}")


def _forget(tmp: str) -> None:
    with _ACTIVE_LOCK:
        _ACTIVE.discard(tmp)


def _user_error(fn: str, where: str, folder: str, e: OSError) -> OSError:
    """The same kind of ``OSError``, naming the user's path instead of a temporary file."""
    if isinstance(e, FileNotFoundError) and not os.path.isdir(folder):
        reason = f"its folder {folder!r} does not exist"
    else:
        reason = f"{e.strerror or e} (in its folder {folder!r})"
    message = f"{fn}: cannot write {where!r}: {reason}"
    return type(e)(message) if e.errno is None else type(e)(e.errno, message)


def save(path: PathLike, tree: Any) -> None:
    """Saves ``tree``'s state dict to ``path`` atomically, in torch's own format,
    with a checksum for every tensor and one for the whole file.

    Tensors are copied to the host first (XLA and CUDA tensors included), each with
    only its own elements: a view of a larger tensor writes the view, not the
    storage behind it. The file is written to ``.<name>.mpfunc-tmp-<pid>-<random>``
    in the same folder, flushed and fsynced, then renamed over ``path``, so a crash
    mid-save never destroys the previous checkpoint. Temporary files that earlier
    saves into the same folder left behind (a process killed mid-save, whichever
    checkpoint it was writing) are removed, unless a live save is still writing them;
    no other file is touched. The file gets the permissions ``torch.save``
    would give it: those of the file it replaces, else 0o666 less the umask.
    ``path`` itself is replaced: a symlink there becomes the file. (mpfunc 0.1
    cannot load these files: it reports the manifest as an unexpected key.)

    Args:
      path: the checkpoint file to write: a ``str``, ``bytes`` or ``os.PathLike`` (not a
        file object, which cannot be written atomically).
      tree: any mpfunc tree (masters, optimizer state, loss scale, lr tensor, params).

    Raises:
      TypeError, ValueError: as ``state_dict``, or a leaf is not a dense tensor with
        data (sparse, quantized, meta or a tensor subclass); nothing is written then.
      TypeError: ``path`` is not a ``str``, ``bytes`` or ``os.PathLike`` (a file object).
      ValueError: ``path`` ends in a separator, ``.`` or ``..`` (``"c.pt/"`` names a
        folder, not the file ``"c.pt"``); nothing is written.
      OSError: the folder is missing or not writable (the error names ``path``; the
        previous file, if any, is intact).
    """
    fn = "save"
    where = _path(fn, path)
    sd = state_dict(tree)
    for k, v in sd.items():
        why = _kind_problem(v, plain=True)
        if why is not None:
            _checks.fail(TypeError, fn, k, *why)
        why = _checks.storage_problem(v)
        if why is not None:
            _checks.fail(ValueError, fn, k, *why, _checks.FREED_HINT)
    host = {k: _host_bytes(v) for k, v in sd.items()}
    host[MANIFEST_KEY] = _manifest(host)
    target = os.path.abspath(where)
    folder, base = os.path.split(target)
    _remove_stale(folder)
    fd, tmp = _create_temp(fn, where, folder, base)
    try:
        _keep_mode(fd, target)
        with os.fdopen(fd, "wb") as f:
            w = _CrcWriter(f)
            torch.save(host, cast(IO[bytes], w))  # torch only calls write and flush
            _seal(f, w)
            f.flush()
            os.fsync(f.fileno())
            if fcntl is not None:  # rename while still locked, so no cleaner takes it
                _replace(fn, where, folder, tmp, target)
        if fcntl is None:  # pragma: no cover - Windows cannot rename an open file
            _replace(fn, where, folder, tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    finally:
        _forget(tmp)
    with contextlib.suppress(OSError):  # make the rename itself durable
        dir_fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def _keep_mode(fd: int, target: str) -> None:
    """Gives the new file the permission bits of the file it replaces, as writing into it
    with ``torch.save`` would keep them."""
    try:
        st = os.stat(target)
    except OSError:
        return
    if stat.S_ISREG(st.st_mode) and hasattr(os, "fchmod"):
        with contextlib.suppress(OSError):  # file systems without modes (FAT, some FUSE)
            os.fchmod(fd, stat.S_IMODE(st.st_mode) & 0o777)


def _replace(fn: str, where: str, folder: str, tmp: str, target: str) -> None:
    try:
        os.replace(tmp, target)
    except OSError as e:
        raise _user_error(fn, where, folder, e) from None

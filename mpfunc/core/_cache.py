"""The step cache: whether a call's checks already passed on identical inputs, and the plans
a passed ``apply_update_`` check remembers. Keys are built from each leaf's metadata
(``leaf_keys``), packed in C++ once the native build registers its packer
(``use_packed_keys``); ``_checks`` decides what a key must cover (``recall``).
"""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any

import torch

from mpfunc.core._compile import compiling, func_transform_active

__all__ = [
    "MemoEntry",
    "clear_memo",
    "dense_key",
    "leaf_keys",
    "memo_candidate",
    "memo_enabled",
    "memo_entry",
    "memo_keep",
    "memo_off",
    "memo_passed",
    "memoizable_part",
    "remember",
    "seen",
    "use_packed_keys",
]


# --- a memo of passed checks ----------------------------------------------------------------
#
# A training loop passes the same trees every step. So a call site may remember that its
# checks passed, keyed on *everything those checks read*: the call site and its rules
# (``tag``), each tree's structure, and each leaf's exact type, dtype, shape, device,
# strides and address (``leaf_keys``, below). The key holds no tensor and no object id
# standing in for metadata: a hit means the checks would read exactly the same values
# again, so they would pass again. A new tensor under a reused id, a ``.data`` swap, a
# changed dtype, shape or layout, or a new alias changes the key and the checks run in full.
#
# Only on eager devices (CPU, CUDA): there a leaf's key is a few attribute reads (packed in
# C++ once the native module is loaded: ~0.1 us a tensor). XLA tensors have no address; what
# the checks read instead (the storage's identity, torch's internal-overlap verdict) is
# most of their cost, so a key is as dear as the checks and XLA trees are always checked
# in full (measured: 6-7 ms with the memo against 4-5 ms without for a seed-sized step).


def _no_packed_keys() -> Any:
    return None


# What returns the C++ packer of leaf keys (``meta_key``), or ``None`` while there is none:
# the native build's ``key_function``. That module sits above the checks, so it registers
# itself here when imported (``use_packed_keys``); until then keys are built in Python.
_packed_keys: list[Callable[[], Any]] = [_no_packed_keys]


def use_packed_keys(source: Callable[[], Any]) -> None:
    """Makes ``source()`` (the native module's ``key_function``) the packer of leaf keys."""
    _packed_keys[0] = source


_MEMO_SIZE = 32
_memo: OrderedDict[Hashable, None] = OrderedDict()
_memo_lock = threading.Lock()
# Exactly these types: a subclass (DTensor, FakeTensor, ...) may answer these attributes
# differently, so its trees are always checked in full.
_MEMO_TYPES = (torch.Tensor, torch.nn.Parameter)


def seen(key: Hashable) -> bool:
    """Whether checks passed on ``key`` (it becomes the newest)."""
    with _memo_lock:
        hit = key in _memo
        if hit:
            _memo.move_to_end(key)
    return hit


def remember(key: Hashable) -> None:
    """Remembers that the checks of ``key`` passed (the oldest key is forgotten)."""
    with _memo_lock:
        _memo[key] = None
        _memo.move_to_end(key)
        while len(_memo) > _MEMO_SIZE:
            _memo.popitem(last=False)


def dense_key(leaves: list[Any]) -> Hashable | None:
    """The memo key of ``check_dense`` on ``leaves`` (its outcome depends on nothing else),
    or ``None`` where they may not be remembered, or only with keys as dear as the check
    (a Python key: the native module is not loaded)."""
    # compiling() first: dynamo would guard on the native module's global (None at the
    # first trace, loaded at the next step: a recompile).
    if compiling() or func_transform_active():
        return None
    if not _enabled[0] or _packed_keys[0]() is None or type(leaves) is not list:
        return None
    part = leaf_keys(leaves)
    if part is None or not memoizable_part(part):
        return None
    return ("check_dense", part)


def clear_memo() -> None:
    """Forgets every passed check (tests)."""
    with _memo_lock:
        _memo.clear()
        _entries.clear()


_enabled = [True]


def memo_enabled() -> bool:
    """False inside ``memo_off()``: call sites then skip building keys."""
    return _enabled[0]


@contextlib.contextmanager
def memo_off() -> Iterator[None]:
    """Every check runs in full inside this block (benchmarks, tests)."""
    was = _enabled[0]
    _enabled[0] = False
    try:
        yield
    finally:
        _enabled[0] = was


# --- the step's memo: checks and the plan's per-leaf decisions -------------------------------
#
# ``apply_update_`` reads six tensors per leaf (master, grad, param, moments, step count), so
# its key must cost well under a microsecond per tensor. A tensor's key is one tuple of
# what the checks and the plan read: its exact type, dtype, shape, device, strides and
# address; a ``None`` leaf's is ``None`` (trees are flattened with units opened, whose
# types the tree spec holds). ``storage_offset`` is not needed: the address includes it.
# Nothing is validated while the key is built: a key is only stored after a full check
# passed *and* every tensor it names was found memoizable (exactly ``torch.Tensor`` or
# ``Parameter``, strided, with an address: not XLA or meta), so a hit (an equal key) means
# the same holds again.


def _fast_keys(leaves: Sequence[Any]) -> tuple[Any, ...]:
    return tuple(
        [
            None if t is None else (type(t), t.dtype, t.shape, t.device, t.stride(), t.data_ptr())
            for t in leaves
        ]
    )


def leaf_keys(leaves: Sequence[Any]) -> tuple[Any, ...] | bytes | None:
    """The memo key of flattened leaves (tensors or ``None``); ``None`` where a leaf is not
    a tensor, or has no strides or address (sparse, some lazy tensors), and always under
    torch.compile (dynamo cannot read addresses, and re-traces, so re-checks, on change)."""
    if compiling():
        return None
    native = _packed_keys[0]()
    if native is not None and type(leaves) is list:
        # The same facts packed in C++ (mpfunc/backends/csrc, ``meta_key``), ~20x cheaper; never
        # equal to a Python key, so the two never mix.
        return native(leaves)  # type: ignore[no-any-return]
    try:
        if leaves and getattr(leaves[0], "is_xla", False):
            return None  # XLA trees are always checked: no address, and a key costs as much
        return _fast_keys(leaves)
    except (AttributeError, TypeError, RuntimeError, NotImplementedError):
        return None


def memoizable_part(part: Any) -> bool:
    """Whether every tensor a tree's key names may be remembered (packed keys: the native
    ``meta_key`` returns one only for such trees)."""
    return isinstance(part, bytes) or all(map(_memoizable, part))


def _memoizable(key: Any) -> bool:
    """Whether the tensor a leaf key names may be remembered (see above)."""
    return key is None or (key[0] in _MEMO_TYPES and key[3].type not in ("xla", "lazy", "meta"))


class MemoEntry:
    """What a passed ``apply_update_`` check remembers: the plans of its optimizers, keyed on
    the plan's own tag and its state's leaf keys. Holds no tensor."""

    __slots__ = ("info", "plans")

    def __init__(self) -> None:
        self.plans: OrderedDict[Hashable, Any] = OrderedDict()
        self.info: Any = None  # what the call site needs to rebuild its checked inputs

    def get(self, key: Hashable) -> Any:
        with _memo_lock:
            return self.plans.get(key)

    def child(self, key: Hashable) -> MemoEntry:
        """The entry of a part of this call (a ``partition``'s group: its leaves cut by
        ``key``), made on first use; it holds plans like this one."""
        with _memo_lock:
            entry = self.plans.get(("child", key))
            if not isinstance(entry, MemoEntry):
                entry = self.plans[("child", key)] = MemoEntry()
                while len(self.plans) > 8:
                    self.plans.popitem(last=False)
        return entry

    def put(self, key: Hashable, value: Any, parts: Sequence[Any]) -> None:
        """Remembers ``value`` under ``key`` if every leaf key in ``parts`` is memoizable."""
        if not _enabled[0] or not all(map(memoizable_part, parts)):
            return
        with _memo_lock:
            self.plans[key] = value
            while len(self.plans) > 8:
                self.plans.popitem(last=False)


_entries: OrderedDict[Hashable, MemoEntry] = OrderedDict()


def memo_entry(tag: Hashable, keys: tuple[Any, ...]) -> tuple[Hashable | None, MemoEntry | None]:
    """``(key, entry)``: the entry of a call whose checks passed on identical inputs, else
    ``(key, None)``; ``(None, None)`` where nothing may be remembered (memo off, a
    ``torch.func`` transform running: its wrappers answer these attributes differently)."""
    if not _enabled[0] or func_transform_active():
        return None, None
    # Inside torch.inference_mode() inference tensors may be written: other checks.
    key = (tag, torch.is_inference_mode_enabled(), keys)
    try:
        with _memo_lock:  # oldest first out: a hit does not move (no second hash)
            entry = _entries.get(key)
    except TypeError:  # an unhashable part of the tag
        return None, None
    return key, entry


def memo_candidate(key: Hashable | None, parts: Sequence[Any]) -> MemoEntry | None:
    """A new entry for ``key``'s call, not yet remembered (``memo_keep``, once every check
    of the call passed); ``None`` if a leaf may not be remembered. ``parts``: the leaf keys
    of every tree in ``key``."""
    if key is None or not all(map(memoizable_part, parts)):
        return None
    return MemoEntry()


def memo_keep(key: Hashable, entry: MemoEntry) -> None:
    """Remembers ``entry`` (from ``memo_candidate``) as ``key``'s: its checks passed."""
    with _memo_lock:
        _entries.pop(key, None)
        _entries[key] = entry
        while len(_entries) > _MEMO_SIZE:
            _entries.popitem(last=False)


def memo_passed(key: Hashable | None, parts: Sequence[Any]) -> MemoEntry | None:
    """After a full check of ``key``'s call passed: its new entry, remembered (``None`` if
    a leaf may not be remembered). ``parts``: the leaf keys of every tree in ``key``."""
    entry = memo_candidate(key, parts)
    if entry is not None:
        assert key is not None
        memo_keep(key, entry)
    return entry

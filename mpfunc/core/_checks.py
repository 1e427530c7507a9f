"""Every check mpfunc makes, written once, and the one wording of its errors.

An error names the function, the pytree path, what was expected and what
arrived::

    apply_update_: at 'grads.layers.0.weight': expected torch.float32 (the master's
    dtype), got torch.bfloat16 tensor of shape (4, 4) on cpu

The rules for hyperparameters (``real``, ``integer``, ``choice``, ``zero_d_bool``)
and for tensor leaves live here; ``_tree`` only says how trees are read.
Every public function runs its checks before its first write, so a bad input
leaves every tensor as it was.
"""

from __future__ import annotations

import heapq
import math
import numbers
from collections.abc import Callable, Hashable, Sequence
from typing import Any, NamedTuple, NoReturn, Union

import torch
from optree import PyTreeSpec

from mpfunc.core import _cache, _dtensor, _tree
from mpfunc.core._compile import compiling, func_transform_active
from mpfunc.core._consumed_grad import ConsumedGrad

__all__ = [
    "FLOAT_DTYPES",
    "FREED_HINT",
    "LR",
    "MASTER_DTYPES",
    "LRArg",
    "Like",
    "Memo",
    "Side",
    "Sweep",
    "check_dense",
    "check_leaf_dtypes",
    "check_memory",
    "check_no_alias",
    "check_not_differentiated",
    "check_pairs",
    "check_same_structure",
    "check_storage",
    "check_tensor_or_none",
    "check_writable",
    "choice",
    "describe",
    "fail",
    "integer",
    "lr",
    "master_dtype",
    "real",
    "recall",
    "storage_problem",
    "tensor_leaves",
    "tensor_sides",
    "zero_d_bool",
]

# The floating dtypes torch computes in; float8 and friends hold data but do not add.
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# A master holds at least fp32 precision; bf16/fp16 masters would defeat the recipe.
MASTER_DTYPES = (torch.float32, torch.float64)


# --- wording ------------------------------------------------------------------------------


def describe(x: Any) -> str:
    """A short description of what arrived, for error messages."""
    if isinstance(x, torch.Tensor):
        layout = "" if x.layout == torch.strided else f"{_layout_name(x.layout)} "
        return f"{x.dtype} {layout}tensor of shape {tuple(x.shape)} on {x.device}"
    if x is None:
        return "None"
    if isinstance(x, type):
        return f"the class {x.__module__}.{x.__qualname__}"
    if isinstance(x, (bool, int, float, str)):
        return f"{type(x).__name__} {x!r:.60}"
    return type(x).__name__


def _layout_name(layout: torch.layout) -> str:
    return str(layout).removeprefix("torch.")


def fail(
    cls: type[Exception], fn: str, path: str, expected: str, got: str, hint: str = ""
) -> NoReturn:
    """Raises ``cls`` with mpfunc's message form: where, what was expected, what arrived."""
    # One f-string: dynamo (torch.compile) traces it, and would stop at a "+=" on it.
    raise cls(f"{fn}: at {path!r}: expected {expected}, got {got}{'. ' if hint else ''}{hint}")


# --- scalars ------------------------------------------------------------------------------


def _num(x: float) -> str:
    """A bound as it reads in errors: an int in full (a seed's 2**64 - 1), a float as %g."""
    return str(x) if isinstance(x, int) else f"{x:g}"


def _bounds(ge: float | None, gt: float | None, le: float | None, lt: float | None) -> str:
    """``">= 0"``, ``"> 1"``, ``"in [0, 1)"``, ``"in (0, 1)"``: how a range reads in errors."""
    low = f"[{_num(ge)}" if ge is not None else (f"({_num(gt)}" if gt is not None else None)
    high = f"{_num(le)}]" if le is not None else (f"{_num(lt)})" if lt is not None else None)
    if low is not None and high is not None:
        return f"in {low}, {high}"
    parts = [f">= {_num(ge)}" if ge is not None else "", f"> {_num(gt)}" if gt is not None else ""]
    parts += [f"<= {_num(le)}" if le is not None else "", f"< {_num(lt)}" if lt is not None else ""]
    return " ".join(p for p in parts if p)


def real(
    fn: str,
    name: str,
    value: object,
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
) -> float:
    """A finite real number within the given bounds, returned as a Python float.

    ``bool`` is refused (``True`` is an int to Python, never a hyperparameter here).
    Errors read ``expected a finite float >= 0, got nan`` (or ``a float in [0, 1)`` when
    both ends are bounded, which already excludes infinities).
    """
    rule = _bounds(ge, gt, le, lt)
    # Any real number: numpy's float32 (a LambdaLR factor computed in numpy) is not a float.
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{fn}: {name}: expected a float {rule}, got {type(value).__name__}")
    v = float(value)
    ok = (
        math.isfinite(v)
        and (ge is None or v >= ge)
        and (gt is None or v > gt)
        and (le is None or v <= le)
        and (lt is None or v < lt)
    )
    if not ok:
        finite = "" if rule.startswith("in ") else "finite "
        raise ValueError(f"{fn}: {name}: expected a {finite}float {rule}, got {v!r}")
    return v


def integer(
    fn: str, name: str, value: object, *, ge: int | None = None, le: int | None = None
) -> int:
    """A Python int (not a bool) within the given bounds."""
    rule = _bounds(ge, None, le, None)
    expected = f"an int {rule}".rstrip()
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{fn}: {name}: expected {expected}, got {value!r}")
    if (ge is not None and value < ge) or (le is not None and value > le):
        raise ValueError(f"{fn}: {name}: expected {expected}, got {value}")
    return value


def choice(fn: str, name: str, value: object, choices: Sequence[str]) -> str:
    """One of ``choices``."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{fn}: {name}: expected one of {', '.join(choices)}, got {value!r}")
    return value


def zero_d_bool(fn: str, name: str, value: object, hint: str = "") -> torch.Tensor | None:
    """``None`` or a 0-d bool tensor (a device-side flag such as ``skip``)."""
    if value is None:
        return None
    if not isinstance(value, torch.Tensor) or value.ndim != 0 or value.dtype != torch.bool:
        extra = f" ({hint})" if hint else ""
        raise TypeError(
            f"{fn}: {name}: expected None or a 0-d bool tensor{extra}, got {describe(value)}"
        )
    return value


# --- trees --------------------------------------------------------------------------------


def check_tensor_or_none(fn: str, name: str, tree: Any, leaves: Sequence[Any]) -> None:
    """Raises ``TypeError`` naming the first leaf that is neither a tensor nor ``None``."""
    for i, leaf in enumerate(leaves):
        if leaf is not None and not isinstance(leaf, torch.Tensor):
            path = _tree.leaf_paths(tree, name)[i]
            fail(TypeError, fn, path, "a tensor or None leaf", describe(leaf))


def _first_difference(a: Any, b: Any, name_a: str, name_b: str) -> str:
    """Explains where two trees first differ, by path (a master strategy's unit, such as a
    remainder master, named as the one leaf it stands for, then by its fields)."""
    for units in (True, False):
        pa = _tree.leaf_paths(a, units=units)
        pb = _tree.leaf_paths(b, units=units)
        set_a, set_b = set(pa), set(pb)
        for p in pa:
            if p not in set_b:
                return f"{p!r} is in {name_a} but not in {name_b}"
        for p in pb:
            if p not in set_a:
                return f"{p!r} is in {name_b} but not in {name_a}"
    where = _container_difference(_tree.flatten(a)[1], _tree.flatten(b)[1], ())
    if where is None:  # pragma: no cover - equal paths and node types: another difference
        return "the leaf paths match but the container types differ"
    path, ta, tb = where
    return (
        f"the leaf paths match but the containers differ: at {_tree.format_path(path)!r} "
        f"{name_a} holds {_a(ta.__qualname__)} and {name_b} {_a(tb.__qualname__)} (mpfunc's trees "
        f"tell container types apart, as optree does: build both the same way, e.g. "
        f"dict(model.named_parameters()), or dict(...) around an OrderedDict such as "
        f"model.state_dict())"
    )


def _a(noun: str) -> str:
    return f"{'an' if noun[:1].lower() in 'aeiou' else 'a'} {noun}"


def _container_difference(
    a: PyTreeSpec, b: PyTreeSpec, path: tuple[Any, ...]
) -> tuple[tuple[Any, ...], type, type] | None:
    """The first node, by path, where two specs with equal leaf paths differ in type."""
    if a.type is not b.type:
        return path, a.type or type(None), b.type or type(None)
    for key, ca, cb in zip(a.entries(), a.children(), b.children()):
        found = _container_difference(ca, cb, (*path, key))
        if found is not None:
            return found
    return None


def _short(spec: PyTreeSpec, limit: int = 200) -> str:
    text = str(spec)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_same_structure(
    fn: str,
    name_a: str,
    a: Any,
    spec_a: PyTreeSpec,
    name_b: str,
    b: Any,
    spec_b: PyTreeSpec,
    hint: str = "",
) -> None:
    """Raises ``ValueError`` if two trees differ in structure, naming the first differing path."""
    if _tree.same_structure(spec_a, spec_b):
        return
    where = _first_difference(a, b, name_a, name_b)
    extra = f". {hint}" if hint else ""
    raise ValueError(
        f"{fn}: {name_a} and {name_b} must have the same tree structure: {where}; "
        f"expected {_short(spec_a)}, got {_short(spec_b)}{extra}"
    )


# --- learning rates -----------------------------------------------------------------------

LR = Union[float, torch.Tensor]
# What a user may pass as lr: a float, a 0-d tensor, or a schedule of the step count.
LRArg = Union[float, torch.Tensor, Callable[[torch.Tensor], Union[float, torch.Tensor]]]


def lr(fn: str, value: object) -> LRArg:
    """A learning rate: a float >= 0, a 0-d floating tensor (read at every step), or a
    schedule, a function of the 0-d step count returning either.

    A tensor's value is not checked: reading it would wait on the device.
    """
    if callable(value) and not isinstance(value, torch.Tensor):
        return value
    if isinstance(value, torch.Tensor):
        if value.ndim != 0 or not value.is_floating_point():
            raise TypeError(
                f"{fn}: lr: expected a float or a 0-d floating-point tensor, got {describe(value)}"
            )
        return value
    return real(fn, "lr", value, ge=0.0)


def master_dtype(fn: str, dtype: object) -> torch.dtype | None:
    """``None`` (each master at least fp32 and never narrower than its param) or a master
    dtype, float32 or float64."""
    if dtype is None:
        return None
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{fn}: dtype: expected a torch.dtype, got {type(dtype).__name__}")
    if dtype not in MASTER_DTYPES:
        raise ValueError(
            f"{fn}: dtype: expected torch.float32 or torch.float64 (masters and their grads keep "
            f"full precision), got {dtype}"
        )
    return dtype


# --- leaves -------------------------------------------------------------------------------


class Side(NamedTuple):
    """One tree of a call, flattened once: its name in errors (``"grads"``,
    ``"state.exp_avg"``), the tree itself (for paths, built only on error) and its leaves."""

    name: str
    tree: Any
    leaves: list[Any]
    units: bool = False  # the tree's units (masters kept as param + buffers) are leaves

    def where_present(self, other: Sequence[Any]) -> Side:
        """These leaves where ``other`` holds one, ``None`` elsewhere (positions kept, so
        paths stay right): the tensors a call writes when ``other`` says which."""
        return self._replace(
            leaves=[x if y is not None else None for x, y in zip(self.leaves, other)]
        )

    def path(self, i: int) -> str:
        # One walk of the tree, on the error path only: linear in the number of leaves.
        return _tree.leaf_paths(self.tree, self.name, units=self.units)[i]


def tensor_sides(side: Side) -> list[Side]:
    """A side whose leaves may be units (NamedTuples of tensors) as sides of tensors only:
    one per unit field, each keeping the unit's path."""
    leaves = side.leaves
    units = [len(x) for x in leaves if isinstance(x, tuple)]
    width = max([0, *units])
    if width == 0:
        return [side]
    if len(units) == len(leaves) and min(units) == width:  # every leaf a unit of one width
        return [side._replace(leaves=list(column)) for column in zip(*leaves)]
    out = []
    for j in range(width):
        leaves = [
            (x[j] if j < len(x) else None) if isinstance(x, tuple) else (x if j == 0 else None)
            for x in side.leaves
        ]
        out.append(side._replace(leaves=leaves))
    return out


def tensor_leaves(
    fn: str, name: str, tree: Any, flat: tuple[list[Any], Any] | None = None
) -> tuple[Side, PyTreeSpec]:
    """Flattens ``tree`` (or takes ``flat``, what ``_tree.flatten(tree)`` returned) and checks
    that every leaf is ``None`` or a dense (strided) tensor.

    Sparse, sparse-compressed and other layouts are refused here, before any write: the
    kernels index memory densely and would fail halfway or read garbage.
    """
    leaves, spec = _tree.flatten(tree) if flat is None else flat
    side = Side(name, tree, leaves)
    check_dense(fn, side)
    check_not_differentiated(fn, side)
    return side, spec


def check_not_consumed(fn: str, side: Side) -> None:
    """No leaf is a ``ConsumedGrad``: the ``.grad`` a param holds after the step inside
    backward stepped its leaf, which has no values (reading them raises partway through a
    call, after other leaves were written). One pass over the leaves' types, in C."""
    if ConsumedGrad not in set(map(type, side.leaves)):
        return
    for i, g in enumerate(side.leaves):
        if isinstance(g, ConsumedGrad):
            fail(
                ValueError,
                fn,
                side.path(i),
                "a tensor that holds its values",
                f"the grad of {g.leaf}, used and freed by the step inside backward",
                f"That leaf already stepped inside backward; {g.end} ends the step (and sets "
                "the grad to None)",
            )


def check_not_differentiated(fn: str, side: Side, of: Callable[[Any], Any] | None = None) -> None:
    """Refuses tensors that a torch.func transform is differentiating. mpfunc's results are
    detached, so ``torch.func.grad`` through a transform would return all-zero grads
    with no error (and such wrappers have no memory for the alias checks to read, even
    under ``no_grad``). Eager autograd cannot be fooled the same way: a loss built from
    detached results has no ``grad_fn``, and ``.backward()`` raises."""
    if not func_transform_active():
        return
    tracked = torch._C._functorch.is_gradtrackingtensor
    # ``of``: what of each leaf to check (a unit's param), read only here, in a transform.
    for i, t in enumerate(side.leaves if of is None else map(of, side.leaves)):
        if t is not None and tracked(t):
            fail(
                TypeError,
                fn,
                side.path(i),
                "a tensor that no torch.func transform tracks",
                "a tensor being differentiated by torch.func.grad/vjp/jacrev",
                "mpfunc's transforms are not differentiable (their results are detached, so "
                "the gradient through them would be all zeros): differentiate the loss with "
                "respect to the model's params, and call mpfunc outside the transform",
            )


def check_dense(fn: str, side: Side) -> None:
    """Every leaf of ``side`` is ``None`` or a dense (strided) tensor whose storage holds
    its elements (``check_storage``), and none is a ``ConsumedGrad`` (``check_not_consumed``).

    Remembered by the leaves' memo keys (below): a loop passes the same tensors at every
    step, and reading each storage's size costs several times a key."""
    key = _cache.dense_key(side.leaves)
    if key is not None and _cache.seen(key):
        return
    strided = torch.strided
    for leaf in side.leaves:
        if leaf is not None and not (isinstance(leaf, torch.Tensor) and leaf.layout is strided):
            _explain_leaves(fn, side)
    check_not_consumed(fn, side)
    check_storage(fn, side)
    if key is not None:
        _cache.remember(key)


def _storage_short(t: torch.Tensor) -> tuple[int, int] | None:
    """``(held, spanned)`` bytes where ``t``'s storage is too small for its elements (freed
    with ``untyped_storage().resize_(0)``, or shrunk), else ``None``. Tensors without
    addresses (XLA, meta), and wrappers without a storage (torch.func's), are not read."""
    if t.numel() == 0 or _no_address(t):
        return None
    try:
        held: int = t.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):
        return None
    if t.is_contiguous():
        reach = t.numel()
    else:
        reach = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    spanned = int(t.storage_offset() + reach) * t.element_size()
    return None if held >= spanned else (held, spanned)


FREED_HINT = (
    "Its storage was freed (untyped_storage().resize_(0), as FSDP does between uses) or "
    "shrunk: pass tensors whose memory is allocated"
)


def storage_problem(t: torch.Tensor) -> tuple[str, str] | None:
    """``(expected, got)`` for an error where ``t``'s storage does not hold its elements,
    else ``None`` (``check_storage``; ``FREED_HINT`` says what to do)."""
    short = _storage_short(_dtensor.local(t))
    if short is None:
        return None
    return (
        f"a tensor whose storage holds its elements ({short[1]} bytes)",
        f"{describe(t)} whose storage holds {short[0]} bytes",
    )


def check_storage(fn: str, side: Side) -> None:
    """Every tensor of ``side`` (each tensor of a unit too) holds its elements in its
    storage. torch's kernels and mpfunc's do not look: a tensor whose storage was freed
    (FSDP's ``untyped_storage().resize_(0)`` between uses) would be read or written at
    address 0 (a crash) or past its memory (another tensor's values).

    A memo key (``leaf_keys``) holds each tensor's address. Freeing a storage moves its
    data to address 0, and shrinking one copies it into a new block while the old one is
    still held, so a remembered pass is recalled for neither. (A storage freed and then
    reallocated smaller between two calls, at the very address it had, would be: the key
    holds no storage size.)"""
    if compiling():  # fake tensors: dynamo traces no storage
        return
    plain = _dtensor.dtensor_type() is None  # (asked once, not per unit)
    for i, t in enumerate(_dtensor.locals_(side.leaves)):
        if t is None or isinstance(t, tuple) or t.is_xla:  # (XLA: no memory to free)
            if isinstance(t, tuple) and not all(map(_holds, t if plain else _dtensor.locals_(t))):
                _storage_error(fn, side.path(i), t)
            continue
        try:  # the common case, sure and cheap: a contiguous tensor at a storage's start
            if (
                t.storage_offset() == 0
                and t.untyped_storage().nbytes() >= t.nbytes
                and t.is_contiguous()
            ):
                continue
        except (RuntimeError, NotImplementedError):  # no storage (torch.func's wrappers)
            continue
        if _storage_short(t) is not None:
            _storage_error(fn, side.path(i), (t,))


def _holds(t: torch.Tensor) -> bool:
    """Whether a unit's tensor holds its elements: the leaves' cheap sure case first (a
    contiguous tensor at its storage's start, ~1 us), else ``_storage_short`` in full."""
    if t.is_xla:  # type: ignore[attr-defined]  # no memory to free (as _storage_short)
        return True
    try:
        if (
            t.storage_offset() == 0
            and t.untyped_storage().nbytes() >= t.nbytes
            and t.is_contiguous()
        ):
            return True
    except (RuntimeError, NotImplementedError):  # _storage_short decides, as before
        pass
    return _storage_short(t) is None


def _storage_error(fn: str, path: str, tensors: Sequence[torch.Tensor]) -> None:
    for t in tensors:
        why = storage_problem(t)
        if why is not None:
            fail(ValueError, fn, path, *why, FREED_HINT)


def _explain_leaves(fn: str, side: Side) -> NoReturn:
    for i, leaf in enumerate(side.leaves):
        if leaf is None:
            continue
        if not isinstance(leaf, torch.Tensor):
            fail(TypeError, fn, side.path(i), "a tensor or None leaf", describe(leaf))
        if leaf.layout is not torch.strided:
            fail(
                TypeError,
                fn,
                side.path(i),
                "a dense (strided) tensor",
                describe(leaf),
                "Sparse grads (nn.Embedding(sparse=True)) need .to_dense() first",
            )
    raise AssertionError("unreachable")  # pragma: no cover


class Like(NamedTuple):
    """What each leaf of one tree must be, given the matching leaf of a reference tree.

    ``dtypes`` is ``None`` for "the reference leaf's dtype", else the allowed dtypes,
    named ``what`` in errors. ``scalar`` asks for a 0-d tensor (a step count) instead of
    the reference's shape. ``optional``: may be ``None`` where the reference holds a
    tensor (grads of params that took none). ``spare``: may hold anything where the
    reference is ``None`` (``out`` trees that have a buffer for every param).
    """

    role: str  # how the reference leaf is named in errors: "the master's"
    dtypes: tuple[torch.dtype, ...] | None = None
    what: str = ""
    scalar: bool = False
    optional: bool = False
    spare: bool = False
    hint: str = ""
    none_why: str = "this leaf has no master"  # why None is expected where ref is None


def check_pairs(fn: str, ref: Side, other: Side, like: Like) -> None:
    """The one pair check: every leaf of ``other`` against the matching leaf of ``ref``
    (the trees' structures are already equal). A fast pass decides; on any doubt the
    explainer names the first leaf at fault, with one wording for every caller."""
    dtypes, scalar, optional, spare = like.dtypes, like.scalar, like.optional, like.spare
    Tensor, strided, no_shape = torch.Tensor, torch.strided, torch.Size([])
    for r, o in zip(ref.leaves, other.leaves):
        if r is None:
            if o is None or spare:
                continue
            break
        if o is None:
            if optional:
                continue
            break
        if not (
            isinstance(o, Tensor)
            and (o.dtype == r.dtype if dtypes is None else o.dtype in dtypes)
            and o.shape == (no_shape if scalar else r.shape)
            and o.device == r.device
            and o.layout is strided
        ):
            break
    else:
        if not like.scalar and _dtensor.dtensor_type() is not None:
            _check_sharding(fn, ref, other, like)
        return
    _explain_pairs(fn, ref, other, like)


def _check_sharding(fn: str, ref: Side, other: Side, like: Like) -> None:
    """DTensor leaves pair with DTensors of one mesh and placement (local shards of one
    shape), plain tensors with plain tensors: elementwise work runs on local shards."""
    cls = _dtensor.dtensor_type()
    for i, (r, o) in enumerate(zip(ref.leaves, other.leaves)):
        if isinstance(r, cls) or isinstance(o, cls):  # a plain pair needs no more reads
            expected = _dtensor.same_sharding(r, o)
            if expected is not None:
                fail(
                    ValueError,
                    fn,
                    other.path(i),
                    f"{expected} ({like.role} sharding)",
                    _dtensor.describe_sharding(o),
                )


def _explain_pairs(fn: str, ref: Side, other: Side, like: Like) -> NoReturn:
    for i, (r, o) in enumerate(zip(ref.leaves, other.leaves)):
        if r is None:
            if o is None or like.spare:
                continue
            fail(ValueError, fn, other.path(i), f"None ({like.none_why})", describe(o))
        if o is None:
            if like.optional:
                continue
            fail(TypeError, fn, other.path(i), like.what or "a tensor", "None", like.hint)
        if not isinstance(o, torch.Tensor):
            fail(TypeError, fn, other.path(i), "a tensor or None leaf", describe(o))
        if o.layout is not torch.strided:
            fail(TypeError, fn, other.path(i), "a dense (strided) tensor", describe(o))
        if like.dtypes is None and o.dtype != r.dtype:
            fail(
                TypeError,
                fn,
                other.path(i),
                f"{r.dtype} ({like.role} dtype)",
                describe(o),
                like.hint,
            )
        if like.dtypes is not None and o.dtype not in like.dtypes:
            fail(TypeError, fn, other.path(i), like.what, describe(o), like.hint)
        if like.scalar and o.shape != ():
            fail(ValueError, fn, other.path(i), f"a 0-d {like.what}", describe(o), like.hint)
        if not like.scalar and o.shape != r.shape:
            fail(
                ValueError,
                fn,
                other.path(i),
                f"shape {tuple(r.shape)} ({like.role})",
                f"shape {tuple(o.shape)}",
                like.hint,
            )
        if o.device != r.device:
            fail(
                ValueError,
                fn,
                other.path(i),
                f"device {r.device} ({like.role})",
                f"device {o.device}",
            )
    raise AssertionError("unreachable")  # pragma: no cover


def check_leaf_dtypes(fn: str, side: Side, dtypes: Sequence[torch.dtype], what: str) -> None:
    """Every tensor leaf of ``side`` has one of ``dtypes``."""
    for i, t in enumerate(side.leaves):
        if t is not None and t.dtype not in dtypes:
            fail(TypeError, fn, side.path(i), what, describe(t))


# --- memory -------------------------------------------------------------------------------


def _overlaps_itself(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` share memory (an expanded, stride-0 tensor, or an
    ``as_strided`` view folding onto itself). Lazy devices (XLA) have no addresses."""
    if _no_address(t):
        # XLA reports strides as contiguous, so ask torch: 0 is "no overlap", and XLA
        # answers 2 ("too hard to tell") for expanded views, and for column slices too,
        # which are then refused as well: never a wrong write.
        return t.numel() > 1 and int(torch._debug_has_internal_overlap(t)) != 0
    if t.is_contiguous() or t.numel() <= 1:
        return False
    # Sorted by stride, each dimension must step past everything the smaller ones reach.
    reach = 0
    for stride, size in sorted((abs(s), n) for n, s in zip(t.shape, t.stride()) if n != 1):
        if stride <= reach:
            return True
        reach += (size - 1) * stride
    return False


def check_writable(fn: str, sides: Sequence[Side], *, in_place: bool = True) -> None:
    """Tensors mpfunc writes must not overlap themselves: writing an expanded (stride-0)
    tensor element by element would store several results in one place.

    With ``in_place`` (the caller's own tensors are written, not copies of them) each must
    also take an in-place write: no inference tensor outside ``torch.inference_mode()``
    (torch's kernels and mpfunc's refuse it, and a step refused at its second group would
    have written the first), and no negative or conjugate view, whose memory holds the
    negated (conjugated) values: torch's fused and foreach kernels refuse it partway,
    mpfunc's native kernel would store the raw bits."""
    # Not while dynamo traces: it cannot trace the inference-mode queries (a graph break,
    # and fullgraph refuses them), and the view flags are checked on the eager call's
    # tensors only (dynamo guards on neither).
    if compiling():
        in_place = False
    inference = in_place and torch.is_inference_mode_enabled()
    for side in sides:
        for i, t in enumerate(_dtensor.locals_(side.leaves)):
            if t is None:
                continue
            # _overlaps_itself, its cases read here without a call per tensor: without an
            # address (XLA) torch's verdict; a contiguous tensor with one overlaps nothing.
            if t.is_xla or t.is_meta:
                overlaps = t.numel() > 1 and int(torch._debug_has_internal_overlap(t)) != 0
            else:
                overlaps = not t.is_contiguous() and _overlaps_itself(t)
            if overlaps:
                if t.is_xla or t.is_meta:
                    # XLA reports contiguous strides for every view and cannot tell an
                    # expanded tensor from a column slice: both are refused, said as such.
                    got = (
                        f"{describe(t)}, a view torch_xla cannot tell apart from an expanded "
                        "tensor (a column slice, a stepped slice, a select or a diagonal of "
                        "another tensor, or an expand)"
                    )
                    hint = (
                        "Pass .clone() of it: on XLA, leaves may be transposes or "
                        "leading-row slices of other tensors, not other views"
                    )
                else:
                    got = f"{describe(t)} with strides {t.stride()}"
                    hint = "Pass .clone() of an expanded tensor"
                expected = "a tensor whose elements do not share memory"
                fail(ValueError, fn, side.path(i), expected, got, hint)
            if in_place and (t.is_neg() or t.is_conj() or (not inference and t.is_inference())):
                _not_in_place(fn, side.path(i), t)


def _not_in_place(fn: str, path: str, t: torch.Tensor) -> NoReturn:
    if t.is_neg() or t.is_conj():
        kind, held = ("negative", "negated") if t.is_neg() else ("conjugate", "conjugated")
        fail(
            ValueError,
            fn,
            path,
            "a tensor that can be updated in place",
            f"a {kind} view ({describe(t)}), whose memory holds the {held} values",
            "Pass a tensor that holds its own values (.clone() of the view)",
        )
    fail(
        ValueError,
        fn,
        path,
        "a tensor that can be updated in place",
        f"an inference tensor outside torch.inference_mode() ({describe(t)})",
        "Make it outside inference mode (.clone() it there), or run this call inside "
        "torch.inference_mode()",
    )


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The byte range ``[start, end)`` that ``t``'s elements can touch."""
    if t.is_contiguous():
        start = t.data_ptr()
        return start, start + t.nbytes
    size = t.element_size()
    low = t.data_ptr() + sum((n - 1) * s for n, s in zip(t.shape, t.stride()) if s < 0) * size
    extent = 1 + sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride()))
    return low, low + extent * size


def _no_address(t: torch.Tensor) -> bool:
    # ``is_xla`` is far cheaper than ``t.device.type``: no device object is built.
    return bool(t.is_xla) or t.is_meta  # type: ignore[attr-defined]


def _root(t: torch.Tensor) -> object:
    """Without addresses (XLA), what a tensor's memory is: its storage, the same object for
    views, ``.detach()`` and ``.data``. Two slices of one tensor count as sharing it, even
    where they do not overlap.

    Under ``torch.compile``, dynamo traces neither addresses nor storages: the root is the
    tensor object itself (hashed by identity; ``id(t)`` would make dynamo guard the id and
    recompile for every new grad). One tensor passed twice is caught, and dynamo guards
    that (it retraces when two inputs become one object). Views, ``.detach()`` and
    ``.data`` of one another are not seen: a view's ``_base`` would refuse the
    non-overlapping slices of one flat buffer that eager accepts, and dynamo guards no
    aliasing between distinct input tensors anyway (see ``check_no_alias``)."""
    if compiling():
        return t
    return int(t.untyped_storage()._cdata)


def check_no_alias(fn: str, written: Sequence[Side], read: Sequence[Side] = ()) -> None:
    """No two leaves share memory where one of them is written.

    Two names for one tensor (tied weights listed twice, a view of another leaf) would
    each get their own master and state, and whichever is written last would win:
    one name's update would be lost with no error. On eager devices memory ranges are
    compared; on XLA, where tensors have no addresses, the viewed tensor's identity is.

    The common case (no overlap at all) costs a few attribute reads per tensor and one
    sort of nearly sorted addresses; only when some ranges overlap does the exact sweep
    run, which tells a harmless overlap of two read-only leaves from one that a write
    would break, and, for strided views whose ranges interleave (``x[:, 0]`` and
    ``x[:, 1]``), compares element addresses: views sharing no element are two tensors
    (above ``_EXACT_LIMIT`` elements they are taken as sharing).

    Under ``torch.compile`` this runs while dynamo traces, by tensor identity (``_root``),
    since addresses cannot be traced: one tensor under two names is refused, and dynamo
    retraces (re-checking) whenever two inputs become one object. Distinct tensors that
    share memory (views) pass: torch.compile does not guard that between its inputs.
    """
    sides = (*written, *read)
    # A DTensor's memory is its local shard's (the wrapper's data_ptr() is 0).
    tensors = _dtensor.locals_([t for side in sides for t in side.leaves if t is not None])
    traced = compiling()
    lazy: list[object] = []
    spans: list[tuple[int, int]] = []
    for t in tensors:  # one pass, the common case (contiguous) read inline
        if traced:
            lazy.append(t)  # (_root, compiling)
        elif t.is_xla or t.is_meta:  # (_no_address)
            lazy.append(int(t.untyped_storage()._cdata))  # (_root)
        elif t.is_contiguous():
            start = t.data_ptr()
            if t.nbytes:
                spans.append((start, start + t.nbytes))
        else:
            sp = _span(t)
            if sp[1] > sp[0]:
                spans.append(sp)
    if lazy:
        if len(dict.fromkeys(lazy)) != len(lazy):
            _sweep(fn, written, read)
        if traced:
            return
    spans.sort()
    reach = -1
    for start, end in spans:
        if start < reach:
            _sweep(fn, written, read)
            return
        if end > reach:
            reach = end


def check_memory(
    fn: str,
    fresh: Sequence[Side],
    written: Sequence[Side],
    read: Sequence[Side] = (),
    *,
    in_place: bool = True,
) -> None:
    """``check_storage`` of each side of ``fresh``, ``check_writable`` of them, then
    ``check_no_alias(written=[*written, *fresh], read=read)``: sides of tensors only.

    One pass reads each tensor once and decides the common case (every ``fresh`` tensor
    contiguous at its storage's start, its storage holding it, writable in place; no two
    byte ranges overlapping); on any doubt the three checks run in full, in that order, so
    an error is the one they give. At 100,000 leaves of a few tensors each, the three
    separate walks cost several seconds of attribute reads."""
    if not _memory_common(fresh, (*written, *read), in_place):
        for side in fresh:
            check_storage(fn, side)
        check_writable(fn, fresh, in_place=in_place)
        check_no_alias(fn, written=[*written, *fresh], read=read)


class Sweep:
    """A step's one memory check, made after every plan and before any kernel runs.

    ``apply_update_`` names what the step writes and reads (``written``: the masters, units
    as leaves, and the params it rounds into; ``read``: the grads), and each plan adds the
    state it will write (``add``), after checking that state's structure, dtypes and
    shapes. ``run`` then checks each state tensor's storage and writability and, over all
    of the step's tensors at once, that no two share memory where one is written
    (``check_memory``): one alias sweep per call, wherever a partition's labels or
    a state's fields put the two names. It runs only when some check of the call ran in
    full (``full``: a memo miss); what the call's checks would remember (``keep``) is
    remembered only after it passed, so a remembered step or plan always stands for
    inputs that passed this check too.
    """

    __slots__ = ("full", "kept", "read", "state", "written")

    def __init__(self, written: list[Side], read: list[Side], *, full: bool) -> None:
        self.written = written
        self.read = read
        self.state: list[Side] = []
        self.full = full
        self.kept: list[Callable[[], None]] = []

    def add(self, state: Sequence[Side], *, checked: bool) -> None:
        """The state one plan writes (each field a side, units as leaves); ``checked``:
        the plan checked it in full (not remembered from an identical past call)."""
        self.state.extend(state)
        self.full = self.full or checked

    def keep(self, remember: Callable[[], None]) -> None:
        """Calls ``remember`` (a memo record of checks that passed) once ``run`` passed."""
        self.kept.append(remember)

    def run(self, fn: str) -> None:
        """The check, if any check of the call ran in full; then what was kept."""
        if self.full:
            fresh = [t for side in self.state for t in tensor_sides(side)]
            written = [t for side in self.written for t in tensor_sides(side)]
            check_memory(fn, fresh, written, self.read)
        for remember in self.kept:
            remember()
        self.kept.clear()


def _memory_common(fresh: Sequence[Side], others: Sequence[Side], in_place: bool) -> bool:
    """Whether ``check_memory``'s checks surely pass (``False``: maybe not; check in full)."""
    if compiling() or _dtensor.dtensor_type() is not None:
        return False
    inference = torch.is_inference_mode_enabled()
    spans: list[tuple[int, int]] = []
    add = spans.append
    try:
        for side in fresh:
            for t in side.leaves:
                if t is None:
                    continue
                if t.is_xla or t.is_meta or not t.is_contiguous() or t.storage_offset() != 0:
                    return False
                n = t.nbytes
                if t.untyped_storage().nbytes() < n:
                    return False
                if in_place and (t.is_neg() or t.is_conj() or (not inference and t.is_inference())):
                    return False
                if n:
                    start = t.data_ptr()
                    add((start, start + n))
        for side in others:
            for t in side.leaves:
                if t is None:
                    continue
                if t.is_xla or t.is_meta:
                    return False
                if t.is_contiguous():
                    n = t.nbytes
                    if n:
                        start = t.data_ptr()
                        add((start, start + n))
                else:
                    sp = _span(t)
                    if sp[1] > sp[0]:
                        add(sp)
    except (RuntimeError, NotImplementedError, AttributeError, TypeError):
        return False  # (no storage, not a tensor): the full checks say what
    spans.sort()
    reach = -1
    for start, end in spans:
        if start < reach:
            return False
        if end > reach:
            reach = end
    return True


def _sweep(fn: str, written: Sequence[Side], read: Sequence[Side]) -> None:
    """The exact check, on the rare path: raises for the first overlap involving a write."""
    # start, end, side, leaf, written, tensor
    spans: list[tuple[int, int, int, int, bool, torch.Tensor]] = []
    ids: dict[object, tuple[int, int, bool]] = {}
    sides = (*written, *read)
    traced = compiling()
    for s, side in enumerate(sides):
        is_written = s < len(written)
        for i, t in enumerate(_dtensor.locals_(side.leaves)):
            if t is None or t.numel() == 0:
                continue
            if traced or _no_address(t):
                prev = ids.setdefault(_root(t), (s, i, is_written))
                if prev != (s, i, is_written) and (prev[2] or is_written):
                    _alias(fn, sides, prev[:2], (s, i))
                continue
            start, end = _span(t)
            spans.append((start, end, s, i, is_written, t))
    spans.sort(key=lambda x: x[:5])
    # The ranges still open at each start (heaps by end: written ones, read-only ones); a
    # pair with a write among them overlaps if they share an element (interleaved views of
    # one buffer, as x[:, 0] and x[:, 1], do not). Past _PAIRS_LIMIT element comparisons in
    # one call, an overlap of ranges counts as sharing (a bounded sweep).
    open_w: list[tuple[int, int]] = []
    open_r: list[tuple[int, int]] = []
    compared = 0
    for k, cur in enumerate(spans):
        start, end, _, _, is_written, t = cur
        for heap in (open_w, open_r):
            while heap and heap[0][0] <= start:
                heapq.heappop(heap)
        for _, o in (*open_w, *open_r) if is_written else open_w:
            other = spans[o]
            compared += 1
            if compared > _PAIRS_LIMIT or share_elements(other[5], t) is not False:
                _alias(fn, sides, other[2:4], cur[2:4])
        heapq.heappush(open_w if is_written else open_r, (end, k))


_EXACT_LIMIT = 1 << 23  # elements of two tensors compared address by address
_PAIRS_LIMIT = 1024  # pairs of overlapping ranges compared in one call


def _byte_starts(t: torch.Tensor) -> torch.Tensor:
    """The address of each element of ``t`` (metadata only: no value is read)."""
    offsets = torch.zeros((), dtype=torch.int64)
    for n, st in zip(t.shape, t.stride()):
        offsets = offsets.unsqueeze(-1) + torch.arange(n, dtype=torch.int64) * st
    return offsets.reshape(-1) * t.element_size() + t.data_ptr()


def share_elements(a: torch.Tensor, b: torch.Tensor) -> bool | None:
    """Whether two tensors whose byte ranges overlap touch a common byte; ``None`` when
    they are too large to compare element by element (taken as sharing)."""
    if a.numel() + b.numel() > _EXACT_LIMIT:
        return None
    if a.is_contiguous() and b.is_contiguous():
        return True  # two dense ranges that overlap share a byte
    sa, sb = _byte_starts(a), torch.sort(_byte_starts(b)).values
    # For each element of a, the first element of b at or after it, and the one before.
    k = torch.searchsorted(sb, sa)
    after = sb[k.clamp(max=sb.numel() - 1)]
    before = sb[(k - 1).clamp(min=0)]
    hit_after = (k < sb.numel()) & (after < sa + a.element_size())
    hit_before = (k > 0) & (before + b.element_size() > sa)
    return bool((hit_after | hit_before).any())


def _alias(fn: str, sides: Sequence[Side], a: tuple[int, int], b: tuple[int, int]) -> NoReturn:
    path_a = sides[a[0]].path(a[1])
    path_b = sides[b[0]].path(b[1])
    t = sides[b[0]].leaves[b[1]]
    if a[0] != b[0]:  # two trees of the call: a grad that is its own output, a master...
        hint = (
            f"A write through one would change the other mid-call: pass {sides[b[0]].name} "
            f"and {sides[a[0]].name} that share no memory (clone one)"
        )
    elif sides[a[0]].name.split(".")[0] in ("params", "masters"):
        hint = (
            "One tensor under two names would be trained twice and one update lost: list "
            "each parameter once (model.named_parameters() does), or untie the weights"
        )
    else:
        hint = "One tensor under two names would be written twice: give each leaf its own"
    fail(
        ValueError,
        fn,
        path_b,
        f"a tensor that shares no memory with {path_a!r}",
        f"{describe(t)} aliasing it",
        hint,
    )


# --- the checks' use of the step cache (``_cache``) -----------------------------------------


class Memo(NamedTuple):
    """Trees flattened once for a call's checks, and whether those checks already passed on
    identical inputs (``hit``). After checking a miss in full, call ``passed()``."""

    sides: list[Side]
    specs: list[PyTreeSpec]
    key: Hashable | None
    hit: bool

    def passed(self) -> None:
        """Remembers that the checks of this key passed (the oldest key is forgotten), if
        every tensor it names may be remembered (``_cache.memoizable_part``)."""
        if self.key is None or not all(map(_cache.memoizable_part, self.key[2])):  # type: ignore[index]
            return
        _cache.remember(self.key)


def recall(tag: Hashable, trees: Sequence[tuple[str, Any]], also: Sequence[Side] = ()) -> Memo:
    """Flattens each ``(name, tree)`` and looks up whether the checks that ``tag`` names
    (the call site, and every rule that decides what it checks) already passed on trees of
    identical structure and leaf metadata. ``also``: trees flattened before, whose leaves
    the checks read too (their structure must be in ``tag``). Nothing is checked here: on
    a miss the caller runs its checks, then ``memo.passed()``."""
    sides, specs = [], []
    for name, tree in trees:
        leaves, spec = _tree.flatten(tree)
        sides.append(Side(name, tree, leaves))
        specs.append(spec)
    if compiling():  # dynamo re-traces (and so re-checks) on any change; no addresses there
        return Memo(sides, specs, None, False)
    parts = [_cache.leaf_keys(s.leaves) for s in (*sides, *also)]
    key: Hashable | None = None
    if all(p is not None for p in parts) and not func_transform_active():
        try:
            # Inside torch.inference_mode() inference tensors may be written: other checks.
            key = ((tag, torch.is_inference_mode_enabled()), tuple(specs), tuple(parts))
            hash(key)
        except TypeError:
            key = None
    if key is None or not _cache.memo_enabled():
        return Memo(sides, specs, None, False)
    return Memo(sides, specs, key, _cache.seen(key))

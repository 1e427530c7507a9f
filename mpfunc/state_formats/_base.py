"""The protocol every state format implements (``StateFormat``) and what formats share
(the draw keys of stochastically rounded moments); the registry is ``_state_format``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from mpfunc.core import _checks, _dtensor, _rng

__all__ = ["Problem", "StateFormat", "encoded_all_right", "keys", "whole_blocks"]

# What is wrong with a stored moment: (exception type, expected, got), or ``None``.
Problem = tuple[type[Exception], str, str] | None


class StateFormat(NamedTuple):
    """One way of storing optimizer moments, chosen by ``state_dtype``.

    ``key``: the ``state_dtype`` a user passes (``torch.bfloat16``, ``torch.uint8``).
    ``container``: the NamedTuple a moment of this format is (a pytree node whose tensors
    are checkpoint leaves, e.g. ``QState``), or ``None`` where a moment is a plain tensor
    of ``key``'s dtype. ``zeros(kind, dtype, like)``: a zero moment of field kind ``kind``
    (``"square"`` for second moments) for a leaf shaped like ``like``; ``dtype``: the
    stored dtype (``key``, or the compute dtype for ``state_dtype=None``).
    ``zeros_list(kind, dtypes, faces)``: the same for a whole field (``None`` where a face
    or its dtype is ``None``). ``problem(kind, x, like, dtype)``: what is wrong with a
    stored moment (``Problem``). ``check_init(fn, side, faces)``: raises, naming the path,
    where a leaf cannot take this format (a leaf smaller than a block). ``load(xs,
    compute, likes)``: fp32 (compute dtype) values of a list of stored moments, each
    shaped like its ``likes`` tensor (the leaf's master values; a format that does not
    keep the shape reads it there), or the stored tensors themselves where they already
    are. ``store(xs, values, kind, skip, steps, salts)``: writes computed values back;
    where ``skip`` is true every stored bit is kept; ``steps`` and ``salts`` key
    stochastic rounding. ``layout(x, face)``: a tensor with the strides of what ``load``
    gives for ``x`` (the moment itself, face-shaped codes, or a contiguous stand-in), for
    the planner's choice of a fused kernel, which pairs elements by memory position.

    Back ends: ``native`` is the format's code in the composed CPU pass
    (``csrc``: ``composed::Format``; the container's tensors passed in order), ``None``
    where that pass does not take it (torch's kernels run); ``xla`` says whether the XLA
    node (``backends/_xla_kernels``) loads and stores it itself; ``salted`` whether its
    store draws random bits (the native pass then takes each leaf's salt).
    ``all_right(kind, xs, likes)`` (or ``None``): whether every stored moment of a field
    is right for its leaf (``problem`` of each would be ``None``), read in one pass of
    attribute reads compared in bulk (no Python call per leaf: the XLA step, which has no
    check memo, checks every field every step); ``False`` may be wrong, and then
    ``problem`` is asked leaf by leaf for the error. Only for formats whose stored dtype is
    always ``key``. ``xs`` and ``likes`` hold no ``None``.
    """

    name: str
    key: torch.dtype
    container: type | None
    zeros: Callable[[str, torch.dtype, torch.Tensor], Any]
    zeros_list: Callable[[str, list[torch.dtype | None], list[Any]], list[Any]]
    problem: Callable[[str, Any, torch.Tensor, torch.dtype], Problem]
    check_init: Callable[[str, Any, list[Any]], None]
    load: Callable[[list[Any], torch.dtype, list[torch.Tensor]], list[torch.Tensor]]
    store: Callable[
        [
            list[Any],
            list[torch.Tensor],
            str,
            torch.Tensor | None,
            list[torch.Tensor] | None,
            list[int],
        ],
        None,
    ]
    layout: Callable[[Any, torch.Tensor], torch.Tensor]
    native: int | None
    xla: bool
    salted: bool
    all_right: Callable[[str, list[Any], list[torch.Tensor]], bool] | None = None


def encoded_all_right(container: type, xs: list[Any], expected: list[tuple[Any, ...]]) -> bool:
    """``StateFormat.all_right`` of an encoded format: every ``x`` exactly a ``container``
    (``codes``, ``scale``) whose ``(codes dtype, codes shape, codes device, scale dtype,
    scale shape)`` is ``expected``'s, the scale on the codes' device, both contiguous."""
    try:
        return (
            set(map(type, xs)) == {container}
            and [
                (x.codes.dtype, x.codes.shape, x.codes.device, x.scale.dtype, x.scale.shape)
                for x in xs
            ]
            == expected
            and all(
                [
                    x.scale.device == x.codes.device
                    and x.codes.is_contiguous()
                    and x.scale.is_contiguous()
                    for x in xs
                ]
            )
        )
    except AttributeError:  # a field that is not a tensor: ``problem`` says which
        return False


def keys(steps: list[torch.Tensor], salts: list[int]) -> list[torch.Tensor]:
    """The draw key of each leaf at this step: its step count (exact in fp32 below 2**24)
    mixed with a per-leaf salt. A Python-int salt traces as a constant: no transfer. On XLA
    the keys are mixed as one stacked vector (a few traced ops per leaf, not a dozen)."""
    pre = [t.to(torch.int32).mul(_rng._GOLDEN).add_(_rng.wrap(s)) for t, s in zip(steps, salts)]
    if len(pre) > 1 and pre[0].device.type == "xla":
        return list(_rng._mix(torch.stack(pre)).unbind(0))
    return [_rng._mix(k) for k in pre]


def in_compute(values: list[torch.Tensor], compute: torch.dtype) -> list[torch.Tensor]:
    """A format's loaded moments in the step's ``compute`` dtype: themselves where they are
    in it already (a float state of that dtype is then stepped in place), else converted.
    A float64 master's step (``"fp32"`` or ``"none"``) computes in float64: float32 and
    bf16 moments and decoded 8/4-bit ones widen exactly (``store_codes`` narrows the
    latter back to float32 before encoding)."""
    if not values or values[0].dtype == compute:
        return values
    return [v.to(compute) for v in values]


def store_codes(
    encode_list_: Callable[..., Any],
    xs: list[Any],
    values: list[torch.Tensor],
    kind: str,
    skip: torch.Tensor | None,
    steps: list[torch.Tensor] | None,
    salts: list[int],
) -> None:
    """A quantized format's store: ``encode_list_(values, xs, noises=)`` writes codes and
    scales (second moments, ``"square"``, rounded stochastically with the draws of
    ``keys(steps, salts)``), and where ``skip`` is set every code and scale keeps its old
    bits."""
    noises: list[torch.Tensor | None] | None = None
    if kind == "square" and steps is not None:
        noises = list(_rng.uniform_list(keys(steps, salts), [v.shape for v in values]))
    old = [(q.codes.clone(), q.scale.clone()) for q in xs] if skip is not None else []
    # The codec reads float32 (a float64 master's moments, computed in float64, round to
    # nearest first, as a float32 or bfloat16 state's ``Tensor.to`` rounds them).
    encode_list_([v.float().contiguous() for v in values], xs, noises=noises)
    if skip is not None:
        codes = [torch.where(skip, c, q.codes) for (c, _), q in zip(old, xs)]
        scales = [torch.where(skip, s, q.scale) for (_, s), q in zip(old, xs)]
        torch._foreach_copy_([q.codes for q in xs], codes)
        torch._foreach_copy_([q.scale for q in xs], scales)


def whole_blocks(fn: str, side: _checks.Side, faces: list[Any], block: int, key: str) -> None:
    """A blockwise format's ``check_init``: every leaf holds at least one whole block. A
    smaller one (a 3-element bias, a 0-d temperature) would spend a scale on a handful
    of bytes for no saving worth having, so it gets a clear error that points to
    ``partition`` with the optimizer ``fn`` belongs to (``"lion.init"``: ``mpfunc.lion``),
    before anything is made."""
    name = fn.split(".", 1)[0] if fn.endswith(".init") else "adamw"
    cls = _dtensor.dtensor_type()
    for i, f in enumerate(faces):
        if cls is not None and isinstance(f, cls):
            # Codes and block scales follow the element index of a whole tensor: a shard's
            # blocks would need the shard's own layout (not built), and the plain full-size
            # state it got failed inside the step, after writes.
            _checks.fail(
                TypeError, fn, side.path(i),
                f"a plain tensor for state_dtype={key}",
                _dtensor.describe_sharding(f),
                "Encoded moments of DTensor (FSDP2) shards are not supported: use "
                "state_dtype=torch.bfloat16 or None for them (mpfunc.partition can mix)",
            )  # fmt: skip
        if f is not None and f.numel() < block:
            _checks.fail(
                ValueError, fn, side.path(i),
                f"a leaf of at least {block} elements for state_dtype={key}",
                f"{f.numel()} elements",
                f"Keep small leaves in fp32 state: mpfunc.partition({{'big': "
                f"mpfunc.{name}(..., state_dtype={key}), 'small': mpfunc.{name}(...)}}, labels) "
                f"with labels from a function such as lambda path, p: 'big' if p.numel() >= "
                f"4096 else 'small'",
            )  # fmt: skip

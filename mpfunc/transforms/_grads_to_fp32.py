"""``grads_to_fp32`` and ``grads_to_fp32_``: low-precision grads into full precision."""

from __future__ import annotations

from typing import Any

import torch

from mpfunc.backends import _plan
from mpfunc.core import _checks, _dtensor, _gc, _tensors, _tree
from mpfunc.core._checks import Like
from mpfunc.transforms import _loss_scale
from mpfunc.transforms._init_master import master_dtype_for
from mpfunc.transforms._loss_scale import ScaleArg

__all__ = ["grads_to_fp32", "grads_to_fp32_"]

_FLOATING = "a floating-point grad"
_HINT = "Non-floating parameters have no master and take no grad; pass None there"
_OUT = Like(
    "the grad's", dtypes=_checks.MASTER_DTYPES, what="a float32 or float64 tensor", spare=True
)


def _check_grads(fn: str, grads: Any) -> tuple[_checks.Side, Any]:
    leaves, spec = _tree.flatten(grads)
    side = _checks.Side("grads", grads, leaves)
    _check_grad_leaves(fn, side)
    return side, spec


def _check_grad_leaves(fn: str, side: _checks.Side) -> None:
    """Every leaf is ``None`` or a dense floating-point tensor, not tracked by torch.func."""
    _checks.check_dense(fn, side)
    _checks.check_not_differentiated(fn, side)
    for i, g in enumerate(side.leaves):
        if g is not None and g.dtype not in _checks.FLOAT_DTYPES:
            _checks.fail(TypeError, fn, side.path(i), _FLOATING, _checks.describe(g), _HINT)


def _check_not_narrowed(
    fn: str, side: _checks.Side, dtypes: list[torch.dtype | None], hint: str
) -> None:
    """A float64 grad cast into float32 would lose its low bits without a word, as a
    float32 master of a float64 param would (``init_master`` refuses that too)."""
    for i, (g, d) in enumerate(zip(side.leaves, dtypes)):
        if g is not None and d is not None and g.itemsize > d.itemsize:
            _checks.fail(
                ValueError, fn, side.path(i), f"a grad no wider than its {d} result",
                _checks.describe(g), hint,
            )  # fmt: skip


def _unscale_(tensors: list[torch.Tensor], value: torch.Tensor | None) -> None:
    """Divides the full-precision grads by the loss scale (if any), one foreach call per
    device, in the grads' precision (after the upcast, so nothing is lost)."""
    if value is None:
        return
    tensors = _dtensor.locals_(tensors)
    keys: list[tuple[object, ...] | None] = [(t.device,) for t in tensors]
    for (device,), idx in _tensors.group_indices(keys).items():
        assert isinstance(device, torch.device)
        torch._foreach_div_(_tensors.pick(tensors, idx), value.to(device, non_blocking=True))


@_gc.without_gc
def grads_to_fp32(grads: Any, dtype: torch.dtype | None = None, *, scale: ScaleArg = None) -> Any:
    """Returns a new tree with every grad cast to full precision.

    The cast is exact: every bf16/fp16 value is representable in fp32. Each result
    keeps its grad's memory layout. ``None`` grads (parameters that took no
    gradient) stay ``None``. With ``scale``, the grads are also divided by the loss
    scale in full precision, with no host read.

    Args:
      grads: a tree of floating-point tensors or ``None``, e.g.
        ``{n: p.grad for n, p in model.named_parameters()}``.
      dtype: ``None`` (default: float32, float64 for float64 grads, as ``init_master``),
        or ``torch.float32``/``torch.float64``.
      scale: ``None``, a ``StaticLossScale``/``DynamicLossScale``, a float > 0 or a 0-d
        tensor: the loss scale to divide out.

    Returns:
      A tree of ``grads``' structure with fresh tensors.

    Raises:
      TypeError: a leaf is not a dense tensor or ``None``, or a grad is not floating point.
      ValueError: ``dtype`` is not float32 or float64, or is narrower than a grad
        (float32 for a float64 grad), or ``scale`` is not positive.
    """
    fn = "grads_to_fp32"
    dtype = _checks.master_dtype(fn, dtype)
    divisor = _loss_scale.scale_value(fn, scale)
    side, spec = _check_grads(fn, grads)
    if dtype is not None:
        _check_not_narrowed(
            fn, side, [dtype] * len(side.leaves),
            "Leave dtype=None: a float64 grad then stays float64, as its master",
        )  # fmt: skip
    with torch.no_grad():
        out = [
            None if g is None else _tensors.fresh_copy(g, master_dtype_for(g, dtype))
            for g in side.leaves
        ]
        _unscale_([t for t in out if t is not None], divisor)
    return _tree.unflatten(spec, out)


@_gc.without_gc
def grads_to_fp32_(grads: Any, out: Any, *, scale: ScaleArg = None) -> Any:
    """Copies ``grads`` into the preallocated full-precision tree ``out``, in place.

    Allocates nothing: each grad is written into ``out``'s matching tensor with
    one foreach copy per (device, dtype) group, element by element whatever the two
    layouts are. Where a grad is ``None``, ``out``'s tensor is left untouched and the
    returned tree holds ``None``, so a parameter without a grad is skipped by
    ``apply_update`` exactly as torch.optim skips it.

    Args:
      grads: a tree of floating-point tensors or ``None``.
      out: a tree of ``grads``' structure holding float32/float64 tensors of the
        grads' shapes and devices, e.g. from ``init_grads(params)``. It may hold
        ``None`` where ``grads`` does.
      scale: as in ``grads_to_fp32``: the loss scale to divide out.

    Returns:
      A tree of ``grads``' structure holding ``out``'s tensors, ``None`` where the
      grad is ``None``. Use it as the ``grads`` argument of ``apply_update``.

    Raises:
      TypeError: a leaf is not a dense tensor or ``None``, a grad is not floating point,
        or an ``out`` tensor is not float32/float64.
      ValueError: the trees differ in structure, a shape or device differs, an ``out``
        tensor is narrower than its grad (float32 for a float64 grad) or is expanded, or two
        leaves share memory.
      Nothing is written unless every check passes.
    """
    fn = "grads_to_fp32_"
    memo = _checks.recall(fn, [("grads", grads), ("out", out)])
    (g, o), (g_spec, o_spec) = memo.sides, memo.specs
    if not memo.hit:
        _check_grad_leaves(fn, g)
        _checks.check_dense(fn, o)
        _checks.check_same_structure(fn, "grads", grads, g_spec, "out", out, o_spec)
        _checks.check_pairs(fn, g, o, _OUT)
        _check_not_narrowed(
            fn, g, [None if t is None else t.dtype for t in o.leaves],
            "Give it a float64 out tensor (init_grads(params) makes one for a float64 param)",
        )  # fmt: skip
        # Only the out tensors that receive a grad are written (positions kept, for paths).
        written = o.where_present(g.leaves)
        _checks.check_writable(fn, [written])
        _checks.check_no_alias(fn, written=[written], read=[g])
        memo.passed()
    divisor = _loss_scale.scale_value(fn, scale)  # checked before any write
    pairs = [(d, s) for d, s in zip(o.leaves, g.leaves) if s is not None]
    dst = [d for d, _ in pairs]
    _plan.copy_grouped_(dst, [s for _, s in pairs])
    with torch.no_grad():
        _unscale_(dst, divisor)
    return _tree.unflatten(g_spec, [None if s is None else d for d, s in zip(o.leaves, g.leaves)])

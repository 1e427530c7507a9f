"""``grads_to_fp32`` and ``grads_to_fp32_``: low-precision grads into full precision."""

from __future__ import annotations

from typing import Any

import torch

from mpfunc import _checks, _dtypes, _grouping, _loss_scale, _tree
from mpfunc._loss_scale import ScaleArg

__all__ = ["grads_to_fp32", "grads_to_fp32_"]


def _check_grads(fn: str, grads: Any, leaves: list[Any]) -> None:
    _checks.check_tensor_or_none(fn, "grads", grads, leaves)
    for i, g in enumerate(leaves):
        if g is not None and not _dtypes.is_floating(g):
            _checks.fail(
                TypeError,
                fn,
                _tree.leaf_path(grads, i, "grads"),
                "a floating-point grad",
                _checks.describe(g),
                "Non-floating parameters have no master and take no grad; pass None there.",
            )


def _unscale_(tensors: list[torch.Tensor], value: torch.Tensor | None) -> None:
    """Divides the fp32 grads by the loss scale (if any), one foreach call per device."""
    if value is None:
        return
    keys: list[tuple[object, ...] | None] = [(t.device,) for t in tensors]
    for (device,), idx in _grouping.group_indices(keys).items():
        assert isinstance(device, torch.device)
        torch._foreach_div_([tensors[i] for i in idx], value.to(device, non_blocking=True))


@_tree.without_gc
def _explain_out(fn: str, grads: Any, g_leaves: list[Any], out: Any, o_leaves: list[Any]) -> None:
    """Raises the error for the first leaf at fault in ``grads_to_fp32_``'s inputs."""
    _check_grads(fn, grads, g_leaves)
    _checks.check_tensor_or_none(fn, "out", out, o_leaves)
    for i, (g, o) in enumerate(zip(g_leaves, o_leaves)):
        if g is None:
            continue
        where = _tree.leaf_path(out, i, "out")
        if o is None:
            _checks.fail(ValueError, fn, where, "a tensor to copy the grad into", "None")
        if o.dtype not in _dtypes.MASTER_DTYPES:
            _checks.fail(TypeError, fn, where, "a float32 or float64 tensor", _checks.describe(o))
        if o.shape != g.shape:
            _checks.fail(
                ValueError, fn, where, f"shape {tuple(g.shape)} (the grad's)",
                f"shape {tuple(o.shape)}",
            )  # fmt: skip
        if o.device != g.device:
            _checks.fail(
                ValueError, fn, where, f"device {g.device} (the grad's)", f"device {o.device}"
            )


@_tree.without_gc
def grads_to_fp32(grads: Any, dtype: torch.dtype = torch.float32, *, scale: ScaleArg = None) -> Any:
    """Returns a new tree with every grad cast to ``dtype`` (fp32 by default).

    The cast is exact: every bf16/fp16 value is representable in fp32.
    ``None`` grads (parameters that took no gradient) stay ``None``. With ``scale``,
    the grads are also divided by the loss scale in fp32 (after the upcast, so
    nothing is lost to low-precision rounding), with no host read.

    Args:
      grads: a tree of floating-point tensors or ``None``, e.g.
        ``{n: p.grad for n, p in model.named_parameters()}``.
      dtype: ``torch.float32`` (default) or ``torch.float64``.
      scale: ``None``, a ``StaticLossScale``/``DynamicLossScale``, a float > 0 or a 0-d
        tensor: the loss scale to divide out.

    Returns:
      A tree of ``grads``' structure with fresh tensors of ``dtype``.

    Raises:
      TypeError: a leaf is not a tensor or ``None``, or a grad is not floating point.
      ValueError: ``dtype`` is not float32 or float64, or ``scale`` is not positive.
    """
    fn = "grads_to_fp32"
    dtype = _dtypes.check_master_dtype(fn, dtype)
    divisor = _loss_scale.scale_value(fn, scale)
    leaves, spec = _tree.flatten(grads)
    _check_grads(fn, grads, leaves)
    with torch.no_grad():
        out = [None if g is None else g.detach().to(dtype=dtype, copy=True) for g in leaves]
        _unscale_([t for t in out if t is not None], divisor)
    return _tree.unflatten(spec, out)


@_tree.without_gc
def grads_to_fp32_(grads: Any, out: Any, *, scale: ScaleArg = None) -> Any:
    """Copies ``grads`` into the preallocated full-precision tree ``out``, in place.

    Allocates nothing: each grad is written into ``out``'s matching tensor with
    one foreach copy per (device, dtype) group. Where a grad is ``None``, ``out``'s
    tensor is left untouched and the returned tree holds ``None``, so a parameter
    without a grad is skipped by ``apply_update`` exactly as torch.optim skips it.

    Args:
      grads: a tree of floating-point tensors or ``None``.
      out: a tree of ``grads``' structure holding float32/float64 tensors of the
        grads' shapes and devices, e.g. from ``init_master(params)``. It may hold
        ``None`` where ``grads`` does.
      scale: as in ``grads_to_fp32``: the loss scale to divide out.

    Returns:
      A tree of ``grads``' structure holding ``out``'s tensors, ``None`` where the
      grad is ``None``. Use it as the ``g32`` argument of ``apply_update``.

    Raises:
      TypeError: a leaf is not a tensor or ``None``, a grad is not floating point, or
        an ``out`` tensor is not float32/float64.
      ValueError: the trees differ in structure, or a shape or device differs.
      Nothing is written unless every check passes.
    """
    fn = "grads_to_fp32_"
    g_leaves, g_spec = _tree.flatten(grads)
    o_leaves, o_spec = _tree.flatten(out)
    _checks.check_same_structure(fn, "grads", grads, g_spec, "out", out, o_spec)
    # One pass for the common case; on any doubt, _explain_out names the culprit.
    dst: list[torch.Tensor] = []
    src: list[torch.Tensor] = []
    keys: list[tuple[object, ...] | None] = []
    Tensor, masters_dtypes = torch.Tensor, _dtypes.MASTER_DTYPES
    for g, o in zip(g_leaves, o_leaves):
        if g is None:
            continue
        if not (
            isinstance(g, Tensor)
            and isinstance(o, Tensor)
            and g.is_floating_point()
            and o.dtype in masters_dtypes
            and o.shape == g.shape
            and o.device == g.device
        ):
            _explain_out(fn, grads, g_leaves, out, o_leaves)
        dst.append(o)
        src.append(g)
        keys.append((o.device, o.dtype, g.dtype))
    divisor = _loss_scale.scale_value(fn, scale)  # checked before any write
    _grouping.copy_grouped_(dst, src, keys)
    with torch.no_grad():
        _unscale_(dst, divisor)
    return _tree.unflatten(g_spec, [None if g is None else o for g, o in zip(g_leaves, o_leaves)])

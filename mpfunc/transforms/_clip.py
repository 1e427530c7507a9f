"""``clip_by_global_norm`` and its in-place twin: sync-free global-norm clipping."""

from __future__ import annotations

import math
from typing import Any, Union

import torch

from mpfunc.core import _checks, _dtensor, _gc, _tensors, _tree
from mpfunc.transforms import _step_in_backward

__all__ = ["clip_by_global_norm", "clip_by_global_norm_"]

MaxNorm = Union[float, torch.Tensor]


def _check_max_norm(fn: str, max_norm: object) -> MaxNorm:
    if isinstance(max_norm, torch.Tensor):
        if max_norm.ndim != 0 or not max_norm.is_floating_point():
            raise TypeError(
                f"{fn}: max_norm: expected a float > 0 or a 0-d float tensor, got "
                f"{_checks.describe(max_norm)}"
            )
        return max_norm
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)):
        raise TypeError(f"{fn}: max_norm: expected a float > 0, got {type(max_norm).__name__}")
    value = float(max_norm)
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{fn}: max_norm: expected a finite float > 0, got {value}")
    return value


def _checked(fn: str, g32: Any, max_norm: object) -> tuple[list[Any], Any, MaxNorm]:
    max_norm = _check_max_norm(fn, max_norm)
    flat = _tree.flatten(g32)
    _step_in_backward.refuse_clip(fn, flat[0])  # grads the step inside backward freed
    side, spec = _checks.tensor_leaves(fn, "grads", g32, flat)
    _checks.check_leaf_dtypes(fn, side, _checks.FLOAT_DTYPES, "a floating-point grad")
    if fn.endswith("_"):  # the in-place twin writes the grads
        _checks.check_writable(fn, [side])
        _checks.check_no_alias(fn, written=[side])
    return side.leaves, spec, max_norm


def _norm_and_coef(
    leaves: list[Any], max_norm: MaxNorm
) -> tuple[torch.Tensor, dict[tuple[object, ...], list[int]], torch.Tensor]:
    """The global 2-norm and the clip coefficient min(1, max_norm / (norm + 1e-6)),
    computed as torch.nn.utils.clip_grad_norm_ computes them: per-(device, dtype)
    ``_foreach_norm``, then the norm of the stacked norms, all on the device."""
    keys: list[tuple[object, ...] | None] = [
        None if g is None else (g.device, g.dtype, _dtensor.sharding_key(g)) for g in leaves
    ]
    groups = _tensors.group_indices(keys)
    norms: list[torch.Tensor] = []
    for (_, _, sharded), idx in groups.items():
        group_norms = torch._foreach_norm([leaves[i] for i in idx], 2.0)
        if sharded is None:
            norms.extend(group_norms)
        else:  # DTensors: the group's norm, reduced across the mesh, as a plain tensor
            norms.append(_dtensor.full(torch.linalg.vector_norm(torch.stack(group_norms), 2.0)))
    if not norms:
        total = torch.zeros((), dtype=torch.float32)
    else:
        first = norms[0].device
        total = torch.linalg.vector_norm(torch.stack([n.to(first) for n in norms]), 2.0)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    return total, groups, coef


@_gc.without_gc
def clip_by_global_norm(g32: Any, max_norm: float | torch.Tensor) -> tuple[Any, torch.Tensor]:
    """Scales all grads down together so that their global 2-norm is at most ``max_norm``.

    Returns ``(clipped, total_norm)``: new grads ``g * min(1, max_norm / (norm + 1e-6))``
    and the norm before clipping, a 0-d tensor on the device. The same arithmetic as
    ``torch.nn.utils.clip_grad_norm_``, and no host read. Clip unscaled grads: call
    it after ``grads_to_fp32(grads, scale=...)``. Decide a skip from the grads before
    clipping (``all_finite(g32)``) or from ``torch.isfinite(total_norm)``, not from the
    clipped grads: with an inf grad the coefficient is 0, so finite grads become 0 and
    the inf becomes NaN, and finite grads whose squares overflow fp32 give an inf norm
    and all-zero clipped grads. A 0-d tensor ``max_norm`` is not range-checked
    (that would read it on the host); a negative one flips the grads' sign.

    Args:
      g32: a tree of floating grads (usually fp32) or ``None``.
      max_norm: a finite float > 0, or a 0-d tensor.

    Returns:
      ``(clipped_g32, total_norm)``.

    Raises:
      TypeError: a leaf is not a floating tensor or ``None``, or ``max_norm`` has the
        wrong type.
      ValueError: ``max_norm`` is not a finite float > 0.
    """
    leaves, spec, max_norm = _checked("clip_by_global_norm", g32, max_norm)
    with torch.no_grad():
        total, groups, coef = _norm_and_coef(leaves, max_norm)
        out: list[Any] = list(leaves)
        for (device, _, _), idx in groups.items():
            assert isinstance(device, torch.device)
            group = [leaves[i] for i in idx]
            local = _dtensor.locals_(group)
            c = coef.to(device)
            scaled = list(torch._foreach_mul(local, c))
            # A 0-d grad times the 0-d coefficient promotes to the coefficient's dtype: those
            # are scaled as the in-place twin (and torch's clip) scales them, in place on a
            # copy, which keeps the grad's dtype and rounds as it does.
            promoted = [k for k, (g, t) in enumerate(zip(local, scaled)) if t.dtype != g.dtype]
            if promoted:
                copies = [local[k].clone() for k in promoted]
                torch._foreach_mul_(copies, c)
                for k, t in zip(promoted, copies):
                    scaled[k] = t
            for i, g, t in zip(idx, group, scaled):
                out[i] = _dtensor.wrap_like(g, t)
    return _tree.unflatten(spec, out), total


@_gc.without_gc
def clip_by_global_norm_(g32: Any, max_norm: float | torch.Tensor) -> tuple[Any, torch.Tensor]:
    """``clip_by_global_norm`` in place: the grads are scaled where they are.

    Returns:
      ``(g32, total_norm)``, the same tree.

    Raises:
      TypeError, ValueError: as ``clip_by_global_norm``; nothing is written then.
    """
    leaves, _, max_norm = _checked("clip_by_global_norm_", g32, max_norm)
    with torch.no_grad():
        total, groups, coef = _norm_and_coef(leaves, max_norm)
        for (device, _, _), idx in groups.items():
            assert isinstance(device, torch.device)
            torch._foreach_mul_(_dtensor.locals_([leaves[i] for i in idx]), coef.to(device))
    return g32, total

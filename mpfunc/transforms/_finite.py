"""``all_finite``: one device-side flag for a whole tree."""

from __future__ import annotations

from typing import Any

import torch

from mpfunc.core import _checks, _dtensor, _gc, _tensors

__all__ = ["all_finite"]


@_gc.without_gc
def all_finite(tree: Any) -> torch.Tensor:
    """Returns a 0-d bool tensor, on the tree's device, that is true iff no floating
    leaf holds an inf or a NaN. Nothing is read back to the host.

    On eager devices each (device, dtype) group takes one
    ``torch._foreach_norm(..., inf)``: the largest magnitude is inf for an inf and
    NaN for a NaN, and unlike a 2-norm it cannot overflow on large finite values,
    and it allocates nothing model-sized. On XLA, whose max reduction drops NaN,
    ``isfinite(t).all()`` per tensor, which fuses into the step's graph.
    Complex leaves are checked in both parts, float8 leaves widened to float32 a leaf at
    a time. Integer and bool leaves and ``None``
    count as finite; so does an empty tree (then the flag lives on the CPU).

    Args:
      tree: a tree of tensors or ``None``.

    Returns:
      A 0-d ``torch.bool`` tensor on the device of the tree's first floating leaf (of
      its first tensor leaf if none holds elements; the CPU for a tree without tensors).

    Raises:
      TypeError: a leaf is not a tensor or ``None``.

    Example::

      finite = mpfunc.all_finite(g32)
      masters, state = mpfunc.apply_update_(masters, g32, state, opt, skip=~finite)
    """
    leaves = _checks.tensor_leaves("all_finite", "tree", tree)[0].leaves
    keys: list[tuple[object, ...] | None] = [
        (t.device, t.dtype, _dtensor.sharding_key(t))
        if t is not None and (t.is_floating_point() or t.is_complex()) and t.numel()
        else None
        for t in leaves
    ]
    flags: list[torch.Tensor] = []
    for (device, dtype, _), idx in _tensors.group_indices(keys).items():
        assert isinstance(device, torch.device) and isinstance(dtype, torch.dtype)
        group = [leaves[i] for i in idx]
        if dtype.is_complex:
            # Finite where both parts are, checked as the real view (a complex NaN counted
            # as finite, as a non-floating leaf does).
            group = [torch.view_as_real(t) for t in group]
        if dtype.itemsize == 1:
            # float8 (torch implements neither the norm nor isfinite for most of them):
            # widened to float32, exactly, a leaf at a time.
            flags.append(torch.stack([torch.isfinite(t.float()).all() for t in group]).all())
        elif _tensors.is_lazy(device):
            # XLA's max reduction does not propagate NaN, so the inf-norm would miss
            # one; isfinite(...).all() fuses into the step's graph instead.
            flags.append(torch.stack([torch.isfinite(t).all() for t in group]).all())
        else:
            norms = torch._foreach_norm(group, float("inf"))
            # One group shares one dtype: isfinite in that dtype, never after a cast
            # (a finite float64 above 3.4e38 would become inf in float32).
            flags.append(torch.stack(norms).isfinite().all())
    if not flags:
        device = next((t.device for t in leaves if t is not None), torch.device("cpu"))
        return torch.ones((), dtype=torch.bool, device=device)
    # DTensors: each flag reduced across the mesh, a plain tensor equal on every rank.
    flags = [_dtensor.full(f) for f in flags]
    first = flags[0]
    for f in flags[1:]:
        first = first & f.to(first.device)
    return first

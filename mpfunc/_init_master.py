"""``init_master``: fresh full-precision copies of a parameter tree."""

from __future__ import annotations

from typing import Any

import torch

from mpfunc import _checks, _tree
from mpfunc._checks import Side
from mpfunc._plan import fresh_copy

__all__ = ["check_params", "init_master", "master_dtype_for"]


def master_dtype_for(t: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    """A leaf's master dtype: ``dtype`` if given, else float32, or float64 for a float64
    leaf. Never narrower than the leaf: a float64 param with a float32 master would lose
    its low bits at the first write back."""
    if dtype is not None:
        return dtype
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def check_params(fn: str, side: Side, dtype: torch.dtype | None) -> None:
    """Refuses what has no faithful master: complex params (mpfunc does not split them
    into real and imaginary parts; a silent ``None`` would never train them), a
    master dtype narrower than its param, and two leaves sharing memory."""
    for i, p in enumerate(side.leaves):
        if p is None:
            continue
        if p.is_complex():
            _checks.fail(
                TypeError, fn, side.path(i), "a real tensor (complex parameters get no master)",
                _checks.describe(p), "Train complex parameters with torch.optim, or hold them "
                "as torch.view_as_real pairs",
            )  # fmt: skip
        if dtype is not None and p.is_floating_point() and p.itemsize > dtype.itemsize:
            _checks.fail(
                ValueError, fn, f"{side.path(i)}", f"a param no wider than the {dtype} master",
                _checks.describe(p), "Leave dtype=None: masters are then never narrower",
            )  # fmt: skip
    # Only floating leaves get masters and are written back; int buffers may share memory.
    floating = [p if p is not None and p.is_floating_point() else None for p in side.leaves]
    _checks.check_no_alias(fn, written=[side._replace(leaves=floating)])


def init_master(
    params: Any, dtype: torch.dtype | None = None, *, trainable_only: bool = False
) -> Any:
    """Returns full-precision master copies of every floating leaf of ``params``.

    Each master has the parameter's shape, device and memory layout, in fresh
    storage that shares nothing with the parameter. Leaves that are not floating
    point (int buffers, bool masks) get no master: their slot holds ``None``, and
    every other mpfunc function leaves them alone. ``None`` leaves stay ``None``.
    Masters are detached: the transforms are not differentiable.

    Args:
      params: a tree of tensors (dict, list, tuple, NamedTuple, nested), such as
        ``dict(model.named_parameters())``. ``None`` leaves are allowed. Each tensor
        must appear once: tied weights listed under two names are refused.
      dtype: ``None`` (default: float32 masters, float64 for float64 params), or
        ``torch.float32``/``torch.float64`` for every master.
      trainable_only: if true, params with ``requires_grad=False`` (frozen, e.g. the base
        weights under LoRA) get ``None``: no master, so no optimizer state either.

    Returns:
      A tree of ``params``' structure holding master tensors, or ``None`` where a leaf
      is ``None``, not floating point, or frozen under ``trainable_only``.

    Raises:
      TypeError: a leaf is neither a dense tensor nor ``None``, a leaf is complex, or
        ``dtype`` is not a dtype.
      ValueError: ``dtype`` is not float32 or float64 or is narrower than a param, or
        two leaves share memory (one tensor under two names).

    Example::

      masters = mpfunc.init_master(dict(model.named_parameters()))
    """
    fn = "init_master"
    dtype = _checks.master_dtype(fn, dtype)
    side, spec = _checks.tensor_leaves(fn, "params", params)
    check_params(fn, side, dtype)
    with torch.no_grad():
        masters = [
            fresh_copy(p, master_dtype_for(p, dtype))
            if p is not None and p.is_floating_point() and (p.requires_grad or not trainable_only)
            else None
            for p in side.leaves
        ]
    return _tree.unflatten(spec, masters)

"""``init_master``: fresh full-precision copies of a parameter tree."""

from __future__ import annotations

from typing import Any

import torch

from mpfunc import _checks, _dtypes, _tree

__all__ = ["init_master"]


def init_master(params: Any, dtype: torch.dtype = torch.float32) -> Any:
    """Returns fp32 master copies of every floating leaf of ``params``.

    Each master has the parameter's shape, device and memory layout, in fresh
    storage that shares nothing with the parameter. Leaves that are not floating
    point (int buffers, bool masks) get no master: their slot holds ``None``, and
    every other mpfunc function leaves them alone. ``None`` leaves stay ``None``.

    Args:
      params: a tree of tensors (dict, list, tuple, NamedTuple, nested), such as
        ``dict(model.named_parameters())``. ``None`` leaves are allowed.
      dtype: the masters' dtype, ``torch.float32`` (default) or ``torch.float64``.

    Returns:
      A tree of ``params``' structure holding detached master tensors, or ``None``
      where a leaf is ``None`` or not floating point.

    Raises:
      TypeError: a leaf is neither a tensor nor ``None``, or ``dtype`` is not a dtype.
      ValueError: ``dtype`` is not float32 or float64.

    Example::

      masters = mpfunc.init_master(dict(model.named_parameters()))
    """
    fn = "init_master"
    dtype = _dtypes.check_master_dtype(fn, dtype)
    leaves, spec = _tree.flatten(params)
    _checks.check_tensor_or_none(fn, "params", params, leaves)
    with torch.no_grad():
        masters = [
            p.detach().to(dtype=dtype, copy=True)
            if p is not None and _dtypes.is_floating(p)
            else None
            for p in leaves
        ]
    return _tree.unflatten(spec, masters)

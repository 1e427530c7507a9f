"""fp32 gradient accumulation across micro-batches: ``init_grads``, ``accumulate_grads(_)``."""

from __future__ import annotations

from typing import Any

import torch

from mpfunc.core import _checks, _dtensor, _gc, _tensors, _tree
from mpfunc.core._checks import Like, Side
from mpfunc.parallel import _sharding
from mpfunc.transforms._init_master import check_params, master_dtype_for

__all__ = ["accumulate_grads", "accumulate_grads_", "init_grads"]

_SAME_LAYOUT = torch.preserve_format  # grads pair with masters element by element
_ACC = Like(
    "the grad's", dtypes=_checks.MASTER_DTYPES, what="a float32 or float64 tensor", spare=True
)


def init_grads(params: Any, dtype: torch.dtype | None = None) -> Any:
    """Returns zeros in full precision shaped like every floating leaf of ``params``,
    in each leaf's memory layout: the accumulator for ``accumulate_grads_``, or the
    ``out`` of ``grads_to_fp32_``. Non-floating leaves and ``None`` give ``None``.

    Args:
      params: the parameter tree.
      dtype: ``None`` (float32, float64 for float64 params, as ``init_master``), or
        ``torch.float32``/``torch.float64``.

    Raises:
      TypeError: a leaf is not a dense tensor or ``None``, or is complex.
      ValueError: ``dtype`` is not float32 or float64, or is narrower than a param.
    """
    fn = "init_grads"
    dtype = _checks.master_dtype(fn, dtype)
    side, spec = _checks.tensor_leaves(fn, "params", params)
    check_params(fn, side, dtype)
    return _tree.unflatten(
        spec,
        [
            _sharding.like_(
                torch.zeros_like(
                    p, dtype=master_dtype_for(p, dtype), memory_format=torch.preserve_format
                ),
                p,
            )
            if p is not None and p.is_floating_point()
            else None
            for p in side.leaves
        ],
    )


def _check(fn: str, acc: Any, grads: Any, in_place: bool) -> tuple[Side, Side, Any]:
    a, a_spec = _checks.tensor_leaves(fn, "acc", acc)
    g, g_spec = _checks.tensor_leaves(fn, "grads", grads)
    _checks.check_same_structure(fn, "acc", acc, a_spec, "grads", grads, g_spec)
    _checks.check_leaf_dtypes(fn, g, _checks.FLOAT_DTYPES, "a floating-point grad")
    _checks.check_pairs(fn, g, a, _ACC)
    if in_place:
        written = a._replace(
            leaves=[x if y is not None else None for x, y in zip(a.leaves, g.leaves)]
        )
        _checks.check_writable(fn, [written])
        _checks.check_no_alias(fn, written=[written], read=[g])
    return a, g, a_spec


def _add_(acc: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
    # acc += grad, computed in the accumulator's precision: the low-precision grad is
    # upcast exactly, so only the fp32 addition rounds. Elements pair by index.
    acc, grads = _dtensor.locals_(acc), _dtensor.locals_(grads)
    keys: list[tuple[object, ...] | None] = [
        (a.device, a.dtype, g.dtype) for a, g in zip(acc, grads)
    ]
    for idx in _tensors.group_indices(keys).values():
        torch._foreach_add_(_tensors.pick(acc, idx), _tensors.pick(grads, idx))


@_gc.without_gc
def accumulate_grads(acc: Any, grads: Any) -> Any:
    """Returns ``acc + grads`` in ``acc``'s precision (fp32); ``acc`` is not modified.

    Where a grad is ``None`` the accumulator is carried over unchanged.

    Raises:
      TypeError, ValueError: the trees differ, or a leaf has the wrong dtype, shape
        or device.
    """
    a, g, spec = _check("accumulate_grads", acc, grads, in_place=False)
    with torch.no_grad():
        out: list[Any] = [
            x if x is None else x.detach().clone(memory_format=torch.preserve_format)
            for x in a.leaves
        ]
        pairs = [(o, y) for o, y in zip(out, g.leaves) if y is not None]
        _add_([o for o, _ in pairs], [y for _, y in pairs])
    return _tree.unflatten(spec, out)


@_gc.without_gc
def accumulate_grads_(acc: Any, grads: Any) -> Any:
    """Adds ``grads`` (bf16/fp16/fp32) into the fp32 accumulator ``acc``, in place.

    Accumulating micro-batch grads in fp32 matches one large fp32 batch far more
    closely than summing them in bf16, where small contributions round away.

    Example::

      acc = mpfunc.init_grads(params)
      for x, y in micro_batches:
          (loss_fn(model(x).float(), y) / len(micro_batches)).backward()
          mpfunc.accumulate_grads_(acc, {n: p.grad for n, p in params.items()})
          model.zero_grad(set_to_none=True)
      mpfunc.apply_update_(masters, acc, state, opt)

    Returns:
      ``acc``.

    Raises:
      TypeError, ValueError: as ``accumulate_grads``, or an accumulator is expanded or
        shares memory with another leaf; nothing is written then.
    """
    a, g, _ = _check("accumulate_grads_", acc, grads, in_place=True)
    pairs = [(x, y) for x, y in zip(a.leaves, g.leaves) if y is not None]
    with torch.no_grad():
        _add_([x for x, _ in pairs], [y for _, y in pairs])
    return acc

"""fp32 gradient accumulation across micro-batches: ``init_grads``, ``accumulate_grads(_)``."""

from __future__ import annotations

from typing import Any

import torch

from mpfunc import _checks, _dtypes, _grouping, _tree

__all__ = ["accumulate_grads", "accumulate_grads_", "init_grads"]


def init_grads(params: Any, dtype: torch.dtype = torch.float32) -> Any:
    """Returns zeros in ``dtype`` (fp32) shaped like every floating leaf of ``params``:
    the accumulator for ``accumulate_grads_``, or the ``out`` of ``grads_to_fp32_``.
    Non-floating leaves and ``None`` give ``None``.

    Raises:
      TypeError: a leaf is not a tensor or ``None``.
      ValueError: ``dtype`` is not float32 or float64.
    """
    fn = "init_grads"
    dtype = _dtypes.check_master_dtype(fn, dtype)
    leaves, spec = _tree.flatten(params)
    _checks.check_tensor_or_none(fn, "params", params, leaves)
    return _tree.unflatten(
        spec,
        [
            torch.zeros(p.shape, dtype=dtype, device=p.device)
            if p is not None and p.is_floating_point()
            else None
            for p in leaves
        ],
    )


def _check(fn: str, acc: Any, grads: Any) -> tuple[list[Any], list[Any], Any]:
    a_leaves, a_spec = _tree.flatten(acc)
    g_leaves, g_spec = _tree.flatten(grads)
    _checks.check_same_structure(fn, "acc", acc, a_spec, "grads", grads, g_spec)
    _checks.check_tensor_or_none(fn, "acc", acc, a_leaves)
    _checks.check_tensor_or_none(fn, "grads", grads, g_leaves)
    for i, (a, g) in enumerate(zip(a_leaves, g_leaves)):
        if g is None:
            continue
        if not g.is_floating_point():
            _checks.fail(
                TypeError, fn, _tree.leaf_path(grads, i, "grads"), "a floating-point grad",
                _checks.describe(g),
            )  # fmt: skip
        if a is None or a.dtype not in _dtypes.MASTER_DTYPES:
            _checks.fail(
                TypeError, fn, _tree.leaf_path(acc, i, "acc"), "a float32 or float64 tensor",
                _checks.describe(a),
            )  # fmt: skip
        if a.shape != g.shape or a.device != g.device:
            _checks.fail(
                ValueError, fn, _tree.leaf_path(acc, i, "acc"),
                f"shape {tuple(g.shape)} on {g.device} (the grad's)", _checks.describe(a),
            )  # fmt: skip
    return a_leaves, g_leaves, a_spec


def _add_(acc: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
    # acc += grad, computed in the accumulator's precision: the low-precision grad is
    # upcast exactly, so only the fp32 addition rounds.
    keys: list[tuple[object, ...] | None] = [
        (a.device, a.dtype, g.dtype) for a, g in zip(acc, grads)
    ]
    for idx in _grouping.group_indices(keys).values():
        torch._foreach_add_([acc[i] for i in idx], [grads[i] for i in idx])


@_tree.without_gc
def accumulate_grads(acc: Any, grads: Any) -> Any:
    """Returns ``acc + grads`` in ``acc``'s precision (fp32); ``acc`` is not modified.

    Where a grad is ``None`` the accumulator is carried over unchanged.

    Raises:
      TypeError, ValueError: the trees differ, or a leaf has the wrong dtype, shape
        or device.
    """
    a_leaves, g_leaves, spec = _check("accumulate_grads", acc, grads)
    with torch.no_grad():
        out: list[Any] = [a if a is None else a.clone() for a in a_leaves]
        pairs = [(o, g) for o, g in zip(out, g_leaves) if g is not None]
        _add_([o for o, _ in pairs], [g for _, g in pairs])
    return _tree.unflatten(spec, out)


@_tree.without_gc
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
      TypeError, ValueError: as ``accumulate_grads``; nothing is written then.
    """
    a_leaves, g_leaves, _ = _check("accumulate_grads_", acc, grads)
    pairs = [(a, g) for a, g in zip(a_leaves, g_leaves) if g is not None]
    with torch.no_grad():
        _add_([a for a, _ in pairs], [g for _, g in pairs])
    return acc

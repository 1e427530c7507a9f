"""``torch_optimizer``: run any ``torch.optim.Optimizer`` class over the masters, in place."""

from __future__ import annotations

import inspect
from typing import Any, NamedTuple

import torch

from mpfunc.core import _checks
from mpfunc.core._optimizer import Group, Optimizer, Step, Work

__all__ = ["TorchOptimizerState", "torch_optimizer"]


class TorchOptimizerState(NamedTuple):
    """Holds the ``torch.optim`` instance, built over the masters' own tensors.

    ``optimizer.state_dict()`` is how to checkpoint it.
    """

    optimizer: torch.optim.Optimizer


def torch_optimizer(cls: type[torch.optim.Optimizer], /, **kwargs: Any) -> Optimizer:
    """Wraps a ``torch.optim`` optimizer class so it steps mpfunc's masters.

    This is the recipe of the original report, per-tensor: the torch optimizer
    is built over the master tensors themselves (``init``), and each
    ``apply_update_`` lends it the fp32 grads as ``.grad``, calls ``step()``, and
    takes them back. It updates masters in place, so only ``apply_update_``
    accepts it; ``apply_update`` (pure) raises ``TypeError``. Prefer
    ``mpfunc.adamw`` & co.: they are sync-free on XLA and their state is a tree.

    Args:
      cls: a ``torch.optim.Optimizer`` subclass, e.g. ``torch.optim.RMSprop``.
      **kwargs: its hyperparameters, passed through (torch checks them).

    Returns:
      An ``Optimizer`` whose state is a ``TorchOptimizerState``.

    Raises:
      TypeError: ``cls`` is not a ``torch.optim.Optimizer`` subclass.

    Example::

      opt = mpfunc.torch_optimizer(torch.optim.RMSprop, lr=1e-3)
      state = opt.init(masters)
      masters, state = mpfunc.apply_update_(masters, g32, state, opt)
    """
    fn = "torch_optimizer"
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise TypeError(f"{fn}: cls: expected a torch.optim.Optimizer subclass, got {cls!r}")
    # Refused here, not in the step: a partition would have written its other labels' masters
    # by the time torch raised (LBFGS's step needs a closure; SparseAdam, sparse grads).
    closure = inspect.signature(cls.step).parameters.get("closure")
    if closure is not None and closure.default is inspect.Parameter.empty:
        raise TypeError(
            f"{fn}: cls: expected an optimizer whose step() needs no closure, got "
            f"{cls.__name__} (it re-evaluates the model inside step): step it with torch.optim"
        )
    if issubclass(cls, torch.optim.SparseAdam):
        raise TypeError(
            f"{fn}: cls: expected an optimizer of dense grads, got SparseAdam (sparse grads "
            "only; mpfunc's grads are dense): use torch.optim.SparseAdam directly"
        )

    def init(masters: Any) -> TorchOptimizerState:
        side, _ = _checks.tensor_leaves(f"{fn}.init", "masters", masters)
        return TorchOptimizerState(cls([m for m in side.leaves if m is not None], **kwargs))

    def plan(step: Step, state: Any, where: str) -> list[Work]:
        if not isinstance(state, TorchOptimizerState):
            raise TypeError(
                f"{where}: state: expected the TorchOptimizerState made by "
                f"torch_optimizer({cls.__name__}, ...).init(masters), got {type(state).__name__}"
            )
        owned = [p for group in state.optimizer.param_groups for p in group["params"]]
        pairs = [(m, g) for m, g in zip(step.masters.leaves, step.grads.leaves) if m is not None]
        if len(owned) != len(pairs) or any(a is not b for a, (b, _) in zip(owned, pairs)):
            raise ValueError(
                f"{where}: state: expected the {cls.__name__} built over these very master "
                f"tensors ({len(pairs)} of them), got one over {len(owned)} other tensors. "
                "torch.optim keeps its state by tensor identity: call opt.init(masters) again."
            )
        plain = all(k is None for k in step.kinds or ())
        if not plain or step.model is not None or step.scale is not None or step.stats is not None:
            raise TypeError(
                f"{where}: torch_optimizer({cls.__name__}, ...) steps 'fp32' masters with fp32 "
                "grads only: use grads_to_fp32_ and masters_to_model_ around it, or an mpfunc "
                "optimizer for master strategies, params=, scale= and stats="
            )
        for i, (m, g) in enumerate(zip(step.masters.leaves, step.grads.leaves)):
            if m is not None and g is not None and g.dtype != m.dtype:
                _checks.fail(
                    TypeError,
                    where,
                    step.grads.path(i),
                    f"{m.dtype} (the master's dtype)",
                    _checks.describe(g),
                    "Cast grads with grads_to_fp32 first",
                )
        if any(g.get("fused") for g in state.optimizer.param_groups):
            from torch._prims_common import is_non_overlapping_and_dense

            for i, m in enumerate(step.masters.leaves):
                if m is not None and m.numel() > 1 and not is_non_overlapping_and_dense(m):
                    _checks.fail(
                        ValueError,
                        where,
                        step.masters.path(i),
                        f"a dense master for torch_optimizer({cls.__name__}, fused=True) "
                        "(torch's fused kernels pair elements by memory position)",
                        f"strides {m.stride()} for shape {tuple(m.shape)}",
                        "Make the masters with init_master (dense, in the param's layout), or "
                        "pass fused=False",
                    )
        if step.skip is not None:
            raise TypeError(
                f"{where}: skip: expected None for torch_optimizer({cls.__name__}, ...), got "
                f"{_checks.describe(step.skip)}: torch.optim optimizers step unconditionally; a "
                "device-side skip needs an mpfunc optimizer (such as mpfunc.adamw(...))"
            )
        group = Group([m for m, _ in pairs], [g for _, g in pairs], state, 0.0, None)
        return [Work(_lend_grads_and_step, group, None)]

    return Optimizer(init=init, plan=plan, functional=False, name=f"torch.{cls.__name__}")


def _like_master(m: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``g``, or a copy of it in the master's memory layout where the strides differ:
    torch's fused kernels (``fused=True``) pair a param's and a grad's elements by memory
    position, so a transposed grad for a row-major master would update the wrong
    elements."""
    if g.numel() <= 1 or g.stride() == m.stride():
        return g
    out = torch.empty_like(m, dtype=g.dtype, memory_format=torch.preserve_format)
    return out.copy_(g)


def _lend_grads_and_step(group: Group, _: Any) -> None:
    """The kernel: lend the grads as ``.grad`` (``None`` where a leaf took none, which
    torch.optim skips), call ``step()``, and take them back."""
    held = [m.grad for m in group.params]  # a master's own .grad is given back after
    try:
        for m, g in zip(group.params, group.grads):
            m.grad = g if g is None else _like_master(m, g)
        group.state.optimizer.step()
    finally:
        for m, h in zip(group.params, held):
            m.grad = h

"""From torch.optim to mpfunc: ``from_torch_optim`` and the ``frozen`` optimizer.

A torch.optim optimizer already says everything mpfunc's ``partition`` needs: which
parameters are trained (those in its ``param_groups``), with which hyperparameters
(each group's values), and which are not (every other parameter, and those that do
not require grad). ``from_torch_optim`` reads that into a label tree and a
``partition`` with one sub-optimizer per group and a ``"frozen"`` label.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from mpfunc.core import _checks, _tree
from mpfunc.core._optimizer import Optimizer, Step, Work
from mpfunc.optim._adam import adam, adamw
from mpfunc.optim._sgd import sgd
from mpfunc.optim._torch_optim import torch_optimizer
from mpfunc.transforms._partition import partition

__all__ = ["FROZEN", "from_torch_optim", "frozen", "native_factory"]

FROZEN = "frozen"

# torch.optim class -> (mpfunc factory, the group keys it takes). Keys that only choose
# torch's implementation (foreach, fused, capturable, differentiable) are left out.
_ADAM_KEYS = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize")
_SGD_KEYS = ("lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize")


def frozen() -> Optimizer:
    """An optimizer that never changes its leaves and keeps no state.

    For the leaves of a ``partition`` that must not train (a ``"frozen"`` label), as
    optax's ``set_to_zero``: grads given for them are ignored, and ``init`` returns
    ``None`` (no step counts, no moments).

    Example::

      opt = mpfunc.partition({"train": mpfunc.adamw(), "frozen": mpfunc.frozen()}, labels)
    """

    def init(masters: Any) -> None:
        _checks.tensor_leaves("frozen.init", "masters", masters)

    def plan(step: Step, state: Any, where: str) -> list[Work]:
        if state is not None:
            raise TypeError(
                f"{where}: {step.state_name}: expected None (frozen() keeps no state), got "
                f"{_checks.describe(state)}"
            )
        return []

    return Optimizer(init=init, plan=plan, functional=True, name="frozen")


def native_factory(
    fn: str, torch_opt: torch.optim.Optimizer, group: Mapping[str, Any] | None = None
) -> tuple[Callable[..., Optimizer], tuple[str, ...]] | None:
    """The mpfunc factory that does ``torch_opt``'s math for ``group`` (one of its
    ``param_groups``; its defaults when ``None``), and the group keys to pass it; ``None``
    for a class mpfunc has no native optimizer for."""
    if not isinstance(torch_opt, torch.optim.Optimizer):
        raise TypeError(
            f"{fn}: torch_opt: expected a torch.optim.Optimizer instance, got "
            f"{_checks.describe(torch_opt)}"
        )
    cls = type(torch_opt)
    if cls is torch.optim.AdamW:
        return adamw, _ADAM_KEYS
    if cls is torch.optim.Adam:
        # torch >= 2.7: Adam(decoupled_weight_decay=True) is AdamW, a value each group
        # may set for itself.
        values = torch_opt.defaults if group is None else group
        decoupled = values.get("decoupled_weight_decay", False)
        return (adamw if decoupled else adam), _ADAM_KEYS
    if cls is torch.optim.SGD:
        return sgd, _SGD_KEYS
    return None


def group_optimizers(fn: str, torch_opt: torch.optim.Optimizer) -> list[Optimizer]:
    """One mpfunc optimizer per param group of ``torch_opt``, with that group's values."""
    native = native_factory(fn, torch_opt)  # checks torch_opt's type
    out = []
    for i, group in enumerate(torch_opt.param_groups):
        native = native and native_factory(fn, torch_opt, group)
        try:
            if native is not None:
                factory, keys = native
                out.append(factory(**{k: group[k] for k in keys}))
            else:
                hyper = {k: group[k] for k in torch_opt.defaults if k in group}
                out.append(torch_optimizer(type(torch_opt), **hyper))
        except (TypeError, ValueError) as e:
            raise type(e)(f"{fn}: param_groups[{i}]: {e}") from e
    return out


def from_torch_optim(torch_opt: torch.optim.Optimizer, params: Any) -> tuple[Any, Optimizer]:
    """Turns a torch.optim optimizer's param groups into mpfunc labels and a ``partition``.

    Each param group becomes a label, ``"group0"``, ``"group1"``, ..., stepped by the
    mpfunc optimizer with that group's hyperparameters: ``torch.optim.Adam``, ``AdamW``
    and ``SGD`` map to ``mpfunc.adam``, ``adamw`` and ``sgd`` (same math, sync-free);
    any other class runs through ``mpfunc.torch_optimizer`` with the group's values
    (in place only). Parameters that do not require grad, or are in no group, get the
    label ``"frozen"`` (``mpfunc.frozen()``: never changed, no state), as torch.optim
    never changes them; with ``init_master(params, trainable_only=True)`` the frozen
    ones have no master at all. The values are read once: later changes to
    ``torch_opt`` (a scheduler's lr) do not reach the result; for schedulers use
    ``mpfunc.MasterOptimizer``.

    Args:
      torch_opt: a ``torch.optim.Optimizer`` over the model's parameters.
      params: the tree you will train with mpfunc, e.g. ``dict(model.named_parameters())``;
        its leaves are found in ``torch_opt`` by identity.

    Returns:
      ``(labels, opt)``: a label tree of ``params``' structure (``None`` at ``None`` and
      non-floating leaves), and ``partition({"group0": ..., "frozen": frozen()}, labels)``.

    Raises:
      TypeError: ``torch_opt`` is not a torch.optim optimizer, or a group's value is of a
        type mpfunc refuses (e.g. tensor betas).
      ValueError: a parameter of ``torch_opt`` is not a leaf of ``params`` (it would
        silently stop training), or a group's value is out of range.

    Example::

      torch_opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                     {"params": no_decay, "weight_decay": 0.0}], lr=3e-4)
      params = dict(model.named_parameters())
      labels, opt = mpfunc.from_torch_optim(torch_opt, params)
      masters = mpfunc.init_master(params, trainable_only=True)
      state = opt.init(masters)
    """
    fn = "from_torch_optim"
    opts = group_optimizers(fn, torch_opt)
    side, spec = _checks.tensor_leaves(fn, "params", params)
    where: dict[int, int] = {}
    for i, group in enumerate(torch_opt.param_groups):
        for p in group["params"]:
            where.setdefault(id(p), i)
    found: set[int] = set()
    labels: list[str | None] = []
    for p in side.leaves:
        if p is None or not p.is_floating_point():
            labels.append(None)
            continue
        index = where.get(id(p))
        labels.append(FROZEN if index is None or not p.requires_grad else f"group{index}")
        found.add(id(p))
    for i, group in enumerate(torch_opt.param_groups):
        names = group.get("param_names")
        for k, p in enumerate(group["params"]):
            if id(p) not in found and p.is_floating_point():
                name = f" ({names[k]!r})" if names else ""
                _checks.fail(
                    ValueError,
                    fn,
                    f"torch_opt.param_groups[{i}].params[{k}]{name}",
                    "a leaf of params (torch.optim trains it)",
                    f"{_checks.describe(p)} that params does not hold",
                    "Pass every trained parameter, e.g. dict(model.named_parameters())",
                )
    optimizers: Mapping[str, Optimizer] = {
        **{f"group{i}": o for i, o in enumerate(opts)},
        FROZEN: frozen(),
    }
    label_tree = _tree.unflatten(spec, labels)
    return label_tree, partition(optimizers, label_tree)

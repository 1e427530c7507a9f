"""``partition``: per-leaf hyperparameters, as torch.optim's param groups provide."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mpfunc.core import _checks, _tree
from mpfunc.core._checks import Side
from mpfunc.core._optimizer import Optimizer, Step, Work
from mpfunc.strategies import _strategy

__all__ = ["partition"]


def partition(optimizers: Mapping[str, Optimizer], labels: Any) -> Optimizer:
    """Steps each leaf with the optimizer its label names: torch.optim's param groups,
    as a tree.

    Each sub-optimizer sees only its own leaves (the others are ``None`` to it), so
    each keeps its own hyperparameters, state and fused/foreach kernels.

    Args:
      optimizers: label -> optimizer, e.g. ``{"decay": adamw(weight_decay=0.1),
        "no_decay": adamw(weight_decay=0.0)}``.
      labels: either a tree of label strings with the masters' structure (``None``
        where a leaf has no master), or a function ``(path, master) -> label`` of the
        dotted pytree path and the master tensor.

    Returns:
      An ``Optimizer`` whose state is a dict: label -> that optimizer's state.

    Raises:
      TypeError: ``optimizers`` is empty or holds something other than Optimizers.
      ValueError (at ``init``/step): a label is not a key of ``optimizers``, or the
        label tree's structure differs from the masters'.

    Example::

      opt = mpfunc.partition(
          {"decay": mpfunc.adamw(weight_decay=0.1), "no_decay": mpfunc.adamw(weight_decay=0.0)},
          lambda path, p: "no_decay" if p.ndim < 2 else "decay",  # biases, norms
      )
    """
    fn = "partition"
    if not isinstance(optimizers, Mapping) or not optimizers:
        got = "an empty dict" if isinstance(optimizers, Mapping) else _checks.describe(optimizers)
        raise TypeError(
            f"{fn}: optimizers: expected a non-empty dict of label -> Optimizer, got {got}"
        )
    for name, opt in optimizers.items():
        if not isinstance(opt, Optimizer):
            raise TypeError(
                f"{fn}: optimizers[{name!r}]: expected an mpfunc Optimizer, got "
                f"{_checks.describe(opt)}"
            )
    opts = dict(optimizers)
    # Labels from a function are cached on what they may depend on: the tree's structure
    # and each leaf's path, shape, dtype and device (never on object ids, which Python
    # reuses). A second tree of the same structure but other shapes gets its own labels.
    cache: dict[Any, list[str | None]] = {}

    def label_list(where: str, masters: Side, spec: Any) -> list[str | None]:
        if callable(labels):
            # A master kept by a strategy is labelled by its param (shape, dtype, device).
            faces = [_strategy.face(m) for m in masters.leaves]
            key = (
                spec,
                tuple(
                    None if m is None else (m.shape, m.dtype, m.device, type(x))
                    for m, x in zip(faces, masters.leaves)
                ),
            )
            if key in cache:
                return cache[key]
            paths = _tree.leaf_paths(masters.tree, units=True)
            out: list[str | None] = [
                None if m is None else labels(paths[i], m) for i, m in enumerate(faces)
            ]
            named = Side("masters", masters.tree, out, units=True)
        else:
            l_leaves, l_spec = _tree.flatten(labels)
            _checks.check_same_structure(
                where, "masters", masters.tree, spec, "labels", labels, l_spec
            )
            out = [None if m is None else lab for m, lab in zip(masters.leaves, l_leaves)]
            named = Side("labels", labels, out)
        for i, lab in enumerate(out):
            if masters.leaves[i] is not None and not _known(lab, opts):
                _checks.fail(
                    ValueError, where, named.path(i), f"a label among {sorted(opts)}", repr(lab)
                )
        if callable(labels):
            cache[key] = out
        return out

    def init(masters: Any) -> dict[str, Any]:
        side, spec = _strategy.master_leaves(f"{fn}.init", "masters", masters)
        labs = label_list(f"{fn}.init", side, spec)
        return {
            name: opt.init(
                _tree.unflatten(
                    spec, [m if lab == name else None for m, lab in zip(side.leaves, labs)]
                )
            )
            for name, opt in opts.items()
        }

    functional = all(opt.functional for opt in opts.values())

    def plan(step: Step, state: Any, where: str) -> list[Work]:
        if not isinstance(state, dict) or set(state) != set(opts):
            got = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise TypeError(
                f"{where}: state: expected the dict made by partition(...).init(masters) with "
                f"keys {sorted(opts)}, got {got}"
            )
        labs = label_list(where, step.masters, step.spec)
        work: list[Work] = []
        for name, opt in opts.items():  # every sub-plan checks before anything runs
            sub = step.only([lab == name for lab in labs], f"state[{name!r}]")
            # Each sub-plan adds its state to the step's one memory check (step.sweep),
            # which sees every label's masters, grads and state together.
            work += opt.plan(sub, state[name], where)
        return work

    return Optimizer(init=init, plan=plan, functional=functional, name=fn)


def _known(label: object, opts: dict[str, Any]) -> bool:
    """Whether ``label`` names one of the optimizers (an unhashable one, such as a list a
    labels function returned, names none)."""
    try:
        return label in opts
    except TypeError:
        return False

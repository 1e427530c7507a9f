"""``partition``: per-leaf hyperparameters, as torch.optim's param groups provide."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from optree import PyTreeSpec

from mpfunc import _checks, _tree
from mpfunc._optimizer import Optimizer, StepInput

__all__ = ["partition"]

Labeler = Callable[[str, torch.Tensor], str]


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
    cache: dict[PyTreeSpec, list[str | None]] = {}

    def label_list(
        where: str, masters: Any, m_leaves: list[Any], m_spec: PyTreeSpec
    ) -> list[str | None]:
        if callable(labels) and m_spec in cache:
            return cache[m_spec]
        if callable(labels):
            paths = _tree.leaf_paths(masters)
            out: list[str | None] = [
                None if m is None else labels(paths[i], m) for i, m in enumerate(m_leaves)
            ]
            tree, prefix = masters, "masters"
        else:
            l_leaves, l_spec = _tree.flatten(labels)
            _checks.check_same_structure(
                where, "masters", masters, m_spec, "labels", labels, l_spec
            )
            out = [None if m is None else lab for m, lab in zip(m_leaves, l_leaves)]
            tree, prefix = labels, "labels"
        for i, lab in enumerate(out):
            if m_leaves[i] is not None and lab not in opts:
                _checks.fail(
                    ValueError, where, _tree.leaf_path(tree, i, prefix),
                    f"a label among {sorted(opts)}", repr(lab),
                )  # fmt: skip
        if callable(labels):
            cache[m_spec] = out
        return out

    def init(masters: Any) -> dict[str, Any]:
        m_leaves, m_spec = _tree.flatten(masters)
        _checks.check_tensor_or_none(f"{fn}.init", "masters", masters, m_leaves)
        labs = label_list(f"{fn}.init", masters, m_leaves, m_spec)
        return {
            name: opt.init(
                _tree.unflatten(
                    m_spec, [m if lab == name else None for m, lab in zip(m_leaves, labs)]
                )
            )
            for name, opt in opts.items()
        }

    def prepare(step: StepInput, state: Any, where: str) -> Callable[[], None]:
        if not isinstance(state, dict) or set(state) != set(opts):
            got = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise TypeError(
                f"{where}: state: expected the dict made by partition(...).init(masters) with "
                f"keys {sorted(opts)}, got {got}"
            )
        labs = label_list(where, step.masters, step.m_leaves, step.m_spec)
        commits = []
        for name, opt in opts.items():
            keep = [lab == name for lab in labs]
            sub = step._replace(
                m_leaves=[m if k else None for m, k in zip(step.m_leaves, keep)],
                g_leaves=[g if k else None for g, k in zip(step.g_leaves, keep)],
                signature=[s if k else None for s, k in zip(step.signature, keep)],
            )
            commits.append(opt.prepare(sub, state[name], where))  # all checks first

        def commit() -> None:
            for c in commits:
                c()

        return commit

    functional = all(opt.functional for opt in opts.values())
    return Optimizer(init=init, prepare=prepare, functional=functional, name=fn)

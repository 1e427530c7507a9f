"""``sgd``: stochastic gradient descent with momentum over master trees.

Two implementations of one step, as torch.optim.SGD defines it:

* ``foreach``: ``torch._foreach_*`` ops, grouped by (device, dtype). Default.
* ``reference``: the same ops one tensor at a time, to read.

torch.optim starts the momentum buffer as a copy of the first gradient, a
Python branch on whether the buffer exists. Here the buffer starts at zero and
the first step is told apart on the device from the step count, so there is
no host branch: with ``dampening == 0``, ``0 * momentum + g`` is ``g`` exactly;
otherwise the gradient's coefficient is ``1 - dampening * min(step, 1)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from mpfunc import _checks, _grouping, _optimizer, _tree
from mpfunc._optimizer import LR, LRArg, Optimizer, StepInput, pick

__all__ = ["SGDState", "sgd"]


class SGDState(NamedTuple):
    """State of ``sgd``. Every field has the masters' structure.

    ``step``: 0-d float32 per leaf, on the master's device (steps taken by that leaf).
    ``momentum_buffer``: like the masters when ``momentum != 0``, else ``None``.
    """

    step: Any
    momentum_buffer: Any = None


class _Hyper(NamedTuple):
    lr: LRArg
    momentum: float
    dampening: float
    weight_decay: float
    nesterov: bool
    maximize: bool
    impl: str


def _reference(P, G, B, S, lr: LR, h: _Hyper) -> None:  # type: ignore[no-untyped-def]
    """One tensor at a time; the op order matches ``_foreach`` exactly."""
    for i in range(len(P)):
        p, g, s = P[i], G[i], S[i]
        if h.maximize:
            g = torch.neg(g)
        if h.weight_decay != 0:
            g = g.add(p, alpha=h.weight_decay)
        if h.momentum != 0:
            b = B[i]
            b.mul_(h.momentum)
            if h.dampening != 0:
                coef = torch.clamp_max(s, 1.0)  # 0 on the first step, then 1
                coef.mul_(-h.dampening)
                coef.add_(1)
                b.addcmul_(g, coef)
            else:
                b.add_(g)
            g = g.add(b, alpha=h.momentum) if h.nesterov else b
        s.add_(1)
        if isinstance(lr, torch.Tensor):
            p.sub_(torch.mul(g, lr))
        else:
            p.add_(g, alpha=-lr)


def _foreach(P, G, B, S, lr: LR, h: _Hyper) -> None:  # type: ignore[no-untyped-def]
    """The multi-tensor step; every op mirrors one line of ``_reference``."""
    if h.maximize:
        G = torch._foreach_neg(G)
    if h.weight_decay != 0:
        G = torch._foreach_add(G, P, alpha=h.weight_decay)
    if h.momentum != 0:
        torch._foreach_mul_(B, h.momentum)
        if h.dampening != 0:
            coef = torch._foreach_clamp_max(S, 1.0)
            torch._foreach_mul_(coef, -h.dampening)
            torch._foreach_add_(coef, 1)
            torch._foreach_addcmul_(B, G, coef)
        else:
            torch._foreach_add_(B, G)
        G = torch._foreach_add(G, B, alpha=h.momentum) if h.nesterov else B
    torch._foreach_add_(S, 1)
    if isinstance(lr, torch.Tensor):
        torch._foreach_sub_(P, torch._foreach_mul(G, lr))
    else:
        torch._foreach_add_(P, G, alpha=-lr)


_KERNELS = {"reference": _reference, "foreach": _foreach}


def sgd(
    lr: LRArg = 1e-3,
    momentum: float = 0.0,
    dampening: float = 0.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
    *,
    maximize: bool = False,
    impl: _grouping.Impl = "auto",
) -> Optimizer:
    """SGD with optional momentum, dampening, Nesterov and L2 weight decay, as ``torch.optim.SGD``.

    Args:
      lr: a float; a 0-d tensor read at every step (change it in place); or a
        schedule, a function of the 0-d float32 step count (steps already taken)
        returning a float or 0-d tensor. Tensors and schedules never recompile on XLA.
      momentum, dampening, weight_decay, nesterov, maximize: as in ``torch.optim.SGD``.
      impl: ``"auto"``/``"foreach"`` (multi-tensor ops) or ``"reference"`` (per-tensor loop).
        torch's fused SGD needs a host flag for the first step, so it is not used.

    Returns:
      An ``Optimizer`` whose state is an ``SGDState``.

    Raises:
      TypeError, ValueError: a hyperparameter is out of range or of the wrong type,
        or ``nesterov`` is set without momentum or with dampening.
    """
    fn = "sgd"
    h = _Hyper(
        lr=_optimizer.check_lr(fn, lr),
        momentum=_optimizer.check_nonneg(fn, "momentum", momentum),
        dampening=_optimizer.check_nonneg(fn, "dampening", dampening),
        weight_decay=_optimizer.check_nonneg(fn, "weight_decay", weight_decay),
        nesterov=bool(nesterov),
        maximize=bool(maximize),
        impl=_optimizer.check_choice(fn, "impl", impl, ("auto", "foreach", "reference")),
    )
    if h.nesterov and (h.momentum <= 0 or h.dampening != 0):
        raise ValueError(
            f"{fn}: nesterov: expected momentum > 0 and dampening == 0, got "
            f"momentum={h.momentum}, dampening={h.dampening}"
        )

    def init(masters: Any) -> SGDState:
        leaves, _ = _tree.flatten(masters)
        _checks.check_tensor_or_none(f"{fn}.init", "masters", masters, leaves)
        return SGDState(
            step=_optimizer.steps_like_masters(masters),
            momentum_buffer=_optimizer.zeros_like_masters(masters) if h.momentum else None,
        )

    def prepare(step: StepInput, state: Any, where: str) -> Callable[[], None]:
        if not isinstance(state, SGDState):
            raise TypeError(
                f"{where}: state: expected the SGDState made by sgd(...).init(masters), got "
                f"{type(state).__name__}"
            )
        m_leaves, g_leaves = step.m_leaves, step.g_leaves
        S = _optimizer.state_field_leaves(where, "step", state.step, step, "step")
        if h.momentum:
            B = _optimizer.state_field_leaves(
                where, "momentum_buffer", state.momentum_buffer, step, "moment"
            )
        elif state.momentum_buffer is not None:
            raise ValueError(
                f"{where}: state.momentum_buffer: expected None (momentum=0), got "
                f"{type(state.momentum_buffer).__name__}"
            )
        else:
            B = [None] * len(m_leaves)
        # Every group's kernel, lr and skip are resolved before the first write.
        work = _optimizer.plan(where, h.impl, h.lr, step, S, has_fused=False)

        def commit() -> None:
            for w in work:
                P, G, Bw, Sw = (pick(x, w.idx) for x in (m_leaves, g_leaves, B, S))
                kernel = _KERNELS[w.impl]
                written = P + Sw + (Bw if h.momentum else [])
                _optimizer.guarded(w.skip, written, kernel, P, G, Bw, Sw, w.lr, h)

        return commit

    return Optimizer(init=init, prepare=prepare, functional=True, name=fn)

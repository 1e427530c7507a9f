"""``adam`` and ``adamw``: Adam over master trees, three implementations of one step.

* ``fused``: torch's own fused kernels (``torch._fused_adam_``/``_fused_adamw_``),
  the ones ``torch.optim.Adam(fused=True)`` runs. Default on CPU and CUDA.
* ``foreach``: a sync-free chain of ``torch._foreach_*`` ops. Default on XLA,
  where it traces into one graph with no host read.
* ``reference``: the same math as ``foreach``, one tensor at a time, to read.

No implementation reads a tensor on the host: bias corrections are computed
from the step tensors on the device.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from mpfunc import _checks, _grouping, _optimizer, _tree
from mpfunc._optimizer import LR, LRArg, Optimizer, StepInput, pick

__all__ = ["AdamState", "adam", "adamw"]


class AdamState(NamedTuple):
    """State of ``adam``/``adamw``. Every field has the masters' structure.

    ``step``: 0-d float32 per leaf, on the master's device (steps taken by that leaf).
    ``exp_avg``, ``exp_avg_sq``: first and second moments, like the masters.
    ``max_exp_avg_sq``: the running max of ``exp_avg_sq`` with ``amsgrad``, else ``None``.
    """

    step: Any
    exp_avg: Any
    exp_avg_sq: Any
    max_exp_avg_sq: Any = None


class _Hyper(NamedTuple):
    lr: LRArg
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    decoupled: bool
    amsgrad: bool
    maximize: bool
    impl: str


def _ln(beta: float) -> float:
    """ln(beta), with ln(0) = -inf so that 1 - 0**t = -expm1(-inf) = 1."""
    return math.log(beta) if beta > 0 else -math.inf


def _reference(P, G, M, V, VM, S, lr: LR, h: _Hyper) -> None:  # type: ignore[no-untyped-def]
    """One tensor at a time; the op order matches ``_foreach`` exactly."""
    log_b1, log_b2 = _ln(h.beta1), _ln(h.beta2)
    for i in range(len(P)):
        p, g, m, v, s = P[i], G[i], M[i], V[i], S[i]
        if h.maximize:
            g = torch.neg(g)
        s.add_(1)
        if h.weight_decay != 0:
            if h.decoupled:
                p.mul_(1 - lr * h.weight_decay)
            else:
                g = g.add(p, alpha=h.weight_decay)
        m.lerp_(g, 1 - h.beta1)
        v.mul_(h.beta2)
        v.addcmul_(g, g, value=1 - h.beta2)
        if h.amsgrad:
            torch.maximum(VM[i], v, out=VM[i])
            v = VM[i]
        # 1 - beta**t computed as -expm1(t * ln beta): accurate to fp32 rounding
        # even while beta**t is close to 1, where 1 - beta**t in fp32 loses digits.
        c1 = torch.mul(s, log_b1)
        c1.expm1_()  # beta1**t - 1, negative
        c2 = torch.mul(s, log_b2)
        c2.expm1_()
        c2.neg_()
        c2.sqrt_()  # sqrt(1 - beta2**t)
        c1.reciprocal_()
        c1.mul_(lr)  # -lr / (1 - beta1**t)
        denom = torch.sqrt(v)
        denom.div_(c2)
        denom.add_(h.eps)
        denom.div_(c1)
        p.addcdiv_(m, denom)


def _bias_terms(
    S: list[torch.Tensor], lr: LR, h: _Hyper
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per leaf, ``-lr / (1 - beta1**t)`` and ``sqrt(1 - beta2**t)``, from the step counts.

    On eager devices, one 0-d op per leaf at a time, exactly as ``_reference`` does.
    On lazy devices (XLA) every 0-d op is a traced graph node, so the counts are
    stacked and the terms computed once for all leaves: the same elementwise math in
    a handful of nodes instead of eight per leaf.
    """
    log_b1, log_b2 = _ln(h.beta1), _ln(h.beta2)
    if S and _grouping.is_lazy(S[0].device):
        st = torch.stack(S)
        neg = torch.reciprocal(torch.expm1(st * log_b1)) * lr
        root = torch.sqrt(torch.neg(torch.expm1(st * log_b2)))
        return list(torch.unbind(neg)), list(torch.unbind(root))
    c1 = torch._foreach_mul(S, log_b1)
    torch._foreach_expm1_(c1)
    c2 = torch._foreach_mul(S, log_b2)
    torch._foreach_expm1_(c2)
    torch._foreach_neg_(c2)
    torch._foreach_sqrt_(c2)
    torch._foreach_reciprocal_(c1)
    torch._foreach_mul_(c1, lr)
    return list(c1), list(c2)


def _foreach(P, G, M, V, VM, S, lr: LR, h: _Hyper) -> None:  # type: ignore[no-untyped-def]
    """The sync-free multi-tensor step; every op mirrors one line of ``_reference``.

    Only the state is updated in place; temporaries are made out of place, which
    costs XLA no memory (it fuses them) and saves it a functionalization pass per op.
    """
    if h.maximize:
        G = torch._foreach_neg(G)
    torch._foreach_add_(S, 1)
    if h.weight_decay != 0:
        if h.decoupled:
            torch._foreach_mul_(P, 1 - lr * h.weight_decay)
        else:
            G = torch._foreach_add(G, P, alpha=h.weight_decay)
    torch._foreach_lerp_(M, G, 1 - h.beta1)
    torch._foreach_mul_(V, h.beta2)
    torch._foreach_addcmul_(V, G, G, value=1 - h.beta2)
    if h.amsgrad:
        torch._foreach_maximum_(VM, V)
        V = VM
    neg_step, c2 = _bias_terms(S, lr, h)
    denom = torch._foreach_div(torch._foreach_sqrt(V), c2)
    denom = torch._foreach_div(torch._foreach_add(denom, h.eps), neg_step)
    torch._foreach_addcdiv_(P, M, denom)


def _fused(P, G, M, V, VM, S, lr: LR, h: _Hyper, skip=None) -> None:  # type: ignore[no-untyped-def]
    """torch's fused kernel; steps are incremented first, as torch.optim does.

    With ``skip``, the kernel's own ``found_inf`` flag leaves params and moments
    untouched on the device, and the step increment is taken back (x + 1 - 1 == x
    exactly for step counts below 2**24).
    """
    found_inf = None if skip is None else skip.to(torch.float32)
    torch._foreach_add_(S, 1)
    kernel = torch._fused_adamw_ if h.decoupled else torch._fused_adam_
    kernel(
        P, G, M, V, VM if h.amsgrad else [], S,
        lr=lr, beta1=h.beta1, beta2=h.beta2, weight_decay=h.weight_decay, eps=h.eps,
        amsgrad=h.amsgrad, maximize=h.maximize, grad_scale=None, found_inf=found_inf,
    )  # fmt: skip
    if found_inf is not None:
        torch._foreach_sub_(S, [found_inf] * len(S))


_KERNELS = {"reference": _reference, "foreach": _foreach}


def _make(fn: str, h: _Hyper) -> Optimizer:
    def init(masters: Any) -> AdamState:
        leaves, _ = _tree.flatten(masters)
        _checks.check_tensor_or_none(f"{fn}.init", "masters", masters, leaves)
        zeros = _optimizer.zeros_like_masters
        return AdamState(
            step=_optimizer.steps_like_masters(masters),
            exp_avg=zeros(masters),
            exp_avg_sq=zeros(masters),
            max_exp_avg_sq=zeros(masters) if h.amsgrad else None,
        )

    def prepare(step: StepInput, state: Any, where: str) -> Callable[[], None]:
        if not isinstance(state, AdamState):
            raise TypeError(
                f"{where}: state: expected the AdamState made by {fn}(...).init(masters), got "
                f"{type(state).__name__}"
            )
        m_leaves, g_leaves = step.m_leaves, step.g_leaves

        def field(name: str) -> list[torch.Tensor | None]:
            kind = "step" if name == "step" else "moment"
            return _optimizer.state_field_leaves(where, name, getattr(state, name), step, kind)

        S, M, V = field("step"), field("exp_avg"), field("exp_avg_sq")
        if h.amsgrad:
            VM = field("max_exp_avg_sq")
        elif state.max_exp_avg_sq is not None:
            raise ValueError(
                f"{where}: state.max_exp_avg_sq: expected None (amsgrad=False), got "
                f"{type(state.max_exp_avg_sq).__name__}"
            )
        else:
            VM = [None] * len(m_leaves)
        # Every group's kernel, lr and skip are resolved before the first write.
        work = _optimizer.plan(where, h.impl, h.lr, step, S, has_fused=True)

        def commit() -> None:
            for w in work:
                P, G, Mw, Vw, VMw, Sw = (pick(x, w.idx) for x in (m_leaves, g_leaves, M, V, VM, S))
                if w.impl == "fused":
                    _fused(P, G, Mw, Vw, VMw, Sw, w.lr, h, w.skip)
                    continue
                kernel = _KERNELS[w.impl]
                written = P + Mw + Vw + Sw + (VMw if h.amsgrad else [])
                _optimizer.guarded(w.skip, written, kernel, P, G, Mw, Vw, VMw, Sw, w.lr, h)

        return commit

    return Optimizer(init=init, prepare=prepare, functional=True, name=fn)


def _hyper(
    fn: str,
    lr: object,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    amsgrad: bool,
    maximize: bool,
    impl: str,
    decoupled: bool,
) -> _Hyper:
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
        raise TypeError(f"{fn}: betas: expected a pair of floats, got {betas!r}")
    return _Hyper(
        lr=_optimizer.check_lr(fn, lr),
        beta1=_optimizer.check_unit_interval(fn, "betas[0]", betas[0]),
        beta2=_optimizer.check_unit_interval(fn, "betas[1]", betas[1]),
        eps=_optimizer.check_nonneg(fn, "eps", eps),
        weight_decay=_optimizer.check_nonneg(fn, "weight_decay", weight_decay),
        decoupled=decoupled,
        amsgrad=bool(amsgrad),
        maximize=bool(maximize),
        impl=_optimizer.check_choice(fn, "impl", impl, _grouping.IMPLS),
    )


def adam(
    lr: LRArg = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    amsgrad: bool = False,
    *,
    maximize: bool = False,
    impl: _grouping.Impl = "auto",
) -> Optimizer:
    """Adam with L2 weight decay added to the gradient, as ``torch.optim.Adam``.

    Args:
      lr: a float; a 0-d tensor read at every step (change it in place); or a
        schedule, a function of the 0-d float32 step count (steps already taken)
        returning a float or 0-d tensor. Tensors and schedules never recompile on XLA.
      betas, eps, weight_decay, amsgrad, maximize: as in ``torch.optim.Adam``.
      impl: ``"auto"`` (fused kernels on CPU/CUDA, foreach elsewhere), ``"fused"``,
        ``"foreach"`` or ``"reference"`` (a per-tensor loop).

    Returns:
      An ``Optimizer`` whose state is an ``AdamState``.

    Raises:
      TypeError, ValueError: a hyperparameter is out of range (lr < 0, betas outside
        [0, 1), eps < 0, weight_decay < 0) or of the wrong type.
    """
    h = _hyper("adam", lr, betas, eps, weight_decay, amsgrad, maximize, impl, decoupled=False)
    return _make("adam", h)


def adamw(
    lr: LRArg = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    amsgrad: bool = False,
    *,
    maximize: bool = False,
    impl: _grouping.Impl = "auto",
) -> Optimizer:
    """AdamW: Adam with decoupled weight decay, as ``torch.optim.AdamW``.

    Same arguments as ``adam``; ``weight_decay`` defaults to 1e-2 and multiplies
    the masters by ``1 - lr * weight_decay`` before the Adam step.

    Example::

      opt = mpfunc.adamw(lr=3e-4, weight_decay=0.1)
      state = opt.init(masters)
      masters, state = mpfunc.apply_update_(masters, g32, state, opt)
    """
    h = _hyper("adamw", lr, betas, eps, weight_decay, amsgrad, maximize, impl, decoupled=True)
    return _make("adamw", h)

"""``sgd``: stochastic gradient descent with momentum over master trees.

Two implementations of one step, as torch.optim.SGD defines it:

* ``native``: mpfunc's own CPU kernel (``_native.sgd_kernel``): the whole mixed step in
  one pass for every master strategy and state format, bit for bit ``foreach`` on the
  strategy's fp32 values. Default on the CPU where the leaf's tensors share one dense
  layout (``_plan`` decides).
* ``foreach``: ``torch._foreach_*`` ops, grouped by (device, dtype). The specification;
  the default elsewhere.
* ``xla``: on XLA, the whole group as one traced node (``_xla_kernels``). Default there
  for fp32 masters.
* ``reference``: the same ops one tensor at a time, to read.

torch.optim starts the momentum buffer as a copy of the first gradient, a
Python branch on whether the buffer exists. Here the buffer starts at zero and
the first step is told apart on the device from the step count, so there is
no host branch: with ``dampening == 0``, ``0 * momentum + g`` is ``g`` exactly;
otherwise the gradient's coefficient is ``1 - dampening * min(step, 1)``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

from mpfunc.backends import _native, _plan
from mpfunc.core import _checks
from mpfunc.core._checks import LRArg
from mpfunc.core._optimizer import Group, Optimizer, Rule, TensorList, unless_skipped
from mpfunc.state_formats import _state_format

__all__ = ["SGDState", "sgd"]


class SGDState(NamedTuple):
    """State of ``sgd``. Every field has the masters' structure.

    ``step``: 0-d float32 per leaf, on the master's device (steps taken by that leaf).
    ``momentum_buffer``: like the masters when ``momentum != 0``, else ``None``.
    """

    step: Any
    momentum_buffer: Any = None


class SGDHyper(NamedTuple):
    momentum: float
    dampening: float
    weight_decay: float
    nesterov: bool
    maximize: bool


def _fields(h: SGDHyper) -> Mapping[str, str]:
    return _plan.fields_from(step="step", momentum_buffer="moment" if h.momentum else None)


def _reference(group: Group, h: SGDHyper) -> None:
    """One tensor at a time; the op order matches ``_foreach`` exactly."""
    s: SGDState = group.state
    lr = group.lr
    written = [*group.params, *s.step, *(s.momentum_buffer or [])]
    with unless_skipped(group.skip, written):
        for i, (p, g, t) in enumerate(zip(group.params, group.grads, s.step)):
            if h.maximize:
                g = torch.neg(g)
            if h.weight_decay != 0:
                g = g.add(p, alpha=h.weight_decay)
            if h.momentum != 0:
                b = s.momentum_buffer[i]
                b.mul_(h.momentum)
                if h.dampening != 0:
                    coef = torch.clamp_max(t, 1.0)  # 0 on the first step, then 1
                    coef.mul_(-h.dampening)
                    coef.add_(1)
                    b.addcmul_(g, coef)
                else:
                    b.add_(g)
                g = g.add(b, alpha=h.momentum) if h.nesterov else b
            t.add_(1)
            if isinstance(lr, torch.Tensor):
                p.sub_(torch.mul(g, lr))
            else:
                p.add_(g, alpha=-lr)


def _foreach(group: Group, h: SGDHyper) -> None:
    """The multi-tensor step; every op mirrors one line of ``_reference``."""
    s: SGDState = group.state
    params, lr, buf = group.params, group.lr, s.momentum_buffer
    grads: TensorList = group.grads
    written = [*params, *s.step, *(buf or [])]
    with unless_skipped(group.skip, written):
        if h.maximize:
            grads = torch._foreach_neg(grads)
        if h.weight_decay != 0:
            grads = torch._foreach_add(grads, params, alpha=h.weight_decay)
        if h.momentum != 0:
            torch._foreach_mul_(buf, h.momentum)
            if h.dampening != 0:
                coef = torch._foreach_clamp_max(s.step, 1.0)
                torch._foreach_mul_(coef, -h.dampening)
                torch._foreach_add_(coef, 1)
                torch._foreach_addcmul_(buf, grads, coef)
            else:
                torch._foreach_add_(buf, grads)
            grads = torch._foreach_add(grads, buf, alpha=h.momentum) if h.nesterov else buf
        torch._foreach_add_(s.step, 1)
        if isinstance(lr, torch.Tensor):
            torch._foreach_sub_(params, torch._foreach_mul(grads, lr))
        else:
            torch._foreach_add_(params, grads, alpha=-lr)


def _xla(group: Group, h: SGDHyper) -> None:
    """The whole group as one XLA computation (``_xla_kernels``): ``_foreach`` op for op;
    see ``_adam._xla``."""
    from mpfunc.backends import _xla_kernels

    s: SGDState = group.state
    _xla_kernels.sgd_xla_(
        group.params, group.grads, s.momentum_buffer, s.step, lr=group.lr,
        momentum=h.momentum, dampening=h.dampening, weight_decay=h.weight_decay,
        nesterov=h.nesterov, maximize=h.maximize, found_inf=group.skip,
        grad_scale=group.scale, model_params=group.model, salts=group.salts,
    )  # fmt: skip


_RULE = Rule(
    name="sgd", state_type=SGDState, fields=_fields,
    kernels={"reference": _reference, "foreach": _foreach, "xla": _xla,
             "native": _native.sgd_kernel},
)  # fmt: skip
_native.register_rule(
    _native.sgd_kernel, SGDState, "momentum_buffer", _foreach,
    lambda zero_beta: [(SGDHyper(0.9, 0.3, 0.1, False, False), 0.05),
                       (SGDHyper(0.9, 0.0, 0.01, True, True), torch.tensor(0.05))],
)  # fmt: skip


def sgd(
    lr: LRArg = 1e-3,
    momentum: float = 0.0,
    dampening: float = 0.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
    *,
    maximize: bool = False,
    impl: _plan.Impl = "auto",
    state_dtype: torch.dtype | None = None,
) -> Optimizer:
    """SGD with optional momentum, dampening, Nesterov and L2 weight decay, as ``torch.optim.SGD``.

    Args:
      lr: a float; a 0-d tensor read at every step (change it in place); or a
        schedule, a function of the 0-d float32 step count (steps already taken)
        returning a float or 0-d tensor. Tensors and schedules never recompile on XLA.
      momentum, dampening, weight_decay, nesterov, maximize: as in ``torch.optim.SGD``.
      impl: ``"auto"`` (one XLA computation per group on XLA for fp32 masters, mpfunc's
        native pass on the CPU where it applies, else foreach), ``"foreach"``
        (multi-tensor ops), ``"xla"`` or ``"reference"`` (a per-tensor loop).
        torch's fused SGD needs a host flag for the first step, so it is not used.

    Returns:
      An ``Optimizer`` whose state is an ``SGDState``.

    Raises:
      TypeError, ValueError: a hyperparameter is out of range or of the wrong type,
        or ``nesterov`` is set without momentum or with dampening.
    """
    fn = "sgd"
    h = SGDHyper(
        momentum=_checks.real(fn, "momentum", momentum, ge=0.0),
        dampening=_checks.real(fn, "dampening", dampening, ge=0.0),
        weight_decay=_checks.real(fn, "weight_decay", weight_decay, ge=0.0),
        nesterov=bool(nesterov),
        maximize=bool(maximize),
    )
    chosen = _checks.choice(fn, "impl", impl, ("auto", "foreach", "reference", "xla"))
    if h.nesterov and (h.momentum <= 0 or h.dampening != 0):
        raise ValueError(
            f"{fn}: nesterov: expected momentum > 0 and dampening == 0, got "
            f"momentum={h.momentum}, dampening={h.dampening}"
        )
    return _plan.elementwise(
        _RULE, h, chosen, _checks.lr(fn, lr), _state_format.check(fn, state_dtype)
    )

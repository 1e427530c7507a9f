"""``sgd``: stochastic gradient descent with momentum over master trees.

Two implementations of one step, as torch.optim.SGD defines it:

* ``native``: mpfunc's own CPU kernel (``_native_kernel``): the whole mixed step in
  one pass for every master strategy and state format, bit for bit ``foreach`` on the
  strategy's fp32 values. Default on the CPU where the leaf's tensors share one dense
  layout (``_plan`` decides).
* ``foreach``: ``torch._foreach_*`` ops, grouped by (device, dtype). The specification;
  the default elsewhere.
* ``xla``: on XLA, the whole group as one traced node (``_build_xla``, run by
  ``backends/_xla_kernels``). Default there for fp32 masters.
* ``reference``: the same ops one tensor at a time, to read.

torch.optim starts the momentum buffer as a copy of the first gradient, a
Python branch on whether the buffer exists. Here the buffer starts at zero and
the first step is told apart on the device from the step count, so there is
no host branch: with ``dampening == 0``, ``0 * momentum + g`` is ``g`` exactly;
otherwise the gradient's coefficient (``_dampened`` in each implementation) is
``m * fp32(1 - dampening) + (1 - m)`` with ``m = min(step, 1)``: 1 on the first step,
then ``1 - dampening`` computed in double and rounded once, as torch.optim's ``alpha``
(exact for ``m`` in {0, 1}). The float32 ``1 - dampening * m`` it replaced was an ulp off
torch's for dampening 0.9 (found in review).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

from mpfunc.backends import _native, _plan, _xla_kernels
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


# A NamedTuple of tensors: safe for torch.load(weights_only=True), torch's default since 2.6.
torch.serialization.add_safe_globals([SGDState])


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
                    first = torch.clamp_max(t, 1.0)  # 0 on the first step, then 1
                    coef = torch.mul(first, 1 - h.dampening)  # (_dampened)
                    coef.add_(torch.rsub(first, 1.0))
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
                first = torch._foreach_clamp_max(s.step, 1.0)
                coef = torch._foreach_mul(first, 1 - h.dampening)  # (_dampened)
                torch._foreach_add_(coef, torch._foreach_add(torch._foreach_neg(first), 1.0))
                torch._foreach_addcmul_(buf, grads, coef)
            else:
                torch._foreach_add_(buf, grads)
            grads = torch._foreach_add(grads, buf, alpha=h.momentum) if h.nesterov else buf
        torch._foreach_add_(s.step, 1)
        if isinstance(lr, torch.Tensor):
            torch._foreach_sub_(params, torch._foreach_mul(grads, lr))
        else:
            torch._foreach_add_(params, grads, alpha=-lr)


def _native_kernel(group: Group, h: SGDHyper) -> None:
    """The ``"native"`` kernel: the whole group in one pass (``_native.rule_step``, rule 0),
    bit for bit ``_foreach`` on the strategy's fp32 values (the torch path), under the same
    contract and for the same leaves as ``_adam._native_kernel``."""
    buf = group.state.momentum_buffer if h.momentum else None
    _native.rule_step(group, 0, buf, h.momentum, h.dampening, h)


def _probe_cases(variant: None) -> list[tuple[SGDHyper, Any]]:
    """The (hyperparameters, lr) pairs ``_native.serves`` runs both ways once per process."""
    return [
        (SGDHyper(0.9, 0.3, 0.1, False, False), 0.05),
        (SGDHyper(0.9, 0.0, 0.01, True, True), torch.tensor(0.05)),
    ]


def _xla(group: Group, h: SGDHyper) -> None:
    """The whole group as one XLA computation (``_build_xla``): ``_foreach`` op for op; see
    ``_adam._xla``."""
    moments = []
    if h.momentum != 0:
        buf = group.state.momentum_buffer
        if buf is None:
            raise ValueError(
                "xla::mpfunc_sgd: momentum_buffer: expected a list of tensors, got None"
            )
        moments.append(("momentum_buffer", buf))
    _xla_kernels.step("sgd", h, group, moments, None, _build_xla)


def _build_xla(h: SGDHyper, group: _xla_kernels.Leaves, shared: tuple[Any, ...]) -> Any:
    """The computation of one SGD step over ``group``: op for op ``_foreach`` between
    the strategy's and state format's loads and stores (as ``_adam._build_xla``).

    The buffer starts at zero and the first step is told apart on the device: the
    gradient's coefficient is the module's ``_dampened`` one.
    """
    b = _xla_kernels.Builder("mpfunc_sgd")
    f32 = torch.float32
    n_moments = 1 if h.momentum != 0 else 0
    units, moments, S, L = b.fields(group, n_moments)
    md = b.moment_dtype(group, n_moments)
    B = moments[0] if h.momentum != 0 else [None] * len(S)
    G = b.grad_params(group)
    _, skip_kind, scaled = shared
    lr = b.param((), f32)
    skip = b.skip(skip_kind)
    ins = list(zip(units, b.unscale(G, scaled), B, S, L))

    one = b.f32(1.0)
    mom, wd, keep = b.f32(h.momentum), b.f32(h.weight_decay), b.f32(1 - h.dampening)
    outs = []
    lows = group.low_dtypes or (None,) * len(ins)
    for i, ((unit, g, buf0, s, old_low), low) in enumerate(zip(ins, lows)):
        g = b.in_turn(group, md, g)  # XLA:CPU's order of work (see there)
        if h.maximize:
            g = -g
        q = b.load(group, i, unit, old_low)
        if h.weight_decay != 0:
            g = g + q * wd
        new = []
        s1 = b.keep(skip, s, s + one)
        if buf0 is not None:
            shape = group.shapes[i]
            draw = (s1, group.salts[i] if group.salts else 0, shape)
            buf = b.widen(buf0, md, shape)
            # 0 on the first step, then 1: the buffer starts at zero, so step 1 gives g.
            first = s.min(one)
            coef = first * keep + (one - first) if h.dampening != 0 else None  # (_dampened)
            buf1 = b.keep(skip, buf, buf * mom + (g if coef is None else g * coef))
            buf1 = b.once(buf1, md, shape)
            g = g + buf1 * mom if h.nesterov else buf1
            new += b.narrow(skip, buf0, buf1, md, draw)
        master = b.store(skip, group, i, unit, q - g * lr)
        outs.extend(master + new + [s1] + b.round_out(skip, old_low, master[0], low))
    return b.xb.Op.tuple(outs).build("mpfunc_sgd")


_RULE = Rule(
    name="sgd",
    state_type=SGDState,
    fields=_fields,
    kernels={
        "reference": _reference,
        "foreach": _foreach,
        "xla": _xla,
        "native": _native_kernel,
    },
)
_native.register_rule(_native_kernel, SGDState, "momentum_buffer", _foreach, _probe_cases)


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
        schedule, a function of the 0-d float32 step count (steps already taken: the
        largest among the leaves stepping on the device) returning a float or 0-d tensor.
        Tensors and schedules never recompile on XLA.
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

"""``lion``: the sign-momentum optimizer of Chen et al. 2023, "Symbolic Discovery of
Optimization Algorithms" (Algorithm 2), over master trees::

    c = beta1 * m + (1 - beta1) * g          # interpolate, then take the sign
    p = p - lr * (sign(c) + weight_decay * p)
    m = beta2 * m + (1 - beta2) * g          # the momentum tracks with beta2

One moment instead of Adam's two. torch has no Lion, so the tests check it
against a plain per-tensor transcription of those three lines. On the CPU the default is
mpfunc's native pass (``_native_kernel``), bit for bit ``_foreach`` on the
strategy's fp32 values, for every master strategy and state format.
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

__all__ = ["LionState", "lion"]


class LionState(NamedTuple):
    """State of ``lion``. Every field has the masters' structure.

    ``step``: 0-d float32 per leaf (steps taken; schedules read it).
    ``exp_avg``: the momentum, like the masters.
    """

    step: Any
    exp_avg: Any


# A NamedTuple of tensors: safe for torch.load(weights_only=True), torch's default since 2.6.
torch.serialization.add_safe_globals([LionState])


class LionHyper(NamedTuple):
    beta1: float
    beta2: float
    weight_decay: float
    maximize: bool


def _fields(h: LionHyper) -> Mapping[str, str]:
    return {"step": "step", "exp_avg": "moment"}


def _reference(group: Group, h: LionHyper) -> None:
    """One tensor at a time; the op order matches ``_foreach`` exactly."""
    s: LionState = group.state
    lr = group.lr
    with unless_skipped(group.skip, [*group.params, *s.step, *s.exp_avg]):
        for p, g, m, t in zip(group.params, group.grads, s.exp_avg, s.step):
            if h.maximize:
                g = torch.neg(g)
            t.add_(1)
            if h.weight_decay != 0:
                p.mul_(1 - lr * h.weight_decay)
            direction = torch.lerp(m, g, 1 - h.beta1).sign_()
            if isinstance(lr, torch.Tensor):
                p.sub_(direction.mul_(lr))
            else:
                p.add_(direction, alpha=-lr)
            m.lerp_(g, 1 - h.beta2)


def _foreach(group: Group, h: LionHyper) -> None:
    """The multi-tensor step; every op mirrors one line of ``_reference``."""
    s: LionState = group.state
    params, lr = group.params, group.lr
    grads: TensorList = group.grads
    with unless_skipped(group.skip, [*params, *s.step, *s.exp_avg]):
        if h.maximize:
            grads = torch._foreach_neg(grads)
        torch._foreach_add_(s.step, 1)
        if h.weight_decay != 0:
            torch._foreach_mul_(params, 1 - lr * h.weight_decay)
        direction = torch._foreach_lerp(s.exp_avg, grads, 1 - h.beta1)
        torch._foreach_sign_(direction)
        if isinstance(lr, torch.Tensor):
            torch._foreach_sub_(params, torch._foreach_mul(direction, lr))
        else:
            torch._foreach_add_(params, direction, alpha=-lr)
        torch._foreach_lerp_(s.exp_avg, grads, 1 - h.beta2)


def _native_kernel(group: Group, h: LionHyper) -> None:
    """The ``"native"`` kernel: as ``_sgd._native_kernel`` (``_native.rule_step``, rule 1),
    bit for bit ``_foreach``."""
    _native.rule_step(group, 1, group.state.exp_avg, h.beta1, h.beta2, h)


def _zero_beta(h: LionHyper) -> bool:
    """A zero beta is probed on its own (lerp at a weight of 1 takes another form)."""
    return h.beta1 == 0 or h.beta2 == 0


def _probe_cases(zero_beta: bool) -> list[tuple[LionHyper, Any]]:
    """The (hyperparameters, lr) pairs ``_native.serves`` runs both ways once per process."""
    b1, b2 = (0.0, 0.0) if zero_beta else (0.9, 0.99)
    return [
        (LionHyper(b1, b2, 0.1, False), 1e-2),
        (LionHyper(b1, b2, 0.0, True), torch.tensor(1e-2)),
    ]


def _xla(group: Group, h: LionHyper) -> None:
    """The whole group as one XLA computation (``_build_xla``): ``_foreach`` op for op; see
    ``_adam._xla``."""
    moments = [("exp_avg", group.state.exp_avg)]
    decay = h.weight_decay if h.weight_decay != 0 else None
    _xla_kernels.step("lion", h, group, moments, decay, _build_xla)


def _build_xla(h: LionHyper, group: _xla_kernels.Leaves, shared: tuple[Any, ...]) -> Any:
    """The computation of one Lion step over ``group``: op for op ``_foreach`` between
    the strategy's and state format's loads and stores (as ``_adam._build_xla``).

    torch_xla lowers ``lerp`` to ``m + w * (g - m)`` and ``sign`` to XLA's sign with NaN
    mapped to 0 (as torch's ``sign``), and both are written that way here.
    """
    b = _xla_kernels.Builder("mpfunc_lion")
    f32 = torch.float32
    units, (M,), S, L = b.fields(group, 1)
    md = b.moment_dtype(group, 1)
    G = b.grad_params(group)
    lr_kind, skip_kind, scaled = shared
    lr = b.param((), f32)
    decay = b.param((), f32) if (h.weight_decay != 0 and lr_kind == "float") else None
    if h.weight_decay != 0 and decay is None:
        decay = b.f32(1.0) - lr * b.f32(h.weight_decay)
    skip = b.skip(skip_kind)
    ins = list(zip(units, b.unscale(G, scaled), M, S, L))

    one = b.f32(1.0)
    w1, w2 = b.f32(1 - h.beta1), b.f32(1 - h.beta2)
    outs = []
    lows = group.low_dtypes or (None,) * len(ins)
    for i, ((unit, g, m0, s, old_low), low) in enumerate(zip(ins, lows)):
        g = b.in_turn(group, md, g)  # XLA:CPU's order of work (see there)
        if h.maximize:
            g = -g
        s1 = b.keep(skip, s, s + one)
        q = b.load(group, i, unit, old_low)
        p1 = q * decay if h.weight_decay != 0 else q
        shape = group.shapes[i]
        m = b.widen(m0, md, shape)
        c = m + w1 * (g - m)
        direction = b.sign(c)
        master = b.store(skip, group, i, unit, p1 - direction * lr)
        m1 = b.once(b.keep(skip, m, m + w2 * (g - m)), md, shape)
        draw = (s1, group.salts[i] if group.salts else 0, shape)
        new = [*b.narrow(skip, m0, m1, md, draw), s1]
        outs.extend(master + new + b.round_out(skip, old_low, master[0], low))
    return b.xb.Op.tuple(outs).build("mpfunc_lion")


_RULE = Rule(
    name="lion",
    state_type=LionState,
    fields=_fields,
    kernels={
        "reference": _reference,
        "foreach": _foreach,
        "xla": _xla,
        "native": _native_kernel,
    },
)
_native.register_rule(_native_kernel, LionState, "exp_avg", _foreach, _probe_cases, _zero_beta)


def lion(
    lr: LRArg = 1e-4,
    betas: tuple[float, float] = (0.9, 0.99),
    weight_decay: float = 0.0,
    *,
    maximize: bool = False,
    impl: _plan.Impl = "auto",
    state_dtype: torch.dtype | None = None,
) -> Optimizer:
    """Lion (Chen et al. 2023): the sign of an interpolated momentum, decoupled weight decay.

    Lion's update has unit size per element, so its lr is usually 3-10x smaller than
    AdamW's and its weight decay 3-10x larger.

    Args:
      lr: a float, a 0-d tensor, or a schedule of the step count (as in ``adamw``).
      betas: ``(beta1, beta2)``: the interpolation for the sign, and the momentum decay.
      weight_decay: decoupled, as in AdamW: the master is multiplied by ``1 - lr * wd``.
      maximize: ascend instead of descend.
      impl: ``"auto"`` (one XLA computation per group on XLA for fp32 masters, mpfunc's
        native pass on the CPU where it applies, else foreach), ``"foreach"``
        (multi-tensor ops), ``"xla"`` or ``"reference"`` (a per-tensor loop).

    Returns:
      An ``Optimizer`` whose state is a ``LionState``.

    Raises:
      TypeError, ValueError: a hyperparameter is out of range or of the wrong type.
    """
    fn = "lion"
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
        raise TypeError(f"{fn}: betas: expected a pair of floats, got {betas!r}")
    h = LionHyper(
        beta1=_checks.real(fn, "betas[0]", betas[0], ge=0.0, le=1.0),
        beta2=_checks.real(fn, "betas[1]", betas[1], ge=0.0, le=1.0),
        weight_decay=_checks.real(fn, "weight_decay", weight_decay, ge=0.0),
        maximize=bool(maximize),
    )
    chosen = _checks.choice(fn, "impl", impl, ("auto", "foreach", "reference", "xla"))
    return _plan.elementwise(
        _RULE, h, chosen, _checks.lr(fn, lr), _state_format.check(fn, state_dtype)
    )

"""``adam`` and ``adamw``: Adam over master trees, five implementations of one step.

* ``native``: mpfunc's own CPU kernel (``_native_kernel``, on ``backends/_native``'s C++
  entries), bit-identical to ``fused`` for finite values, that also takes low-precision
  grads and writes rounded params in the same pass. Default on CPU where it builds and
  the layouts allow.
* ``fused``: torch's own fused kernels (``torch._fused_adam_``/``_fused_adamw_``),
  the ones ``torch.optim.Adam(fused=True)`` runs. Default on CUDA, and on CPU without
  ``native``, where the leaf's tensors share one dense layout (``_plan`` decides).
* ``foreach``: a sync-free chain of ``torch._foreach_*`` ops; on XLA it traces into
  one graph with no host read (about 16 nodes per leaf).
* ``xla``: on XLA, the whole group as one traced node: the ``foreach`` math as one
  cached XLA computation (``_build_xla``, run by ``backends/_xla_kernels``). Default on
  XLA for fp32 masters.
* ``reference``: the same math as ``foreach``, one tensor at a time, to read.

No implementation reads a tensor on the host: bias corrections are computed
from the step tensors on the device.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

from mpfunc.backends import _native, _plan, _xla_kernels
from mpfunc.core import _checks
from mpfunc.core._checks import LRArg
from mpfunc.core._optimizer import Group, Optimizer, Rule, TensorList, unless_skipped
from mpfunc.core._tensors import compute_dtype
from mpfunc.state_formats import _state_format

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


# A NamedTuple of tensors: safe for torch.load(weights_only=True), torch's default since 2.6.
torch.serialization.add_safe_globals([AdamState])


class AdamHyper(NamedTuple):
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    decoupled: bool  # AdamW: decay the master, not the grad
    amsgrad: bool
    maximize: bool


def _fields(h: AdamHyper) -> Mapping[str, str]:
    return _plan.fields_from(
        step="step",
        exp_avg="moment",
        exp_avg_sq="square",
        max_exp_avg_sq="square" if h.amsgrad else None,
    )


def _ln(beta: float) -> float:
    """ln(beta), with ln(0) = -inf so that 1 - 0**t = -expm1(-inf) = 1."""
    return math.log(beta) if beta > 0 else -math.inf


def _maximum_(dst: TensorList, other: TensorList) -> None:
    """``dst = maximum(dst, other)``, NaN where either is NaN, as torch's CPU and CUDA
    ``maximum`` give it. torch_xla's (XLA:CPU) keeps ``dst`` where ``other`` is NaN, so on
    lazy devices a NaN is put back: ``dst + other`` is NaN where either is."""
    torch._foreach_maximum_(dst, other)
    if dst and _plan.is_lazy(dst[0].device):
        for d, o in zip(dst, other):
            d.copy_(torch.where(o.isnan(), d + o, d))


def _reference(group: Group, h: AdamHyper) -> None:
    """One tensor at a time; the op order matches ``_foreach`` exactly."""
    s: AdamState = group.state
    lr = group.lr
    log_b1, log_b2 = _ln(h.beta1), _ln(h.beta2)
    written = [*group.params, *s.step, *s.exp_avg, *s.exp_avg_sq, *(s.max_exp_avg_sq or [])]
    with unless_skipped(group.skip, written):
        for i, (p, g, m, v, t) in enumerate(
            zip(group.params, group.grads, s.exp_avg, s.exp_avg_sq, s.step)
        ):
            if h.maximize:
                g = torch.neg(g)
            t.add_(1)
            if h.weight_decay != 0:
                if h.decoupled:
                    p.mul_(1 - lr * h.weight_decay)
                else:
                    g = g.add(p, alpha=h.weight_decay)
            m.lerp_(g, 1 - h.beta1)
            v.mul_(h.beta2)
            v.addcmul_(g, g, value=1 - h.beta2)
            if h.amsgrad:
                vmax = s.max_exp_avg_sq[i]
                _maximum_([vmax], [v])
                v = vmax
            # 1 - beta**t computed as -expm1(t * ln beta): accurate to fp32 rounding
            # even while beta**t is close to 1, where 1 - beta**t in fp32 loses digits.
            # In the leaf's own precision (float64 for a float64 leaf: _in_compute).
            (t,) = _in_compute([t], [p])
            c1 = torch.mul(t, log_b1)
            c1.expm1_()  # beta1**t - 1, negative
            c2 = torch.mul(t, log_b2)
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


def _in_compute(steps: list[torch.Tensor], params: TensorList) -> list[torch.Tensor]:
    """The float32 step counts, each widened to float64 where its leaf computes in float64
    (``_tensors.compute_dtype``): a float64 leaf's bias corrections in float64, as
    torch.optim computes them (Python floats). In float32 they put a relative error of
    ~6e-8 into every step of a float64 leaf (1.1e-9 after one AdamW step at lr 1e-2:
    found by tests/test_float64_layouts.py, on every path but torch's fused kernel)."""
    wants = [compute_dtype(p.dtype) for p in params]
    return [t if t.dtype == want else t.to(want) for t, want in zip(steps, wants)]


def _bias_terms(
    steps: list[torch.Tensor], params: TensorList, lr: Any, h: AdamHyper
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per leaf, ``-lr / (1 - beta1**t)`` and ``sqrt(1 - beta2**t)``, from the step counts,
    in each leaf's compute dtype (``_in_compute``).

    On eager devices, one 0-d op per leaf at a time, exactly as ``_reference`` does.
    On lazy devices (XLA) every 0-d op is a traced graph node, so the counts are
    stacked (one stack per dtype) and the terms computed once for all leaves: the same
    elementwise math in a handful of nodes instead of eight per leaf.
    """
    log_b1, log_b2 = _ln(h.beta1), _ln(h.beta2)
    steps = _in_compute(steps, params)
    if steps and _plan.is_lazy(steps[0].device):
        neg: list[Any] = [None] * len(steps)
        root: list[Any] = [None] * len(steps)
        for dtype in dict.fromkeys(t.dtype for t in steps):
            at = [i for i, t in enumerate(steps) if t.dtype == dtype]
            st = torch.stack([steps[i] for i in at])
            terms = torch.reciprocal(torch.expm1(st * log_b1)) * lr
            roots = torch.sqrt(torch.neg(torch.expm1(st * log_b2)))
            for i, a, b in zip(at, torch.unbind(terms), torch.unbind(roots)):
                neg[i], root[i] = a, b
        return neg, root
    c1 = torch._foreach_mul(steps, log_b1)
    torch._foreach_expm1_(c1)
    c2 = torch._foreach_mul(steps, log_b2)
    torch._foreach_expm1_(c2)
    torch._foreach_neg_(c2)
    torch._foreach_sqrt_(c2)
    torch._foreach_reciprocal_(c1)
    torch._foreach_mul_(c1, lr)
    return list(c1), list(c2)


def _foreach(group: Group, h: AdamHyper) -> None:
    """The sync-free multi-tensor step; every op mirrors one line of ``_reference``.

    Only the state is updated in place; temporaries are made out of place, which
    costs XLA no memory (it fuses them) and saves it a functionalization pass per op.
    """
    s: AdamState = group.state
    params, lr = group.params, group.lr
    grads: TensorList = group.grads
    v: TensorList = s.exp_avg_sq
    written = [*params, *s.step, *s.exp_avg, *v, *(s.max_exp_avg_sq or [])]
    with unless_skipped(group.skip, written):
        if h.maximize:
            grads = torch._foreach_neg(grads)
        torch._foreach_add_(s.step, 1)
        if h.weight_decay != 0:
            if h.decoupled:
                torch._foreach_mul_(params, 1 - lr * h.weight_decay)
            else:
                grads = torch._foreach_add(grads, params, alpha=h.weight_decay)
        torch._foreach_lerp_(s.exp_avg, grads, 1 - h.beta1)
        torch._foreach_mul_(v, h.beta2)
        torch._foreach_addcmul_(v, grads, grads, value=1 - h.beta2)
        if h.amsgrad:
            _maximum_(s.max_exp_avg_sq, v)
            v = s.max_exp_avg_sq
        neg_step, c2 = _bias_terms(s.step, params, lr, h)
        denom = torch._foreach_div(torch._foreach_sqrt(v), c2)
        denom = torch._foreach_div(torch._foreach_add(denom, h.eps), neg_step)
        torch._foreach_addcdiv_(params, s.exp_avg, denom)


def _fused(group: Group, h: AdamHyper) -> None:
    """torch's fused kernel, on leaves whose tensors share one dense layout.

    Steps are incremented first, as torch.optim does. With ``skip``, the kernel's own
    ``found_inf`` flag leaves params and moments untouched on the device, and the step
    grows by ``1 - found_inf``: exactly 0 or 1, whatever the count (a ``+ 1 - 1``
    round trip would change counts from 2**24 on).
    """
    s: AdamState = group.state
    found_inf = None if group.skip is None else group.skip.to(torch.float32)
    if found_inf is None:
        torch._foreach_add_(s.step, 1)
    else:
        torch._foreach_add_(s.step, [1 - found_inf] * len(s.step))
    kernel = torch._fused_adamw_ if h.decoupled else torch._fused_adam_
    kernel(
        group.params,
        group.grads,
        s.exp_avg,
        s.exp_avg_sq,
        s.max_exp_avg_sq or [],
        s.step,
        lr=group.lr,
        beta1=h.beta1,
        beta2=h.beta2,
        weight_decay=h.weight_decay,
        eps=h.eps,
        amsgrad=h.amsgrad,
        maximize=h.maximize,
        grad_scale=None,
        found_inf=found_inf,
    )


def _native_kernel(group: Group, h: AdamHyper) -> None:
    """The ``"native"`` kernel: the whole group in one call, one pass (``_native``).

    Honours the kernel contract: grads in fp32 or low precision are divided by
    ``group.scale`` when it is set; ``group.skip`` (the kernel's ``found_inf``) leaves
    every tensor and step count bit-identical; ``group.model``, when set, receives the
    rounded masters. ``_plan`` picks it for CPU groups of one master strategy and one
    state format (``composed_format``), one grad dtype and one model dtype, every tensor
    of a leaf sharing one dense layout (contiguous where draws or 8-bit blocks follow
    the element index).
    """
    s: AdamState = group.state
    if group.params and not _native.plain(group.params[0], s.exp_avg[0]):
        _composed(group, h)
        return
    _native.adam_mixed_(
        group.params,
        group.grads,
        s.exp_avg,
        s.exp_avg_sq,
        s.max_exp_avg_sq,
        s.step,
        group.model,
        lr=group.lr,
        beta1=h.beta1,
        beta2=h.beta2,
        eps=h.eps,
        weight_decay=h.weight_decay,
        decoupled=h.decoupled,
        amsgrad=h.amsgrad,
        maximize=h.maximize,
        grad_scale=group.scale,
        found_inf=group.skip,
    )


def _composed(group: Group, h: AdamHyper) -> None:
    """A group of one non-default (strategy, state format) pair: ``step_composed_``."""
    s: AdamState = group.state
    moments = [s.exp_avg, s.exp_avg_sq, *([s.max_exp_avg_sq] if h.amsgrad else [])]
    strategy, fmt, prims, auxs, data, scales = _native.composed_args(group, moments)
    lr = group.lr
    tensor_lr = lr if isinstance(lr, torch.Tensor) else None
    _native.load().step_composed_(
        strategy,
        fmt,
        prims,
        auxs,
        group.grads,
        data,
        scales,
        s.step,
        group.model or [],
        _native.salts(group, fmt),
        0.0 if tensor_lr is not None else float(lr),
        tensor_lr,
        float(h.beta1),
        float(h.beta2),
        float(h.eps),
        float(h.weight_decay),
        bool(h.decoupled),
        bool(h.amsgrad),
        bool(h.maximize),
        group.scale,
        group.skip,
    )


def _xla(group: Group, h: AdamHyper) -> None:
    """The whole group as one XLA computation (``_build_xla``, run by
    ``_xla_kernels.step``): ``_foreach``'s math op for op, with grads widened and divided
    by ``group.scale`` inside, and ``group.model`` written. The plan picks it on XLA for
    fp32 masters and state."""
    s: AdamState = group.state
    moments = [("exp_avg", s.exp_avg), ("exp_avg_sq", s.exp_avg_sq)]
    if h.amsgrad:
        if s.max_exp_avg_sq is None:
            raise ValueError(
                "xla::mpfunc_adam: max_exp_avg_sq: expected a list of tensors (amsgrad), got None"
            )
        moments.append(("max_exp_avg_sq", s.max_exp_avg_sq))
    decay = h.weight_decay if (h.decoupled and h.weight_decay != 0) else None
    _xla_kernels.step("adam", h, group, moments, decay, _build_xla)


def _build_xla(h: AdamHyper, group: _xla_kernels.Leaves, shared: tuple[Any, ...]) -> Any:
    """The computation of one Adam/AdamW step over ``group``.

    Op for op the HLO of ``_plan._run_mixed`` around ``_foreach`` (with
    ``_optimizer.unless_skipped`` for the skip): the strategy's load, the moments widened,
    the moments by ``lerp`` (``m + (1 - beta1) * (g - m)``) and ``v * beta2 + g*g *
    (1 - beta2)``, the bias corrections ``-lr / (1 - beta1**t)`` and ``sqrt(1 - beta2**t)``
    through ``expm1(t * ln beta)``, ``p + m / ((sqrt(v) / c2 + eps) / c1)``, then the
    moments rounded back and the strategy's store.
    """
    b = _xla_kernels.Builder("mpfunc_adam")
    f32 = torch.float32
    n_moments = 3 if h.amsgrad else 2
    units, moments, S, L = b.fields(group, n_moments)
    md = b.moment_dtype(group, n_moments)
    M, V = moments[0], moments[1]
    VM = moments[2] if h.amsgrad else [None] * len(M)
    G = b.grad_params(group)
    lr_kind, skip_kind, scaled = shared
    lr = b.param((), f32)
    use_decay = h.weight_decay != 0 and h.decoupled
    decay = b.param((), f32) if (use_decay and lr_kind == "float") else None
    if use_decay and decay is None:
        # Tensor lr: ``1 - lr * weight_decay`` in fp32 on the device, as _foreach does.
        decay = b.f32(1.0) - lr * b.f32(h.weight_decay)
    skip = b.skip(skip_kind)
    ins = list(zip(units, b.unscale(G, scaled), M, V, VM, S, L))

    one = b.f32(1.0)
    ln_b1, ln_b2 = b.f32(_ln(h.beta1)), b.f32(_ln(h.beta2))
    w1, w2 = b.f32(1 - h.beta1), b.f32(1 - h.beta2)
    beta2, eps, wd = b.f32(h.beta2), b.f32(h.eps), b.f32(h.weight_decay)
    outs = []
    lows = group.low_dtypes or (None,) * len(ins)
    for i, ((unit, g, m0, v0, vm0, s, old_low), low) in enumerate(zip(ins, lows)):
        g = b.in_turn(group, md, g)  # XLA:CPU's order of work (see there)
        if h.maximize:
            g = -g
        s1 = b.keep(skip, s, s + one)
        q = b.load(group, i, unit, old_low)
        p1 = q
        if h.weight_decay != 0:
            if h.decoupled:
                p1 = q * decay
            else:
                g = g + q * wd
        shape = group.shapes[i]
        draw = (s1, group.salts[i] if group.salts else 0, shape)
        m, v = b.widen(m0, md, shape), b.widen(v0, md, shape)
        m1 = b.once(b.keep(skip, m, m + w1 * (g - m)), md, shape)
        v1 = b.once(b.keep(skip, v, v * beta2 + (g * g) * w2), md, shape)
        vm1 = None
        if vm0 is not None:
            vm = b.widen(vm0, md, shape)
            # XLA:CPU's max drops a NaN second operand (torch's CPU maximum propagates
            # either): vm + v1 is NaN where either is.
            nan = (vm != vm) | (v1 != v1)
            vm1 = b.once(b.keep(skip, vm, nan.select(vm + v1, vm.max(v1))), md, shape)
        vd = v1 if vm1 is None else vm1
        c2 = (-((s1 * ln_b2).expm1())).sqrt()
        c1 = (one / (s1 * ln_b1).expm1()) * lr
        denom = ((vd.sqrt() / c2) + eps) / c1
        master = b.store(skip, group, i, unit, p1 + m1 / denom)
        new = b.narrow(skip, m0, m1, md, draw) + b.narrow(skip, v0, v1, md, draw)
        if vm1 is not None:
            new += b.narrow(skip, vm0, vm1, md, draw)
        outs.extend(master + new + [s1] + b.round_out(skip, old_low, master[0], low))
    return b.xb.Op.tuple(outs).build("mpfunc_adam")


def _rule(name: str) -> Rule:
    kernels = {
        "reference": _reference,
        "foreach": _foreach,
        "fused": _fused,
        "native": _native_kernel,
        "xla": _xla,
    }
    return Rule(name=name, state_type=AdamState, fields=_fields, kernels=kernels)


def _make(
    fn: str,
    lr: object,
    betas: object,
    eps: object,
    weight_decay: object,
    amsgrad: bool,
    maximize: bool,
    impl: str,
    decoupled: bool,
    state_dtype: object = None,
) -> Optimizer:
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
        raise TypeError(f"{fn}: betas: expected a pair of floats, got {betas!r}")
    h = AdamHyper(
        beta1=_checks.real(fn, "betas[0]", betas[0], ge=0.0, lt=1.0),
        beta2=_checks.real(fn, "betas[1]", betas[1], ge=0.0, lt=1.0),
        eps=_checks.real(fn, "eps", eps, ge=0.0),
        weight_decay=_checks.real(fn, "weight_decay", weight_decay, ge=0.0),
        decoupled=decoupled,
        amsgrad=bool(amsgrad),
        maximize=bool(maximize),
    )
    chosen = _checks.choice(fn, "impl", impl, _plan.IMPLS)
    return _plan.elementwise(
        _rule(fn), h, chosen, _checks.lr(fn, lr), _state_format.check(fn, state_dtype)
    )


def adam(
    lr: LRArg = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    amsgrad: bool = False,
    *,
    maximize: bool = False,
    impl: _plan.Impl = "auto",
    state_dtype: torch.dtype | None = None,
) -> Optimizer:
    """Adam with L2 weight decay added to the gradient, as ``torch.optim.Adam``.

    Args:
      lr: a float; a 0-d tensor read at every step (change it in place); or a
        schedule, a function of the 0-d float32 step count (steps already taken: the
        largest among the leaves stepping on the device) returning a float or 0-d tensor.
        Tensors and schedules never recompile on XLA.
      betas, eps, weight_decay, amsgrad, maximize: as in ``torch.optim.Adam``.
      impl: ``"auto"`` (fused kernels on CPU/CUDA where layouts allow, one XLA
        computation per group on XLA for fp32 masters, foreach elsewhere), ``"fused"``
        (falls back to foreach, leaf by leaf, where a leaf's tensors differ in layout),
        ``"xla"`` (XLA devices and fp32 masters only), ``"foreach"`` or ``"reference"``
        (a per-tensor loop). Under ``torch.compile``, ``"auto"`` and ``"fused"`` trace the
        foreach chain, which inductor fuses (torch's fused kernels, mpfunc's native and XLA
        kernels have no functional form to compile).
      state_dtype: how moments are stored: ``None`` (like the master), ``torch.float32``,
        ``torch.bfloat16`` (computed in fp32, stored rounded), ``torch.uint8``
        (blockwise 8-bit, 2.125 bytes per element for two moments with scales) or
        ``torch.uint4`` (blockwise 4-bit, 1.125 bytes; the torch path only): the formats
        of ``state_formats/_state_format.py``'s registry.

    Returns:
      An ``Optimizer`` whose state is an ``AdamState``.

    Raises:
      TypeError, ValueError: a hyperparameter is out of range (lr < 0, betas outside
        [0, 1), eps < 0, weight_decay < 0) or of the wrong type.
    """
    return _make(
        "adam",
        lr,
        betas,
        eps,
        weight_decay,
        amsgrad,
        maximize,
        impl,
        decoupled=False,
        state_dtype=state_dtype,
    )


def adamw(
    lr: LRArg = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    amsgrad: bool = False,
    *,
    maximize: bool = False,
    impl: _plan.Impl = "auto",
    state_dtype: torch.dtype | None = None,
) -> Optimizer:
    """AdamW: Adam with decoupled weight decay, as ``torch.optim.AdamW``.

    Same arguments as ``adam``; ``weight_decay`` defaults to 1e-2 and multiplies
    the masters by ``1 - lr * weight_decay`` before the Adam step.

    Example::

      opt = mpfunc.adamw(lr=3e-4, weight_decay=0.1)
      state = opt.init(masters)
      masters, state = mpfunc.apply_update_(masters, g32, state, opt)
    """
    return _make(
        "adamw",
        lr,
        betas,
        eps,
        weight_decay,
        amsgrad,
        maximize,
        impl,
        decoupled=True,
        state_dtype=state_dtype,
    )

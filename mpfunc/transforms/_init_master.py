"""``init_master``: fresh full-precision copies of a parameter tree."""

from __future__ import annotations

from typing import Any

import torch

from mpfunc.core import _checks, _gc, _tree
from mpfunc.core._checks import Side
from mpfunc.core._tensors import fresh_copy
from mpfunc.strategies import _overwritten, _strategy

__all__ = ["check_params", "init_master", "master_dtype_for"]


def master_dtype_for(t: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    """A leaf's master dtype: ``dtype`` if given, else float32, or float64 for a float64
    leaf. Never narrower than the leaf: a float64 param with a float32 master would lose
    its low bits at the first write back."""
    if dtype is not None:
        return dtype
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def check_params(fn: str, side: Side, dtype: torch.dtype | None) -> None:
    """Refuses what has no faithful master: complex params (mpfunc does not split them
    into real and imaginary parts; a silent ``None`` would never train them), a
    master dtype narrower than its param, and two leaves sharing memory."""
    for i, p in enumerate(side.leaves):
        if p is None:
            continue
        if p.is_complex():
            _checks.fail(
                TypeError,
                fn,
                side.path(i),
                "a real tensor (complex parameters get no master)",
                _checks.describe(p),
                "Train complex parameters with torch.optim, or hold them "
                "as torch.view_as_real pairs",
            )
        if dtype is not None and p.is_floating_point() and p.itemsize > dtype.itemsize:
            _checks.fail(
                ValueError,
                fn,
                f"{side.path(i)}",
                f"a param no wider than the {dtype} master",
                _checks.describe(p),
                "Leave dtype=None: masters are then never narrower",
            )
    # Only floating leaves get masters and are written back; int buffers may share memory.
    floating = [p if p is not None and p.is_floating_point() else None for p in side.leaves]
    _checks.check_no_alias(fn, written=[side._replace(leaves=floating)])


@_gc.without_gc  # a few objects per leaf: no full collections over 100,000 leaves
def init_master(
    params: Any,
    dtype: torch.dtype | None = None,
    *,
    strategy: Any = "fp32",
    seed: int = 0,
    trainable_only: bool = False,
) -> Any:
    """Returns the masters of every floating leaf of ``params``, kept by ``strategy``.

    With the default ``"fp32"`` strategy each master is a full-precision copy with the
    parameter's shape, device and memory layout, in fresh storage that shares nothing
    with the parameter. The other strategies keep the parameter itself plus at most a
    small buffer (see the README's "choosing a strategy"):

    * ``"remainder"``: bf16 param + int16 remainder + a tie bit, exactly the fp32 master
      (2.125 B/param), the param always ``Tensor.to``'s rounding of it;
    * ``"kahan"``: param + a compensation buffer of the param's dtype (2 B/param);
    * ``"stochastic"``: the bf16 param, stochastically rounded (a 4-byte RNG key per leaf);
    * ``"none"``: the param alone, rounded to nearest (plain low-precision training).

    Their masters are NamedTuples (``RemainderMaster(param, remainder, ties)``, ...) that hold
    the model's own param: a step writes it (``apply_update_``), and the checkpoint of
    the masters holds everything needed to resume bit for bit.

    Leaves that are not floating point (int buffers, bool masks) get no master: their
    slot holds ``None``, and every other mpfunc function leaves them alone. ``None``
    leaves stay ``None``. Masters are detached: the transforms are not differentiable.

    Args:
      params: a tree of tensors (dict, list, tuple, NamedTuple, nested), such as
        ``dict(model.named_parameters())``. ``None`` leaves are allowed. Each tensor
        must appear once: tied weights listed under two names are refused.
      dtype: ``None`` (default: float32 masters, float64 for float64 params), or
        ``torch.float32``/``torch.float64`` for every ``"fp32"`` master. The other
        strategies' masters are their own (``torch.float64`` beside one is refused).
      strategy: a strategy name for every leaf, a tree of names shaped like ``params``,
        or a function ``(path, param) -> name`` (``path`` as in error messages:
        ``"layers.0.weight"``).
      seed: the seed of the ``"stochastic"`` strategy's random streams (one per leaf): an
        int in ``[-2**63, 2**64)``, read modulo 2**64 as ``torch.manual_seed`` reads it.
      trainable_only: give no master (``None``) to params with ``requires_grad=False``,
        such as frozen base weights under LoRA: the optimizers then skip them.

    Returns:
      A tree of ``params``' structure holding masters, or ``None`` where a leaf is
      ``None``, not floating point, or frozen under ``trainable_only``.

    Raises:
      TypeError: a leaf is neither a dense tensor nor ``None``, a leaf is complex, or
        ``dtype`` is not a dtype.
      ValueError: ``dtype`` is not float32 or float64 or is narrower than a param (or
        float64 beside a strategy other than ``"fp32"``), two
        leaves share memory (one tensor under two names), a strategy name is unknown, or
        a strategy cannot apply to a leaf (``"remainder"`` on an fp32 param: the error
        names the path and why).

    Example::

      masters = mpfunc.init_master(dict(model.named_parameters()), strategy="remainder")
    """
    fn = "init_master"
    dtype = _checks.master_dtype(fn, dtype)
    seed = _checks.integer(fn, "seed", seed, ge=-(2**63), le=2**64 - 1)  # torch's range
    side, spec = _checks.tensor_leaves(fn, "params", params)
    check_params(fn, side, dtype)
    trained = [
        p
        if p is not None and p.is_floating_point() and (not trainable_only or p.requires_grad)
        else None
        for p in side.leaves
    ]
    kinds = _strategy.resolve(fn, strategy, side._replace(leaves=trained))
    _strategy.check_applies(fn, side, kinds)
    if dtype is not None and dtype != torch.float32:
        for i, s in enumerate(kinds):
            if s is not None and s.unit is not None:  # its master is the strategy's, not dtype's
                _checks.fail(
                    ValueError, fn, side.path(i),
                    f"dtype None or torch.float32 beside strategy {s.name!r} (dtype sets "
                    f"\"fp32\" masters; a {s.name!r} master is the param plus its "
                    f"strategy's buffers)", f"dtype={dtype}",
                    "Use strategy=\"fp32\" for these leaves to keep float64 masters",
                )  # fmt: skip
    with torch.no_grad():
        masters = [
            None
            if s is None or p is None
            else fresh_copy(p, master_dtype_for(p, dtype))
            if s.unit is None
            else s.make(p, seed, i)
            for i, (p, s) in enumerate(zip(side.leaves, kinds))
        ]
    _overwritten.made(masters)  # for masters_to_model_'s stale-unit check
    return _tree.unflatten(spec, masters)

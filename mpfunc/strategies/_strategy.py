"""Master strategies: how each leaf keeps the full-precision value it trains.

A strategy decides what a master *is* between steps. ``"fp32"`` keeps a float32 copy
(the master is a plain tensor). The others keep the model's own low-precision param
and, at most, a small buffer beside it; the master is then a NamedTuple *unit* that
holds the param itself plus that buffer (``RemainderMaster(param, remainder, ties)``, ...):

==============  ============================  =====================================
strategy        persistent bytes beyond param  the fp32 value a step starts from
==============  ============================  =====================================
``fp32``        4 (the master)                 the master
``remainder``   2.125 (int16 + a tie bit)      exactly the fp32 master (``_remainder``)
``kahan``       2 (compensation, param dtype)  param + compensation
``stochastic``  4 per leaf (an RNG key)        the param; stochastically rounded back
``none``        0                              the param; rounded to nearest back
==============  ============================  =====================================

Every optimizer runs on every strategy through one protocol: a step ``load``s the fp32
values of a chunk of leaves into temporaries, runs the optimizer's kernel on them, and
``store``s them back into the encoding (``_plan``). The units are pytree nodes (their
tensors are leaves for checkpoints and shardings); mpfunc's transforms flatten masters
with ``units=True`` so that each unit pairs with one param and one grad.

Adding a strategy: write ``_strategy_<name>.py`` defining a unit NamedTuple and a
``STRATEGY`` (a ``_base.Strategy``), import it here and list it in ``_MODULES`` below.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from mpfunc.core import _checks, _tree
from mpfunc.strategies import (
    _strategy_fp32,
    _strategy_kahan,
    _strategy_none,
    _strategy_remainder,
    _strategy_stochastic,
)
from mpfunc.strategies._base import Strategy, buffer_problem

__all__ = ["STRATEGIES", "Strategy", "buffer_problem", "by_unit", "face", "resolve"]


# The strategies, in the order the docs list them. Each module defines STRATEGY.
_MODULES = (
    _strategy_fp32,
    _strategy_remainder,
    _strategy_kahan,
    _strategy_stochastic,
    _strategy_none,
)
STRATEGIES: dict[str, Strategy] = {}
_BY_UNIT: dict[type, Strategy] = {}


def _load_all() -> None:
    for module in _MODULES:
        s: Strategy = module.STRATEGY
        STRATEGIES[s.name] = s
        if s.unit is not None:
            _tree.register_unit(s.unit)
            _BY_UNIT[s.unit] = s


def by_unit(leaf: Any) -> Strategy | None:
    """The strategy of a master leaf: ``None`` for a tensor (``"fp32"``) or ``None`` leaf."""
    return _BY_UNIT.get(type(leaf))


def face(leaf: Any) -> Any:
    """The tensor that gives a master leaf its shape and device: the master itself, or a
    unit's param (``None`` stays ``None``)."""
    s = _BY_UNIT.get(type(leaf))
    return leaf if s is None else leaf.param


def is_unit(leaf: Any) -> bool:
    return type(leaf) in _BY_UNIT


def _names() -> str:
    return ", ".join(repr(n) for n in STRATEGIES)


def _name(fn: str, where: str, value: object) -> Strategy:
    if isinstance(value, str) and value in STRATEGIES:
        return STRATEGIES[value]
    raise ValueError(f"{fn}: {where}: expected a strategy name ({_names()}), got {value!r}")


def resolve(fn: str, strategy: object, params: _checks.Side) -> list[Strategy | None]:
    """One strategy per leaf of ``params`` (``None`` where the leaf gets no master), from a
    name, a tree of names shaped like the params, or ``fn(path, param) -> name``."""
    leaves = params.leaves
    if isinstance(strategy, str):
        s = _name(fn, "strategy", strategy)
        return [s if p is not None else None for p in leaves]
    if callable(strategy):
        paths = _tree.leaf_paths(params.tree)
        out: list[Strategy | None] = []
        for path, p in zip(paths, leaves):
            out.append(None if p is None else _name(fn, f"strategy({path!r})", strategy(path, p)))
        return out
    names, spec = _tree.flatten(strategy)
    _, p_spec = _tree.flatten(params.tree)
    _checks.check_same_structure(
        fn,
        "params",
        params.tree,
        p_spec,
        "strategy",
        strategy,
        spec,
        "Give one strategy name per param, or a single name, or a function (path, param) -> name",
    )
    side = _checks.Side("strategy", strategy, names)
    return [None if p is None else _name(fn, side.path(i), names[i]) for i, p in enumerate(leaves)]


def check_applies(fn: str, params: _checks.Side, kinds: Sequence[Strategy | None]) -> None:
    """Every chosen strategy applies to its param; else a clear error naming the path."""
    for i, (p, s) in enumerate(zip(params.leaves, kinds)):
        if p is None or s is None:
            continue
        why = s.why_not(p)
        if why is not None:
            if p.dtype in (torch.float32, torch.float64):  # a mixed model: fp32 norms
                why += (
                    f". In a model that keeps some params in {p.dtype} beside bf16 ones, "
                    f"choose per leaf: strategy=lambda path, p: {s.name!r} if p.dtype == "
                    f"torch.bfloat16 else 'none' (a {p.dtype} param is its own exact "
                    f"master: 'none' steps it in place, as torch.optim does)"
                )
            _checks.fail(
                ValueError,
                fn,
                params.path(i),
                f"a param the {s.name!r} strategy applies to",
                _checks.describe(p),
                why,
            )


_MASTER_DTYPES = (torch.float32, torch.float64)


def master_leaves(
    fn: str, name: str, tree: Any, flat: tuple[list[Any], Any] | None = None
) -> tuple[_checks.Side, Any]:
    """Flattens a masters tree with each unit as one leaf (or takes ``flat``, what
    ``_tree.flatten(tree, units=True)`` returned), and checks every leaf: ``None``, a dense
    float32/float64 tensor, or a unit whose tensors fit together; every tensor's storage
    holds its elements."""
    leaves, spec = _tree.flatten(tree, units=True) if flat is None else flat
    side = _checks.Side(name, tree, leaves, units=True)
    strided, Tensor = torch.strided, torch.Tensor
    for leaf in leaves:
        if leaf is None:
            continue
        if isinstance(leaf, Tensor) and leaf.layout is strided and leaf.dtype in _MASTER_DTYPES:
            continue
        if type(leaf) in _BY_UNIT and unit_problem(leaf) is None:
            continue
        _explain(fn, side)
    _checks.check_storage(fn, side)
    _checks.check_not_differentiated(fn, side, face)
    return side, spec


def _explain(fn: str, side: _checks.Side) -> None:
    for i, leaf in enumerate(side.leaves):
        if leaf is None:
            continue
        if type(leaf) in _BY_UNIT:
            why = unit_problem(leaf)
            if why is not None:
                _checks.fail(
                    ValueError,
                    fn,
                    side.path(i),
                    f"a {type(leaf).__name__} made by init_master",
                    why,
                )
            continue
        if not isinstance(leaf, torch.Tensor):
            _checks.fail(
                TypeError, fn, side.path(i), "a tensor or None leaf", _checks.describe(leaf)
            )
        if leaf.layout is not torch.strided:
            _checks.fail(
                TypeError, fn, side.path(i), "a dense (strided) tensor", _checks.describe(leaf)
            )
        if leaf.dtype not in _MASTER_DTYPES:
            _checks.fail(
                TypeError,
                fn,
                side.path(i),
                "a float32 or float64 master",
                _checks.describe(leaf),
                "Masters come from init_master; grads go second",
            )


def unit_problem(leaf: Any) -> str | None:
    """What is wrong with a master unit's tensors, if anything."""
    s = _BY_UNIT[type(leaf)]
    Tensor, strided = torch.Tensor, torch.strided
    for t in leaf:
        if not isinstance(t, Tensor) or t.layout is not strided:
            for name, t in zip(leaf._fields, leaf):
                if not isinstance(t, Tensor) or t.layout is not strided:
                    return f"its {name} is {_checks.describe(t)}, not a dense tensor"
    return s.check(leaf)


_load_all()

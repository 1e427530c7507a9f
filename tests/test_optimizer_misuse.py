"""A functional optimizer used as a torch.optim one (``zero_grad``, ``step``,
``param_groups``, an LR scheduler): errors that point to the fix; the optimizer stays a
plain NamedTuple."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import mpfunc

_POINTER = (
    r"mpfunc\.MasterOptimizer\(model\.parameters\(\), opt=mpfunc\.{}.*mpfunc\.apply_update_\("
)


@pytest.mark.parametrize("factory", ["sgd", "adam", "adamw", "lion"])
@pytest.mark.parametrize(
    "use",
    [
        lambda opt: opt.step(),
        lambda opt: opt.zero_grad(),
        lambda opt: opt.param_groups,
        lambda opt: opt.state_dict(),
        lambda opt: opt.load_state_dict({}),
        lambda opt: opt.add_param_group({}),
        lambda opt: opt.state,
        lambda opt: opt.defaults,
    ],
    ids=["step", "zero_grad", "param_groups", "state_dict", "load", "add_group", "state", "defs"],
)
def test_torch_optim_habits_on_a_functional_optimizer_point_to_the_fix(
    factory: str, use: Any
) -> None:
    """Issue 20, item 12: ``mpfunc.adamw().step()`` said only "'Optimizer' object has no
    attribute 'step'". The AttributeError now names ``mpfunc.MasterOptimizer`` (with the
    factory to pass) and ``mpfunc.apply_update_``."""
    opt = getattr(mpfunc, factory)(**({"lr": 0.1} if factory == "sgd" else {}))
    with pytest.raises(AttributeError, match=_POINTER.format(factory)) as info:
        use(opt)
    assert info.value.name in str(info.value) and info.value.obj is opt


def test_the_optimizer_stays_a_plain_named_tuple() -> None:
    """The pointer changes nothing else: optree flattens the Optimizer as before (four
    leaves, a namedtuple node), it pickles and copies, its fields read as before, and
    other missing attributes give the plain AttributeError (``hasattr`` and copy's
    ``__deepcopy__`` probe still work)."""
    import copy
    import pickle

    import optree

    from mpfunc.core._optimizer import Optimizer

    opt = mpfunc.adamw()
    leaves, spec = optree.tree_flatten(opt)
    assert leaves == [opt.init, opt.plan, True, "adamw"]
    assert spec.kind == optree.PyTreeKind.NAMEDTUPLE and spec.type is Optimizer
    assert optree.tree_unflatten(spec, leaves) == opt
    assert not hasattr(opt, "step") and not hasattr(opt, "param_groups")
    assert copy.copy(opt) == opt and copy.deepcopy(opt) == opt
    assert opt._replace(name="x").name == "x" and opt._fields == Optimizer._fields
    picklable = Optimizer(len, len, False, "sgd")  # the factories' closures are local
    assert pickle.loads(pickle.dumps(picklable)) == picklable
    with pytest.raises(AttributeError, match=r"^'Optimizer' object has no attribute 'stpe'$"):
        opt.stpe  # noqa: B018
    other = mpfunc.torch_optimizer(torch.optim.SGD, lr=0.1)
    with pytest.raises(AttributeError, match=r"this optimizer \('torch\.SGD'\).*opt=mpfunc\.adamw"):
        other.step()


def _schedulers() -> list[Any]:
    s = torch.optim.lr_scheduler
    return [
        pytest.param(lambda o: s.LambdaLR(o, lambda n: 1.0), "pointer", id="LambdaLR"),
        pytest.param(lambda o: s.MultiplicativeLR(o, lambda n: 1.0), "pointer", id="Mult"),
        pytest.param(lambda o: s.StepLR(o, 1), "torch", id="StepLR"),
        pytest.param(lambda o: s.MultiStepLR(o, [1]), "torch", id="MultiStepLR"),
        pytest.param(lambda o: s.ConstantLR(o), "torch", id="ConstantLR"),
        pytest.param(lambda o: s.LinearLR(o), "torch", id="LinearLR"),
        pytest.param(lambda o: s.ExponentialLR(o, 0.9), "torch", id="ExponentialLR"),
        pytest.param(lambda o: s.PolynomialLR(o), "torch", id="PolynomialLR"),
        pytest.param(lambda o: s.CosineAnnealingLR(o, 10), "torch", id="Cosine"),
        pytest.param(lambda o: s.CosineAnnealingWarmRestarts(o, 10), "torch", id="Restarts"),
        pytest.param(lambda o: s.CyclicLR(o, 0.1, 1.0), "torch", id="CyclicLR"),
        pytest.param(lambda o: s.OneCycleLR(o, 1.0, total_steps=10), "torch", id="OneCycle"),
        pytest.param(lambda o: s.ReduceLROnPlateau(o), "torch", id="Plateau"),
    ]


@pytest.mark.parametrize(("make", "says"), _schedulers())
def test_an_lr_scheduler_on_a_functional_optimizer(make: Any, says: str) -> None:
    """Issue 20, item 12: what a user sees when handing ``mpfunc.adamw()`` to a
    torch.optim.lr_scheduler. Schedulers that read ``optimizer.param_groups`` first
    (LambdaLR, MultiplicativeLR) now raise the AttributeError naming
    ``mpfunc.MasterOptimizer`` and ``mpfunc.apply_update_`` (before: "no attribute
    'param_groups'"). The others start with torch's own check,
    ``isinstance(optimizer, torch.optim.Optimizer)``, and raise torch's TypeError
    "Optimizer is not an Optimizer" before touching the object: mpfunc cannot change
    that message without monkeypatching torch (which it does not do), so it is pinned
    here as documentation. MasterOptimizer itself works with every scheduler
    (tests/test_master_optimizer.py)."""
    opt = mpfunc.adamw()
    if says == "pointer":
        with pytest.raises(AttributeError, match=_POINTER.format("adamw")):
            make(opt)
    else:
        with pytest.raises(TypeError, match=r"^Optimizer is not an Optimizer$"):
            make(opt)

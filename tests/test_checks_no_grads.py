"""A step that would train nothing: all-``None`` grads and grads read from a state dict
are errors naming the likely causes; some ``None`` grads still step the others."""

from __future__ import annotations

import pytest
import torch
from support.entry_checks import (
    BF16,
    _refused,
    _setup,
)

import mpfunc

_NO_GRAD = (
    r"^{fn}: grads: expected a grad for at least one master, got None for every master "
    r"\(3\), so nothing would be trained and no step counted\. Was loss\.backward\(\) called "
    r"before the step .*model\.state_dict\(\).*dict\(model\.named_parameters\(\)\)"
)


@pytest.mark.parametrize("fn", ["apply_update_", "apply_update"])
def test_all_none_grads_are_an_error_naming_the_likely_causes(fn: str) -> None:
    """Issue 20, item 11: with every grad ``None`` (backward forgotten, or grads read from
    ``model.state_dict()``'s detached tensors) a step trained nothing and counted nothing,
    silently. Now it raises, naming both causes; nothing is written."""
    params, masters, _, state, opt = _setup()
    none = {k: None for k in masters}
    kwargs = {"params": params} if fn == "apply_update_" else {}
    regex = _NO_GRAD.format(fn=fn)
    _refused(ValueError, regex, getattr(mpfunc, fn), masters, none, state, opt, **kwargs)


def test_grads_read_from_a_state_dict_are_an_error() -> None:
    """The README's loop with ``model.state_dict()`` as the params tree: its tensors are
    detached, so after backward every grad read from them is ``None``."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.ReLU(), torch.nn.Linear(2, 1))
    params = dict(model.state_dict())
    masters = mpfunc.init_master(params)
    opt = mpfunc.adamw(lr=1e-2)
    state = opt.init(masters)
    model(torch.randn(4, 3)).sum().backward()
    grads = {k: p.grad for k, p in params.items()}
    regex = _NO_GRAD.format(fn="apply_update_").replace(r"\(3\)", r"\(4\)")
    _refused(ValueError, regex, mpfunc.apply_update_, masters, grads, state, opt, params=params)


def test_some_none_grads_still_step_the_others() -> None:
    params, masters, grads, state, opt = _setup()
    grads["a"] = grads["b"] = None  # type: ignore[assignment]
    mpfunc.apply_update_(masters, grads, state, opt, params=params)
    assert {k: int(s) for k, s in state.step.items()} == {"a": 0, "b": 0, "c": 1}


def test_masters_without_any_floating_leaf_need_no_grad() -> None:
    """A tree with no master at all (int buffers only) has nothing to train: no error."""
    params = {"n": torch.tensor(3)}
    masters = mpfunc.init_master(params)
    opt = mpfunc.adamw()
    mpfunc.apply_update_(masters, {"n": None}, opt.init(masters), opt, params=params)


def test_master_optimizer_step_without_grads_does_nothing() -> None:
    """``MasterOptimizer`` is a torch.optim.Optimizer: a step where no param has a
    ``.grad`` does nothing, as torch.optim's does, and warns once (NoGradWarning: the
    usual cause, a model moved after the optimizer was made, trains nothing)."""
    from mpfunc.optim._master_optimizer import NoGradWarning

    model = torch.nn.Linear(3, 2).to(BF16)
    opt = mpfunc.MasterOptimizer(model.parameters(), lr=1e-2)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.warns(NoGradWarning):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert opt.state_dict()["state"] == {} or all(
        int(s["step"]) == 0 for s in opt.state_dict()["state"].values()
    )

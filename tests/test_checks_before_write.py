"""Every check of the in-place transforms runs before any write: a table of sparse,
expanded, float8, aliased and second-group faults for every in-place function, each
raising the right exception with a message naming the pytree path, what was expected
and what arrived, and leaving every input's bits and ``_version`` as they were
(``error_table.check_row``); partition's cross-label aliasing and state errors."""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import partial
from typing import Any

import pytest
import torch
from support.error_table import Call, WrongMessage, call, row
from support.hardening import (
    _DENSE,
    _SHARED,
    BF16,
    F32,
    F64,
    OPTS,
    W,
    _alias,
    _assert_unchanged,
    _at,
    _desc,
    _fp8,
    _rand,
    _snapshot,
    _tree,
    _windows,
    _with,
)

import mpfunc

# torch warns once per process that CSR support is in beta; these tests only hand CSR
# tensors to functions that must refuse them.
pytestmark = pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta:UserWarning")


def _get(tree: Any, path: str) -> Any:
    for key in path.split("."):
        tree = tree[key]
    return tree


def _expanded(shape: tuple[int, ...], dtype: torch.dtype = F32) -> torch.Tensor:
    return torch.zeros(shape[-1], dtype=dtype).expand(shape)


def _folded(shape: tuple[int, ...] = W) -> torch.Tensor:
    """A view whose elements overlap without a zero stride: ``as_strided`` (2, 3), (1, 1)."""
    return torch.zeros(8).as_strided(shape, (1, 1))


def _put_pair(inp: Inputs, key: str, pair: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Puts two tensors at a.w and z.w of ``inp[key]``."""
    _put(inp, key, "a.w", pair[0])
    _put(inp, key, "z.w", pair[1])


def _coo(shape: tuple[int, ...], dtype: torch.dtype = F32) -> torch.Tensor:
    return _rand(shape, dtype, 7).to_sparse()


def _csr(shape: tuple[int, ...], dtype: torch.dtype = F32) -> torch.Tensor:
    return _rand(shape, dtype, 7).to_sparse_csr()


# The state field that holds a moment like the masters (partition: z.w is labelled "d").
MOMENT = {
    "sgd": "momentum_buffer",
    "adam": "exp_avg",
    "adamw": "exp_avg",
    "lion": "exp_avg",
    "partition": "exp_avg",
}


Inputs = dict[str, Any]


Change = Callable[[Inputs], None]


def _put(inp: Inputs, key: str, path: str, value: Any) -> None:
    inp[key] = _with(inp[key], path, value)


def _put_state(name: str, inp: Inputs, field: str, path: str, value: Any) -> None:
    s = inp["state"]
    if name == "partition":  # z.w belongs to the "d" (adamw) sub-state
        inp["state"] = {
            **s,
            "d": s["d"]._replace(**{field: _with(getattr(s["d"], field), path, value)}),
        }
    else:
        inp["state"] = s._replace(**{field: _with(getattr(s, field), path, value)})


def _update_inputs(name: str, z: torch.dtype) -> Inputs:
    """Masters one real step in (moments non-zero, counts 1), fresh grads and the opt."""
    opt = OPTS[name]()
    m, g = _tree(F32, 0, z), _tree(F32, 10, z)
    s = opt.init(m)
    mpfunc.apply_update_(m, g, s, opt)
    return {"masters": m, "grads": _tree(F32, 20, z), "state": s, "opt": opt}


def _g2f_inputs(z: torch.dtype) -> Inputs:
    return {"grads": _tree(BF16, 0, z), "out": _tree(F32, 30, F64 if z == F64 else F32)}


def _m2m_inputs(z: torch.dtype) -> Inputs:
    # Masters one step away from the params, so any early write would show.
    return {"masters": _tree(F32, 40, F64 if z == F64 else F32), "params": _tree(BF16, 0, z)}


def _acc_inputs(z: torch.dtype) -> Inputs:
    return {"acc": _tree(F32, 50, F64 if z == F64 else F32), "grads": _tree(BF16, 0, z)}


def _clip_inputs(z: torch.dtype) -> Inputs:
    return {"grads": _tree(F32, 60, z)}


def _set(key: str, value: Callable[[Inputs], Any]) -> Change:
    """Puts ``value(inputs)`` at z.w of ``inputs[key]``."""

    def change(inp: Inputs) -> None:
        _put(inp, key, "z.w", value(inp))

    return change


def _set_state(name: str, field: str, value: Callable[[Inputs], Any]) -> Change:
    """Puts ``value(inputs)`` at z.w of the state field (in the "d" sub-state of a partition)."""

    def change(inp: Inputs) -> None:
        _put_state(name, inp, field, "z.w", value(inp))

    return change


def _zw(key: str) -> Callable[[Inputs], Any]:
    """The tensor now at z.w of ``inputs[key]``: to put it under a second name."""
    return lambda inp: _get(inp[key], "z.w")


def _then(*changes: Change) -> Change:
    def change(inp: Inputs) -> None:
        for c in changes:
            c(inp)

    return change


def _case(
    fn: Callable[..., Any],
    build: Callable[[torch.dtype], Inputs],
    order: tuple[str, ...],
    change: Change,
    z: torch.dtype = F32,
    **kwargs: Any,
) -> Callable[[], Call]:
    def make() -> Call:
        inp = build(z)
        change(inp)
        return call(fn, *[inp[k] for k in order], **kwargs)

    return make


def _strides(shape: tuple[int, ...], dtype: torch.dtype = F32) -> str:
    return _desc(shape, dtype) + f" with strides {_expanded(shape).stride()}"


def _update_rows() -> list[Any]:
    fn = "apply_update_"
    rows = []
    for name in OPTS:
        mom = MOMENT[name]
        st = "state['d']" if name == "partition" else "state"  # how errors name the state
        build = partial(_update_inputs, name)
        c = partial(_case, mpfunc.apply_update_, build, ("masters", "grads", "state", "opt"))
        rows += [
            row(f"{name}-grad-coo", c(_set("grads", lambda i: _coo(W))), TypeError,
                _at(fn, "grads.z.w", _DENSE, _desc(W, F32, "sparse_coo"))),
            row(f"{name}-grad-csr", c(_set("grads", lambda i: _csr(W))), TypeError,
                _at(fn, "grads.z.w", _DENSE, _desc(W, F32, "sparse_csr"))),
            row(f"{name}-master-expanded",
                c(_set("masters", lambda i: _expanded(W))), ValueError,
                _at(fn, "masters.z.w", _SHARED, _strides(W))),
            row(f"{name}-moment-expanded",
                c(_set_state(name, mom, lambda i: _expanded(W))), ValueError,
                _at(fn, f"{st}.{mom}.z.w", _SHARED, _strides(W))),
            row(f"{name}-grad-is-master",
                c(_set("grads", _zw("masters"))), ValueError,
                _alias(fn, "masters.z.w", "grads.z.w")),
            row(f"{name}-moment-is-master",
                c(_set_state(name, mom, _zw("masters"))), ValueError,
                _alias(fn, "masters.z.w", f"{st}.{mom}.z.w")),
            row(f"{name}-moment-is-grad",
                c(_set_state(name, mom, _zw("grads"))),
                ValueError, _alias(fn, "grads.z.w", f"{st}.{mom}.z.w")),
            row(f"{name}-master-folded", c(_set("masters", lambda i: _folded())),
                ValueError, _at(fn, "masters.z.w", _SHARED, _desc(W) + " with strides (1, 1)")),
            row(f"{name}-masters-overlap-partly",
                c(lambda i: _put_pair(i, "masters", _windows(3))), ValueError,
                _alias(fn, "masters.a.w", "masters.z.w")),
            row(f"{name}-master-views-master",
                c(_set("masters", lambda i: _get(i["masters"], "a.w")[:])), ValueError,
                _alias(fn, "masters.a.w", "masters.z.w")),
            row(f"{name}-fp64-group-bad-step",
                c(_set_state(name, "step", lambda i: torch.zeros(1)), z=F64), ValueError,
                _at(fn, f"{st}.step.z.w", "a 0-d float32 step count", _desc((1,)))),
            row(f"{name}-fp64-group-bad-moment",
                c(_set_state(name, mom, lambda i: torch.zeros(W)), z=F64), TypeError,
                _at(fn, f"{st}.{mom}.z.w", "torch.float64 (the master's dtype)", _desc(W))),
            row(f"{name}-fp64-group-expanded-master",
                c(_set("masters", lambda i: _expanded(W, F64)), z=F64), ValueError,
                _at(fn, "masters.z.w", _SHARED, _strides(W, F64))),
        ]  # fmt: skip
    return rows


def _transform_rows() -> list[Any]:
    g2f = partial(_case, mpfunc.grads_to_fp32_, _g2f_inputs, ("grads", "out"))
    m2m = partial(_case, mpfunc.masters_to_model_, _m2m_inputs, ("masters", "params"))
    acc = partial(_case, mpfunc.accumulate_grads_, _acc_inputs, ("acc", "grads"))
    clip = partial(_case, mpfunc.clip_by_global_norm_, _clip_inputs, ("grads",), max_norm=0.1)
    fl = "a floating-point grad"
    f8 = _desc(W, torch.float8_e4m3fn)
    return [
        # grads_to_fp32_: grads read, out written
        row("g2f-grad-coo", g2f(_set("grads", lambda i: _coo(W, BF16))), TypeError,
            _at("grads_to_fp32_", "grads.z.w", _DENSE, _desc(W, BF16, "sparse_coo"))),
        row("g2f-grad-csr", g2f(_set("grads", lambda i: _csr(W, BF16))), TypeError,
            _at("grads_to_fp32_", "grads.z.w", _DENSE, _desc(W, BF16, "sparse_csr"))),
        row("g2f-out-coo", g2f(_set("out", lambda i: _coo(W))), TypeError,
            _at("grads_to_fp32_", "out.z.w", _DENSE, _desc(W, F32, "sparse_coo"))),
        row("g2f-grad-fp8", g2f(_set("grads", lambda i: _fp8(W))), TypeError,
            _at("grads_to_fp32_", "grads.z.w", fl, f8)),
        row("g2f-out-expanded", g2f(_set("out", lambda i: _expanded(W))), ValueError,
            _at("grads_to_fp32_", "out.z.w", _SHARED, _strides(W))),
        row("g2f-out-views-out",
            g2f(_set("out", lambda i: _get(i["out"], "a.w")[:])), ValueError,
            _alias("grads_to_fp32_", "out.a.w", "out.z.w")),
        row("g2f-out-is-grad",
            g2f(_then(_set("grads", lambda i: _rand(W)), _set("out", _zw("grads")))), ValueError,
            _alias("grads_to_fp32_", "grads.z.w", "out.z.w")),
        row("g2f-fp64-group-expanded-out",
            g2f(_set("out", lambda i: _expanded(W, F64)), z=F64), ValueError,
            _at("grads_to_fp32_", "out.z.w", _SHARED, _strides(W, F64))),
        # masters_to_model_: masters read, params written
        row("m2m-param-coo", m2m(_set("params", lambda i: _coo(W, BF16))), TypeError,
            _at("masters_to_model_", "params.z.w", _DENSE, _desc(W, BF16, "sparse_coo"))),
        row("m2m-master-csr", m2m(_set("masters", lambda i: _csr(W))), TypeError,
            _at("masters_to_model_", "masters.z.w", _DENSE, _desc(W, F32, "sparse_csr"))),
        row("m2m-param-expanded",
            m2m(_set("params", lambda i: _expanded(W, BF16))), ValueError,
            _at("masters_to_model_", "params.z.w", _SHARED, _strides(W, BF16))),
        row("m2m-param-is-param",
            m2m(_set("params", lambda i: _get(i["params"], "a.w"))), ValueError,
            _alias("masters_to_model_", "params.a.w", "params.z.w")),
        row("m2m-param-is-master",
            m2m(_set("params", _zw("masters"))), ValueError,
            _alias("masters_to_model_", "masters.z.w", "params.z.w")),
        row("m2m-fp64-group-expanded-param",
            m2m(_set("params", lambda i: _expanded(W, F64)), z=F64), ValueError,
            _at("masters_to_model_", "params.z.w", _SHARED, _strides(W, F64))),
        # accumulate_grads_: grads read, acc written
        row("acc-grad-coo", acc(_set("grads", lambda i: _coo(W, BF16))), TypeError,
            _at("accumulate_grads_", "grads.z.w", _DENSE, _desc(W, BF16, "sparse_coo"))),
        row("acc-grad-csr", acc(_set("grads", lambda i: _csr(W, BF16))), TypeError,
            _at("accumulate_grads_", "grads.z.w", _DENSE, _desc(W, BF16, "sparse_csr"))),
        row("acc-grad-fp8", acc(_set("grads", lambda i: _fp8(W))), TypeError,
            _at("accumulate_grads_", "grads.z.w", fl, f8)),
        row("acc-acc-expanded", acc(_set("acc", lambda i: _expanded(W))), ValueError,
            _at("accumulate_grads_", "acc.z.w", _SHARED, _strides(W))),
        row("acc-acc-views-acc",
            acc(_set("acc", lambda i: _get(i["acc"], "a.w")[:])), ValueError,
            _alias("accumulate_grads_", "acc.a.w", "acc.z.w")),
        row("acc-acc-is-grad",
            acc(_then(_set("grads", lambda i: _rand(W)), _set("acc", _zw("grads")))), ValueError,
            _alias("accumulate_grads_", "grads.z.w", "acc.z.w")),
        row("acc-fp64-group-expanded-acc",
            acc(_set("acc", lambda i: _expanded(W, F64)), z=F64), ValueError,
            _at("accumulate_grads_", "acc.z.w", _SHARED, _strides(W, F64))),
        # clip_by_global_norm_: grads written
        row("clip-grad-coo", clip(_set("grads", lambda i: _coo(W))), TypeError,
            _at("clip_by_global_norm_", "grads.z.w", _DENSE, _desc(W, F32, "sparse_coo"))),
        row("clip-grad-csr", clip(_set("grads", lambda i: _csr(W))), TypeError,
            _at("clip_by_global_norm_", "grads.z.w", _DENSE, _desc(W, F32, "sparse_csr"))),
        row("clip-grad-fp8", clip(_set("grads", lambda i: _fp8(W))), TypeError,
            _at("clip_by_global_norm_", "grads.z.w", fl, f8)),
        row("clip-grad-expanded", clip(_set("grads", lambda i: _expanded(W))),
            ValueError, _at("clip_by_global_norm_", "grads.z.w", _SHARED, _strides(W))),
        row("clip-grad-views-grad",
            clip(_set("grads", lambda i: _get(i["grads"], "a.w")[:])), ValueError,
            _alias("clip_by_global_norm_", "grads.a.w", "grads.z.w")),
        row("clip-fp64-group-expanded",
            clip(_set("grads", lambda i: _expanded(W, F64)), z=F64), ValueError,
            _at("clip_by_global_norm_", "grads.z.w", _SHARED, _strides(W, F64))),
    ]  # fmt: skip


@pytest.mark.parametrize(("make", "exc", "regex"), _update_rows() + _transform_rows())
def test_bad_input_raises_naming_the_path_and_writes_nothing(
    make: Callable[[], Call], exc: type[Exception], regex: str
) -> None:
    """Item 5 and item 2 (aliasing at every in-place write): sparse grads, expanded written
    tensors, float8 grads, aliases between trees and within one, and faults in the second
    (device, dtype) group all raise before the first write."""
    check_row(make, exc, regex)


def check_row(make: Callable[[], Call], exc: type[Exception], regex: str) -> None:
    """``error_table.check_row``, for every input this file makes: ``error_table``'s bit
    view fails on sparse tensors and on 1-d stride-0 tensors, so bits are compared on a
    dense, contiguous copy here (the ``_version`` check is on the input itself)."""
    fn, args, kwargs = make()
    before = _snapshot((args, kwargs))
    with pytest.raises(exc) as info:
        fn(*args, **kwargs)
    _assert_unchanged(before)
    if not re.search(regex, str(info.value)):
        raise WrongMessage(f"{str(info.value)!r}\ndoes not match\n{regex!r}")


def _cross_label(target: str) -> Call:
    """A partition whose "n" (sgd) sub-state holds a view of a tensor another label owns:
    z.w's master, z.w's adamw moment or z.w's grad (a.b is labelled "n", z.w "d")."""
    inp = _update_inputs("partition", F32)
    m, g, s = inp["masters"], inp["grads"], inp["state"]
    owner = {"master": m, "state": s["d"].exp_avg, "grad": g}[target]
    victim = _get(owner, "z.w")
    s["n"] = s["n"]._replace(momentum_buffer=_with(s["n"].momentum_buffer, "a.b", victim[0]))
    return call(mpfunc.apply_update_, m, g, s, inp["opt"])


@pytest.mark.parametrize("target", ["master", "state", "grad"])
def test_partition_refuses_aliasing_across_labels(target: str) -> None:
    """Each sub-plan checks its own leaves; a sub-state tensor sharing memory with another
    label's master, state or grad is caught too (once found accepted, then written twice)."""
    check_row(partial(_cross_label, target), ValueError, "shares no memory with")


def test_partition_state_errors_name_the_label() -> None:
    """A bad leaf in a partition's sub-state: the path must say which sub-state holds it."""
    inp = _update_inputs("partition", F32)
    _put_state("partition", inp, "exp_avg", "z.w", _expanded(W))
    with pytest.raises(ValueError, match=re.escape("at \"state['d'].exp_avg.z.w\"")):
        mpfunc.apply_update_(inp["masters"], inp["grads"], inp["state"], inp["opt"])

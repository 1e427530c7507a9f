"""Error paths are linear in the number of leaves: a bad last leaf of 10,000 is found
fast."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from support.error_table import Call, call, row
from support.hardening import (
    _DENSE,
    _SHARED,
    BF16,
    F32,
    _alias,
    _assert_unchanged,
    _at,
    _fp8,
    _snapshot,
)

import mpfunc

# torch warns once per process that CSR support is in beta; these tests only hand CSR
# tensors to functions that must refuse them.
pytestmark = pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta:UserWarning")


N = 10_000


LIMIT_S = 10.0  # quadratic paths took ~90 s at 4,000 leaves


def _many(dtype: torch.dtype, last: Any = None) -> dict[str, list[Any]]:
    xs: list[Any] = [torch.full((2,), 0.5, dtype=dtype) for _ in range(N)]
    if last is not None:
        xs[-1] = last(xs) if callable(last) else last
    return {"layers": xs}


LASTBAD = f"layers.{N - 1}"


def _update_many(last_grad: Any = None, last_master: Any = None, alias: bool = False) -> Call:
    opt = mpfunc.adamw(lr=0.1)
    m = _many(F32, last_master)
    g = _many(F32, last_grad)
    if alias:  # the last grad is the first master
        g["layers"][-1] = m["layers"][0]
    return call(mpfunc.apply_update_, m, g, opt.init(m), opt)


def _partition_many() -> Call:
    # Labels from a function: the last leaf's label is unknown. The error names it by path.
    opt = mpfunc.partition(
        {"a": mpfunc.sgd(lr=0.1)}, lambda path, m: "b" if path == LASTBAD else "a"
    )
    m = _many(F32)
    return call(mpfunc.apply_update_, m, _many(F32), {"a": mpfunc.sgd(lr=0.1).init(m)}, opt)


def _g2f_many(last_grad: Any = None, last_out: Any = None) -> Call:
    return call(mpfunc.grads_to_fp32_, _many(BF16, last_grad), _many(F32, last_out))


def _m2m_many(last_param: Any) -> Call:
    return call(mpfunc.masters_to_model_, _many(F32), _many(BF16, last_param))


LINEAR: list[Any] = [
    row("g2f-grad-int", lambda: _g2f_many(last_grad=torch.zeros(2, dtype=torch.int32)),
        TypeError, _at("grads_to_fp32_", f"grads.{LASTBAD}", "a floating-point grad")),
    row("g2f-out-shape", lambda: _g2f_many(last_out=torch.zeros(3)),
        ValueError, _at("grads_to_fp32_", f"out.{LASTBAD}", "shape (2,) (the grad's)")),
    row("g2f-grad-coo", lambda: _g2f_many(last_grad=torch.zeros(2, dtype=BF16).to_sparse()),
        TypeError, _at("grads_to_fp32_", f"grads.{LASTBAD}", _DENSE)),
    row("g2f-out-alias", lambda: _g2f_many(last_out=lambda xs: xs[0]),
        ValueError, _alias("grads_to_fp32_", "out.layers.0", f"out.{LASTBAD}")),
    row("update-grad-dtype", lambda: _update_many(last_grad=torch.zeros(2, dtype=torch.float64)),
        TypeError,
        _at("apply_update_", f"grads.{LASTBAD}", "a grad no wider than its 32-bit master")),
    row("update-master-expanded", lambda: _update_many(last_master=torch.zeros(1).expand(2)),
        ValueError, _at("apply_update_", f"masters.{LASTBAD}", _SHARED)),
    row("update-grad-alias", lambda: _update_many(alias=True),
        ValueError, _alias("apply_update_", "masters.layers.0", f"grads.{LASTBAD}")),
    row("m2m-param-shape", lambda: _m2m_many(torch.zeros(3, dtype=BF16)),
        ValueError, _at("masters_to_model_", f"params.{LASTBAD}", "shape (2,) (the master's)")),
    row("m2m-param-alias", lambda: _m2m_many(lambda xs: xs[0]),
        ValueError, _alias("masters_to_model_", "params.layers.0", f"params.{LASTBAD}")),
    row("acc-grad-fp8",
        lambda: call(mpfunc.accumulate_grads_, _many(F32), _many(BF16, _fp8((2,)))),
        TypeError, _at("accumulate_grads_", f"grads.{LASTBAD}", "a floating-point grad")),
    row("init-master-alias", lambda: call(mpfunc.init_master, _many(BF16, lambda xs: xs[0])),
        ValueError, _alias("init_master", "params.layers.0", f"params.{LASTBAD}")),
    row("partition-label", _partition_many,
        ValueError, _at("apply_update_", f"masters.{LASTBAD}", "a label among ['a']", "'b'")),
    row("clip-grad-expanded",
        lambda: call(mpfunc.clip_by_global_norm_, _many(F32, torch.zeros(1).expand(2)), 1.0),
        ValueError, _at("clip_by_global_norm_", f"grads.{LASTBAD}", _SHARED)),
]  # fmt: skip


@pytest.mark.parametrize(("make", "exc", "regex"), LINEAR)
def test_error_with_only_the_last_of_10000_leaves_bad_is_fast(
    make: Callable[[], Call], exc: type[Exception], regex: str
) -> None:
    fn, args, kwargs = make()
    before = _snapshot((args, kwargs))
    start = time.perf_counter()
    with pytest.raises(exc) as info:
        fn(*args, **kwargs)
    elapsed = time.perf_counter() - start
    assert elapsed < LIMIT_S, f"{elapsed:.1f} s for {N} leaves"
    _assert_unchanged(before)
    assert re.search(regex, str(info.value)), str(info.value)

"""Bad inputs to the training-loop pieces raise ``TypeError``/``ValueError`` and modify nothing.

The style of ``test_checks_table.py``: one table of rows (a callable that builds the call with
fresh tensors, the exception type, a regex the message must match). Each message must
name the function, the dotted pytree path where a leaf is at fault, what was expected
and what arrived. Every row also checks that each input tensor (grads, accumulators,
masters, optimizer state, loss-scale state, max_norm/scale/skip tensors) keeps its bits
and its ``_version``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import pytest
import torch
from support.error_table import (
    DROP,
    Call,
    assert_unchanged,
    at,
    call,
    check_row,
    desc,
    nest,
    new,
    row,
    same_structure,
    snapshot,
)

import mpfunc

F32, BF16, I64 = torch.float32, torch.bfloat16, torch.int64

# The tree every row starts from. optree sorts dict keys, so the leaves run
# layers.0.bias, layers.0.weight, layers.1.bias, layers.1.weight, norm.weight:
# faults go into BAD, after three valid leaves, at a path that is never trivial.
LAYOUT: dict[str, tuple[int, ...]] = {
    "layers.0.weight": (3, 2),
    "layers.0.bias": (3,),
    "layers.1.weight": (1, 3),
    "layers.1.bias": (1,),
    "norm.weight": (1,),
}
BAD = "layers.1.weight"


def tree(dtype: torch.dtype = F32, changes: dict[str, Any] | None = None, seed: int = 0) -> Any:
    """LAYOUT as nested dicts and lists (digit keys make lists), random values of ``dtype``;
    ``changes`` replace leaves (callables are called), add paths, or remove them (DROP)."""
    gen = torch.Generator().manual_seed(seed)
    flat: dict[str, Any] = {p: torch.randn(s, generator=gen).to(dtype) for p, s in LAYOUT.items()}
    return nest(flat, changes)


# --- rows --------------------------------------------------------------------------------


def _clip_rows() -> Iterator[Any]:
    finite_pos = "expected a finite float > 0, got "
    for fn, f in (
        ("clip_by_global_norm", mpfunc.clip_by_global_norm),
        ("clip_by_global_norm_", mpfunc.clip_by_global_norm_),
    ):

        def c(max_norm: Any, changes: dict[str, Any] | None = None, f: Any = f) -> Call:
            value = max_norm() if callable(max_norm) else max_norm
            return call(f, tree(changes=changes), value)

        g = f"grads.{BAD}"
        yield from [
            row(f"{fn}-max_norm-0", partial(c, 0.0), ValueError,
                rf"^{fn}: max_norm: {finite_pos}0\.0$"),
            row(f"{fn}-max_norm-int-0", partial(c, 0), ValueError,
                rf"^{fn}: max_norm: {finite_pos}0\.0$"),
            row(f"{fn}-max_norm-negative", partial(c, -1.0), ValueError,
                rf"^{fn}: max_norm: {finite_pos}-1\.0$"),
            row(f"{fn}-max_norm-nan", partial(c, math.nan), ValueError,
                rf"^{fn}: max_norm: {finite_pos}nan$"),
            row(f"{fn}-max_norm-inf", partial(c, math.inf), ValueError,
                rf"^{fn}: max_norm: {finite_pos}inf$"),
            row(f"{fn}-max_norm-bool", partial(c, True), TypeError,
                rf"^{fn}: max_norm: expected a float > 0, got bool$"),
            row(f"{fn}-max_norm-str", partial(c, "1.0"), TypeError,
                rf"^{fn}: max_norm: expected a float > 0, got str$"),
            row(f"{fn}-max_norm-1d-tensor", partial(c, new((1,))), TypeError,
                rf"^{fn}: max_norm: expected a float > 0 or a 0-d float tensor, got "
                + re.escape(desc(F32, (1,)))),
            row(f"{fn}-max_norm-int-tensor", partial(c, new((), I64)), TypeError,
                rf"^{fn}: max_norm: expected a float > 0 or a 0-d float tensor, got "
                + re.escape(desc(I64, ()))),
            row(f"{fn}-grad-int", partial(c, 1.0, {BAD: new(dtype=I64)}), TypeError,
                at(fn, g, "a floating-point grad", desc(I64))),
            row(f"{fn}-grad-bool", partial(c, 1.0, {BAD: new(dtype=torch.bool)}), TypeError,
                at(fn, g, "a floating-point grad", desc(torch.bool))),
            row(f"{fn}-grad-not-tensor", partial(c, 1.0, {BAD: 0.5}), TypeError,
                at(fn, g, "a tensor or None leaf", "float 0.5")),
        ]  # fmt: skip


def _scale_rows() -> Iterator[Any]:
    """grads_to_fp32(_)'s scale=, and the loss-scale constructors."""
    for fn, f in (
        ("grads_to_fp32", mpfunc.grads_to_fp32),
        ("grads_to_fp32_", mpfunc.grads_to_fp32_),
    ):

        def c(scale: Any, f: Any = f) -> Call:
            value = scale() if callable(scale) else scale
            extra = (tree(F32),) if f is mpfunc.grads_to_fp32_ else ()
            return call(f, tree(BF16), *extra, scale=value)

        yield from [
            row(f"{fn}-scale-0", partial(c, 0.0), ValueError,
                rf"^{fn}: scale: expected a finite float > 0, got 0\.0$"),
            row(f"{fn}-scale-negative", partial(c, -2.0), ValueError,
                rf"^{fn}: scale: expected a finite float > 0, got -2\.0$"),
            row(f"{fn}-scale-nan", partial(c, math.nan), ValueError,
                rf"^{fn}: scale: expected a finite float > 0, got nan$"),
            row(f"{fn}-scale-inf", partial(c, math.inf), ValueError,
                rf"^{fn}: scale: expected a finite float > 0, got inf$"),
            row(f"{fn}-scale-bool", partial(c, True), TypeError,
                rf"^{fn}: scale: expected a float > 0, got bool$"),
            row(f"{fn}-scale-1d-tensor", partial(c, new((1,))), TypeError,
                rf"^{fn}: scale: expected a finite float > 0 or a 0-d float tensor, got "
                + re.escape(desc(F32, (1,)))),
            row(f"{fn}-scale-int-tensor", partial(c, new((), I64)), TypeError,
                rf"^{fn}: scale: expected a finite float > 0 or a 0-d float tensor, got "
                + re.escape(desc(I64, ()))),
        ]  # fmt: skip

    static, dynamic = "StaticLossScale", "DynamicLossScale"
    S, D = mpfunc.StaticLossScale, mpfunc.DynamicLossScale
    yield from [
        row(f"{static}-0", lambda: call(S, 0.0), ValueError,
            rf"^{static}: scale: expected a finite float > 0, got 0\.0$"),
        row(f"{static}-nan", lambda: call(S, math.nan), ValueError,
            rf"^{static}: scale: expected a finite float > 0, got nan$"),
        row(f"{static}-negative", lambda: call(S, -1.0), ValueError,
            rf"^{static}: scale: expected a finite float > 0, got -1\.0$"),
        row(f"{static}-1d-tensor", lambda: call(S, torch.ones(2)), TypeError,
            rf"^{static}: scale: expected a finite float > 0 or a 0-d float tensor, got "
            + re.escape(desc(F32, (2,)))),
        row(f"{dynamic}-init_scale-0", lambda: call(D, 0.0), ValueError,
            rf"^{dynamic}: init_scale: expected a finite float > 0, got 0\.0$"),
        row(f"{dynamic}-growth_interval-0", lambda: call(D, growth_interval=0), ValueError,
            rf"^{dynamic}: growth_interval: expected an int >= 1, got 0$"),
        row(f"{dynamic}-growth_interval-negative", lambda: call(D, growth_interval=-5),
            ValueError, rf"^{dynamic}: growth_interval: expected an int >= 1, got -5$"),
        row(f"{dynamic}-growth_interval-float", lambda: call(D, growth_interval=2.0),
            TypeError, rf"^{dynamic}: growth_interval: expected an int >= 1, got 2\.0$"),
        row(f"{dynamic}-growth_factor-1", lambda: call(D, growth_factor=1.0), ValueError,
            rf"^{dynamic}: growth_factor: expected a finite float > 1, got 1\.0$"),
        row(f"{dynamic}-growth_factor-0.5", lambda: call(D, growth_factor=0.5), ValueError,
            rf"^{dynamic}: growth_factor: expected a (finite )?float > 1, got 0\.5$"),
        row(f"{dynamic}-backoff_factor-0", lambda: call(D, backoff_factor=0.0), ValueError,
            rf"^{dynamic}: backoff_factor: expected a float in \(0, 1\), got 0\.0$"),
        row(f"{dynamic}-backoff_factor-1", lambda: call(D, backoff_factor=1.0), ValueError,
            rf"^{dynamic}: backoff_factor: expected a float in \(0, 1\), got 1\.0$"),
        row(f"{dynamic}-backoff_factor-1.5", lambda: call(D, backoff_factor=1.5), ValueError,
            rf"^{dynamic}: backoff_factor: expected a float in \(0, 1\), got 1\.5$"),
        row(f"{dynamic}-backoff_factor-negative", lambda: call(D, backoff_factor=-0.5),
            ValueError,
            rf"^{dynamic}: backoff_factor: expected a float in \(0, 1\), got -0\.5$"),
        row(f"{dynamic}-min_scale-negative", lambda: call(D, min_scale=-1.0), ValueError,
            rf"^{dynamic}: min_scale: expected a finite float >= 0(\.0)?, got -1\.0$"),
    ]  # fmt: skip

    fn = "DynamicLossScale.adjust"
    expected = rf"^{re.escape(fn)}: finite: expected a 0-d bool tensor, got "

    def adjust(finite: Any) -> Call:
        value = finite() if callable(finite) else finite
        return call(mpfunc.DynamicLossScale.adjust, mpfunc.DynamicLossScale(), value)

    yield from [
        row(f"{fn}-1d-bool", partial(adjust, new((1,), torch.bool)), TypeError,
            expected + re.escape(desc(torch.bool, (1,))) + "$"),
        row(f"{fn}-0d-float", partial(adjust, new((), F32)), TypeError,
            expected + re.escape(desc(F32, ())) + "$"),
        row(f"{fn}-0d-int", partial(adjust, new((), I64)), TypeError,
            expected + re.escape(desc(I64, ())) + "$"),
        row(f"{fn}-python-bool", partial(adjust, True), TypeError, expected + "bool True$"),
        row(f"{fn}-none", partial(adjust, None), TypeError, expected + "None$"),
    ]  # fmt: skip


OPTS = {
    "decay": lambda: mpfunc.adamw(lr=1e-3, weight_decay=0.1),
    "no_decay": lambda: mpfunc.adamw(lr=1e-3, weight_decay=0.0),
}
LABELS = "['decay', 'no_decay']"


def _labels(changes: dict[str, Any] | None = None) -> Any:
    """The label tree: no_decay for biases and norms, decay for weights."""
    undecayed = [p for p in LAYOUT if p.endswith("bias") or p.startswith("norm")]
    flat = {p: "no_decay" if p in undecayed else "decay" for p in LAYOUT}
    return nest(flat, changes)


def _optimizers(changes: dict[str, Any] | None = None) -> dict[str, Any]:
    opts: dict[str, Any] = {k: v() for k, v in OPTS.items()}
    opts.update(changes or {})
    return opts


def partition_init(labels: Any) -> Call:
    return call(mpfunc.partition(_optimizers(), labels).init, tree(F32))


def partition_step(fn: str, labels: Any) -> Call:
    """``apply_update(_)`` through a partition whose labels are bad, with the state of a
    partition over good labels."""
    masters = tree(F32)
    state = mpfunc.partition(_optimizers(), _labels()).init(masters)
    opt = mpfunc.partition(_optimizers(), labels)
    f = {"apply_update": mpfunc.apply_update, "apply_update_": mpfunc.apply_update_}[fn]
    return call(f, masters, tree(F32, seed=1), state, opt)


def _partition_rows() -> Iterator[Any]:
    fn = "partition"
    label_among = f"a label among {LABELS}"
    yield from [
        row("partition-init-labels-missing-leaf",
            partial(partition_init, _labels({BAD: DROP})), ValueError,
            same_structure("partition.init", "masters", "labels", BAD, True)),
        row("partition-init-labels-extra-leaf",
            partial(partition_init, _labels({"head.weight": "decay"})), ValueError,
            same_structure("partition.init", "masters", "labels", "head.weight", False)),
        row("partition-init-unknown-label", partial(partition_init, _labels({BAD: "bias"})),
            ValueError, at("partition.init", f"labels.{BAD}", label_among, "'bias'")),
        row("partition-init-label-not-str", partial(partition_init, _labels({BAD: 3})),
            ValueError, at("partition.init", f"labels.{BAD}", label_among, "3")),
        row("partition-init-callable-unknown-label",
            partial(partition_init, lambda path, m: "bias" if path == BAD else "decay"),
            ValueError, at("partition.init", f"masters.{BAD}", label_among, "'bias'")),
        row("partition-optimizers-empty", lambda: call(mpfunc.partition, {}, _labels()),
            TypeError, rf"^{fn}: optimizers: expected a non-empty dict of label -> Optimizer, "
            r"got (an empty dict|\{\})$"),
        row("partition-optimizers-list",
            lambda: call(mpfunc.partition, list(_optimizers().values()), _labels()), TypeError,
            rf"^{fn}: optimizers: expected a non-empty dict of label -> Optimizer, got list$"),
        row("partition-optimizers-torch-class",
            lambda: call(mpfunc.partition, _optimizers({"decay": torch.optim.AdamW}),
                         _labels()), TypeError,
            rf"^{fn}: optimizers\['decay'\]: expected an mpfunc Optimizer, got the class "
            r"torch\.optim\.adamw\.AdamW$"),
        row("partition-optimizers-str",
            lambda: call(mpfunc.partition, _optimizers({"no_decay": "adamw"}), _labels()),
            TypeError,
            rf"^{fn}: optimizers\['no_decay'\]: expected an mpfunc Optimizer, got str 'adamw'$"),
    ]  # fmt: skip
    for step in ("apply_update", "apply_update_"):
        yield from [
            row(f"partition-{step}-labels-missing-leaf",
                partial(partition_step, step, _labels({BAD: DROP})), ValueError,
                same_structure(step, "masters", "labels", BAD, True)),
            row(f"partition-{step}-unknown-label",
                partial(partition_step, step, _labels({BAD: "bias"})), ValueError,
                at(step, f"labels.{BAD}", label_among, "'bias'")),
        ]  # fmt: skip


def skip_call(fn: str, opt: Callable[[], mpfunc.Optimizer], skip: Any) -> Call:
    masters = tree(F32)
    o = opt()
    f = {"apply_update": mpfunc.apply_update, "apply_update_": mpfunc.apply_update_}[fn]
    value = skip() if callable(skip) else skip
    return call(f, masters, tree(F32, seed=1), o.init(masters), o, skip=value)


def _skip_rows() -> Iterator[Any]:
    for fn in ("apply_update", "apply_update_"):
        expected = (
            rf"^{fn}: skip: expected None or a 0-d bool tensor "
            r"\(e\.g\. ~mpfunc\.all_finite\(g32\)\), got "
        )
        for name, opt in (
            ("sgd", lambda: mpfunc.sgd(lr=0.1, momentum=0.9)),
            ("adamw", lambda: mpfunc.adamw(lr=1e-3)),
        ):
            s = partial(skip_call, fn, opt)
            yield from [
                row(f"{fn}-{name}-skip-1d-bool", partial(s, new((1,), torch.bool)), TypeError,
                    expected + re.escape(desc(torch.bool, (1,))) + "$"),
                row(f"{fn}-{name}-skip-0d-float", partial(s, new((), F32)), TypeError,
                    expected + re.escape(desc(F32, ())) + "$"),
                row(f"{fn}-{name}-skip-0d-int", partial(s, new((), I64)), TypeError,
                    expected + re.escape(desc(I64, ())) + "$"),
                row(f"{fn}-{name}-skip-python-true", partial(s, True), TypeError,
                    expected + "bool True$"),
                row(f"{fn}-{name}-skip-python-false", partial(s, False), TypeError,
                    expected + "bool False$"),
            ]  # fmt: skip
    torch_adamw = partial(mpfunc.torch_optimizer, torch.optim.AdamW, lr=1e-3)
    yield row(
        "apply_update_-torch_adamw-skip",
        partial(skip_call, "apply_update_", torch_adamw, lambda: torch.tensor(False)),
        TypeError,
        r"^apply_update_: skip: expected None for torch_optimizer\(AdamW, \.\.\.\), got "
        r"torch\.bool tensor of shape \(\) on cpu: .*needs an mpfunc optimizer",
    )


def acc_call(
    f: Callable[..., Any],
    acc: dict[str, Any] | None = None,
    grads: dict[str, Any] | None = None,
    acc_dtype: torch.dtype = F32,
) -> Call:
    """``accumulate_grads(_)(acc, grads)``: an fp32 accumulator and bf16 grads, changed."""
    return call(f, tree(acc_dtype, acc), tree(BF16, grads, seed=1))


def _accumulate_rows() -> Iterator[Any]:
    a, g = f"acc.{BAD}", f"grads.{BAD}"
    grad_shape = "shape (1, 3) (the grad's)"
    f32_or_f64 = "a float32 or float64 tensor"
    for fn, f in (
        ("accumulate_grads", mpfunc.accumulate_grads),
        ("accumulate_grads_", mpfunc.accumulate_grads_),
    ):
        c = partial(acc_call, f)
        yield from [
            row(f"{fn}-grads-missing-leaf", partial(c, grads={"layers.1.bias": DROP}),
                ValueError, same_structure(fn, "acc", "grads", "layers.1.bias", True)),
            row(f"{fn}-grads-extra-leaf", partial(c, grads={"head.weight": new()}),
                ValueError, same_structure(fn, "acc", "grads", "head.weight", False)),
            row(f"{fn}-acc-shape", partial(c, acc={BAD: new((3, 1))}), ValueError,
                at(fn, a, grad_shape, "shape (3, 1)")),
            row(f"{fn}-grads-shape", partial(c, grads={BAD: new((3, 1), BF16)}), ValueError,
                at(fn, a, "shape (3, 1) (the grad's)", "shape (1, 3)")),
            row(f"{fn}-acc-device", partial(c, acc={BAD: new(device="meta")}), ValueError,
                at(fn, a, "device cpu (the grad's)", "device meta")),
            row(f"{fn}-acc-bf16", partial(c, acc_dtype=BF16), TypeError,
                at(fn, "acc.layers.0.bias", f32_or_f64, desc(BF16, (3,)))),
            row(f"{fn}-acc-bf16-leaf", partial(c, acc={BAD: new(dtype=BF16)}), TypeError,
                at(fn, a, f32_or_f64, desc(BF16))),
            row(f"{fn}-acc-fp16-leaf", partial(c, acc={BAD: new(dtype=torch.float16)}),
                TypeError, at(fn, a, f32_or_f64, desc(torch.float16))),
            row(f"{fn}-acc-none", partial(c, acc={BAD: None}), TypeError,
                at(fn, a, f32_or_f64, "None")),
            row(f"{fn}-grads-int", partial(c, grads={BAD: new(dtype=I64)}), TypeError,
                at(fn, g, "a floating-point grad", desc(I64))),
            row(f"{fn}-grads-not-tensor", partial(c, grads={BAD: 0.5}), TypeError,
                at(fn, g, "a tensor or None leaf", "float 0.5")),
            row(f"{fn}-acc-not-tensor", partial(c, acc={BAD: "acc"}), TypeError,
                at(fn, a, "a tensor or None leaf", "str 'acc'")),
        ]  # fmt: skip
    yield row(
        "init_grads-dtype-bf16",
        lambda: call(mpfunc.init_grads, tree(BF16), BF16),
        ValueError,
        r"^init_grads: dtype: expected torch\.float32 or torch\.float64 .*, got torch\.bfloat16$",
    )


ROWS = [*_clip_rows(), *_scale_rows(), *_partition_rows(), *_skip_rows(), *_accumulate_rows()]


@pytest.mark.parametrize(("make", "exc", "regex"), ROWS)
def test_bad_input_raises_and_modifies_nothing(
    make: Callable[[], Call], exc: type[Exception], regex: str
) -> None:
    check_row(make, exc, regex)


def test_row_ids_are_unique() -> None:
    ids = [p.id for p in ROWS]
    assert len(ids) == len(set(ids))


# --- validation before any write, on the last leaf ------------------------------------------


def test_accumulate_bad_last_grad_writes_nothing() -> None:
    # norm.weight is optree's last leaf: a bad shape there must stop the earlier adds too.
    acc = tree(F32)
    grads = tree(BF16, {"norm.weight": new((2,), BF16)}, seed=1)
    before = snapshot((acc, grads))
    with pytest.raises(ValueError, match=r"'acc\.norm\.weight'"):
        mpfunc.accumulate_grads_(acc, grads)
    assert_unchanged(before)


def test_clip_bad_last_grad_writes_nothing() -> None:
    grads = tree(F32, {"norm.weight": new((1,), I64)})
    before = snapshot(grads)
    with pytest.raises(TypeError, match=r"'grads\.norm\.weight'"):
        mpfunc.clip_by_global_norm_(grads, 1e-3)
    assert_unchanged(before)


def test_partition_bad_last_label_writes_nothing() -> None:
    masters = tree(F32)
    state = mpfunc.partition(_optimizers(), _labels()).init(masters)
    opt = mpfunc.partition(_optimizers(), _labels({"norm.weight": "bias"}))
    grads = tree(F32, seed=1)
    before = snapshot((masters, grads, state))
    with pytest.raises(ValueError, match=r"'labels\.norm\.weight'"):
        mpfunc.apply_update_(masters, grads, state, opt)
    assert_unchanged(before)

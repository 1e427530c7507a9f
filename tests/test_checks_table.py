"""Bad inputs: every public function raises ``TypeError``/``ValueError`` and modifies nothing.

One table, in the style of torch's ``test_optim`` error inputs: each row is a callable
that builds the call (fresh tensors every time), the exception type, and a regex the
message must match. Where a leaf is at fault the regex pins the dotted pytree path, what
was expected and what arrived. Every row also checks that each input tensor (masters,
grads, params, state, out, lr) is bit-identical and has the same ``_version`` afterwards.
The shared machinery (trees from dotted paths, snapshots, ``check_row``) is in
``error_table.py``.
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
    tensors,
)

import mpfunc

# The model every row starts from, as dotted paths. optree sorts dict keys, so the leaves
# run layers.0.bias, layers.0.weight, layers.1.bias, layers.1.weight, norm.num_batches,
# norm.weight: faults go into BAD, after three valid leaves, at a path that is never
# trivial (a dict in a list in a dict).
LAYOUT: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
    "layers.0.weight": ((3, 2), torch.bfloat16),
    "layers.0.bias": ((3,), torch.bfloat16),
    "layers.1.weight": ((1, 3), torch.bfloat16),
    "layers.1.bias": ((1,), torch.bfloat16),
    "norm.weight": ((1,), torch.bfloat16),
    "norm.num_batches": ((), torch.int64),  # not floating: no master, no grad
}
BAD = "layers.1.weight"
NO_MASTER = "norm.num_batches"
# --- trees -----------------------------------------------------------------------------


def _flat(kind: str) -> dict[str, Any]:
    """LAYOUT's leaves as params (bf16, int buffer), masters (fp32 copies), grads (bf16),
    g32 (fp32), moments (fp32 zeros) or steps (0-d fp32); ``None`` at the int buffer for
    every kind but params."""
    flat: dict[str, Any] = {}
    for i, (path, (shape, dtype)) in enumerate(LAYOUT.items()):
        if not dtype.is_floating_point:
            flat[path] = torch.full(shape, 7, dtype=dtype) if kind == "params" else None
            continue
        seed = i + (100 if kind in ("grads", "g32") else 0)
        x = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
        flat[path] = {
            "params": x,
            "grads": x,
            "masters": x.float(),
            "g32": x.float(),
            "moments": torch.zeros(shape),
            "steps": torch.zeros(()),
        }[kind]
    return flat


def _tree(kind: str, changes: dict[str, Any] | None = None) -> Any:
    return nest(_flat(kind), changes)


# --- rows ------------------------------------------------------------------------------


F32 = torch.float32
BF16 = torch.bfloat16
MASTER_SHAPE = "shape (1, 3) (the master's)"
MASTER_DTYPE = "torch.float32 (the master's dtype)"
STATE_SHAPE = "shape (1, 3) (the master's)"
STATE_DTYPE = "torch.float32 (the master's dtype)"
NO_MASTER_GRAD = (
    "None (this leaf has no master: init_master gives none to non-floating params, and to "
    "frozen ones (requires_grad=False) under trainable_only=True)"
)


OPTIMIZERS: dict[str, Callable[[], mpfunc.Optimizer]] = {
    "sgd": lambda: mpfunc.sgd(lr=0.1, momentum=0.9),
    "adam": lambda: mpfunc.adam(lr=1e-3),
    "adamw": lambda: mpfunc.adamw(lr=1e-3, amsgrad=True),
    "torch_adamw": lambda: mpfunc.torch_optimizer(torch.optim.AdamW, lr=1e-3),
}
UPDATES = {"apply_update": mpfunc.apply_update, "apply_update_": mpfunc.apply_update_}
STATE_TYPE = {"sgd": "SGDState", "adam": "AdamState", "adamw": "AdamState"}
FIRST_MOMENT = {"sgd": "momentum_buffer", "adam": "exp_avg", "adamw": "exp_avg"}
LAST_FIELD = {"sgd": "momentum_buffer", "adam": "exp_avg_sq", "adamw": "max_exp_avg_sq"}


def update_call(
    fn: str,
    opt: str | Callable[[], mpfunc.Optimizer],
    masters: dict[str, Any] | None = None,
    g32: dict[str, Any] | None = None,
    state: Callable[[mpfunc.Optimizer], Any] | None = None,
) -> Call:
    """``fn(masters, g32, state, opt)`` with changed leaves. By default ``state`` is
    ``opt.init`` over the unchanged masters, whose tensors the passed masters share."""
    o = OPTIMIZERS[opt]() if isinstance(opt, str) else opt()
    flat = _flat("masters")
    s = o.init(nest(flat)) if state is None else state(o)
    return call(UPDATES[fn], nest(flat, masters), _tree("g32", g32), s, o)


def init_from(
    opt: Callable[[], mpfunc.Optimizer], changes: dict[str, Any] | None = None
) -> Callable[[mpfunc.Optimizer], Any]:
    """A state made by another optimizer, or over other masters (with ``changes``)."""
    return lambda _: opt().init(_tree("masters", changes))


def state_with(field: str, changes: dict[str, Any]) -> Callable[[mpfunc.Optimizer], Any]:
    """``opt.init``'s state with ``field`` rebuilt from the layout, with ``changes``."""
    kind = "steps" if field == "step" else "moments"
    return lambda opt: opt.init(_tree("masters"))._replace(**{field: _tree(kind, changes)})


def tuple_for_list_call(fn: str) -> Call:
    """Grads with the masters' leaf paths, but a tuple where the masters hold a list."""
    opt, masters, g32 = mpfunc.adam(), _tree("masters"), _tree("g32")
    g32["layers"] = tuple(g32["layers"])
    return call(UPDATES[fn], masters, g32, opt.init(masters), opt)


def torch_instance_call(fn: str) -> Call:
    """A torch.optim instance where an mpfunc Optimizer belongs."""
    masters = _tree("masters")
    return call(UPDATES[fn], masters, _tree("g32"), None, torch.optim.AdamW([torch.zeros(1)]))


def cast_call(
    f: Callable[..., Any], grads: dict[str, Any] | None = None, out: dict[str, Any] | None = None
) -> Call:
    """``grads_to_fp32(grads)`` or ``grads_to_fp32_(grads, out)``, with changed leaves."""
    extra = (_tree("g32", out),) if f is mpfunc.grads_to_fp32_ else ()
    return call(f, _tree("grads", grads), *extra)


def to_model_call(
    f: Callable[..., Any],
    masters: dict[str, Any] | None = None,
    params: dict[str, Any] | None = None,
) -> Call:
    """``masters_to_model(_)(masters, params)``, with changed leaves."""
    return call(f, _tree("masters", masters), _tree("params", params))


def _update_rows() -> Iterator[Any]:
    """apply_update and apply_update_, crossed with every optimizer."""
    g, m = f"grads.{BAD}", f"masters.{BAD}"
    for fn in UPDATES:
        for name in OPTIMIZERS:
            u, id = partial(update_call, fn, name), f"{fn}-{name}"
            yield from [
                row(f"{id}-grads-missing-leaf", partial(u, g32={"layers.1.bias": DROP}),
                    ValueError, same_structure(fn, "masters", "grads", "layers.1.bias", True)),
                row(f"{id}-grads-extra-leaf", partial(u, g32={"layers.1.gate": new()}),
                    ValueError, same_structure(fn, "masters", "grads", "layers.1.gate", False)),
                row(f"{id}-grads-shape", partial(u, g32={BAD: new((3, 1))}), ValueError,
                    at(fn, g, MASTER_SHAPE, "shape (3, 1)")),
                row(f"{id}-grads-device", partial(u, g32={BAD: new(device="meta")}), ValueError,
                    at(fn, g, "device cpu (the master's)", "device meta")),
                row(f"{id}-grads-fp64", partial(u, g32={BAD: new(dtype=torch.float64)}),
                    TypeError, at(fn, g, "a grad no wider than its 32-bit master",
                                  desc(torch.float64) + ". Cast grads to the master's dtype")),
                row(f"{id}-grads-int", partial(u, g32={BAD: new(dtype=torch.int64)}), TypeError,
                    at(fn, g, "a floating-point grad", desc(torch.int64))),
                row(f"{id}-grads-where-no-master", partial(u, g32={NO_MASTER: new(())}),
                    ValueError, at(fn, f"grads.{NO_MASTER}", NO_MASTER_GRAD, desc(F32, ()))),
                row(f"{id}-grads-not-tensor", partial(u, g32={BAD: 0.5}), TypeError,
                    at(fn, g, "a tensor or None leaf", "float 0.5")),
                row(f"{id}-masters-not-tensor", partial(u, masters={BAD: "w"}), TypeError,
                    at(fn, m, "a tensor or None leaf", "str 'w'")),
                row(f"{id}-masters-bf16", partial(u, masters={BAD: new(dtype=BF16)}), TypeError,
                    at(fn, m, "a float32 or float64 master", desc(BF16))),
            ]  # fmt: skip
            if name == "torch_adamw":  # its own state rows are below
                continue
            where = ()
            first, last = f"state.{FIRST_MOMENT[name]}", f"state.{LAST_FIELD[name]}"
            other = "adam" if name == "sgd" else "sgd"
            yield from [
                row(f"{id}-state-wrong-type", partial(u, state=init_from(OPTIMIZERS[other])),
                    TypeError, rf"^{fn}: state: expected the {STATE_TYPE[name]} made by "
                    rf"{name}\(\.\.\.\)\.init\(masters\), got {STATE_TYPE[other]}$", *where),
                row(f"{id}-state-other-keys",
                    partial(u, state=init_from(OPTIMIZERS[name], {"head.weight": new((2,))})),
                    ValueError, rf"^{fn}: masters and state\.step must have the same tree "
                    r"structure: 'head\.weight' is in state\.step but not in masters; expected "
                    r"PyTreeSpec\(.*\), got PyTreeSpec\(.*'head'", *where),
                row(f"{id}-state-other-shapes",
                    partial(u, state=init_from(OPTIMIZERS[name], {BAD: new((3, 1))})), ValueError,
                    at(fn, f"{first}.{BAD}", STATE_SHAPE, "shape (3, 1)"), *where),
                row(f"{id}-state-fp64",
                    partial(u, state=state_with(last[6:], {BAD: new(dtype=torch.float64)})),
                    TypeError, at(fn, f"{last}.{BAD}", STATE_DTYPE, desc(torch.float64)), *where),
                row(f"{id}-state-device",
                    partial(u, state=state_with(last[6:], {BAD: new(device="meta")})), ValueError,
                    at(fn, f"{last}.{BAD}", "device cpu (the master's)", "device meta"), *where),
                row(f"{id}-state-not-tensor", partial(u, state=state_with(last[6:], {BAD: 0.0})),
                    TypeError, at(fn, f"{last}.{BAD}", "a tensor or None leaf", "float 0.0"),
                    *where),
                row(f"{id}-state-where-no-master",
                    partial(u, state=state_with(last[6:], {NO_MASTER: new(())})), ValueError,
                    at(fn, f"{last}.{NO_MASTER}", "None (this leaf has no master)",
                       desc(F32, ())), *where),
                row(f"{id}-state-step-int",
                    partial(u, state=state_with("step", {BAD: new((), torch.int64)})), TypeError,
                    at(fn, f"state.step.{BAD}", "float32 step count",
                       desc(torch.int64, ())), *where),
            ]  # fmt: skip
        # A state made under another amsgrad/momentum setting than the optimizer's.
        where = ()
        amsgrad = partial(mpfunc.adam, amsgrad=True)
        yield from [
            row(f"{fn}-adam-amsgrad-state-without-max",
                partial(update_call, fn, amsgrad, state=init_from(mpfunc.adam)), ValueError,
                rf"^{fn}: masters and state\.max_exp_avg_sq must have the same tree structure: .*"
                r"expected .*, got ", *where),
            row(f"{fn}-adam-state-with-max",
                partial(update_call, fn, "adam", state=init_from(amsgrad)), ValueError,
                rf"^{fn}: state\.max_exp_avg_sq: expected None \(these hyperparameters use no "
                r"max_exp_avg_sq\), got "),
            row(f"{fn}-sgd-momentum-state-without-buffer",
                partial(update_call, fn, "sgd", state=init_from(mpfunc.sgd)), ValueError,
                rf"^{fn}: masters and state\.momentum_buffer must have the same tree structure: .*"
                r"expected .*, got ", *where),
            row(f"{fn}-sgd-state-with-buffer",
                partial(update_call, fn, mpfunc.sgd, state=init_from(OPTIMIZERS["sgd"])),
                ValueError,
                rf"^{fn}: state\.momentum_buffer: expected None \(these hyperparameters use no "
                r"momentum_buffer\), got "),
            row(f"{fn}-adam-fused-on-meta",
                partial(update_call, fn, partial(mpfunc.adam, impl="fused"),
                        masters={BAD: new(device="meta")}, g32={BAD: new(device="meta")},
                        state=lambda o: o.init(_tree("masters", {BAD: new(device="meta")}))),
                ValueError, rf"^{fn}: .*'masters\.layers\.1\.weight'.*fused.*got .*meta"),
            row(f"{fn}-grads-tuple-for-list", partial(tuple_for_list_call, fn), ValueError,
                rf"^{fn}: masters and grads must have the same tree structure: .*"
                r"expected PyTreeSpec\(\{'layers': \[.*got PyTreeSpec\(\{'layers': \("),
            row(f"{fn}-opt-is-torch-optimizer-instance", partial(torch_instance_call, fn),
                TypeError, rf"^{fn}: opt: expected an mpfunc Optimizer .*, got AdamW$"),
        ]  # fmt: skip
    fn, torch_adamw = "apply_update_", OPTIMIZERS["torch_adamw"]
    identity = rf"^{fn}: state: expected the AdamW built over these very master tensors "
    yield from [
        row("apply_update-torch_adamw-is-in-place-only",
            partial(update_call, "apply_update", "torch_adamw"), TypeError,
            r"^apply_update: opt: torch\.AdamW updates its tensors in place .*use apply_update_"),
        row(f"{fn}-torch_adamw-state-wrong-type",
            partial(update_call, fn, "torch_adamw", state=init_from(mpfunc.adam)), TypeError,
            rf"^{fn}: state: expected the TorchOptimizerState made by "
            r"torch_optimizer\(AdamW, \.\.\.\)\.init\(masters\), got AdamState$"),
        row(f"{fn}-torch_adamw-state-other-keys",
            partial(update_call, fn, torch_adamw,
                    state=init_from(torch_adamw, {"head.weight": new((2,))})), ValueError,
            identity + r"\(5 of them\), got one over 6 other tensors"),
        row(f"{fn}-torch_adamw-state-other-masters",
            partial(update_call, fn, torch_adamw, state=init_from(torch_adamw)), ValueError,
            identity + r"\(5 of them\), got one over 5 other tensors"),
    ]  # fmt: skip


def _transform_rows() -> Iterator[Any]:
    """init_master, grads_to_fp32(_), masters_to_model(_)."""
    for fn, f, kind in (
        ("init_master", mpfunc.init_master, "params"),
        ("grads_to_fp32", mpfunc.grads_to_fp32, "grads"),
    ):
        for dtype in (torch.float16, torch.bfloat16, torch.int64):
            yield row(
                f"{fn}-dtype-{str(dtype)[6:]}",
                lambda f=f, kind=kind, dtype=dtype: call(f, _tree(kind), dtype=dtype),
                ValueError,
                rf"^{fn}: dtype: expected torch\.float32 or torch\.float64 "
                rf"\(.*\), got {re.escape(str(dtype))}$",
            )
        yield row(
            f"{fn}-dtype-str",
            lambda f=f, kind=kind: call(f, _tree(kind), dtype="float32"),
            TypeError,
            rf"^{fn}: dtype: expected a torch\.dtype, got str$",
        )
    yield row(
        "init_master-params-not-tensor",
        lambda: call(mpfunc.init_master, _tree("params", {BAD: 0.5})),
        TypeError,
        at("init_master", f"params.{BAD}", "a tensor or None leaf", "float 0.5"),
    )

    g, o = f"grads.{BAD}", f"out.{BAD}"
    for fn, f in (
        ("grads_to_fp32", mpfunc.grads_to_fp32),
        ("grads_to_fp32_", mpfunc.grads_to_fp32_),
    ):
        c = partial(cast_call, f)
        yield from [
            *(row(f"{fn}-grads-{str(dtype)[6:]}", partial(c, {BAD: new(dtype=dtype)}), TypeError,
                  at(fn, g, "a floating-point grad", desc(dtype) + ". Non-floating"))
              for dtype in (torch.int64, torch.bool, torch.complex64)),
            row(f"{fn}-grads-not-tensor", partial(c, {BAD: "g"}), TypeError,
                at(fn, g, "a tensor or None leaf", "str 'g'")),
        ]  # fmt: skip
    f64 = {BAD: new(dtype=torch.float64)}
    yield row(
        "grads_to_fp32-narrows-float64",
        lambda: call(mpfunc.grads_to_fp32, _tree("grads", f64), dtype=torch.float32),
        ValueError,
        at("grads_to_fp32", g, "a grad no wider than its torch.float32 result",
           desc(torch.float64) + ". Leave dtype=None"),
    )  # fmt: skip
    fn, c = "grads_to_fp32_", partial(cast_call, mpfunc.grads_to_fp32_)
    yield from [
        row(f"{fn}-narrows-float64", partial(c, f64), ValueError,
            at(fn, g, "a grad no wider than its torch.float32 result",
               desc(torch.float64) + ". Give it a float64 out")),
        row(f"{fn}-out-missing-leaf", partial(c, out={"layers.1.bias": DROP}), ValueError,
            same_structure(fn, "grads", "out", "layers.1.bias", True)),
        row(f"{fn}-out-extra-leaf", partial(c, out={"head.weight": new()}), ValueError,
            same_structure(fn, "grads", "out", "head.weight", False)),
        row(f"{fn}-out-not-tensor", partial(c, out={BAD: 0.5}), TypeError,
            at(fn, o, "a tensor or None leaf", "float 0.5")),
        row(f"{fn}-out-none", partial(c, out={BAD: None}), TypeError,
            at(fn, o, "a float32 or float64 tensor", "None")),
        row(f"{fn}-out-bf16", partial(c, out={BAD: new(dtype=BF16)}), TypeError,
            at(fn, o, "a float32 or float64 tensor", desc(BF16))),
        row(f"{fn}-out-shape", partial(c, out={BAD: new((3, 1))}), ValueError,
            at(fn, o, "shape (1, 3) (the grad's)", "shape (3, 1)")),
        row(f"{fn}-grads-device", partial(c, {BAD: new(dtype=BF16, device="meta")}), ValueError,
            at(fn, o, "device meta (the grad's)", "device cpu")),
        row(f"{fn}-out-device", partial(c, out={BAD: new(device="meta")}), ValueError,
            at(fn, o, "device cpu (the grad's)", "device meta")),
    ]  # fmt: skip

    p, m = f"params.{BAD}", f"masters.{BAD}"
    floating_param = "a floating-point parameter for this master"
    for fn, f in (
        ("masters_to_model", mpfunc.masters_to_model),
        ("masters_to_model_", mpfunc.masters_to_model_),
    ):
        to = partial(to_model_call, f)
        yield from [
            row(f"{fn}-params-missing-leaf", partial(to, params={"layers.1.bias": DROP}),
                ValueError, same_structure(fn, "masters", "params", "layers.1.bias", True)),
            row(f"{fn}-params-extra-leaf", partial(to, params={"head.weight": new()}), ValueError,
                same_structure(fn, "masters", "params", "head.weight", False)),
            row(f"{fn}-params-shape", partial(to, params={BAD: new((3, 1), BF16)}), ValueError,
                at(fn, p, MASTER_SHAPE, "shape (3, 1)")),
            row(f"{fn}-params-device", partial(to, params={BAD: new(dtype=BF16, device="meta")}),
                ValueError, at(fn, p, "device cpu (the master's)", "device meta")),
            row(f"{fn}-masters-device", partial(to, masters={BAD: new(device="meta")}), ValueError,
                at(fn, p, "device meta (the master's)", "device cpu")),
            row(f"{fn}-params-int", partial(to, params={BAD: new(dtype=torch.int64)}), TypeError,
                at(fn, p, floating_param, desc(torch.int64))),
            row(f"{fn}-params-none", partial(to, params={BAD: None}), TypeError,
                at(fn, p, floating_param, "None")),
            row(f"{fn}-master-for-int-buffer", partial(to, masters={NO_MASTER: new(())}), TypeError,
                at(fn, f"params.{NO_MASTER}", floating_param, desc(torch.int64, ()))),
            row(f"{fn}-params-not-tensor", partial(to, params={BAD: 0.5}), TypeError,
                at(fn, p, "a tensor or None leaf", "float 0.5")),
            row(f"{fn}-masters-not-tensor", partial(to, masters={BAD: 0.5}), TypeError,
                at(fn, m, "a tensor or None leaf", "float 0.5")),
            row(f"{fn}-masters-bf16", partial(to, masters={BAD: new(dtype=BF16)}), TypeError,
                at(fn, m, "a float32 or float64 master", desc(BF16))),
        ]  # fmt: skip


def bad(fn: str, f: Callable[..., Any], exc: type[Exception], regex: str, **kwargs: Any) -> Any:
    """A factory row: ``f(**kwargs)`` raises ``exc`` matching ``"^fn: " + regex``.
    A callable argument (an lr tensor) is made when the row runs."""

    def label(v: Any) -> str:  # a tensor maker shows as e.g. float32[1]
        return f"{str(v().dtype)[6:]}{list(v().shape)}" if callable(v) else str(v)

    id = "-".join([fn, *(f"{k}={label(v)}" for k, v in kwargs.items())])
    make = lambda: call(f, **{k: v() if callable(v) else v for k, v in kwargs.items()})  # noqa: E731
    return row(id, make, exc, f"^{fn}: {regex}")


def _factory_rows() -> Iterator[Any]:
    """sgd, adam, adamw and torch_optimizer reject bad hyperparameters when built."""
    nonneg = r"expected a finite float >= 0, got "
    lr_tensor = r"lr: expected a float or a 0-d floating-point tensor, got "
    int_0d = re.escape(desc(torch.int64, ()))
    for fn, f in (("sgd", mpfunc.sgd), ("adam", mpfunc.adam), ("adamw", mpfunc.adamw)):
        yield from [
            bad(fn, f, ValueError, r"lr: " + nonneg + r"-0\.1$", lr=-0.1),
            bad(fn, f, ValueError, r"lr: " + nonneg + r"nan$", lr=math.nan),
            bad(fn, f, ValueError, r"lr: " + nonneg + r"inf$", lr=math.inf),
            bad(fn, f, TypeError, r"lr: expected a float >= 0, got bool$", lr=True),
            bad(fn, f, TypeError, r"lr: expected a float >= 0, got str$", lr="0.1"),
            bad(fn, f, TypeError, lr_tensor + re.escape(desc(F32, (1,))), lr=new((1,))),
            bad(fn, f, TypeError, lr_tensor + int_0d, lr=new((), torch.int64)),
            bad(fn, f, ValueError, r"weight_decay: " + nonneg + r"-0\.01$", weight_decay=-0.01),
            bad(fn, f, ValueError, r"impl: expected one of auto, .*, got 'cuda'$", impl="cuda"),
        ]
    nesterov = r"nesterov: expected momentum > 0 and dampening == 0, got "
    impls = r"impl: expected one of auto, foreach, reference, xla, got "
    damped = {"momentum": 0.9, "dampening": 0.1}
    sgd = partial(bad, "sgd", mpfunc.sgd)
    yield from [
        sgd(ValueError, r"momentum: " + nonneg + r"-0\.9$", momentum=-0.9),
        sgd(ValueError, r"dampening: " + nonneg + r"-0\.1$", dampening=-0.1),
        sgd(ValueError, nesterov + r"momentum=0\.0, dampening=0\.0$", nesterov=True),
        sgd(ValueError, nesterov + r"momentum=0\.9, dampening=0\.1$", nesterov=True, **damped),
        sgd(ValueError, impls + r"'fused'$", impl="fused"),
    ]
    unit = r"expected a float in \[0, 1\), got "
    pair = r"betas: expected a pair of floats, got "
    for fn, f in (("adam", mpfunc.adam), ("adamw", mpfunc.adamw)):
        yield from [
            bad(fn, f, ValueError, r"betas\[0\]: " + unit + r"1\.0$", betas=(1.0, 0.999)),
            bad(fn, f, ValueError, r"betas\[0\]: " + unit + r"-0\.1$", betas=(-0.1, 0.999)),
            bad(fn, f, ValueError, r"betas\[1\]: " + unit + r"1\.0$", betas=(0.9, 1.0)),
            bad(fn, f, ValueError, r"betas\[1\]: " + unit + r"-0\.1$", betas=(0.9, -0.1)),
            bad(fn, f, ValueError, r"betas\[1\]: " + unit + r"nan$", betas=(0.9, math.nan)),
            bad(fn, f, TypeError, pair + r"\(0\.9,\)$", betas=(0.9,)),
            bad(fn, f, ValueError, r"eps: " + nonneg + r"-1e-08$", eps=-1e-8),
        ]
    # torch_optimizer's cls is positional-only.
    subclass = r"cls: expected a torch\.optim\.Optimizer subclass, got 'adamw'$"
    yield bad(
        "torch_optimizer", lambda cls: mpfunc.torch_optimizer(cls), TypeError, subclass, cls="adamw"
    )


ROWS = [*_update_rows(), *_transform_rows(), *_factory_rows()]


@pytest.mark.parametrize(("make", "exc", "regex"), ROWS)
def test_bad_input_raises_and_modifies_nothing(
    make: Callable[[], Call], exc: type[Exception], regex: str
) -> None:
    check_row(make, exc, regex)


def test_row_ids_are_unique() -> None:
    ids = [p.id for p in ROWS]
    assert len(ids) == len(set(ids))


# --- validation before any write, on a bigger tree -------------------------------------

N = 24
LAST = f"blocks.{N - 1}.weight"  # optree's last leaf: lists keep order, "weight" > "bias"


def _big(kind: str, changes: dict[str, Any] | None = None) -> Any:
    """N blocks of (weight, bias): bf16 params/grads, fp32 masters/g32, fp32 zero moments."""
    dtype = BF16 if kind in ("params", "grads") else F32
    gen = torch.Generator().manual_seed(0 if kind in ("params", "masters") else 1)
    flat: dict[str, Any] = {}
    for i in range(N):
        for leaf, shape in (("weight", (4, 3)), ("bias", (4,))):
            x = torch.randn(shape, generator=gen).to(BF16).to(dtype)
            flat[f"blocks.{i}.{leaf}"] = torch.zeros(shape) if kind == "moments" else x
    return nest(flat, changes)


def _assert_raises_and_writes_nothing(fn: Callable[..., Any], *args: Any, path: str) -> None:
    before = snapshot(args)
    with pytest.raises((TypeError, ValueError)) as info:
        fn(*args)
    assert_unchanged(before)
    assert path in str(info.value)


@pytest.mark.parametrize("opt", ["sgd", "adam", "adamw", "torch_adamw"])
def test_apply_update_bad_last_grad_writes_nothing(opt: str) -> None:
    o, m = OPTIMIZERS[opt](), _big("masters")
    g = _big("g32", {LAST: new((3, 4))})
    _assert_raises_and_writes_nothing(mpfunc.apply_update_, m, g, o.init(m), o, path=LAST)


@pytest.mark.parametrize("opt", ["sgd", "adam", "adamw"])
def test_apply_update_bad_last_state_leaf_writes_nothing(opt: str) -> None:
    # The last leaf of the last state field is the optimizer's last check before writing.
    o, m = OPTIMIZERS[opt](), _big("masters")
    state = o.init(m)._replace(**{LAST_FIELD[opt]: _big("moments", {LAST: new((3, 4))})})
    _assert_raises_and_writes_nothing(mpfunc.apply_update_, m, _big("g32"), state, o, path=LAST)


@pytest.mark.parametrize("f", [mpfunc.adam, mpfunc.adamw])
def test_apply_update_fused_without_kernel_on_last_leaf_writes_nothing(
    f: Callable[..., mpfunc.Optimizer],
) -> None:
    # The cpu group resolves to the fused kernel first; the meta group has none. The whole
    # plan is made before the first kernel runs, so the cpu masters stay as they were.
    o = f(impl="fused")
    m = _big("masters", {LAST: new((4, 3), device="meta")})
    g = _big("g32", {LAST: new((4, 3), device="meta")})
    state = o.init(m)
    before = snapshot((m, g, state))
    with pytest.raises(ValueError, match="fused"):
        mpfunc.apply_update_(m, g, state, o)
    assert_unchanged(before)


@pytest.mark.parametrize(
    "out",
    [{LAST: new((3, 4))}, {LAST: None}, {LAST: new(device="meta")}, {LAST: new(dtype=BF16)}],
    ids=["shape", "none", "device", "bf16"],
)
def test_grads_to_fp32_bad_last_out_writes_nothing(out: dict[str, Any]) -> None:
    # out starts as zeros, so a single early write would show.
    _assert_raises_and_writes_nothing(
        mpfunc.grads_to_fp32_, _big("grads"), _big("moments", out), path=f"out.{LAST}"
    )


@pytest.mark.parametrize(
    "params",
    [
        {LAST: new((3, 4), BF16)},
        {LAST: new((4, 3), BF16, "meta")},
        {LAST: new((4, 3), torch.int64)},
    ],
    ids=["shape", "device", "int"],
)
def test_masters_to_model_bad_last_param_writes_nothing(params: dict[str, Any]) -> None:
    # Masters one step away from the params, so a single early write would show.
    masters = _big("masters")
    for t in tensors(masters):
        t.add_(1)
    _assert_raises_and_writes_nothing(
        mpfunc.masters_to_model_, masters, _big("params", params), path=f"params.{LAST}"
    )


# --- trees deeper than optree walks -------------------------------------------------------


def _deep(depth: int, leaf: Any) -> Any:
    tree = leaf
    for _ in range(depth):
        tree = {"a": tree}
    return tree


def _leaves(tree: Any) -> list[torch.Tensor]:
    """The tensors of a tree of any depth (a loop: the test's own walk must not recurse)."""
    out, todo = [], [tree]
    while todo:
        x = todo.pop()
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, dict):
            todo.extend(x.values())
        elif isinstance(x, (list, tuple)):
            todo.extend(x)
    return out


def test_a_tree_too_deep_is_a_value_error_naming_the_limit() -> None:
    """optree walks ``optree.MAX_RECURSION_DEPTH`` (1000) levels, and mpfunc's own
    containers (a pure update's copy of a partition's state, a checkpoint's dict) add one
    or two: a user tree of depth 1000 used to end in a bare ``RecursionError``. Now a
    ``ValueError`` that names the limit and the fix, raised before anything is written."""
    import optree

    limit = optree.MAX_RECURSION_DEPTH
    params = _deep(limit, torch.ones(3, dtype=torch.bfloat16))
    masters = mpfunc.init_master(params)  # a tree at the limit itself is walked
    opt = mpfunc.partition({"all": mpfunc.adamw(lr=1e-3)}, lambda path, p: "all")
    state = opt.init(masters)
    grads = _deep(limit, torch.ones(3))
    snap = snapshot(_leaves([params, masters, state, grads]))
    assert len(snap) == 6
    match = (
        rf"expected a tree nested at most {limit} levels deep \(optree's limit; mpfunc's own "
        r"containers.* add a level or two to yours\), got a deeper one"
    )
    deeper = _deep(limit + 1, torch.ones(3))
    calls: list[Callable[[], Any]] = [
        lambda: mpfunc.apply_update_(masters, deeper, state, opt, params=params),
        lambda: mpfunc.apply_update(masters, grads, state, mpfunc.adamw(lr=1e-3)),
        lambda: mpfunc.state_dict({"masters": masters, "state": state}),
        lambda: mpfunc.init_master(_deep(limit + 1, torch.ones(3))),
    ]
    for call_ in calls:
        with pytest.raises(ValueError, match=match):
            call_()
        assert_unchanged(snap)
    # A partition's state holds each sub-state a level down, but a step walks each
    # sub-state's fields alone: trees at the limit step.
    master = _leaves(masters)[0]
    before = master.clone()
    mpfunc.apply_update_(masters, grads, state, opt, params=params)
    assert not torch.equal(master, before)

"""One traced node per optimizer step on XLA: the machinery of the ``"xla"`` kernels of
``mpfunc.adam``/``adamw``/``sgd``/``lion``. Each optimizer's computation (``_build_xla``
in ``optim/_<name>.py``) is written with ``Builder`` and run by ``step``; the layout of
the inputs, the checks, each master strategy's and state format's loads and stores, the
cache and the call are here.

On the XLA device every torch op is traced into the graph on the host, and for an
optimizer the tracing is the step: mpfunc's foreach Adam traces about 16 nodes per
leaf. Here the whole update of a group of leaves (same device) is one node: an XLA
computation built once with ``torch_xla.core.xla_builder``, cached, and called with
``torch_xla._XLAC._xla_user_computation`` (the mechanism behind torch_xla's
documented ``xla_op_registry``). Its results are written back with one
``torch._foreach_copy_`` per state field, which, like any in-place op, keeps XLA's
input/output buffer donation; the node lists its inputs so that each buffer is donated
to its own output (see ``_Leaves``).

The computation is ``mpfunc.optim._adam._foreach``, ``mpfunc.optim._sgd._foreach`` and
``mpfunc.optim._lion._foreach`` op for op (the HLO torch_xla lowers them to), with the skip
applied as ``_optimizer.unless_skipped`` does. The results agree with the foreach path's
within the stated bound and are nearly always bit-identical: XLA:CPU fuses ``a * b + c``
into one rounding where both ops land in one fusion, and fusion depends on the whole
graph, so a few elements can differ in the last bit (a 0-d leaf's second moment; SGD
with dampening after a skipped first step). The same holds for the foreach path itself
in two different graphs.

torch_xla's own fused ops (``_xla_adam_optimizer_step_``/``_xla_sgd_optimizer_step_``,
used by ``torch_xla.amp.syncfree``) cannot keep mpfunc's promises: they take ``lr`` as a
host double (a tensor lr would need a host read, and lr 0.0 or 1.0 becomes a graph
constant, so a new graph), compute ``1 - beta2`` and ``1 - beta**t`` in fp32 (the
stored ``exp_avg_sq`` is 1.7e-4 off torch.optim's at beta2 = 0.9999), need a float
``found_inf`` of the param dtype, and, for SGD, apply ``maximize`` by negating lr,
which flips the sign of the momentum buffer and of weight decay.

The master strategies and bf16 state run in the same node: ``_plan._run_mixed`` around
the optimizer, op for op, with each strategy's ``load`` and ``store`` and the state
format's widening and rounding inside (``_B.load``/``store``/``widen``/``narrow``):
``"none"`` (the param widened, rounded back to nearest even), ``"kahan"`` (``param +
compensation`` in fp32, and the compensated store), ``"remainder"`` (``_remainder``'s
join and split, by bitcasts), ``"stochastic"`` (``_rng``'s counter-based hash of the key
and the row-major element index in wrapping s32 arithmetic, the truncation rounding of
``_strategy_stochastic``, and the key's advance), bf16 moments (widened, rounded to
nearest even, their old bits kept where skipped) and 8-bit moments (``_quantize``'s
decode and its blockwise encode, the second moment rounded stochastically with
``_state_format``'s draws keyed on the step count and the leaf's salt) and 4-bit moments
(``_quantize4``'s ``decode_ops``/``encode_ops``: the same rules, codes packed two a byte).
Adam/AdamW on every such pair give the foreach path's bits (tests/test_xla_kernels.py);
the one caveat is the fused multiply-add above, which shows in a remainder's low half as
it does in an fp32 master.

The codec is the torch path's bits (tests/test_xla_codec.py) but not its ops: it is
written for XLA:CPU's code generator (``Builder.codes``, ``entry``, ``once``), where the
torch path's op-for-op form ran 2-3x slower (table gathers, a stored array of square
roots, strided nibble packing, the optimizer's math recomputed inside each codec fusion),
and on XLA:CPU a ``"remainder"`` or ``"kahan"`` master with 8/4-bit moments steps its
leaves in turn (``in_turn``). The forms for XLA:CPU (``cpu_forms``) are off under SPMD and
on other devices.

Also folded into the node, to cut host time further:

* low-precision grads (bf16/fp16) are widened inside, exactly as ``grads_to_fp32_``
  widens them, so the fp32 grad buffers are not needed on this path;
* ``model_params``: the masters after the step, rounded to each model param's dtype
  (round to nearest even), as ``masters_to_model_`` writes them (a skipped step keeps
  their bits, as ``apply_update_(params=)`` does).

What this path does not take (callers keep the foreach path for it): fp64 masters,
``stats=``, tensors on different devices within one call, and anything but one lr and
one skip flag per call. torch_xla is imported on first use only.

See docs/design.md#the-xla-one-node-kernels.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, NoReturn, Optional, Union

import torch

from mpfunc.core import _rng
from mpfunc.state_formats import _state_format
from mpfunc.strategies import _strategy, _strategy_kahan

if TYPE_CHECKING:
    from mpfunc.core._optimizer import Group

__all__ = ["Builder", "Leaves", "clear_cache", "step"]

LR = Union[float, torch.Tensor]

# Computations kept, keyed on the hyperparameters, each leaf's shape and dtypes, and the
# order of the state inputs (a permutation, never a tensor id): each new tree layout builds
# one (40 ms for the seed model's 101 leaves) and XLA compiles it into the step graph.
_CACHE_SIZE = 64
_cache: dict[tuple[Any, ...], Any] = {}
_lock = threading.Lock()


def clear_cache() -> None:
    """Drops every cached computation (tests; a process that changes models often)."""
    with _lock:
        _cache.clear()


def _xb() -> Any:
    import torch_xla.core.xla_builder as xb

    return xb


def _device_type() -> str:
    """The process's PJRT device type ("CPU", "TPU", "CUDA", ...), "SPMD" under SPMD."""
    import torch_xla.runtime as xr

    return "SPMD" if xr.is_spmd() else str(xr.device_type())  # type: ignore[no-untyped-call]


def _xlac() -> Any:
    import torch_xla

    return torch_xla._XLAC  # type: ignore[attr-defined]


def _type(dtype: torch.dtype) -> str:
    return str(_xb().Op.from_torch_type(dtype))


# --- inputs, keys and the call ---------------------------------------------------------------


def _shared_inputs(
    fn: str,
    device: torch.device,
    lr: LR,
    found_inf: Optional[torch.Tensor],
    decay: Optional[float],
    grad_scale: Optional[LR],
) -> tuple[list[torch.Tensor], tuple[Any, ...]]:
    """lr (and, for a float lr, AdamW's ``1 - lr * weight_decay``), the skip flag and the
    loss scale as 0-d device tensors, in that order, and their part of the key.

    A float lr becomes a 0-d fp32 input, so a schedule of floats does not recompile
    (torch_xla keeps such scalars as cached device data, no transfer), except at exactly
    0.0 and 1.0, which torch_xla bakes into the graph as constants: each compiles a graph
    of its own once (so does a float loss scale of 1.0, or a decay factor of 1.0). A 1-element
    host tensor instead would transfer at every step, and a graph of another shape would
    compile anyway (tried; found in review); a 0-d tensor lr avoids both. Its decay factor
    is computed in float64 and rounded once, as ``_adam._foreach`` does with a float lr.
    """
    inputs = [_scalar(fn, "lr", lr, device)]
    lr_kind = "tensor" if isinstance(lr, torch.Tensor) else "float"
    if lr_kind == "float" and decay is not None:
        inputs.append(torch.full((), 1.0 - float(lr) * decay, dtype=torch.float32, device=device))
    skip_kind: Optional[torch.dtype] = None
    if found_inf is not None:
        if found_inf.shape != () or found_inf.device != device:
            raise ValueError(
                f"{fn}: found_inf: expected a 0-d tensor on {device}, got "
                f"{found_inf.dtype} tensor of shape {tuple(found_inf.shape)} on "
                f"{found_inf.device}"
            )
        if not (found_inf.dtype == torch.bool or found_inf.is_floating_point()):
            raise TypeError(
                f"{fn}: found_inf: expected a bool or float tensor, got {found_inf.dtype}"
            )
        inputs.append(found_inf)
        skip_kind = found_inf.dtype
    if grad_scale is not None:
        inputs.append(_scalar(fn, "grad_scale", grad_scale, device))
    return inputs, (lr_kind, skip_kind, grad_scale is not None)


def _scalar(fn: str, name: str, value: LR, device: torch.device) -> torch.Tensor:
    """A float, or a 0-d float32 tensor already on ``device``, as a 0-d device tensor."""
    if isinstance(value, torch.Tensor):
        if value.shape != () or value.dtype != torch.float32 or value.device != device:
            raise ValueError(
                f"{fn}: {name}: expected a float or a 0-d float32 tensor on {device}, got "
                f"{value.dtype} tensor of shape {tuple(value.shape)} on {value.device}"
            )
        return value
    return torch.full((), float(value), dtype=torch.float32, device=device)


def _run(
    kind: str,
    h: tuple[Any, ...],
    group: _Leaves,
    shared: tuple[list[torch.Tensor], tuple[Any, ...]],
    build: Callable[[Any, _Leaves, tuple[Any, ...]], Any],
) -> None:
    """Gets (or builds, with ``build(h, group, shared_key)``) the computation of this step,
    calls it once, and copies its results into ``group.dests`` (one list of destinations
    per output field; the results come leaf-major: leaf 0's fields, then leaf 1's, ...)."""
    inputs, shared_key = shared
    key: tuple[Any, ...] = (kind, h, shared_key, group.order, group.shapes, group.grad_dtypes)
    key += (group.low_dtypes, group.strategy, group.types, group.salts, group.extents)
    # The forms the builder chose (``Builder.cpu_forms``): SPMD turned on in a process that
    # built this computation without it gets the plain forms, not the ones it all-gathers.
    key += (_device_type(),)
    with _lock:
        comp = _cache.get(key)
    if comp is None:
        comp = build(h, group, shared_key)
        with _lock:
            if len(_cache) >= _CACHE_SIZE:
                _cache.pop(next(iter(_cache)))
            _cache[key] = comp
    results = _xlac()._xla_user_computation(f"xla::mpfunc_{kind}", group.inputs + inputs, comp)
    n_fields = len(group.dests)
    with torch.no_grad():
        for j, dst in enumerate(group.dests):
            if dst:
                torch._foreach_copy_(dst, list(results[j::n_fields]))


_SCALAR = torch.Size([])
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# Moments the node loads (widened to fp32) and stores (rounded to nearest even), as
# ``_state_format.load``/``store`` do: one dtype per group.
_MOMENT_DTYPES = (torch.float32, torch.bfloat16)
# The state formats the node serves (``StateFormat.xla``), by key; ``torch.uint8`` (the
# 8-bit ``QState``, its codec ``decode``/``encode`` below) and ``torch.uint4`` (the 4-bit
# ``Q4State``, its codec ``_quantize4.decode_ops``/``encode_ops``) are the encoded formats.
# A format not served here takes the foreach path.
_SERVED = {k for k, f in _state_format.FORMATS.items() if f.xla}
_SALTED = {k for k, f in _state_format.FORMATS.items() if f.salted}
_U4: torch.dtype = torch.uint4  # type: ignore[attr-defined]
# Encoded formats: a moment is (codes, bf16 block scales); codes face-shaped at 8 bits,
# flat packed bytes (two a byte) at 4.
_CODES_EXTENT = {torch.uint8: "face", _U4: "packed"}

# The master strategies whose ``load`` and ``store`` the node does itself, with the param
# dtypes it takes for each ("fp32": the master is a plain float32 tensor). ``_plan``'s
# ``xla_applies`` reads this table.
PARAM_DTYPES: dict[str, tuple[torch.dtype, ...]] = {
    "fp32": (torch.float32,),
    "none": (torch.bfloat16, torch.float16, torch.float32),
    "kahan": (torch.bfloat16, torch.float16),
    "remainder": (torch.bfloat16,),
    "stochastic": (torch.bfloat16,),
}
# A unit's second tensor: (its dtype, ``None`` for the param's; whether it is 0-d).
_AUX: dict[str, tuple[Optional[torch.dtype], bool]] = {
    "kahan": (None, False),
    "remainder": (torch.int16, False),
    "stochastic": (torch.int32, True),
}


class _Leaves(NamedTuple):
    """A checked group, laid out as the computation's parameters.

    ``inputs`` holds first the state the step rewrites (``dests``: the master's tensors
    (the fp32 master, or a unit's param and its buffer), moments, step counts, and the
    model params), ordered by torch_xla tensor id, then the grads (leaf order). ``order``
    says which (field, leaf) each state parameter is: ``field * n + leaf``. ``types`` gives
    each state field's dtype per leaf, ``extents`` each field's shape: ``"face"`` (the
    master's), ``"scalar"`` (0-d) or ``"blocks"`` (one per 32-element block: 8-bit scales).
    ``salts``: each leaf's place in the tree (its 8-bit draws' salt), or ``None``.

    Why the order: torch_xla donates the buffers of rewritten tensors, and XLA's
    ``OptimizeInputOutputBufferAlias`` pairs donated parameters with outputs by byte size,
    first come first served (parameters in parameter order, outputs in torch_xla's output
    order, which is by tensor id). The graph's parameters follow this node's operands, so
    listing them by tensor id pairs each buffer with its own output. In any other order,
    same-sized buffers (a leaf's master and moments, equal layers) pair crosswise and XLA
    copies every one of them: 800 copies and 3.5x the execution time for the seed model's
    101 leaves on XLA:CPU.
    """

    inputs: list[torch.Tensor]
    order: tuple[int, ...]
    shapes: tuple[torch.Size, ...]
    grad_dtypes: tuple[torch.dtype, ...]
    low_dtypes: Optional[tuple[torch.dtype, ...]]
    device: torch.device
    strategy: str
    types: tuple[tuple[torch.dtype, ...], ...]
    extents: tuple[str, ...]
    dests: list[list[torch.Tensor]]
    salts: Optional[tuple[int, ...]]


def _by_tensor_id(state: Sequence[torch.Tensor]) -> list[int]:
    """Positions of ``state`` sorted by torch_xla tensor id (the order torch_xla lists a
    graph's outputs in); the given order where ids cannot be read."""
    get_id = getattr(_xlac(), "_xla_get_tensor_id", None)
    if get_id is None:  # pragma: no cover - every torch_xla 2.x has it
        return list(range(len(state)))
    ids = [get_id(t) for t in state]
    # Descending: torch_xla numbers a graph's parameters in its post-order walk, which
    # visits a node's operands last to first.
    return sorted(range(len(state)), key=ids.__getitem__, reverse=True)


def _strategy_of(master: object) -> str:
    """The master strategy of a leaf: ``"fp32"`` for a tensor (or anything not a unit)."""

    s = _strategy.by_unit(master)
    return "fp32" if s is None else s.name


def _gather(
    fn: str,
    params: Sequence[Any],
    grads: Sequence[torch.Tensor],
    moments: Sequence[tuple[str, Sequence[Optional[torch.Tensor]]]],
    steps: Sequence[torch.Tensor],
    model_params: Optional[Sequence[Optional[torch.Tensor]]],
    salts: Optional[Sequence[int]] = None,
) -> _Leaves:
    """Checks a group (every check before any write) and lays out its inputs.

    The common case costs one pass of attribute reads per list, compared in bulk; only a
    failing group runs the per-leaf loop that names the culprit.
    """
    n = len(params)
    for name, seq in (("grads", grads), ("steps", steps), *moments):
        if len(seq) != n:
            raise ValueError(f"{fn}: {name}: expected {n} entries (one per param), got {len(seq)}")
    if model_params is not None and len(model_params) != n:
        raise ValueError(
            f"{fn}: model_params: expected {n} entries (one per param), got {len(model_params)}"
        )
    strategy = _strategy_of(params[0])
    if strategy != "fp32" and model_params is not None:
        raise ValueError(
            f"{fn}: model_params: expected None for {strategy!r} masters (a unit writes its "
            "own param)"
        )
    group = _layout(strategy, params, grads, moments, steps, model_params)
    if group is None:
        _explain(fn, strategy, params, grads, moments, steps, model_params)
    assert group is not None
    if group.types and _moment_kinds(moments) & _SALTED:
        if salts is None or len(salts) != n:
            raise ValueError(
                f"{fn}: salts: expected {n} ints (each leaf's place in the tree: 8-bit "
                f"moments draw with it), got {salts!r}"
            )
        group = group._replace(salts=tuple(int(x) for x in salts))
    return group


def _moment_kinds(moments: Sequence[tuple[str, Sequence[Any]]]) -> set[Optional[torch.dtype]]:
    """The moments' state formats by key (``torch.uint8`` stands for an 8-bit ``QState``),
    else their dtypes."""
    of = _state_format.of_moment
    return {
        getattr(t, "dtype", None) if f is None else f.key
        for _, seq in moments
        for t in seq
        for f in (of(t),)
    }


def _layout(
    strategy: str,
    params: Sequence[Any],
    grads: Sequence[torch.Tensor],
    moments: Sequence[tuple[str, Sequence[Optional[torch.Tensor]]]],
    steps: Sequence[torch.Tensor],
    model_params: Optional[Sequence[Optional[torch.Tensor]]],
) -> Optional[_Leaves]:
    """The group laid out, or ``None`` where a check fails (``_explain`` names it)."""
    n = len(params)
    Tensor = torch.Tensor
    if strategy == "fp32":
        unit = [list(params)]
    else:
        kind = type(params[0])
        if strategy not in PARAM_DTYPES or not all(type(u) is kind for u in params):
            return None
        unit = [list(f) for f in zip(*params)]
    if not all(isinstance(t, Tensor) for f in unit for t in f):
        return None
    faces = unit[0]
    device = faces[0].device
    psig = [(t.shape, t.device) for t in faces]
    ptypes = tuple(t.dtype for t in faces)
    ok = device.type == "xla" and all(dev == device for _, dev in psig)
    ok = ok and set(ptypes) <= set(PARAM_DTYPES[strategy])
    aux_dtype, aux_scalar = _AUX.get(strategy, (None, False))
    if ok and len(unit) > 1:
        ok = [(t.shape, t.dtype, t.device) for t in unit[1]] == [
            (_SCALAR if aux_scalar else s, d if aux_dtype is None else aux_dtype, dev)
            for (s, dev), d in zip(psig, ptypes)
        ]
    if ok and len(unit) > 2:  # "remainder"'s tie bits
        from mpfunc.strategies import _remainder

        ok = all(_remainder.tie_problem(t, p) is None for t, p in zip(unit[2], faces))
    kinds = _moment_kinds(moments) if moments else {torch.float32}
    ok = ok and len(kinds) == 1 and kinds <= _SERVED
    mdtype = next(iter(kinds))
    held: list[list[Any]] = [list(seq) for _, seq in moments]
    extents = ["face"] * len(moments)
    if ok and mdtype in _CODES_EXTENT:
        from mpfunc.state_formats import _quantize, _quantize4

        packed = _CODES_EXTENT[mdtype] == "packed"
        csig = [((_quantize4.packed_bytes(math.prod(s)),) if packed else s, d) for s, d in psig]
        codes = [[q.codes for q in seq] for seq in held]
        scales = [[q.scale for q in seq] for seq in held]
        ok = all(isinstance(t, Tensor) for f in (*codes, *scales) for t in f)
        for c, sc in zip(codes, scales):
            signed = c[0].dtype if ok else None
            ok = ok and signed in (torch.int8, torch.uint8)
            ok = ok and [(t.shape, t.dtype, t.device) for t in c] == [
                (s, signed, dev) for s, dev in csig
            ]
            bf16 = _quantize.SCALE_DTYPE
            ok = ok and [(t.shape, t.dtype, t.device) for t in sc] == [
                ((_quantize.blocks(math.prod(s)),), bf16, dev) for s, dev in psig
            ]
        held = [f for pair in zip(codes, scales) for f in pair]
        extents = [_CODES_EXTENT[mdtype], "blocks"] * len(moments)
    elif ok:
        msig = [(s, mdtype, dev) for s, dev in psig]
        ok = all([(t.shape, t.dtype, t.device) for t in seq] == msig for seq in held)
    f32 = torch.float32
    ok = ok and all(isinstance(t, Tensor) for t in steps)
    ok = ok and [(t.shape, t.dtype, t.device) for t in steps] == [(_SCALAR, f32, device)] * n
    ok = ok and all(isinstance(g, Tensor) for g in grads)
    if not ok:
        return None
    ok = [(g.shape, g.device) for g in grads] == psig
    grad_dtypes = tuple(g.dtype for g in grads)
    ok = ok and all(d in _FLOATS for d in set(grad_dtypes))
    low_dtypes = None
    if model_params is not None:
        ok = ok and all(isinstance(t, Tensor) for t in model_params)
        if ok:
            low_dtypes = tuple(t.dtype for t in model_params)  # type: ignore[union-attr]
            ok = [(t.shape, t.device) for t in model_params] == psig and all(  # type: ignore[union-attr]
                d in _FLOATS for d in set(low_dtypes)
            )
    if not ok:
        return None
    dests: list[list[Any]] = [*unit, *held, list(steps)]
    model: list[list[Any]] = [list(model_params)] if low_dtypes and model_params else []
    state = [t for seq in (*dests, *model) for t in seq]
    order = _by_tensor_id(state)
    inputs = [state[k] for k in order] + list(grads)
    shapes = tuple(s for s, _ in psig)
    types = tuple(tuple(t.dtype for t in f) for f in dests)
    aux = ["scalar" if aux_scalar else "face"] if len(unit) > 1 else []
    aux += ["ties"] if len(unit) > 2 else []
    extents = ["face", *aux, *extents, "scalar"]
    dests += model
    layout = (tuple(order), shapes, grad_dtypes, low_dtypes, device, strategy, types)
    return _Leaves(inputs, *layout, tuple(extents), dests, None)


def _explain(
    fn: str,
    strategy: str,
    params: Sequence[Any],
    grads: Sequence[torch.Tensor],
    moments: Sequence[tuple[str, Sequence[Optional[torch.Tensor]]]],
    steps: Sequence[torch.Tensor],
    model_params: Optional[Sequence[Optional[torch.Tensor]]],
) -> None:
    """Raises the error for the first leaf at fault."""

    def where(
        name: str, i: int, expected: str, got: str, cls: type[Exception] = ValueError
    ) -> NoReturn:
        raise cls(f"{fn}: at {name}[{i}]: expected {expected}, got {got}")

    def desc(t: object) -> str:
        if isinstance(t, torch.Tensor):
            return f"{t.dtype} tensor of shape {tuple(t.shape)} on {t.device}"
        return type(t).__name__

    def short(d: Optional[torch.dtype]) -> str:
        return str(d).removeprefix("torch.")

    if strategy not in PARAM_DTYPES:
        known = ", ".join(PARAM_DTYPES)
        expected = f"a float32 master or a unit of a strategy this kernel takes ({known})"
        where("params", 0, expected, f"a {strategy!r} master", TypeError)
    first = params[0]
    device = getattr(first if strategy == "fp32" else first[0], "device", None)
    mdtype = getattr(moments[0][1][0], "dtype", None) if moments else torch.float32
    if _moment_kinds(moments[:1]) == {torch.uint8}:
        raise ValueError(
            f"{fn}: 8-bit moments: expected every moment a QState of int8 or uint8 codes and "
            "bf16 block scales, shaped as opt.init makes them"
        )
    if _moment_kinds(moments[:1]) == {_U4}:
        raise ValueError(
            f"{fn}: 4-bit moments: expected every moment a Q4State of int8 or uint8 packed "
            "codes and bf16 block scales, shaped as opt.init makes them"
        )
    if mdtype not in _MOMENT_DTYPES:
        where(moments[0][0], 0, "a float32 or bfloat16 moment", desc(moments[0][1][0]), TypeError)
    for i, x in enumerate(params):
        if strategy == "fp32":
            p = x
            if not isinstance(p, torch.Tensor) or p.dtype != torch.float32:
                where("params", i, "a float32 master", desc(p), TypeError)
        else:
            if type(x) is not type(first):
                where("params", i, f"a {type(first).__name__} (as params[0])", desc(x), TypeError)
            p = x[0]
            kinds = PARAM_DTYPES[strategy]
            if not isinstance(p, torch.Tensor) or p.dtype not in kinds:
                expected = f"a {' or '.join(map(short, kinds))} param in its {type(x).__name__}"
                where("params", i, expected, desc(p), TypeError)
            if len(x) > 1:
                aux_dtype, aux_scalar = _AUX[strategy]
                want = (_SCALAR if aux_scalar else p.shape, aux_dtype or p.dtype, p.device)
                t = x[1]
                if not isinstance(t, torch.Tensor) or (t.shape, t.dtype, t.device) != want:
                    raise ValueError(
                        f"{fn}: at params[{i}].{x._fields[1]}: expected {short(want[1])} of "
                        f"shape {tuple(want[0])} on {p.device}, got {desc(t)}"
                    )
            if len(x) > 2:
                from mpfunc.strategies import _remainder

                problem = _remainder.tie_problem(x[2], p)
                if problem is not None:
                    raise ValueError(f"{fn}: at params[{i}].{x._fields[2]}: {problem}")
        if p.device.type != "xla" or p.device != device:
            where("params", i, f"a tensor on the group's XLA device ({device})", desc(p))
        g = grads[i]
        if not isinstance(g, torch.Tensor) or g.dtype not in _FLOATS:
            where("grads", i, "a floating-point tensor", desc(g), TypeError)
        if g.shape != p.shape or g.device != p.device:
            where("grads", i, f"shape {tuple(p.shape)} on {p.device}", desc(g))
        for name, seq in moments:
            t = seq[i]
            if not isinstance(t, torch.Tensor) or (t.shape, t.dtype, t.device) != (
                p.shape,
                mdtype,
                p.device,
            ):
                where(name, i, f"{short(mdtype)} of shape {tuple(p.shape)} on {p.device}", desc(t))
        s = steps[i]
        if not isinstance(s, torch.Tensor) or (s.shape, s.dtype, s.device) != (
            _SCALAR,
            torch.float32,
            p.device,
        ):
            where("steps", i, f"a 0-d float32 step count on {p.device}", desc(s))
        if model_params is not None:
            low = model_params[i]
            if not isinstance(low, torch.Tensor) or low.dtype not in _FLOATS:
                where(
                    "model_params",
                    i,
                    "a floating-point tensor for every leaf",
                    desc(low),
                    TypeError,
                )
            if low.shape != p.shape or low.device != p.device:
                where("model_params", i, f"shape {tuple(p.shape)} on {p.device}", desc(low))
    raise AssertionError(f"{fn}: a check failed but no leaf was found at fault")  # pragma: no cover


# --- the builders ----------------------------------------------------------------------------

# _rng's constants (int32): the golden-ratio step and MurmurHash3's fmix32 multipliers.
_GOLDEN, _M1, _M2 = -1640531535, -2048144789, -1028477387


class _B:
    """A small helper around one ``xla_builder`` computation: parameters in order, fp32
    constants, casts, and each master strategy's and state format's load and store."""

    def __init__(self, name: str) -> None:
        self.xb = _xb()
        self.builder = self.xb.create_builder(name)
        self.n = 0
        self._consts: dict[tuple[Any, ...], Any] = {}
        self._signed: dict[int, bool] = {}  # id of an 8-bit codes parameter -> its map
        # Forms written for XLA:CPU's code generator (measured there): ``barrier`` and the
        # 4-bit codec's bitcast packing. Elsewhere (TPU, GPU: XLA fuses differently, and a
        # stored array is memory traffic) and under SPMD (the partitioner all-gathers a
        # gather's operand and a bitcast that changes the shape) the plain forms.
        self.cpu_forms = _device_type() == "CPU"
        self._stored: Any = None  # the last leaf's new param, where ``in_turn`` waits for it

    def param(self, shape: Sequence[int], dtype: torch.dtype) -> Any:
        op = self.xb.mkparam(self.builder, self.n, self.xb.mkshape(_type(dtype), tuple(shape)))
        self.n += 1
        return op

    def const(self, value: float, dtype: str) -> Any:
        """A scalar constant of the builder's ``dtype`` ("f32", "s32", "u16", ...), made
        once per computation."""
        k = (dtype, value)
        if k not in self._consts:
            self._consts[k] = self.xb.Op.scalar(self.builder, value, dtype=dtype)
        return self._consts[k]

    def f32(self, value: float) -> Any:
        """A fp32 scalar constant: ``value`` rounded once, as torch_xla rounds a Python
        scalar that meets an fp32 tensor."""
        return self.const(value, "f32")

    def s32(self, value: int) -> Any:
        return self.const(value, "s32")

    def fields(
        self, group: _Leaves, n_moments: int
    ) -> tuple[list[list[Any]], list[list[Any]], list[Any], list[Any]]:
        """The state parameters in ``group.order``: per leaf the master's tensors (the fp32
        master, or a unit's param and buffer), ``n_moments`` moment fields as
        ``[field][leaf]``, the 0-d step counts, and the model params' (their old values,
        kept where the step is skipped), ``None`` per leaf without them."""
        n = len(group.shapes)
        n_fields = len(group.types)
        ops: list[list[Any]] = [[None] * n for _ in range(n_fields + 1)]
        for k in group.order:
            field, leaf = divmod(k, n)
            if field == n_fields:
                assert group.low_dtypes is not None
                ops[field][leaf] = self.param(group.shapes[leaf], group.low_dtypes[leaf])
                continue
            extent = group.extents[field]
            shape: Sequence[int] = group.shapes[leaf]
            if extent == "scalar":
                shape = ()
            elif extent == "ties":
                from mpfunc.strategies import _remainder

                shape = _remainder.tie_shape(shape)
            elif extent == "blocks":
                shape = (-(-math.prod(shape) // 32),)
            elif extent == "packed":  # 4-bit codes, two a byte
                shape = (-(-math.prod(shape) // 2),)
            dtype = group.types[field][leaf]
            ops[field][leaf] = op = self.param(shape, dtype)
            if dtype in (torch.int8, torch.uint8):
                self._signed[id(op)] = dtype == torch.int8
        width = 2 if self.moment_dtype(group, n_moments) in _CODES_EXTENT else 1
        u = n_fields - width * n_moments - 1
        units = [list(x) for x in zip(*ops[:u])]
        moments = ops[u : n_fields - 1]
        if width == 2:  # 8-bit and 4-bit: (codes, scales) per leaf
            moments = [list(zip(c, sc)) for c, sc in zip(moments[0::2], moments[1::2])]
        return units, moments, ops[n_fields - 1], ops[n_fields]

    def moment_dtype(self, group: _Leaves, n_moments: int) -> torch.dtype:
        """The moments' stored dtype (``torch.uint8``: 8-bit ``QState``s; ``torch.uint4``:
        4-bit ``Q4State``s)."""
        if not n_moments or not group.shapes:
            return torch.float32
        if group.extents[-2] == "blocks":
            return _U4 if group.extents[-3] == "packed" else torch.uint8
        return group.types[-2][0]

    def load(self, group: _Leaves, i: int, unit: list[Any], old_low: Any) -> Any:
        """The fp32 value leaf ``i``'s step starts from, as its strategy's ``load`` gives it
        (an "fp32" master refreshed from its model param, ``refresh``)."""
        s, dtype, f32 = group.strategy, group.types[0][i], torch.float32
        if s == "fp32":
            low = None if group.low_dtypes is None else group.low_dtypes[i]
            return self.refresh(unit[0], old_low, low)
        if s == "remainder":
            from mpfunc.strategies import _remainder

            shape = group.shapes[i]
            return _remainder._join_ops(self.xb, self.builder, unit[0], unit[1], unit[2], shape)
        x = self.to(unit[0], dtype, f32)
        if s != "kahan":
            return x
        # Kahan: ``param.float().add_(compensation.float())``, but -0.0 added where the
        # compensation is stale: a zero param, or one too large for the param
        # (``_strategy_kahan._load``).
        c = self.to(unit[1], dtype, f32)
        half_ulp = self.f32(_strategy_kahan.HALF_ULP[dtype])
        stale = (x == x.zeros_like()) | (self.abs(c) > self.abs(x) * half_ulp)
        return x + stale.select(c.scalar_like(-0.0), c)

    def store(self, skip: Any, group: _Leaves, i: int, unit: list[Any], x: Any) -> list[Any]:
        """The master's tensors after the step (``x``: its new fp32 value), each keeping its
        old bits where the step is skipped, as the strategy's ``store`` writes them."""
        s, dtype, f32 = group.strategy, group.types[0][i], torch.float32
        if s == "fp32":
            return [self.keep(skip, unit[0], x)]
        if s in ("remainder", "kahan"):
            # Several outputs, each a fusion that would recompute the whole update (and read
            # the master's inputs after the first has overwritten its own, which made XLA
            # copy them first): the new master is stored once (``barrier``).
            x = self.barrier(x, group.shapes[i])
        if s == "remainder":
            from mpfunc.strategies import _remainder

            outs = _remainder._split_ops(self.xb, self.builder, x, group.shapes[i])
            kept = [self.keep(skip, old, new) for old, new in zip(unit, outs)]
            self._stored = kept[0]
            return kept
        if s == "stochastic":
            key = unit[1]
            param = self.round_stochastic(x, self.bits(key, group.shapes[i]))
            nxt = self.mix(key + self.s32(_GOLDEN))  # _rng.advance
            return [self.keep(skip, unit[0], param), self.keep(skip, key, nxt)]
        param = self.to(x, f32, dtype)
        if s == "none":
            return [self.keep(skip, unit[0], param)]
        comp = self.to(x - self.to(param, dtype, f32), f32, dtype)  # Kahan's store
        kept = [self.keep(skip, unit[0], param), self.keep(skip, unit[1], comp)]
        self._stored = kept[0]
        return kept

    def widen(self, m: Any, dtype: torch.dtype, shape: Sequence[int] = ()) -> Any:
        """A stored moment in fp32 (``_state_format.load``; 8-bit: ``_quantize._decode``;
        4-bit: ``_quantize4.dequantize4``)."""
        if dtype == _U4:
            from mpfunc.state_formats import _quantize4

            return _quantize4.decode_ops(self, m[0], m[1], shape, self._signed[id(m[0])])
        if dtype == torch.uint8:
            return self.decode(m[0], m[1], shape)
        return self.to(m, dtype, torch.float32)

    def narrow(
        self,
        skip: Any,
        old: Any,
        new: Any,
        dtype: torch.dtype,
        draw: Optional[tuple[Any, int, Sequence[int]]] = None,
    ) -> list[Any]:
        """A moment's outputs: ``new`` (already kept) in fp32 state, else rounded to nearest
        even with the old stored bits where skipped (``_state_format.store``); 8-bit: the
        codes and scales of ``_quantize._encode``, a second moment (unsigned codes) rounded
        stochastically with ``draw`` = (the step count after the step, the leaf's salt,
        its shape), as ``_state_format.store`` draws."""
        if dtype == torch.float32:
            return [new]
        if dtype not in _CODES_EXTENT:
            return [self.keep(skip, old, self.to(new, torch.float32, dtype))]
        assert draw is not None
        codes, scale = old
        signed = self._signed[id(codes)]
        step, salt, shape = draw
        noise = None
        if not signed:
            key = self.mix(step.cast("s32") * self.s32(_GOLDEN) + self.s32(_rng.wrap(salt)))
            noise = self.uniform(key, shape)
        if dtype == _U4:
            from mpfunc.state_formats import _quantize4

            c, sc = _quantize4.encode_ops(self, new, signed, noise, shape)
        else:
            c, sc = self.encode(new, signed, noise, shape)
        return [self.keep(skip, codes, c), self.keep(skip, scale, sc)]

    # --- the 8-bit codec (_quantize) and the block code 4-bit shares, one leaf at a time ---

    def entry(self, k: Any, twice_levels: float) -> Any:
        """The decode table's value of s32 codes ``k`` (not the marks): ``k / (2L - |k|)``
        for a map with ``L`` levels a side, one fp32 division. It is the table's entry
        bit for bit (tests/test_native_composed.py checks every entry), and elementwise:
        XLA:CPU fuses it where a 256-entry gather is a separate, scalar loop."""
        kf = k.cast("f32")
        return kf / (self.f32(twice_levels) - self.abs(kf))

    def once(self, x: Any, dtype: torch.dtype, shape: Sequence[int]) -> Any:
        """A new moment ``x`` (fp32, of ``shape``), computed once where it is stored
        encoded (``dtype``: 8-bit or 4-bit), else ``x`` itself.

        The codec reads a new moment in two fusions (the block reduction, the codes) and the
        optimizer's update in a third; XLA:CPU recomputes a cheap producer (the decode, the
        moment's arithmetic) inside each: without this, an AdamW step's device time on 51
        leaves of 256 x 256 was 2.1x (8-bit) and 1.7x (4-bit) what it is. The builder has
        no optimization barrier; an identity gather (indices ``0..n-1``) is one that XLA
        keeps, and gives the same bits. Only on XLA:CPU, where it was measured: on a TPU or
        GPU, XLA's fusion differs and the stored array would be extra memory traffic."""
        if dtype not in _CODES_EXTENT:
            return x
        return self.barrier(x, shape)

    def in_turn(self, group: _Leaves, dtype: torch.dtype, g: Any) -> Any:
        """Leaf ``g``'s grad, made to wait for the previous leaf's new param where that pays
        on XLA:CPU: a ``"remainder"`` or ``"kahan"`` master with 8- or 4-bit moments.

        XLA:CPU's runtime starts every ready fusion in turn, one stage of every leaf before
        the next stage of any, and with these pairs' stored arrays (the master and both
        moments, ``barrier``) a leaf's data leaves the cache before its next stage reads it:
        on 51 leaves of 256 x 256 their device time was 17-23 ms against 9-14 with the
        leaves in turn, as fast as ``"stochastic"`` with the same state (for the other pairs
        the order made no gain or cost up to 25%). The wait is a select on a predicate that
        is never true, ``(x != x) & (x == x)`` of the previous param's first element, which
        XLA does not fold; ``g`` comes out unchanged."""
        prev, self._stored = self._stored, None
        if prev is None or not self.cpu_forms or dtype not in _CODES_EXTENT:
            return g
        first = prev.reshape([math.prod(prev.shape().sizes)]).slice_in_dim(0, 1, 0).reshape([])
        first = first.cast("f32")
        never = (first != first) & (first == first)
        return never.select(-g, g)

    def barrier(self, x: Any, shape: Sequence[int]) -> Any:
        """``x`` (of ``shape``), stored once between XLA's fusions (an identity gather), on
        XLA:CPU only (``cpu_forms``); else ``x``, and for an empty ``x`` (a gather of no
        elements is refused by XLA: an empty "remainder" or "kahan" leaf failed the whole
        node after other groups had stepped; found in review)."""
        n = math.prod(shape)
        if not self.cpu_forms or n == 0:
            return x
        idx = self.xb.Op.iota(self.builder, self.xb.mkshape("s32", (n, 1)), 0)
        dims = {"offset_dims": [], "collapsed_slice_dims": [0], "start_index_map": [0]}
        operands = (x.reshape([n]).op, idx.op)
        out = self.xb.mkop("Gather", operands, index_vector_dim=1, slice_sizes=[1], **dims)
        return out.reshape(list(shape))

    def abs(self, x: Any) -> Any:
        return self.xb.mkop("Abs", (x.op,))

    def square(self, x: Any) -> Any:
        """``_quantize.square``: ``x * x`` flushed, a select between the product and the
        subtraction that reads it, which XLA:CPU then does not fuse into a multiply-add."""
        return self.flush(x * x)

    def flush(self, x: Any) -> Any:
        """``_quantize._flush``: magnitudes below fp32's smallest normal read as 0."""
        return (self.abs(x) < self.f32(2.0**-126)).select(x.zeros_like(), x)

    def per_element(self, blocks: Any, n: int) -> Any:
        """A per-block value ``(nb,)`` repeated for each of the ``n`` elements."""
        nb = -(-n // 32)
        return blocks.broadcast_in_dim([nb, 32], [0]).reshape([nb * 32]).slice_in_dim(0, n, 0)

    def decode(self, codes: Any, scale: Any, shape: Sequence[int]) -> Any:
        """``_quantize._decode``: ``scale * T[code]`` (squared for the unsigned map), the
        marks NaN (signed) and ``+inf`` (unsigned)."""
        from mpfunc.state_formats import _quantize

        n = math.prod(shape)
        signed = self._signed[id(codes)]
        k = codes.reshape([n]).cast("s32")
        vals = self.entry(k, 2.0 * (_quantize._S_LEVELS if signed else _quantize._U_LEVELS))
        mark = k == self.s32(_quantize._S_NAN if signed else _quantize._U_NAN)
        vals = mark.select(vals.scalar_like(math.nan if signed else math.inf), vals)
        s = scale.cast("f32")
        if not signed:
            s = s.max(self.f32(2.0**-126))
        y = vals * self.per_element(s, n)
        if not signed:
            y = y * y
        return self.flush(y).reshape(list(shape))

    def rne(self, x: Any) -> Any:
        """``torch.round`` (to nearest, ties to even) of moderate values, exactly: the builder
        has no such op. ``x - floor(x)`` is exact."""
        r = x.floor()
        d = x - r
        half = r * self.f32(0.5)
        odd = half.floor() != half
        up = (d > self.f32(0.5)) | ((d == self.f32(0.5)) & odd)
        return up.select(r + self.f32(1.0), r)

    def encode(self, x: Any, signed: bool, noise: Any, shape: Sequence[int]) -> tuple[Any, Any]:
        """``_quantize._encode`` of one leaf's fp32 values: its codes (the codes' dtype and
        ``shape``) and bf16 block scales. Blocks are zero-padded, as ``_as_blocks`` pads."""
        from mpfunc.state_formats import _quantize

        n = math.prod(shape)
        draws = None if noise is None else self.blocks(noise, n)
        levels = _quantize._S_LEVELS if signed else _quantize._U_LEVELS
        code, scale = self.codes(self.blocks(x, n), signed, levels, draws)
        codes = code.reshape([-(-n // 32) * 32]).slice_in_dim(0, n, 0).reshape(list(shape))
        return codes.cast("s8" if signed else "u8"), scale

    def blocks(self, v: Any, n: int) -> Any:
        """The ``n`` fp32 values of ``v`` in row-major order, zero-padded to whole blocks of
        32 and shaped ``(blocks, 32)``, as ``_quantize._as_blocks`` and
        ``_quantize4._as_blocks`` lay them out."""
        nb = -(-n // 32)
        flat = v.reshape([n])
        if nb * 32 > n:
            pad = self.f32(0.0).broadcast([nb * 32 - n])
            flat = self.xb.Op.concat_in_dim([flat, pad], 0, builder=self.builder)
        return flat.reshape([nb, 32])

    def codes(self, xb: Any, signed: bool, levels: int, draws: Any) -> tuple[Any, Any]:
        """The companded block code of ``_quantize._encode`` (8-bit, ``levels`` 127/254)
        and ``_quantize4._encode`` (4-bit, 7/14): fp32 blocks ``xb`` of shape ``(nb, 32)``
        -> s32 codes of the same shape (the marks ``-(L + 1)`` and ``L + 1`` for
        non-finite values) and the bf16 block scales ``(nb,)``. ``draws``: ``None`` (to
        nearest) or fp32 draws in [0, 1) shaped like ``xb`` (stochastic).

        The torch path's bits in a form XLA:CPU compiles to vector loops (the op-for-op form
        took 2x as long): the unsigned block scale is ``sqrt`` of the block's largest kept
        value, equal to the largest ``sqrt`` (a correctly rounded ``sqrt`` is monotonic), so
        no fp32 array of square roots is stored between the reduction and the codes; each
        mask is computed where it is used; a stochastic code's two table neighbours are
        ``entry`` divisions, not gathers."""
        from mpfunc.state_formats._quantize import BF16_MAX

        tiny, zero, one = self.f32(2.0**-126), self.f32(0.0), self.f32(1.0)
        finite = (xb - xb) == zero
        if signed:
            keep = finite & (self.abs(xb) >= tiny)
            kept = keep.select(xb, xb.zeros_like())
            amax = self.abs(kept).reduce(self.f32(-math.inf), lambda a, c: a.max(c), [1])
        else:  # (ok: finite and > -tiny; keep: ok and >= tiny, which is x >= tiny)
            keep = finite & (xb >= tiny)
            kept = keep.select(xb, xb.zeros_like())
            amax = kept.reduce(self.f32(-math.inf), lambda a, c: a.max(c), [1]).sqrt()
            kept = kept.sqrt()
        scale = amax.min(self.f32(BF16_MAX)).cast("bf16")
        s = scale.cast("f32")
        den = (s > zero).select(s, s.ones_like()).broadcast_in_dim(list(xb.shape().sizes), [0])
        y = self.flush(kept / den)
        t = (y + y) / (self.abs(y) + one)
        low, twice = (-levels if signed else 0), 2.0 * levels
        if draws is None:
            code = self.rne(t * self.f32(levels)).max(self.f32(low)).min(self.f32(levels))
            code = code.cast("s32")
        else:
            lo = (t * self.f32(levels)).floor().max(self.f32(low)).min(self.f32(levels - 1))
            lo = lo.cast("s32")
            a, b = self.entry(lo, twice), self.entry(lo + self.s32(1), twice)
            value = y
            if not signed:
                value, a, b = self.square(y), self.square(a), self.square(b)
            code = lo + (draws < (value - a) / (b - a)).cast("s32")
        if signed:
            return finite.select(code, code.scalar_like(-levels - 1)), scale
        code = keep.select(code.max(self.s32(1)), code)
        ok = finite & (xb > -tiny)
        return ok.select(code, code.scalar_like(levels + 1)), scale

    def uniform(self, key: Any, shape: Sequence[int]) -> Any:
        """``_rng.uniform(key, shape)``: 24 random bits per element, in [0, 1)."""
        return self.shr(self.bits(key, shape), 8).cast("f32") * self.f32(2.0**-24)

    def shr(self, x: Any, n: int) -> Any:
        """Logical right shift of s32 values: ``_rng._shr``'s bits, as one unsigned division
        by ``2**n``, which XLA turns into a logical shift (the builder's only right shift,
        torch_xla 2.9's misspelt ``ShifRight``, is arithmetic). A signed division of the
        masked value, ``_rng._shr`` written op for op, became seven ops a shift on XLA:CPU
        (the rounding of a signed division towards zero)."""
        return (x.bitcast("u32") / self.const(1 << n, "u32")).bitcast("s32")

    def mix(self, x: Any) -> Any:
        """``_rng._mix``: MurmurHash3's fmix32 in wrapping s32 arithmetic."""
        x = x ^ self.shr(x, 16)
        x = x * self.s32(_M1)
        x = x ^ self.shr(x, 13)
        x = x * self.s32(_M2)
        return x ^ self.shr(x, 16)

    def bits(self, key: Any, shape: Sequence[int]) -> Any:
        """``_rng.bits(key, shape)``: the row-major element index hashed with the key."""
        n = math.prod(shape)
        index = self.xb.Op.iota(self.builder, self.xb.mkshape("s32", (n,)), 0)
        index = index.reshape(list(shape))
        x = self.mix(index * self.s32(_GOLDEN) + key)
        return self.mix(x ^ key)

    def round_stochastic(self, x: Any, r: Any) -> Any:
        """``_strategy_stochastic``'s rounding of fp32 ``x`` to bf16 with draws ``r``: the low
        16 bits of ``r`` added to the bits, truncated; NaN stays NaN."""
        t = (x.bitcast("s32") + (r & self.s32(0xFFFF))) & self.s32(-65536)
        return (x != x).select(x, t.bitcast("f32")).cast("bf16")

    def round_out(self, skip: Any, old: Any, p: Any, low: Optional[torch.dtype]) -> list[Any]:
        """The model param's output: the master rounded to nearest even (as ``Tensor.to``),
        or its old bits where the step is skipped; nothing without a model param."""
        if low is None:
            return []
        return [self.keep(skip, old, self.to(p, torch.float32, low))]

    def refresh(self, p: Any, old: Any, low: Optional[torch.dtype]) -> Any:
        """The master the step starts from: the model param's value where the param no
        longer equals the master rounded to its dtype (written behind the step's back),
        else the master, as ``_plan.refresh_from_params_``. Compared in the param's dtype."""
        if low is None:
            return p
        r = self.to(p, torch.float32, low)
        # Equal, or both NaN (the master keeps its own NaN's bits): x != x is NaN.
        same = (r == old) | ((r != r) & (old != old))
        return same.select(p, self.to(old, low, torch.float32))

    def grad_params(self, group: _Leaves) -> list[Any]:
        """The grads' parameters (after the state), widened to fp32 inside."""
        return [
            self.to(self.param(shape, dtype), dtype, torch.float32)
            for shape, dtype in zip(group.shapes, group.grad_dtypes)
        ]

    def unscale(self, grads: list[Any], scaled: bool) -> list[Any]:
        """With a loss scale (the last parameter), the widened grads divided by it, as
        ``grads_to_fp32_(..., scale=)`` divides them after the upcast."""
        if not scaled:
            return grads
        scale = self.param((), torch.float32)
        return [g / scale for g in grads]

    def skip(self, kind: Optional[torch.dtype]) -> Any:
        """The skip flag's parameter as a predicate (a float flag skips when nonzero, NaN
        included), or ``None`` without one."""
        if kind is None:
            return None
        flag = self.param((), kind)
        if kind == torch.bool:
            return flag
        return flag != self.xb.Op.scalar(self.builder, 0, dtype=_type(kind))

    def keep(self, skip: Any, old: Any, new: Any) -> Any:
        """``old`` where the step is skipped, else ``new``: the same select as
        ``_optimizer.unless_skipped``, applied to each state value as soon as it is computed.

        Later values read the selected ones (equal to the new ones whenever they are used),
        never the old buffers: a fusion that still read an old moment after its output was
        written would make XLA copy that buffer rather than update it in place.
        """
        return new if skip is None else skip.select(old, new)

    def sign(self, x: Any) -> Any:
        """torch_xla's ``sign``: -1, +1, or ``x`` itself for a (signed) zero, and 0 for NaN
        (as torch's), by selects (the builder has no sign op)."""
        zero = x.zeros_like()
        signed_zero = (x != x).select(zero, x)
        return (x > zero).select(x.ones_like(), (x < zero).select(-x.ones_like(), signed_zero))

    def to(self, op: Any, src: torch.dtype, dst: torch.dtype) -> Any:
        return op if src == dst else op.cast(_type(dst))


# --- the optimizers' entry -------------------------------------------------------------------

# What an optimizer module's ``"xla"`` kernel builds with: its computation is a function
# ``build(h, leaves, shared_key)`` written with a ``Builder`` over the ``Leaves`` of a group.
Builder = _B
Leaves = _Leaves


def step(
    kind: str,
    h: tuple[Any, ...],
    group: Group,
    moments: Sequence[tuple[str, Sequence[Any]]],
    decay: Optional[float],
    build: Callable[[Any, _Leaves, tuple[Any, ...]], Any],
) -> None:
    """One step of an optimizer's ``"xla"`` kernel over same-device XLA tensors, traced as
    one node (``xla::mpfunc_<kind>``), in place.

    Args:
      kind: the optimizer's name in the node and the cache key.
      h: its hyperparameters (a NamedTuple, part of the cache key), as ``build`` takes them.
      group: the kernel's ``Group``: ``params`` fp32 masters or the units of one master
        strategy (``PARAM_DTYPES``), grads of any floating dtype (widened inside, as
        ``grads_to_fp32_`` does), ``state.step`` 0-d float32 counts, ``lr`` a float or a 0-d
        float32 device tensor (changing either recompiles nothing; a float of exactly 0.0
        or 1.0 compiles one graph each: ``_shared_inputs``), ``skip`` (bool or float,
        nonzero: every state tensor keeps its bits), ``scale`` the loss scale the widened
        grads are divided by, ``model`` (fp32 masters only) the params that receive the
        masters rounded, ``salts`` each leaf's place in the tree (8-bit moments' draws).
      moments: the state fields the step rewrites besides the step count, ``(name, list)``
        in the order ``build`` reads them (``Builder.fields``), all float32, all bfloat16
        or all 8-bit ``QState``s.
      decay: the decoupled weight decay, or ``None``: with a float lr, ``1 - lr * decay`` is
        computed in float64, rounded once and passed as an input (``_shared_inputs``).
      build: makes the computation (called once per cache key).

    Raises:
      TypeError, ValueError: a list's length, a tensor's dtype, shape or device, or ``lr``,
        ``skip`` or ``scale`` is not as stated. Nothing is written then. The
        hyperparameters are taken as checked (the optimizer's factory checks them).
    """
    if not group.params:
        return
    fn = f"xla::mpfunc_{kind}"
    state = group.state
    leaves = _gather(fn, group.params, group.grads, moments, state.step, group.model, group.salts)
    shared = _shared_inputs(fn, leaves.device, group.lr, group.skip, decay, group.scale)
    _run(kind, h, leaves, shared, build)

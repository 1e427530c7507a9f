"""The cases `bench.transforms` times: every mpfunc transform and its baselines.

A case builds its own buffers from a shared :class:`Point` (one tree of a given
size and tensor count) and returns a zero-argument ``step`` that runs the
transform once. Each case states the bytes its transform must read and write per
element; the roofline ratio divides the achieved bandwidth by the device's
measured ``copy_`` (casts) or in-place ``add_`` (optimizer updates) bandwidth.

The baselines (per-tensor loops, ``torch._foreach_*``, ``torch.optim`` and a
flat buffer sliced per tensor) live here, in ``bench/``, never in the library.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

import mpfunc

Step = Callable[[], Any]

# Hyperparameters shared by mpfunc and the torch.optim baselines.
LR = 1e-3
MOMENTUM = 0.9
BETAS = (0.9, 0.999)
EPS = 1e-8
ADAMW_WD = 1e-2


@dataclass
class Point:
    """One tree: ``len(sizes)`` 1-d tensors, as a dict with ordered keys.

    ``params`` and ``grads`` are in the model dtype (bf16), ``masters`` and
    ``grads32`` in fp32. In-place cases may mutate ``params`` and ``masters``;
    the values drift by a few steps of lr 1e-3, which does not change timings.
    """

    device: torch.device
    sizes: list[int]
    params: dict[str, torch.Tensor]
    grads: dict[str, torch.Tensor]
    masters: dict[str, torch.Tensor]
    grads32: dict[str, torch.Tensor]

    @property
    def numel(self) -> int:
        return sum(self.sizes)


def split_sizes(total: int, count: int) -> list[int]:
    """``count`` sizes summing to ``total``, equal up to a remainder on the first."""
    if count < 1 or total < count:
        raise ValueError(f"cannot split {total} elements into {count} tensors")
    base = total // count
    sizes = [base] * count
    sizes[0] += total - base * count
    return sizes


def make_point(
    total: int, count: int, device: torch.device, model_dtype: torch.dtype, seed: int
) -> Point:
    """Random normal masters, their model-dtype cast, and small random grads."""
    gen = torch.Generator().manual_seed(seed)
    params, grads, masters, grads32 = {}, {}, {}, {}
    width = len(str(count))
    for i, n in enumerate(split_sizes(total, count)):
        key = f"w{i:0{width}d}"
        m = torch.randn(n, generator=gen)
        g = torch.randn(n, generator=gen).mul_(1e-3)
        masters[key] = m.to(device)
        params[key] = m.to(device=device, dtype=model_dtype)
        grads[key] = g.to(device=device, dtype=model_dtype)
        grads32[key] = grads[key].float()
    return Point(device, split_sizes(total, count), params, grads, masters, grads32)


@dataclass(frozen=True)
class Case:
    """One transform implementation to time.

    ``transform`` names what is computed (the same for a transform and its
    baselines), ``variant`` who computes it. ``roof`` is ``"copy"`` or ``"add"``:
    the measured bandwidth this transform is held against.
    """

    transform: str
    variant: str
    bytes_per_elem: int
    roof: str
    build: Callable[[Point], Step]
    devices: tuple[str, ...] = ("cpu", "cuda", "xla")
    size_sweep_only: bool = False


def _vals(tree: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    return list(tree.values())


# ---- casts: grads_to_fp32 and masters_to_model -------------------------------------------


def _g2f_mpfunc(pt: Point) -> Step:
    return lambda: mpfunc.grads_to_fp32(pt.grads)


def _g2f_mpfunc_(pt: Point) -> Step:
    out = {k: torch.empty_like(g, dtype=torch.float32) for k, g in pt.grads.items()}
    return lambda: mpfunc.grads_to_fp32_(pt.grads, out)


def _g2f_loop(pt: Point) -> Step:
    grads = _vals(pt.grads)
    return lambda: [g.to(torch.float32) for g in grads]


def _g2f_loop_(pt: Point) -> Step:
    grads = _vals(pt.grads)
    outs = [torch.empty_like(g, dtype=torch.float32) for g in grads]

    def step() -> None:
        for o, g in zip(outs, grads):
            o.copy_(g)

    return step


def _g2f_foreach_(pt: Point) -> Step:
    grads = _vals(pt.grads)
    outs = [torch.empty_like(g, dtype=torch.float32) for g in grads]
    return lambda: torch._foreach_copy_(outs, grads)


def _g2f_flat_(pt: Point) -> Step:
    # The original recipe: one fp32 buffer, each grad copied through an offset slice.
    grads = _vals(pt.grads)
    flat = torch.empty(pt.numel, dtype=torch.float32, device=pt.device)

    def step() -> None:
        off = 0
        for g in grads:
            n = g.numel()
            flat[off : off + n].view_as(g).copy_(g)
            off += n

    return step


def _m2m_mpfunc(pt: Point) -> Step:
    return lambda: mpfunc.masters_to_model(pt.masters, pt.params)


def _m2m_mpfunc_(pt: Point) -> Step:
    return lambda: mpfunc.masters_to_model_(pt.masters, pt.params)


def _m2m_loop(pt: Point) -> Step:
    pairs = list(zip(_vals(pt.masters), _vals(pt.params)))
    return lambda: [m.to(p.dtype) for m, p in pairs]


def _m2m_loop_(pt: Point) -> Step:
    pairs = list(zip(_vals(pt.masters), _vals(pt.params)))

    def step() -> None:
        for m, p in pairs:
            p.copy_(m)

    return step


def _m2m_foreach_(pt: Point) -> Step:
    masters, params = _vals(pt.masters), _vals(pt.params)
    return lambda: torch._foreach_copy_(params, masters)


def _m2m_flat_(pt: Point) -> Step:
    params = _vals(pt.params)
    flat = torch.cat([m.view(-1) for m in _vals(pt.masters)])

    def step() -> None:
        off = 0
        for p in params:
            n = p.numel()
            p.copy_(flat[off : off + n].view_as(p))
            off += n

    return step


# ---- optimizer updates ---------------------------------------------------------------------


def _mpfunc_opt(kind: str, impl: str) -> Any:
    if kind == "sgd":
        return mpfunc.sgd(lr=LR, momentum=MOMENTUM, impl=impl)
    if kind == "adam":
        return mpfunc.adam(lr=LR, betas=BETAS, eps=EPS, impl=impl)
    return mpfunc.adamw(lr=LR, betas=BETAS, eps=EPS, weight_decay=ADAMW_WD, impl=impl)


def _update_mpfunc(kind: str, impl: str, inplace: bool) -> Callable[[Point], Step]:
    def build(pt: Point) -> Step:
        opt = _mpfunc_opt(kind, impl)
        # The pure twin gets its own masters so that the shared ones stay put.
        masters = pt.masters if inplace else {k: m.clone() for k, m in pt.masters.items()}
        cell = [masters, opt.init(masters)]
        apply = mpfunc.apply_update_ if inplace else mpfunc.apply_update

        def step() -> Any:
            # Reassign, as a training loop would: the pure twin frees the old trees here.
            cell[0], cell[1] = apply(cell[0], pt.grads32, cell[1], opt)
            return cell

        return step

    return build


def _torch_optimizer(kind: str, params: list[torch.Tensor], mode: str) -> torch.optim.Optimizer:
    # "default": what torch.optim picks when told nothing (foreach on CPU and CUDA).
    if mode == "default":
        flags: dict[str, Any] = {}
    else:
        flags = {"foreach": mode == "foreach", "fused": True if mode == "fused" else None}
    if kind == "sgd":
        return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM, **flags)
    if kind == "adam":
        return torch.optim.Adam(params, lr=LR, betas=BETAS, eps=EPS, **flags)
    return torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=ADAMW_WD, **flags)


def _update_torch(kind: str, mode: str) -> Callable[[Point], Step]:
    """torch.optim on the same fp32 tree: ``mode`` is loop, foreach, fused or default."""

    def build(pt: Point) -> Step:
        params = []
        for m, g in zip(_vals(pt.masters), _vals(pt.grads32)):
            p = m.detach().requires_grad_(True)  # shares the master's storage
            p.grad = g
            params.append(p)
        opt = _torch_optimizer(kind, params, mode)
        return opt.step

    return build


def _update_flat(kind: str) -> Callable[[Point], Step]:
    """One flat fp32 buffer stepped by torch's fused optimizer: the single-tensor best case."""

    def build(pt: Point) -> Step:
        p = torch.cat([m.view(-1) for m in _vals(pt.masters)]).requires_grad_(True)
        p.grad = torch.cat([g.view(-1) for g in _vals(pt.grads32)])
        opt = _torch_optimizer(kind, [p], "fused")
        return opt.step

    return build


# ---- the mixed-precision step: bf16 grads in, bf16 params out --------------------------------


def _mixed_one_pass(pt: Point) -> Step:
    """The whole mixed step in one call, ``apply_update_(..., params=)``: bf16 grads in,
    masters, moments and bf16 params written in one pass (on CPU: the native kernel)."""
    opt = _mpfunc_opt("adamw", "auto")
    masters, params, grads = pt.masters, pt.params, pt.grads
    state = opt.init(masters)
    apply: Any = mpfunc.apply_update_
    return lambda: apply(masters, grads, state, opt, params=params)


def _mixed_no_memo(pt: Point) -> Step:
    """As ``_mixed_one_pass`` with mpfunc's memo of passed checks off: every call checks and
    plans each leaf in full, as before the memo (the side-by-side "before")."""
    from mpfunc.core import _cache

    step = _mixed_one_pass(pt)

    def run() -> Any:
        with _cache.memo_off():
            return step()

    return run


def _mixed_kernel(pt: Point) -> Step:
    """The native kernel alone, on the lists ``_plan`` would give it: what the step costs
    without mpfunc's per-leaf checks and planning in Python."""
    from mpfunc.core._optimizer import Group
    from mpfunc.optim import _adam

    opt = _mpfunc_opt("adamw", "auto")
    masters, params, grads = pt.masters, pt.params, pt.grads
    state = opt.init(masters)
    keys = list(masters)
    lists = {f: [getattr(state, f)[k] for k in keys] for f in ("step", "exp_avg", "exp_avg_sq")}
    group = Group(
        [masters[k] for k in keys],
        [grads[k] for k in keys],
        state._replace(**lists),
        LR,
        None,
        model=[params[k] for k in keys],
    )
    hyper = _adam.AdamHyper(*BETAS, EPS, ADAMW_WD, decoupled=True, amsgrad=False, maximize=False)
    return lambda: _adam._native_kernel(group, hyper)


def _mixed_three_calls(pt: Point) -> Step:
    """The in-place loop of today: ``grads_to_fp32_``, ``apply_update_``, ``masters_to_model_``."""
    opt = _mpfunc_opt("adamw", "auto")
    masters, params, grads = pt.masters, pt.params, pt.grads
    state = opt.init(masters)
    g32 = {k: torch.empty_like(g, dtype=torch.float32) for k, g in grads.items()}

    def step() -> Any:
        mpfunc.grads_to_fp32_(grads, g32)
        mpfunc.apply_update_(masters, g32, state, opt)
        return mpfunc.masters_to_model_(masters, params)

    return step


# ---- reference bandwidth at the same size (one tensor) -------------------------------------


def _copy_ref(pt: Point) -> Step:
    src = torch.cat([m.view(-1) for m in _vals(pt.masters)])
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def _add_ref(pt: Point) -> Step:
    a = torch.cat([m.view(-1) for m in _vals(pt.masters)])
    b = torch.cat([g.view(-1) for g in _vals(pt.grads32)])
    return lambda: a.add_(b)


# Bytes per element each transform must move (model dtype: 2 bytes).
CAST_BYTES = 2 + 4  # read a bf16 value, write an fp32 one (or the reverse)
SGD_BYTES = 3 * 4 + 2 * 4  # read p, g, momentum; write p, momentum (fp32)
ADAM_BYTES = 4 * 4 + 3 * 4  # read p, g, m, v; write p, m, v (fp32)
# The mixed step: read a bf16 grad and the fp32 master, m, v; write master, m, v and the
# bf16 param. The same 28 bytes as an fp32 AdamW step.
MIXED_BYTES = 2 + 3 * 4 + 3 * 4 + 2
MIXED = "mixed adamw_ (bf16 grads in, bf16 params out)"

NO_XLA = ("cpu", "cuda")
# Roofline holds these against the measured in-place add_; the casts against copy_.
UPDATE_ROOF = "add"


# The same-size references: transform name -> the roof it measures.
REFERENCE_TRANSFORMS = {"copy_ fp32 (1 tensor)": "copy", "add_ fp32 (1 tensor)": "add"}


def all_cases() -> list[Case]:
    cases = [
        Case("copy_ fp32 (1 tensor)", "torch", 8, "copy", _copy_ref, size_sweep_only=True),
        Case("add_ fp32 (1 tensor)", "torch", 12, "add", _add_ref, size_sweep_only=True),
        Case("grads_to_fp32", "mpfunc", CAST_BYTES, "copy", _g2f_mpfunc),
        Case("grads_to_fp32", "loop", CAST_BYTES, "copy", _g2f_loop),
        Case("grads_to_fp32_", "mpfunc", CAST_BYTES, "copy", _g2f_mpfunc_),
        Case("grads_to_fp32_", "loop", CAST_BYTES, "copy", _g2f_loop_),
        Case("grads_to_fp32_", "_foreach_copy_", CAST_BYTES, "copy", _g2f_foreach_),
        Case("grads_to_fp32_", "flat slices", CAST_BYTES, "copy", _g2f_flat_),
        Case("masters_to_model", "mpfunc", CAST_BYTES, "copy", _m2m_mpfunc),
        Case("masters_to_model", "loop", CAST_BYTES, "copy", _m2m_loop),
        Case("masters_to_model_", "mpfunc", CAST_BYTES, "copy", _m2m_mpfunc_),
        Case("masters_to_model_", "loop", CAST_BYTES, "copy", _m2m_loop_),
        Case("masters_to_model_", "_foreach_copy_", CAST_BYTES, "copy", _m2m_foreach_),
        Case("masters_to_model_", "flat slices", CAST_BYTES, "copy", _m2m_flat_),
    ]
    # The mixed step against torch's AdamW on an fp32 tree of the same shapes, interleaved.
    cases += [
        Case(MIXED, "mpfunc, 1 pass", MIXED_BYTES, UPDATE_ROOF, _mixed_one_pass),
        Case(MIXED, "mpfunc, 1 pass, no memo", MIXED_BYTES, UPDATE_ROOF, _mixed_no_memo),
        Case(MIXED, "native kernel alone", MIXED_BYTES, UPDATE_ROOF, _mixed_kernel, ("cpu",)),
        Case(MIXED, "mpfunc, 3 calls", MIXED_BYTES, UPDATE_ROOF, _mixed_three_calls),
        Case(
            MIXED,
            "torch.optim fused, fp32 tree",
            ADAM_BYTES,
            UPDATE_ROOF,
            _update_torch("adamw", "fused"),
            NO_XLA,
        ),
        Case(
            MIXED,
            "torch.optim default, fp32 tree",
            ADAM_BYTES,
            UPDATE_ROOF,
            _update_torch("adamw", "default"),
        ),
    ]
    for kind, nbytes in (("sgd", SGD_BYTES), ("adam", ADAM_BYTES), ("adamw", ADAM_BYTES)):
        pure, inplace = f"apply_update {kind}", f"apply_update_ {kind}"
        cases.append(Case(pure, "mpfunc", nbytes, UPDATE_ROOF, _update_mpfunc(kind, "auto", False)))
        cases.append(
            Case(inplace, "mpfunc", nbytes, UPDATE_ROOF, _update_mpfunc(kind, "auto", True))
        )
        if kind == "adamw":
            for impl in ("fused", "foreach", "reference"):
                cases.append(
                    Case(
                        inplace,
                        f"mpfunc impl={impl}",
                        nbytes,
                        UPDATE_ROOF,
                        _update_mpfunc(kind, impl, True),
                        devices=NO_XLA if impl == "fused" else ("cpu", "cuda", "xla"),
                    )
                )
        cases += [
            Case(inplace, "torch.optim loop", nbytes, UPDATE_ROOF, _update_torch(kind, "loop")),
            Case(
                inplace, "torch.optim foreach", nbytes, UPDATE_ROOF, _update_torch(kind, "foreach")
            ),
            Case(
                inplace,
                "torch.optim fused",
                nbytes,
                UPDATE_ROOF,
                _update_torch(kind, "fused"),
                devices=NO_XLA,
            ),
            Case(
                inplace,
                "flat (1 tensor, fused)",
                nbytes,
                UPDATE_ROOF,
                _update_flat(kind),
                devices=NO_XLA,
            ),
        ]
    return cases

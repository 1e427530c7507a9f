"""Global-norm clipping, fp32 gradient accumulation and ``all_finite``.

References are independent of mpfunc: torch's ``clip_grad_norm_`` (from
``torch.nn.utils.clip_grad``, since importing torch_xla replaces
``torch.nn.utils.clip_grad_norm_`` with its own) on fp32 CPU copies of the same leaves,
in optree's flatten order; a one-large-batch fp32 gradient; ``torch.isfinite`` on the CPU.

Stated bounds, and why they hold:

* **clip, CPU, float max_norm: bit for bit.** mpfunc runs torch's own arithmetic: one
  2-norm per leaf, the 2-norm of the stacked norms, ``clamp(max_norm / (norm + 1e-6),
  max=1)`` and one multiply per leaf, in the same order, so the total norm and every
  clipped grad have the same bits as ``clip_grad_norm_``'s.
* **clip, CPU, 0-d tensor max_norm: the norm bit for bit, the clipped grads within
  5 * 2**-24 relative, elementwise.** torch turns max_norm into a Python float, and
  ``float / tensor`` is ``reciprocal() * float`` (two roundings, <= 2u with
  u = 2**-24), where mpfunc's ``tensor / tensor`` rounds once (<= u): the coefficients
  differ by <= 3u, and each side's product with the grad adds <= u.
* **clip, XLA: relative 1e-6,** ``|norm - ref| <= 1e-6 * ref`` and, elementwise,
  ``|clipped - ref| <= 1e-6 * |ref|``. XLA reduces the sums of squares in another
  order. Each side sums at most 6 * 64 same-sign squares in fp32; a pairwise sum of
  n terms is within about (log2(n) + 1) * 2**-24 ~ 6e-7 of the exact one for n = 384,
  and the square root halves that. XLA's order is its own, so beyond that argument
  the bound is empirical: observed <= 1.3e-7 for the norm. A clipped grad is one
  rounded product with the coefficient, so it inherits the coefficient's relative
  error plus half an ulp (observed <= 1.7e-7).
* **accumulation, fp32: 1e-6 of each leaf's largest entry,**
  ``max|acc - big| <= 1e-6 * max|big|`` per leaf. The loss scalings 1/(32*10)/16 and
  1/(512*10) have the same mantissa, so the two are fp32 sums of the same 512
  per-sample contributions that differ only in summation order; elementwise relative
  error is meaningless where an entry cancels to near zero, so the bound is taken
  against the leaf's largest magnitude (observed <= 3.3e-7 for seeds 0-3).
* **accumulation, bf16 model:** fp32 accumulation of the bf16 micro-batch grads is
  at least 4x closer (relative L2 over all leaves) to the fp32 large-batch gradient
  than summing the same bf16 grads in bf16 (observed 6-8x: ~6e-4 against ~4e-3).

XLA results are read only after one ``torch_xla.sync()``, because every clipped leaf
depends on every grad and torch_xla 2.9 mixes up such graphs when they are cut by
successive reads: with ``s = x.sum() + y.sum()`` for two same-shape device tensors,
``(x * s).cpu()`` and then ``(y * s).cpu()`` both return ``x * s`` (the second graph
hits the first one's compile-cache entry).
"""

from __future__ import annotations

import copy
import math
from typing import Any

import optree
import pytest
import torch
from helpers import assert_bits_equal, assert_trees_bits_equal, assert_unchanged, leaves, snapshot
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import SHAPES, bit_trees, bits_tensor, realize, specs, tree_shapes
from torch.nn.utils import clip_grad

import mpfunc

XLA_RTOL = 1e-6
TENSOR_MAX_NORM_RTOL = 5 * 2**-24
ACC_RTOL = 1e-6
BF16_MARGIN = 4.0


def per_device(device: torch.device, cpu: int, xla: int) -> Any:
    """Hypothesis settings with fewer examples on XLA, where each new tree compiles."""
    return settings(max_examples=cpu if device.type == "cpu" else xla)


def sync(device: torch.device) -> None:
    if device.type == "xla":
        import torch_xla

        torch_xla.sync()


def is_float(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point()


def floats_only(tree: Any) -> Any:
    """Grads exist only for floating leaves: int/bool buffers become None."""
    return optree.tree_map(lambda t: t if is_float(t) else None, tree, none_is_leaf=True)


def to_device(tree: Any, device: torch.device) -> Any:
    return optree.tree_map(
        lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, tree, none_is_leaf=True
    )


def clone(tree: Any) -> Any:
    return optree.tree_map(
        lambda t: t.clone() if isinstance(t, torch.Tensor) else t, tree, none_is_leaf=True
    )


# --- clip_by_global_norm -----------------------------------------------------------------


def torch_clip(grads_cpu: list[torch.Tensor | None], max_norm: float) -> tuple[Any, Any]:
    """torch's clip_grad_norm_ on fp32 CPU copies of the non-None leaves, in flatten order.

    Taken from ``torch.nn.utils.clip_grad``: importing torch_xla (conftest does) replaces
    ``torch.nn.utils.clip_grad_norm_`` itself with torch_xla's own version, whose
    arithmetic differs (it rounds max_norm to the grads' dtype before dividing).
    """
    params = []
    for g in grads_cpu:
        if g is not None:
            p = torch.nn.Parameter(torch.zeros_like(g))
            p.grad = g.clone()
            params.append(p)
    total = clip_grad.clip_grad_norm_(params, max_norm)
    it = iter(params)
    return [None if g is None else next(it).grad for g in grads_cpu], total


def assert_close_rel(actual: torch.Tensor, expected: torch.Tensor, rtol: float) -> None:
    a, e = actual.detach().cpu().double(), expected.detach().cpu().double()
    bad = ~((a - e).abs() <= rtol * e.abs())
    assert not bool(bad.any()), (
        f"relative {rtol} exceeded: got {a[bad][:3].tolist()}, expected {e[bad][:3].tolist()}"
    )


def draw_max_norm(data: st.DataObject, device: torch.device) -> tuple[Any, float]:
    """A float, or a 0-d fp32 tensor on the CPU or the grads' device; and its value."""
    value = data.draw(st.sampled_from([1e-4, 0.01, 0.5, 1.0, 3.0, 100.0]), label="max_norm")
    kind = data.draw(st.sampled_from(["float", "cpu tensor", "device tensor"]), label="kind")
    if kind == "float":
        return value, value
    t = torch.tensor(value, device="cpu" if kind == "cpu tensor" else device)
    return t, float(torch.tensor(value))  # the fp32 value, as the CPU reference sees it


def test_clip_matches_torch(device: torch.device) -> None:
    @per_device(device, cpu=80, xla=20)
    @given(data=st.data())
    def prop(data: st.DataObject) -> None:
        spec = data.draw(specs(dtypes=[torch.float32]), label="spec")
        scale = data.draw(st.sampled_from([1e-5, 1e-3, 1.0, 100.0]), label="grad scale")
        grads_cpu = floats_only(realize(spec, torch.device("cpu"), scale=scale))
        grads = to_device(grads_cpu, device)
        max_norm, value = draw_max_norm(data, device)
        snap = snapshot(grads)
        clipped, total = mpfunc.clip_by_global_norm(grads, max_norm)
        in_place = clone(grads)
        same, total_ = mpfunc.clip_by_global_norm_(in_place, max_norm)
        sync(device)
        assert_unchanged(grads, snap)  # the pure form mutates nothing
        assert same is in_place
        ref, ref_total = torch_clip(leaves(grads_cpu), value)
        assert total.shape == () and total.dtype == torch.float32
        if any(g is not None for g in leaves(grads)):  # else there is no device to be on
            assert total.device == device
        if device.type == "cpu":
            assert_bits_equal(total, ref_total)
        else:
            assert_close_rel(total, ref_total, XLA_RTOL)
        for c, r in zip(leaves(clipped), ref):
            if r is None:
                assert c is None
                continue
            assert c.dtype == torch.float32 and c.shape == r.shape and c.device == device
            if device.type != "cpu":
                assert_close_rel(c, r, XLA_RTOL)
            elif isinstance(max_norm, torch.Tensor):
                assert_close_rel(c, r, TENSOR_MAX_NORM_RTOL)
            else:
                assert_bits_equal(c, r)
        # The twins agree bit for bit, norm included.
        assert_trees_bits_equal(in_place, clipped)
        assert_bits_equal(total_, total)

    prop()


def test_clip_leaves_outputs_fresh_and_keeps_nones(device: torch.device) -> None:
    g = {"b": torch.ones(3, device=device), "a": None, "w": torch.full((2, 2), 2.0).to(device)}
    clipped, total = mpfunc.clip_by_global_norm(g, 1.0)
    sync(device)
    assert clipped["a"] is None
    assert clipped["b"] is not g["b"] and clipped["w"] is not g["w"]
    assert_close_rel(total, torch.tensor(math.sqrt(3 + 16)), 1e-7)
    # Below max_norm the coefficient is exactly 1: the grads come back unchanged.
    kept, _ = mpfunc.clip_by_global_norm(g, 100.0)
    sync(device)
    assert_bits_equal(kept["w"], g["w"])


def test_clip_norm_is_a_device_scalar_without_host_reads(xla_device: torch.device) -> None:
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.debug.metrics as met

    def transfers() -> int:
        data = met.metric_data("TransferFromDeviceTime")
        return 0 if data is None else int(data[0])

    grads = {"w": torch.randn(3, 5).to(xla_device), "b": torch.randn(7).to(xla_device)}
    torch_xla.sync()
    xm.wait_device_ops()
    for max_norm in (0.5, torch.tensor(0.5), torch.tensor(0.5, device=xla_device)):
        before = transfers()
        clipped, total = mpfunc.clip_by_global_norm(grads, max_norm)
        finite = mpfunc.all_finite(clipped)
        _, total_ = mpfunc.clip_by_global_norm_(clone(grads), max_norm)
        torch_xla.sync()
        xm.wait_device_ops()
        assert transfers() == before, f"a device-to-host transfer with max_norm={max_norm!r}"
        assert total.shape == () and total.device == xla_device == total_.device
        assert finite.shape == () and finite.dtype == torch.bool and finite.device == xla_device


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("inplace", [False, True], ids=["pure", "inplace"])
def test_clip_non_finite_grad(device: torch.device, bad: float, inplace: bool) -> None:
    """A non-finite grad makes the norm non-finite and all_finite(clipped) false."""
    grads = {
        "emb": torch.randn(7).to(device),
        "layers": [torch.randn(3, 5).to(device), torch.randn(2, 3, 4).to(device)],
    }
    grads["layers"][1][1, 2, 3] = bad
    f = mpfunc.clip_by_global_norm_ if inplace else mpfunc.clip_by_global_norm
    clipped, total = f(grads, 1.0)
    finite = mpfunc.all_finite(clipped)
    sync(device)
    assert total.device == device and not bool(torch.isfinite(total.cpu()))
    assert finite.device == device and not bool(finite.cpu())


def test_clip_empty_and_all_none_trees() -> None:
    for tree in ({}, [], {"a": None}, [None, None]):
        clipped, total = mpfunc.clip_by_global_norm(tree, 1.0)
        assert clipped == tree
        assert total.shape == () and float(total) == 0.0


# --- fp32 gradient accumulation ------------------------------------------------------------

N_MICRO, MICRO, D_IN, HIDDEN, D_OUT = 16, 32, 32, 64, 10


def mlp(seed: int) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    """A 2-layer MLP and a regression batch of N_MICRO * MICRO samples (targets near 1,
    so the per-sample contributions to each grad mostly share a sign, as they do early
    in training)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(D_IN, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, D_OUT)
    )
    x = torch.randn(N_MICRO * MICRO, D_IN)
    y = torch.randn(N_MICRO * MICRO, D_OUT) + 1.0
    return model, x, y


def grads_of(
    model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, divide: int
) -> dict[str, torch.Tensor]:
    """Grads of mean-squared error (loss in fp32) over the batch, divided by ``divide``."""
    model.zero_grad(set_to_none=True)
    dtype = next(model.parameters()).dtype
    loss = torch.nn.functional.mse_loss(model(x.to(dtype)).float(), y) / divide
    loss.backward()
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def micro_batches(x: torch.Tensor, y: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(x[i : i + MICRO], y[i : i + MICRO]) for i in range(0, len(x), MICRO)]


def rel_l2(tree: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    num = sum(float(((tree[k].double() - ref[k].double()) ** 2).sum()) for k in ref)
    den = sum(float((ref[k].double() ** 2).sum()) for k in ref)
    return math.sqrt(num / den)


def test_fp32_accumulation_matches_one_large_batch() -> None:
    model, x, y = mlp(seed=0)
    big = {k: g.clone() for k, g in grads_of(model, x, y, 1).items()}
    params = dict(model.named_parameters())
    acc = mpfunc.init_grads(params)
    for k, a in acc.items():
        assert a.dtype == torch.float32 and a.shape == params[k].shape and not a.any()
    for xb, yb in micro_batches(x, y):
        out = mpfunc.accumulate_grads_(acc, grads_of(model, xb, yb, N_MICRO))
        assert out is acc
    for k in big:
        err = float((acc[k] - big[k]).abs().max())
        tol = ACC_RTOL * float(big[k].abs().max())
        assert err <= tol, f"{k}: max|acc - big| = {err:.3g} > {tol:.3g}"


def test_fp32_accumulation_of_bf16_grads_beats_bf16_sums() -> None:
    model, x, y = mlp(seed=0)
    model = model.to(torch.bfloat16)
    x = x.to(torch.bfloat16).float()  # the same inputs for the bf16 model and the reference
    # The reference: the same (bf16-valued) weights in fp32, one large fp32 batch.
    ref_model = copy.deepcopy(model).float()
    ref = {k: g.clone() for k, g in grads_of(ref_model, x, y, 1).items()}
    acc = mpfunc.init_grads(dict(model.named_parameters()))
    bf16_sum: dict[str, torch.Tensor] = {}
    for xb, yb in micro_batches(x, y):
        g = grads_of(model, xb, yb, N_MICRO)
        assert all(t.dtype == torch.bfloat16 for t in g.values())
        mpfunc.accumulate_grads_(acc, g)
        bf16_sum = {k: bf16_sum[k] + t if bf16_sum else t.clone() for k, t in g.items()}
    assert all(a.dtype == torch.float32 for a in acc.values())
    err_acc, err_bf16 = rel_l2(acc, ref), rel_l2(bf16_sum, ref)
    assert err_bf16 > BF16_MARGIN * err_acc, (
        f"relative L2 error vs the fp32 large batch: bf16 sums {err_bf16:.3g}, "
        f"fp32 accumulation {err_acc:.3g} (ratio {err_bf16 / err_acc:.2f}, want > {BF16_MARGIN})"
    )


def test_accumulate_twins_agree_skip_none_and_pure_mutates_nothing(device: torch.device) -> None:
    @per_device(device, cpu=40, xla=10)
    @given(data=st.data())
    def prop(data: st.DataObject) -> None:
        spec = data.draw(specs(), label="spec")  # bf16/fp16 leaves
        params = realize(spec, device)
        acc = mpfunc.init_grads(params)
        for salt in (1, 2):
            full = floats_only(realize(spec, device, salt=salt))
            n = len(leaves(full))
            drop = data.draw(st.lists(st.booleans(), min_size=n, max_size=n), label="drop")
            grads = optree.tree_unflatten(
                optree.tree_structure(full, none_is_leaf=True),
                [None if d else g for g, d in zip(leaves(full), drop)],
            )
            acc_snap, g_snap = snapshot(acc), snapshot(grads)
            pure = mpfunc.accumulate_grads(acc, grads)
            sync(device)
            assert_unchanged(acc, acc_snap)
            assert_unchanged(grads, g_snap)
            expected = [
                None if a is None else (a.cpu() if g is None else a.cpu() + g.cpu().float())
                for a, g in zip(leaves(acc), leaves(grads))
            ]
            for p, a, e in zip(leaves(pure), leaves(acc), expected):
                if a is None:
                    assert p is None
                    continue
                assert p is not a and p.dtype == torch.float32 and p.device == device
                assert_bits_equal(p, e)  # one fp32 add of an exactly upcast grad
            out = mpfunc.accumulate_grads_(acc, grads)
            sync(device)
            assert out is acc
            assert_trees_bits_equal(acc, pure)

    prop()


def test_init_grads_dtype_and_non_floating_leaves() -> None:
    params = {"w": torch.ones(2, 3, dtype=torch.bfloat16), "n": torch.arange(3), "x": None}
    acc = mpfunc.init_grads(params)
    assert acc["n"] is None and acc["x"] is None
    assert acc["w"].dtype == torch.float32 and not acc["w"].any()
    acc64 = mpfunc.init_grads(params, torch.float64)
    assert acc64["w"].dtype == torch.float64
    # An fp64 accumulator takes fp32 and bf16 grads alike.
    mpfunc.accumulate_grads_(acc64, {"w": torch.full((2, 3), 0.1), "n": None, "x": None})
    mpfunc.accumulate_grads_(
        acc64, {"w": torch.ones(2, 3, dtype=torch.bfloat16), "n": None, "x": None}
    )
    assert_bits_equal(acc64["w"], torch.full((2, 3), 0.1).double() + 1.0)


# --- all_finite ----------------------------------------------------------------------------


def reference_finite(tree_cpu: Any) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in leaves(tree_cpu) if is_float(t))


@st.composite
def any_bit_trees(draw: st.DrawFn) -> Any:
    """bit_trees (bf16/fp16), or the same nesting of arbitrary-bit fp32 leaves."""
    if draw(st.booleans()):
        return draw(bit_trees())
    return draw(
        tree_shapes(
            st.builds(lambda: bits_tensor(draw, draw(st.sampled_from(SHAPES)), torch.float32))
        )
    )


def test_all_finite_matches_isfinite(device: torch.device) -> None:
    @per_device(device, cpu=100, xla=20)
    @given(data=st.data())
    def prop(data: st.DataObject) -> None:
        tree_cpu = data.draw(any_bit_trees(), label="tree")
        tree = to_device(tree_cpu, device)
        snap = snapshot(tree)
        flag = mpfunc.all_finite(tree)
        sync(device)
        assert flag.shape == () and flag.dtype == torch.bool
        if any(is_float(t) and t.numel() for t in leaves(tree)):
            assert flag.device == device
        assert bool(flag.cpu()) == reference_finite(tree_cpu)
        assert_unchanged(tree, snap)

    prop()


@pytest.mark.parametrize(
    "tree",
    [{}, [], (), None, [None], {"n": torch.arange(3), "m": torch.tensor([True, False])}],
    ids=["dict", "list", "tuple", "none", "list-of-none", "ints"],
)
def test_all_finite_empty_and_int_trees_are_finite(tree: Any) -> None:
    flag = mpfunc.all_finite(tree)
    assert flag.shape == () and flag.dtype == torch.bool and bool(flag)


def test_all_finite_on_int_tree_on_device(device: torch.device) -> None:
    flag = mpfunc.all_finite([torch.arange(3, device=device), None])
    assert flag.shape == () and flag.dtype == torch.bool and bool(flag.cpu())


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan, 65504.0, 3e38])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_all_finite_single_special_value(device: torch.device, value: float, dtype: Any) -> None:
    """One special value in the last element of the last leaf; large finite values are
    finite (the max-norm cannot overflow the way a 2-norm would)."""
    x = torch.zeros(64, dtype=dtype)
    x[-1] = value
    tree = {"a": torch.ones(3, 5, dtype=dtype).to(device), "z": x.to(device)}
    flag = mpfunc.all_finite(tree)
    sync(device)
    assert bool(flag.cpu()) == bool(torch.isfinite(x).all()), (dtype, value, x[-1])


def test_all_finite_device_when_floating_leaves_are_empty(xla_device: torch.device) -> None:
    flag = mpfunc.all_finite({"w": torch.zeros(0, device=xla_device)})
    assert flag.device == xla_device

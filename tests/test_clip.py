"""Global-norm clipping against torch's ``clip_grad_norm_``.

References are independent of mpfunc: torch's ``clip_grad_norm_`` (from
``torch.nn.utils.clip_grad``, since importing torch_xla replaces
``torch.nn.utils.clip_grad_norm_`` with its own) on fp32 CPU copies of the same leaves,
in optree's flatten order.

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
XLA results are read only after one ``torch_xla.sync()``, because every clipped leaf
depends on every grad and torch_xla 2.9 mixes up such graphs when they are cut by
successive reads: with ``s = x.sum() + y.sum()`` for two same-shape device tensors,
``(x * s).cpu()`` and then ``(y * s).cpu()`` both return ``x * s`` (the second graph
hits the first one's compile-cache entry).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from support.helpers import (
    assert_bits_equal,
    assert_trees_bits_equal,
    assert_unchanged,
    leaves,
    snapshot,
)
from support.strategies import realize, specs
from support.trees import clone, floats_only, per_device, sync, to_device
from torch.nn.utils import clip_grad

import mpfunc

XLA_RTOL = 1e-6
TENSOR_MAX_NORM_RTOL = 5 * 2**-24


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


FLOAT_DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64]


def test_clip_matches_torch(device: torch.device) -> None:
    @per_device(device, cpu=80, xla=20)
    @given(data=st.data())
    def prop(data: st.DataObject) -> None:
        # Every float dtype: a 0-d grad times the 0-d coefficient used to come back in the
        # coefficient's dtype from the pure form. (XLA's clipped half-precision grads were
        # seen 16 fp16 ulps from torch's CPU ones: fp32/fp64 there.)
        dtypes = FLOAT_DTYPES if device.type == "cpu" else [torch.float32, torch.float64]
        spec = data.draw(specs(dtypes=dtypes), label="spec")
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
        assert total.shape == () and total.dtype == ref_total.dtype
        if any(g is not None for g in leaves(grads)):  # else there is no device to be on
            assert total.device == device
        # Grads of several dtypes: torch may stack the groups' norms in another order than
        # mpfunc does (torch 2.4 always, 2.9 at times), a last-bit difference in the norm.
        mixed = len({g.dtype for g in leaves(grads_cpu) if g is not None}) > 1
        if device.type == "cpu" and not mixed:
            assert_bits_equal(total, ref_total)
        else:
            assert_close_rel(total, ref_total, XLA_RTOL)
        for c, r, g0 in zip(leaves(clipped), ref, leaves(grads_cpu)):
            if r is None:
                assert c is None
                continue
            assert c.dtype == r.dtype and c.shape == r.shape and c.device == device
            # A last-bit difference in the coefficient shows as up to two ulps of the
            # grad's own dtype (its ulp is 2**-8 to 2**-7 of the value for bf16).
            ulp = 2 * torch.finfo(c.dtype).eps
            if isinstance(max_norm, torch.Tensor) and c.dtype in (torch.bfloat16, torch.float16):
                # torch reads a tensor max_norm as a float, and a float divides in the norm's
                # dtype: with half-precision grads its coefficient is rounded to that dtype
                # (fp16's subnormal ones are 1% coarse). mpfunc divides in fp32, on the device:
                # within two ulps of the exactly rounded product, from its own norm.
                coef = min(1.0, float(max_norm) / (float(total) + 1e-6))
                # (an absolute floor of two of the dtype's subnormal steps, where 2**-24
                # apart is a whole ulp for fp16)
                fi = torch.finfo(c.dtype)
                torch.testing.assert_close(
                    c.cpu(), (g0.double() * coef).to(c.dtype), rtol=ulp,
                    atol=2 * fi.smallest_normal * fi.eps,
                )  # fmt: skip
            elif device.type != "cpu" or mixed:
                assert_close_rel(c, r, max(XLA_RTOL, ulp))
            elif isinstance(max_norm, torch.Tensor):
                assert_close_rel(c, r, max(TENSOR_MAX_NORM_RTOL, ulp))
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

"""Comparison helpers for the tests: bit equality and the stated error bound."""

from __future__ import annotations

from typing import Any

import optree
import torch

from mpfunc.core import _tree

# The bound for paths whose op order differs from torch.optim's (foreach/reference
# Adam, any lr given as a tensor): |mpfunc - torch| <= RTOL * |torch| + ATOL_PER_LR * lr * N
# elementwise after N steps. ATOL scales with the distance the optimizer can move.
RTOL = 1e-6
ATOL_PER_LR = 1e-6

_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def settle(t: torch.Tensor) -> None:
    """On XLA, run pending work before reading a tensor back: torch_xla 2.9 can reuse a
    cached graph for a read whose graph matches an earlier one's shape but not its
    inputs, returning the earlier result. A sync materializes everything first."""
    if t.device.type == "xla":
        import torch_xla

        torch_xla.sync()


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bit patterns of a floating tensor, on the CPU."""
    settle(t)
    return t.detach().cpu().contiguous().view(_INT[t.element_size()])


def assert_bits_equal(a: torch.Tensor, b: torch.Tensor, *, nan_payload: bool = True) -> None:
    """Bit-for-bit equality. With ``nan_payload=False``, any NaN matches any NaN (torch's CPU
    casts canonicalize NaN payloads, XLA keeps them)."""
    assert a.dtype == b.dtype, (a.dtype, b.dtype)
    assert a.shape == b.shape, (a.shape, b.shape)
    settle(a)
    settle(b)
    a, b = a.detach().cpu(), b.detach().cpu()
    same = bits(a) == bits(b)
    if not nan_payload:
        same |= torch.isnan(a) & torch.isnan(b)
    assert bool(same.all()), (
        f"bits differ at {(~same).nonzero()[:5].tolist()}: {a[~same][:5]} vs {b[~same][:5]}"
    )


def leaves(tree: Any) -> list[Any]:
    """Every leaf, ``None`` included, by mpfunc's own tree rules."""
    return _tree.flatten(tree)[0]


def _joined(tree: Any) -> Any:
    """Remainder units as their fp32 masters: a NaN master's remainder is its payload."""
    from mpfunc.strategies._remainder import _join_eager
    from mpfunc.strategies._strategy_remainder import RemainderMaster

    def join(x: Any) -> Any:
        if isinstance(x, RemainderMaster):
            return _join_eager(*(t.detach().cpu() for t in x))
        return x

    return optree.tree_map(
        join, tree, is_leaf=lambda x: isinstance(x, RemainderMaster), none_is_leaf=True
    )


def assert_trees_bits_equal(a: Any, b: Any, *, nan_payload: bool = True) -> None:
    if not nan_payload:
        a, b = _joined(a), _joined(b)
    sa, sb = _tree.flatten(a)[1], _tree.flatten(b)[1]
    assert sa == sb, (sa, sb)
    for x, y in zip(leaves(a), leaves(b)):
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor)
            if x.is_floating_point():
                assert_bits_equal(x, y, nan_payload=nan_payload)
            else:
                assert torch.equal(x.cpu(), y.cpu())
        else:
            assert x is None and y is None


def assert_close_bound(actual: torch.Tensor, expected: torch.Tensor, lr: float, steps: int) -> None:
    """The stated bound: elementwise |a - e| <= RTOL*|e| + ATOL_PER_LR*lr*steps."""
    a, e = actual.detach().cpu().double(), expected.detach().cpu().double()
    tol = RTOL * e.abs() + ATOL_PER_LR * lr * max(steps, 1)
    err = (a - e).abs()
    bad = ~(err <= tol)
    assert not bool(bad.any()), (
        f"bound exceeded at {bad.nonzero()[:3].tolist()}: got {a[bad][:3].tolist()}, "
        f"expected {e[bad][:3].tolist()}, max err/tol {float((err / tol).max()):.3g}"
    )


def snapshot(tree: Any) -> list[Any]:
    """Clones and version counters of every tensor in ``tree``."""
    for t in leaves(tree):
        if isinstance(t, torch.Tensor):
            settle(t)
            break
    return [
        (t.detach().cpu().clone(), t._version) if isinstance(t, torch.Tensor) else t
        for t in leaves(tree)
    ]


def assert_unchanged(tree: Any, snap: list[Any]) -> None:
    for t in leaves(tree):
        if isinstance(t, torch.Tensor):
            settle(t)
            break
    for t, s in zip(leaves(tree), snap):
        if isinstance(t, torch.Tensor):
            clone, version = s
            assert t._version == version, "a tensor was written in place"
            if t.is_floating_point():
                assert_bits_equal(t, clone)
            else:
                assert torch.equal(t.cpu(), clone)


def laid_out(kind: str, shape: tuple[int, ...], x: torch.Tensor) -> torch.Tensor:
    """``x``'s values (``prod(shape)`` of them) as a tensor of ``shape`` in the layout
    ``kind``: "transposed" (a 2-d shape, the transpose of a contiguous tensor),
    "channels_last" (4-d), "sliced" (2-d, every other column of a wider tensor: not dense),
    or anything else for contiguous."""
    if kind == "transposed":
        return x.reshape(shape[1], shape[0]).t()
    if kind == "channels_last":
        return x.reshape(shape).contiguous(memory_format=torch.channels_last)
    if kind == "sliced":
        wide = torch.zeros(shape[0], shape[1] * 2, dtype=x.dtype, device=x.device)
        wide[:, ::2] = x.reshape(shape)
        return wide[:, ::2]
    return x.reshape(shape)


def pruned_run(
    strategy: str, device: Any, impl: str, dtype: torch.dtype, *, seed: int, steps: int
) -> Any:
    """The masters of a unit strategy's SGD run whose params are zeroed between steps
    (pruning, ``nn.init.zeros_``): ``steps`` steps, then columns ``[:, :32]`` of the
    4 x 64 param set to 0 (``[0, :8]`` to -0), then one step with zero grads."""
    import mpfunc

    gen = torch.Generator().manual_seed(seed)
    params = {"w": torch.randn(4, 64, generator=gen).to(dtype).to(device)}
    masters = mpfunc.init_master(params, strategy=strategy)
    opt = mpfunc.sgd(lr=1e-3, impl=impl)  # type: ignore[arg-type]
    state = opt.init(masters)
    for _ in range(steps):
        grad = {"w": torch.randn(4, 64, generator=gen).to(dtype).to(device)}
        mpfunc.apply_update_(masters, grad, state, opt)
    with torch.no_grad():
        params["w"][:, :32] = 0
        params["w"][0, :8] = -0.0
    zero = {"w": torch.zeros(4, 64, dtype=dtype, device=device)}
    mpfunc.apply_update_(masters, zero, state, opt)
    return masters


def state_tensors(opt: Any) -> list[torch.Tensor]:
    """Every tensor of a MasterOptimizer's ``state_dict()``: masters, moments, counts, keys,
    8-bit codes and scales, in a fixed order."""
    out: list[torch.Tensor] = []
    for _, entry in sorted(opt.state_dict()["state"].items()):
        for _, t in sorted(entry.items()):
            out += [t] if isinstance(t, torch.Tensor) else [x for x in t if x is not None]
    return out

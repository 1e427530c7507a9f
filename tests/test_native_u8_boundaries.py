"""The native 8-bit and 4-bit encodes on their decision boundaries, against the torch path
bit for bit.

Every code the encode writes is a discrete decision: a first moment's code rounds
``L t`` to nearest (midpoints at ``k + 1/2``; ``L`` = 127 levels, 7 for 4-bit codes), a
second moment's lower code is ``floor(L' t)`` (boundaries at the integers; ``L'`` = 254,
or 14) and its stochastic step up compares the draw with ``(value - a) / (b - a)``. The
native pass may decide these with cheaper arithmetic (it leaves out flushes and clamps it
proves cannot change a code); these inputs sit on every boundary and a few ulps either
side of it, where a wrong shortcut would show.

With ``betas=(0, 0)`` and ``lr=0`` one AdamW step stores ``m = g`` and ``v = fl(g * g)``,
and ``sqrt(fl(g * g)) == |g|`` in binary floating point, so both moments' companded values
are the grads' own: ``g / s`` with ``s`` the block's largest magnitude (its first element,
3.0: a scale whose reciprocal is inexact, as most are).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import mpfunc
from mpfunc.core import _rng
from mpfunc.optim import _adam
from mpfunc.state_formats import _quantize, _quantize4
from tests.support.helpers import assert_trees_bits_equal
from tests.support.native import native_module

SCALE = 3.0
ULPS = 4  # neighbours each side of a boundary


@pytest.fixture(scope="module")
def native() -> Any:
    return native_module()


def _around(y: torch.Tensor, ulps: int = ULPS) -> torch.Tensor:
    """float32 of ``y`` (float64) and its ``ulps`` neighbours each side."""
    mid = y.float()
    out, up, down = [mid], mid, mid
    for _ in range(ulps):
        up = torch.nextafter(up, torch.full_like(up, math.inf))
        down = torch.nextafter(down, torch.full_like(down, -math.inf))
        out += [up, down]
    return torch.cat(out)


def _grads_of(y: torch.Tensor) -> torch.Tensor:
    """Grads whose companded values (``g / SCALE``) are ``y`` and its neighbours (none
    above the block's largest magnitude, SCALE)."""
    return _around(y.double() * SCALE).clamp(-SCALE, SCALE)


# Per format: its state dtype, signed and unsigned levels, and fp32 decode tables indexed by
# the unsigned code.
FORMATS = {
    8: (torch.uint8, 127, 254, _quantize._TABLE_CPU[False]),
    4: (torch.uint4, 7, 14, _quantize4._TABLE_CPU[False]),  # type: ignore[attr-defined]
}


def _signed_midpoints(levels: int) -> torch.Tensor:
    # fl(L t) = k + 1/2 at t = (k + 1/2) / L, y = t / (2 - t); both signs.
    t = (torch.arange(0, levels, dtype=torch.float64) + 0.5) / levels
    y = t / (2 - t)
    return torch.cat([y, -y])


def _unsigned_floors(levels: int) -> torch.Tensor:
    # floor(L' t) steps at t = k / L', y = t / (2 - t) (the decode table's entries), the
    # clamp to L' - 1 included.
    t = torch.arange(1, levels + 1, dtype=torch.float64) / levels
    return t / (2 - t)


def _blocks(payload: torch.Tensor) -> torch.Tensor:
    """Blocks of 32: SCALE first (the block's largest magnitude), then 31 payload values."""
    rows = -(-payload.numel() // 31)
    pad = torch.zeros(rows * 31 - payload.numel())
    body = torch.cat([payload, pad]).view(rows, 31)
    return torch.cat([torch.full((rows, 1), SCALE), body], dim=1).reshape(-1)


def _step(
    g: torch.Tensor, strategy: str, impl: Any, monkeypatch: pytest.MonkeyPatch, bits: int = 8
) -> Any:
    drawn: list[torch.Tensor] = []
    real = _rng.uniform_list

    def spy(keys: Any, shapes: Any) -> Any:
        out = list(real(keys, shapes))
        drawn.extend(out)
        return out

    monkeypatch.setattr(_rng, "uniform_list", spy)
    params = {"w": torch.zeros(g.numel(), dtype=torch.bfloat16)}
    masters = mpfunc.init_master(params, strategy=strategy, seed=3)
    opt = mpfunc.adamw(lr=0.0, betas=(0.0, 0.0), weight_decay=0.0, impl=impl,
                       state_dtype=FORMATS[bits][0])  # fmt: skip
    state = opt.init(masters)
    kw: dict[str, Any] = {"params": params} if strategy == "fp32" else {}
    masters, state = mpfunc.apply_update_(masters, {"w": g.clone()}, state, opt, **kw)
    monkeypatch.setattr(_rng, "uniform_list", real)
    noise = [d for d in drawn if d.shape == g.shape]
    return (params, masters, state), (noise[-1] if noise else None)


def _thresholds(u: torch.Tensor, gen: torch.Generator, bits: int = 8) -> torch.Tensor:
    """Per element, a companded value whose square sits on its draw's threshold between
    a random pair of neighbouring codes: value = a + u (b - a), offset by -ULPS..ULPS ulps
    (cycling), so the comparison ``u < (value - a) / (b - a)`` is decided by last bits."""
    n = u.numel()
    _, _, levels, table = FORMATS[bits]
    lo = torch.randint(0, levels, (n,), generator=gen)
    a, b = table[lo], table[lo + 1]
    a, b = a * a, b * b  # fp32, as the codec squares its table entries
    y = torch.sqrt(a.double() + u.double() * (b.double() - a.double()))
    g = (y * SCALE).float()
    offsets = torch.arange(n) % (2 * ULPS + 1) - ULPS
    for _ in range(ULPS):
        g = torch.where(offsets > 0, torch.nextafter(g, torch.full_like(g, math.inf)), g)
        g = torch.where(offsets < 0, torch.nextafter(g, torch.full_like(g, -math.inf)), g)
        offsets = offsets - offsets.sign()
    return g


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("strategy", ["fp32", "stochastic"])
def test_codes_on_every_boundary_equal_the_torch_path(
    monkeypatch: pytest.MonkeyPatch, native: Any, strategy: str, bits: int
) -> None:
    _, s_levels, u_levels, table = FORMATS[bits]
    fixed = torch.cat([
        _grads_of(_signed_midpoints(s_levels)),
        _grads_of(_unsigned_floors(u_levels)),
        _grads_of(torch.tensor([0.0, 1.0, float(table[1]), 2.0**-70, 2.0**-126])),
    ])  # fmt: skip
    # Room for the thresholds after the fixed values; the draws depend only on the element
    # index and the step's key, so a first run tells every element's draw.
    n_fixed = _blocks(fixed).numel()
    g = torch.cat([_blocks(fixed), _blocks(torch.zeros(31 * 160))])
    _, u = _step(g, strategy, "foreach", monkeypatch, bits)
    gen = torch.Generator().manual_seed(11)
    tail = _thresholds(u[n_fixed:].reshape(-1, 32)[:, 1:].reshape(-1), gen, bits)
    g = torch.cat([_blocks(fixed), _blocks(tail)])
    assert g.numel() % 32 == 0 and g.abs().max() == SCALE

    want, _ = _step(g, strategy, "foreach", monkeypatch, bits)
    ran: list[int] = []
    real = _adam._composed

    def spy(group: Any, h: Any) -> None:
        ran.append(1)
        real(group, h)

    monkeypatch.setattr(_adam, "_composed", spy)
    got, _ = _step(g, strategy, "auto", monkeypatch, bits)
    assert ran, "the native pass did not run"
    assert_trees_bits_equal(got, want, nan_payload=False)
    # The inputs did reach the decisions: both maps use most of their codes here.
    state = got[2]
    for q, levels in ((state.exp_avg["w"], 2 * s_levels), (state.exp_avg_sq["w"], u_levels)):
        codes = q.codes if bits == 8 else _quantize4._unpack(q.codes)
        assert len(torch.unique(codes)) > 0.75 * levels

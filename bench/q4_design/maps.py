"""The candidate 4-bit moment codecs, simulated on the CPU as value round trips.

A codec's stored state is a function of its decoded value (decoding is deterministic), so
the study keeps each candidate's moment as the fp32 tensor it decodes to and applies
``roundtrip`` after every EMA update: the same numbers a codes-and-scales state would give.

Every map here has 15 value levels, so a 4-bit code keeps one pattern for the NaN/inf mark
(as the 8-bit format keeps one). Signed (first moment) maps: a symmetric table of levels in
``y = x / s`` (``s`` the block's largest magnitude, rounded to bf16). Unsigned (second
moment) maps: levels in ``v / s`` or ``sqrt(v) / s``; a positive ``v`` never decodes to 0.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from mpfunc.core import _rng

SCALE = torch.bfloat16


class Map(NamedTuple):
    """A level table and how values are rounded onto it.

    ``levels``: increasing, in the normalized domain (``y`` for signed maps, ``v / s`` or
    ``sqrt(v) / s`` for unsigned ones, by ``sqrt``). ``mids``: the nearest-rounding
    thresholds between neighbouring levels (in the same domain; for a companded map they
    are the compander's midpoints, as the 8-bit codec rounds in ``t``).
    """

    name: str
    levels: torch.Tensor
    mids: torch.Tensor
    sqrt: bool = False  # unsigned: levels of sqrt(v)
    rank1: bool = False  # unsigned: scale min(row max, column max) of v, no blocks
    zero_excluding: bool = False  # unsigned: no level at 0


def _softsign_levels(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``t / (2 - t)`` at ``t = k / n``, and the midpoints in ``t``."""
    t = torch.arange(n + 1, dtype=torch.float64) / n
    mid_t = (t[1:] + t[:-1]) / 2
    return t / (2 - t), mid_t / (2 - mid_t)


def _plain(levels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return levels, (levels[1:] + levels[:-1]) / 2


def _symmetric(pos: torch.Tensor, mids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.cat([-pos.flip(0)[:-1], pos]), torch.cat([-mids.flip(0), mids])


def signed_maps() -> dict[str, Map]:
    """First-moment maps: 0 and seven magnitudes each side."""
    p = 0.5 + 0.5 * torch.arange(8, dtype=torch.float64) / 7.5
    normal = torch.special.ndtri(p)
    normal = normal / normal[-1]
    log2 = torch.tensor([0.0, *(2.0**-k for k in range(6, -1, -1))], dtype=torch.float64)
    raw = {
        "softsign": _softsign_levels(7),
        "linear": _plain(torch.arange(8, dtype=torch.float64) / 7),
        "normal": _plain(normal),
        "log2": _plain(log2),
    }
    return {k: Map(k, *(t.float() for t in _symmetric(*v))) for k, v in raw.items()}


def unsigned_maps() -> dict[str, Map]:
    """Second-moment maps: 15 levels each."""
    lin = torch.arange(15, dtype=torch.float64) / 14
    maps = [
        Map("sqrt-softsign", *_softsign_levels(14), sqrt=True),
        Map("sqrt-linear", *_plain(lin), sqrt=True),
        Map("linear", *_plain(lin)),
        Map(
            "rank1-linear0x",
            *_plain(torch.arange(1, 16, dtype=torch.float64) / 15),
            rank1=True,
            zero_excluding=True,
        ),
        Map("rank1-sqrt-softsign", *_softsign_levels(14), sqrt=True, rank1=True),
    ]
    return {m.name: m._replace(levels=m.levels.float(), mids=m.mids.float()) for m in maps}


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    flat = x.reshape(-1)
    pad = -flat.numel() % block
    return torch.nn.functional.pad(flat, (0, pad)).view(-1, block)


def _unblock(xb: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return xb.reshape(-1)[: like.numel()].view(like.shape)


def _bf16(s: torch.Tensor) -> torch.Tensor:
    return s.to(SCALE).float()


def _nearest(y: torch.Tensor, m: Map) -> torch.Tensor:
    return torch.bucketize(y, m.mids)


def _stochastic(value: torch.Tensor, levels_v: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Codes rounded up with the probability that keeps the decoded value unbiased.

    ``value`` and ``levels_v`` are in the moment's own units (normalized ``v``)."""
    lo = (torch.bucketize(value, levels_v, right=True) - 1).clamp(0, len(levels_v) - 2)
    a, b = levels_v[lo], levels_v[lo + 1]
    p = ((value - a) / (b - a)).clamp(0, 1)
    return lo + (u < p).long()


def roundtrip_signed(x: torch.Tensor, m: Map, block: int) -> torch.Tensor:
    """A first moment through the map, rounded to nearest: the value it decodes to."""
    xb = _blocks(x, block)
    s = _bf16(xb.abs().amax(dim=1, keepdim=True))
    y = (xb / torch.where(s > 0, s, 1.0)).clamp(-1, 1)
    return _unblock(m.levels[_nearest(y, m)] * s, x)


def _rank1_scale(v: torch.Tensor) -> torch.Tensor:
    """min(row max, column max) of a 2-d ``v``: every element's own upper bound."""
    r = _bf16(v.amax(dim=1, keepdim=True))
    c = _bf16(v.amax(dim=0, keepdim=True))
    return torch.minimum(r, c)


def roundtrip_unsigned(v: torch.Tensor, m: Map, block: int, u: torch.Tensor | None) -> torch.Tensor:
    """A second moment through the map (nearest, or stochastic with draws ``u``)."""
    if m.rank1:
        s_v = _rank1_scale(v)  # in v units
        vb, ub = v, u
    else:
        vb = _blocks(v, block)
        ub = None if u is None else _blocks(u, block)
        top = vb.amax(dim=1, keepdim=True)
        s_v = _bf16(top.sqrt()) ** 2 if m.sqrt else _bf16(top)
    s_safe = torch.where(s_v > 0, s_v, 1.0)
    w = (vb / s_safe).clamp(0, 1.0)  # normalized v
    y = w.sqrt() if m.sqrt else w  # the map's domain
    levels_v = m.levels**2 if m.sqrt else m.levels
    code = _nearest(y, m) if ub is None else _stochastic(w, levels_v, ub)
    if not m.zero_excluding:
        code = torch.where(vb > 0, code.clamp(min=1), code)
    out = levels_v[code] * s_v
    return out if m.rank1 else _unblock(out, v)


def bytes_per_param(shapes: list[torch.Size], m: Map | None, block: int, scale_bytes: int) -> float:
    """Persistent bytes per element of one moment over leaves of ``shapes``: half a byte
    per code, plus block scales (or a row and a column of bf16 scales, rank-1)."""
    n = sum(math.prod(s) for s in shapes)
    scales = 0
    for s in shapes:
        if m is not None and m.rank1:
            scales += (s[0] + s[1]) * 2
        else:
            scales += -(-math.prod(s) // block) * scale_bytes
    return (n / 2 + scales) / n


def draws(keys: list[torch.Tensor], shapes: list[torch.Size]) -> list[torch.Tensor]:
    """This step's uniform draws per leaf from ``_rng``'s counter hash; keys then advance."""
    out = [_rng.uniform(k, s) for k, s in zip(keys, shapes)]
    _rng.advance(keys)
    return out

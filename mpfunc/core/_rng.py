"""Counter-based random bits on the device: the same bits on CPU, CUDA and XLA.

Stochastic rounding (the ``"stochastic"`` master strategy, the second moment of
``state_dtype=torch.uint8``) needs fresh random bits every step, reproducible from a
seed, drawn on the device with no host sync, and saved in a checkpoint. A global
generator gives none of that across devices, so mpfunc hashes instead: element ``i``
of a draw with key ``k`` gets ``mix(mix(i * golden + k) ^ k)``, where ``mix`` is
MurmurHash3's 32-bit finalizer (an invertible avalanche: every input bit flips each
output bit with probability about 1/2). The key is a 0-d int32 tensor on the device
that the caller advances every step (``advance``), so the whole state is 4 bytes per
leaf, and a step's draws depend only on (key, element index): the same on every device
and for every memory layout (the index is the logical, row-major one).

All arithmetic is int32 and wraps modulo 2**32 (two's complement, as torch's integer
kernels and XLA do); right shifts are made logical with a mask.

See docs/design.md#the-stochastic-rng-and-rounding.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = ["advance", "bits", "bits_list", "key_for", "uniform", "uniform_list"]

_GOLDEN = -1640531535  # 0x9E3779B1 as int32
_M1 = -2048144789  # 0x85EBCA6B
_M2 = -1028477387  # 0xC2B2AE35

Shape = torch.Size | tuple[int, ...]


def _shr(x: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int32 values (torch's ``>>`` is arithmetic)."""
    # On non-negative values only: torch_xla 2.9 lowers ``>>`` as a division (truncating,
    # so not a shift of negative values) and torch.bitwise_right_shift in s64. The sign
    # bit is put back where a logical shift moves it.
    low = torch.bitwise_and(x, 0x7FFFFFFF) >> n
    return low.add_(torch.lt(x, 0).to(torch.int32).mul_(1 << (31 - n)))


def _mix(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's fmix32 on int32 tensors (a new tensor; ``x`` is not modified)."""
    x = torch.bitwise_xor(x, _shr(x, 16))
    x = x.mul_(_M1)
    x = x.bitwise_xor_(_shr(x, 13))
    x = x.mul_(_M2)
    return x.bitwise_xor_(_shr(x, 16))


def wrap(v: int) -> int:
    """A Python int as the int32 with the same low 32 bits."""
    v &= 0xFFFFFFFF
    return v - (1 << 32) if v >= 1 << 31 else v


def _mix_int(x: int) -> int:
    """``_mix`` on one value held as a Python int in ``[0, 2**32)``: the same bits."""
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & 0xFFFFFFFF
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & 0xFFFFFFFF
    return x ^ (x >> 16)


def key_for(seed: int, index: int, device: torch.device | str) -> torch.Tensor:
    """The first key of leaf ``index`` under ``seed``: a 0-d int32 tensor on ``device``,
    ``mix(mix((seed * golden + index) ^ mix(high)) ^ index)``, with ``seed`` read modulo
    2**64 as ``torch.manual_seed`` reads it and ``high`` its upper 32 bits (so seeds
    that differ only there, such as ``s`` and ``s + 2**32``, get other streams; ``mix(0)``
    is 0, so a seed in ``[0, 2**32)`` keeps the key it always had). Hashed in Python
    integers (the same bits as ``_mix`` on tensors; tests/test_strategies.py checks): a
    model of 100,000 leaves needs 100,000 keys, and a dozen tensor ops each took seconds."""
    seed %= 2**64
    low = ((seed * 0x9E3779B1 + index) & 0xFFFFFFFF) ^ _mix_int(seed >> 32)
    h = _mix_int(_mix_int(low) ^ (index & 0xFFFFFFFF))
    return torch.tensor(wrap(h), dtype=torch.int32, device=device)


def next_keys(keys: list[torch.Tensor]) -> list[torch.Tensor]:
    """What ``advance`` makes of each key, as new tensors (the keys are not written)."""
    return [_mix(k.add(_GOLDEN)) for k in keys]


def advance(keys: list[torch.Tensor]) -> None:
    """Moves every key to its next value in place (a step's draws are then fresh)."""
    if not keys:
        return
    torch._foreach_copy_(keys, next_keys(keys))


# On lazy devices, the row length of the element index (see ``_index``).
_COLS = 1024


def _index(n: int, device: torch.device) -> torch.Tensor:
    """The row-major element index ``0 .. n-1`` (int32) on ``device``.

    torch_xla 2.9 traces ``torch.arange(n)`` as a constant literal of ``n`` elements built
    on the host: ~9 ms of tracing per 65,536 elements, and tens of MB of constants in the
    graph of a real model, which XLA then compiles. On XLA the index is built as
    ``row * _COLS + col`` from two short ranges instead; the values are the same.
    """
    if device.type != "xla" or n <= _COLS:
        return torch.arange(n, dtype=torch.int32, device=device)
    rows = -(-n // _COLS)
    row = torch.arange(rows, dtype=torch.int32, device=device).mul(_COLS).unsqueeze(1)
    col = torch.arange(_COLS, dtype=torch.int32, device=device)
    return torch.add(row, col).view(-1)[:n]


def _hash(index: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """The bits of elements ``index`` under ``key`` (broadcast against it):
    ``mix(mix(i * golden + k) ^ k)``, as the module docstring defines them."""
    x = _mix(index.mul(_GOLDEN).add_(key))
    return _mix(x.bitwise_xor_(key))


def bits(key: torch.Tensor, shape: Shape) -> torch.Tensor:
    """32 random bits per element (int32) of a tensor of ``shape``, on ``key``'s device."""
    return _hash(_index(math.prod(shape), key.device).reshape(shape), key)


def uniform(key: torch.Tensor, shape: Shape) -> torch.Tensor:
    """Draws in [0, 1) with 24 random bits each, float32, of ``shape``."""
    return _to_uniform(bits(key, shape))


def _to_uniform(b: torch.Tensor) -> torch.Tensor:
    return _shr(b, 8).to(torch.float32).mul_(2.0**-24)


def _batched(keys: Sequence[torch.Tensor], shapes: Sequence[Shape]) -> bool:
    if len(keys) != len(shapes):
        raise ValueError(f"expected one shape per key, got {len(shapes)} for {len(keys)} keys")
    return len(keys) > 1 and keys[0].device.type == "xla"


def _bits_flat(keys: Sequence[torch.Tensor], sizes: list[int]) -> torch.Tensor:
    """The draws of every key side by side: element ``j`` of key ``m`` is hashed with its
    own leaf index ``j`` and key ``m``, as ``bits`` does."""
    device = keys[0].device
    i = torch.cat([_index(n, device) for n in sizes])
    return _hash(i, torch.cat([key.reshape(1).expand(n) for key, n in zip(keys, sizes)]))


def _split(flat: torch.Tensor, sizes: list[int], shapes: Sequence[Shape]) -> list[torch.Tensor]:
    return [part.view(s) for part, s in zip(torch.split(flat, sizes), shapes)]


def bits_list(keys: Sequence[torch.Tensor], shapes: Sequence[Shape]) -> list[torch.Tensor]:
    """``bits(k, s)`` for each pair: the same bits.

    On XLA the whole list is one chain of ops over the concatenated elements (each
    element's leaf index and key laid side by side), not ~30 traced ops per tensor; the
    results are read-only slices of that chain. Elsewhere, one call per tensor.
    """
    if not _batched(keys, shapes):
        return [bits(k, s) for k, s in zip(keys, shapes)]
    sizes = [math.prod(s) for s in shapes]
    return _split(_bits_flat(keys, sizes), sizes, shapes)


def uniform_list(keys: Sequence[torch.Tensor], shapes: Sequence[Shape]) -> list[torch.Tensor]:
    """``uniform(k, s)`` for each pair (batched on XLA as ``bits_list``)."""
    if not _batched(keys, shapes):
        return [uniform(k, s) for k, s in zip(keys, shapes)]
    sizes = [math.prod(s) for s in shapes]
    return _split(_to_uniform(_bits_flat(keys, sizes)), sizes, shapes)

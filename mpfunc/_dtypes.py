"""Dtype rules: which leaves get masters and which dtypes a master may have."""

from __future__ import annotations

import torch

__all__ = ["MASTER_DTYPES", "check_master_dtype", "is_floating"]

# A master must hold at least fp32 precision; bf16/fp16 masters would defeat the recipe.
MASTER_DTYPES = (torch.float32, torch.float64)


def is_floating(t: torch.Tensor) -> bool:
    """Only real floating-point leaves get masters; ints, bools and complex pass through."""
    return t.is_floating_point()


def check_master_dtype(fn: str, dtype: object) -> torch.dtype:
    """Returns ``dtype`` if it is a valid master dtype, else raises a clear error."""
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{fn}: dtype: expected a torch.dtype, got {type(dtype).__name__}")
    if dtype not in MASTER_DTYPES:
        raise ValueError(
            f"{fn}: dtype: expected torch.float32 or torch.float64 (masters and their grads keep "
            f"full precision), got {dtype}"
        )
    return dtype

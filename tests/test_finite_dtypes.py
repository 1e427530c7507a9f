"""``all_finite`` checks each leaf in its own dtype: float64 values beyond float32's
range are finite."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from support.hardening import BF16, F64, B, _rand
from support.helpers import settle

import mpfunc

# torch warns once per process that CSR support is in beta; these tests only hand CSR
# tensors to functions that must refuse them.
pytestmark = pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta:UserWarning")


def _flag(tree: Any) -> bool:
    f = mpfunc.all_finite(tree)
    settle(f)
    return bool(f.cpu())


def test_all_finite_float64_beyond_float32_range(device: torch.device) -> None:
    big = torch.tensor([1e300, -1e300, 3.5e38], dtype=F64, device=device)
    assert _flag({"a": big})
    assert _flag(
        {
            "a": big,
            "b": _rand(B, device=device),
            "c": _rand(B, BF16, device=device),
            "i": torch.arange(3, device=device),
            "n": None,
        }
    )
    for bad in (float("inf"), float("-inf"), float("nan")):
        assert not _flag({"a": torch.tensor([1e300, bad, 1.0], dtype=F64, device=device)})
        mixed = {"a": big, "b": torch.tensor([1.0, bad, 2.0], device=device)}
        assert not _flag(mixed)
        mixed = {"a": big, "c": torch.tensor([1.0, bad, 2.0], dtype=BF16, device=device)}
        assert not _flag(mixed)
    assert _flag({"h": torch.tensor([65504.0, -65504.0, 1.0], dtype=torch.float16, device=device)})

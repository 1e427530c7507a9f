"""The layouts people have, for params and grads, and the optimizers the layout and
strategy tests draw (with their torch.optim references)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

import mpfunc

BF16 = torch.bfloat16


class Layout(NamedTuple):
    name: str
    shape: tuple[int, ...]
    make: Callable[[torch.Generator, torch.dtype], torch.Tensor]


def randn(gen: torch.Generator, dtype: torch.dtype, *shape: int) -> torch.Tensor:
    return torch.randn(shape, generator=gen).to(dtype)


# Param layouts. Shapes come from a small fixed catalog (each new shape compiles on XLA).
PARAM_LAYOUTS = [
    Layout("contiguous", (3, 5), lambda g, d: randn(g, d, 3, 5)),
    Layout("transposed", (3, 5), lambda g, d: randn(g, d, 5, 3).t()),
    Layout(
        "channels_last",
        (2, 3, 2, 2),
        lambda g, d: randn(g, d, 2, 3, 2, 2).to(memory_format=torch.channels_last),
    ),
    Layout("sliced", (4, 3), lambda g, d: randn(g, d, 4, 6)[:, ::2]),
    Layout("offset", (5,), lambda g, d: randn(g, d, 10)[3:8]),
    Layout("scalar", (), lambda g, d: randn(g, d)),
    Layout("size1", (1, 1, 1, 1), lambda g, d: randn(g, d, 1, 1, 1, 1)),
]


def grad_like(kind: str, shape: tuple[int, ...], gen: torch.Generator, scale: float) -> Any:
    """A bf16 grad of ``shape`` in layout ``kind`` (falling back to contiguous)."""
    if kind == "transposed" and len(shape) == 2:
        return (randn(gen, torch.float32, shape[1], shape[0]) * scale).to(BF16).t()
    if kind == "expanded" and len(shape) >= 1:
        row = (randn(gen, torch.float32, 1, *shape[1:]) * scale).to(BF16)
        return row.expand(shape)
    if kind == "channels_last" and len(shape) == 4:
        x = (randn(gen, torch.float32, *shape) * scale).to(BF16)
        return x.to(memory_format=torch.channels_last)
    return (randn(gen, torch.float32, *shape) * scale).to(BF16)


GRAD_LAYOUTS = ["contiguous", "transposed", "expanded", "channels_last"]

OPTS: dict[str, tuple[Callable[..., mpfunc.Optimizer], Any, dict[str, Any], list[str]]] = {
    "sgd": (
        mpfunc.sgd,
        torch.optim.SGD,
        dict(lr=0.1, momentum=0.9, weight_decay=0.01),
        ["auto", "foreach", "reference"],
    ),
    "sgd-nesterov": (
        mpfunc.sgd,
        torch.optim.SGD,
        dict(lr=0.05, momentum=0.9, nesterov=True),
        ["auto", "foreach", "reference"],
    ),
    "adam": (
        mpfunc.adam,
        torch.optim.Adam,
        dict(lr=1e-2, weight_decay=0.1),
        ["auto", "fused", "foreach", "reference"],
    ),
    "adamw": (
        mpfunc.adamw,
        torch.optim.AdamW,
        dict(lr=1e-2, weight_decay=0.1),
        ["auto", "fused", "foreach", "reference"],
    ),
    "adamw-amsgrad": (
        mpfunc.adamw,
        torch.optim.AdamW,
        dict(lr=1e-2, amsgrad=True),
        ["auto", "fused", "foreach", "reference"],
    ),
    "lion": (
        mpfunc.lion,
        None,
        dict(lr=1e-3, weight_decay=0.1, betas=(0.9, 0.99)),
        ["auto", "foreach", "reference"],
    ),
}


class LionReference:
    """Chen et al. 2023, Algorithm 2, one tensor at a time, written from the paper."""

    def __init__(self, params: list[torch.Tensor], lr: float, betas: Any, weight_decay: float):
        self.params, self.lr, self.wd = params, lr, weight_decay
        self.b1, self.b2 = betas
        self.m = [torch.zeros_like(p) for p in params]

    def step(self, grads: list[torch.Tensor]) -> None:
        for p, g, m in zip(self.params, grads, self.m):
            c = self.b1 * m + (1 - self.b1) * g
            p -= self.lr * (torch.sign(c) + self.wd * p)
            m.mul_(self.b2).add_((1 - self.b2) * g)

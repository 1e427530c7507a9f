"""Small tree utilities the tests share, by mpfunc's own tree rules."""

from __future__ import annotations

from typing import Any

import torch
from hypothesis import settings

from mpfunc.core import _tree


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
    return _tree.map_tensors(lambda t: t if t.is_floating_point() else None, tree)


def to_device(tree: Any, device: torch.device) -> Any:
    return _tree.map_tensors(lambda t: t.to(device), tree)


def clone(tree: Any) -> Any:
    return _tree.map_tensors(torch.Tensor.clone, tree)


def model_tree() -> dict[str, Any]:
    """A small parameter tree: an embedding, two layers, a norm with an int buffer."""
    gen = torch.Generator().manual_seed(3)
    return {
        "emb": torch.randn(10, 4, generator=gen),
        "layers": [
            {"w": torch.randn(4, 4, generator=gen), "b": torch.randn(4, generator=gen)},
            {"w": torch.randn(4, 4, generator=gen), "b": torch.randn(4, generator=gen)},
        ],
        "ln": {"weight": torch.randn(4, generator=gen), "steps": torch.tensor(3)},
    }


def grads_for(step: int, params: Any) -> Any:
    """Seeded normal grads for the floating leaves of ``params``, ``None`` elsewhere."""
    gen = torch.Generator().manual_seed(100 + step)
    return _tree.map_tensors(
        lambda p: torch.randn(p.shape, generator=gen) if p.is_floating_point() else None, params
    )

"""A small model for the XLA step tests, and torch_xla's metrics read as numbers."""

from __future__ import annotations

from typing import Any

import torch


def _metrics() -> Any:
    import torch_xla.debug.metrics as met

    return met


def count(name: str) -> int:
    data = _metrics().metric_data(name)
    return 0 if data is None else int(data[0])


def fallbacks() -> dict[str, int]:
    met = _metrics()
    return {n: int(met.counter_value(n)) for n in met.counter_names() if n.startswith("aten::")}


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(16, 32)
        self.ln = torch.nn.LayerNorm(32)
        self.fc1 = torch.nn.Linear(32, 64)
        self.fc2 = torch.nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(self.ln(self.emb(x)))))

"""The size of the shared transformer-like model (``bench.common.model``), without torch.

The parents of ``bench.seed`` and ``bench.dp_scaling`` size the model and count its
parameters here; only their workers import torch and build it.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Size of the transformer-like stack and of its (fixed, synthetic) batch."""

    d_model: int
    layers: int
    heads: int
    ffn: int
    vocab: int
    seq: int
    batch: int
    dropout: float = 0.1


def count(cfg: ModelConfig) -> tuple[int, int]:
    """(parameters, tensors) of the model, without building it."""
    d, f = cfg.d_model, cfg.ffn
    block = (3 * d * d + 3 * d) + (d * d + d) + (d * f + f) + (f * d + d) + 4 * d
    params = cfg.vocab * d + cfg.seq * d + cfg.layers * block + 2 * d + d * cfg.vocab
    return params, 2 + 12 * cfg.layers + 3

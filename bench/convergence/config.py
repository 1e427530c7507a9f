"""The convergence study's modes, sizes and optimizer schedule."""

from __future__ import annotations

import math
from typing import Any

MODES = ("fp32", "bf16", "mixed")
TARGET_GAP = 0.01  # mixed final validation loss within 1% of fp32

PRESETS: dict[str, dict[str, Any]] = {
    "default": {
        "steps": 800,
        "batch": 16,
        "ctx": 128,
        "d_model": 128,
        "layers": 3,
        "heads": 4,
        "lr": 3e-3,
        "eval_every": 50,
        "eval_batches": 4,
        "final_eval_batches": 32,
        "corpus_chars": 4_000_000,
    },
    "smoke": {
        "steps": 12,
        "batch": 4,
        "ctx": 32,
        "d_model": 32,
        "layers": 1,
        "heads": 2,
        "lr": 3e-3,
        "eval_every": 6,
        "eval_batches": 2,
        "final_eval_batches": 2,
        "corpus_chars": 200_000,
    },
}
BETAS = (0.9, 0.99)
EPS = 1e-8
WEIGHT_DECAY = 0.01
WARMUP_FRACTION = 0.05
FINAL_LR_FRACTION = 0.1


def lr_at(step: int, cfg: dict[str, Any]) -> float:
    """Linear warm-up, then cosine decay to ``FINAL_LR_FRACTION`` of the peak."""
    peak, steps = cfg["lr"], cfg["steps"]
    warmup = max(1, int(WARMUP_FRACTION * steps))
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    low = FINAL_LR_FRACTION * peak
    return low + 0.5 * (peak - low) * (1.0 + math.cos(math.pi * progress))

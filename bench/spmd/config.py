"""The spmd benchmark's modes, model sizes and schedules (no torch: the parent reads them).

Modes, over a 1-D mesh whose axis ``data`` also shards the batch: ``replicated`` (params,
fp32 masters and AdamW state on every device: plain data parallel), ``zero1`` (masters,
state and fp32 grad buffers sharded by ``mpfunc.mark_sharding_``, params replicated) and
``fsdp`` (params sharded too; masters and state inherit).
"""

from __future__ import annotations

from bench.common.model_config import ModelConfig

MODES = ("replicated", "zero1", "fsdp")
LR, BETAS, EPS, WEIGHT_DECAY = 1e-3, (0.9, 0.999), 1e-8, 1e-2
PRESETS = {
    # 4.2M parameters in 53 tensors.
    "default": ModelConfig(
        d_model=256, layers=4, heads=4, ffn=1024, vocab=2048, seq=32, batch=16, dropout=0.0
    ),
    # Seconds in total, for the test suite.
    "smoke": ModelConfig(
        d_model=32, layers=1, heads=2, ffn=64, vocab=64, seq=8, batch=8, dropout=0.0
    ),
}
# Per preset: warm-up steps, blocks, steps per block.
SCHEDULES = {"default": (2, 5, 3), "smoke": (2, 2, 2)}

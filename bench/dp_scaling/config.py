"""The dp_scaling benchmark's modes, model sizes and schedules (no torch: the parent reads them).

Modes: ``unsharded``: ``mpfunc.all_reduce_grads`` (bucketed) and full fp32 masters on every
rank; ``sharded``: ``mpfunc.reduce_grads_to_owners`` (each bucket reduced to its owner
only), masters and AdamW state for this rank's leaves only, then
``mpfunc.broadcast_params_``; ``pertensor``: the baseline, one
``torch.distributed.all_reduce`` per grad tensor and full masters.
"""

from __future__ import annotations

from bench.common.model_config import ModelConfig

MODES = ("unsharded", "sharded", "pertensor")
LR, BETAS, EPS, WEIGHT_DECAY = 1e-3, (0.9, 0.999), 1e-8, 1e-2
PRESETS = {
    # 7.4M parameters in 101 tensors; about 0.1-0.3 s a step with 1 or 2 ranks on 2 cores.
    "default": ModelConfig(
        d_model=256, layers=8, heads=4, ffn=1024, vocab=2048, seq=32, batch=8, dropout=0.0
    ),
    # Seconds in total, for the test suite.
    "smoke": ModelConfig(
        d_model=32, layers=2, heads=2, ffn=64, vocab=64, seq=8, batch=4, dropout=0.0
    ),
}
# Per preset: warm-up steps, blocks, steps per block.
SCHEDULES = {"default": (2, 8, 3), "smoke": (1, 2, 2)}

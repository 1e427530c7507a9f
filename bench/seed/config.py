"""The seed benchmark's modes, model sizes and schedules (no torch: the parent reads them).

Every mode trains the same model (``bench.common.model``) from the same initial weights with
AdamW, loss in fp32. A mode is a recipe and an optimizer implementation:

- ``fp32``, ``bf16``: the model in that dtype, ``torch.optim.AdamW`` on its parameters;
- ``flat``: the original report's recipe, a bf16 model and one flat fp32 master buffer;
- ``pertensor``: the report's fix, one fp32 master per bf16 tensor, ``torch.optim.AdamW``;
- ``mpfunc``: a bf16 model with fp32 masters through mpfunc's single-pass ``apply_update_``;
- ``mpfunc-remainder``, ``mpfunc-kahan``, ``mpfunc-stochastic``: the same with a master
  strategy, and the state dtype its memory target goes with (``STRATEGY_MODES``): the
  peak-memory row per strategy;
- ``autocast``: an fp32 model under ``torch.autocast`` to bf16;
- ``syncfree`` (XLA only): an fp32 model with ``torch_xla.amp.syncfree.AdamW``, the
  optimizer a torch_xla user would pick (one fused op per tensor);
- ``<recipe>-fused`` (CPU and CUDA only): the recipe with ``torch.optim.AdamW(fused=True)``,
  the fastest torch.optim a user could pick, next to the recipe on torch's default;
- ``mpfunc-step-in-backward``: ``mpfunc.MasterOptimizer(..., step_in_backward=True)``, each
  leaf stepped as its grad completes (skipped, with the reason, where mpfunc has no such
  option);
- ``peer-<name>`` (CPU and CUDA only): a bf16 model with another library's memory-saving
  AdamW (``bench.common.peers``; skipped, with the reason, where it does not import).

A mode is one line: a strategy row in ``STRATEGY_MODES``, a peer in ``PEERS``.
"""

from __future__ import annotations

from bench.common.model_config import ModelConfig
from bench.common.peers import PEERS

# mpfunc with a master strategy: (strategy, state dtype name or None for fp32 moments).
STRATEGY_MODES = {
    "mpfunc-remainder": ("remainder", None),
    "mpfunc-kahan": ("kahan", "bfloat16"),
    "mpfunc-stochastic": ("stochastic", "uint8"),
}
# MasterOptimizer with each leaf stepped from its grad hook: (strategy, state dtype name).
BACKWARD_MODES = {"mpfunc-step-in-backward": ("fp32", None)}
PEER = "peer-"
PEER_MODES = tuple(PEER + name for name in PEERS)
BASE_MODES = (
    "fp32",
    "bf16",
    "flat",
    "pertensor",
    "mpfunc",
    *STRATEGY_MODES,
    *BACKWARD_MODES,
    "autocast",
    "syncfree",
    *PEER_MODES,
)
# Recipes that run torch.optim.AdamW, and so get a fused twin on the devices that have one.
TORCH_OPTIM_MODES = ("fp32", "bf16", "flat", "pertensor", "autocast")
FUSED = "-fused"
# Table order: each fused twin right after its recipe.
MODES = tuple(
    name
    for base in BASE_MODES
    for name in ((base, base + FUSED) if base in TORCH_OPTIM_MODES else (base,))
)
DEVICES = ("cpu", "xla", "cuda")
# Modes every device runs; the others only where listed.
ONLY_ON = {
    "syncfree": ("xla",),
    **{m + FUSED: ("cpu", "cuda") for m in TORCH_OPTIM_MODES},
    **{m: ("cpu", "cuda") for m in PEER_MODES},  # peers have no XLA path
}
# Modes whose step time the others are divided by in the tables (where they ran).
REFERENCES = ("fp32", "fp32-fused", "bf16", "pertensor", "pertensor-fused", "flat")

# AdamW hyperparameters: torch.optim.AdamW's defaults, spelled out for mpfunc.adamw.
LR, BETAS, EPS, WEIGHT_DECAY = 1e-3, (0.9, 0.999), 1e-8, 1e-2

PRESETS = {
    # About 0.1-0.3 s a step on 2 CPU cores, with enough tensors (101) and few enough
    # tokens that the optimizer's share of the step is visible, as in large-model training.
    "default": ModelConfig(d_model=256, layers=8, heads=4, ffn=1024, vocab=2560, seq=64, batch=4),
    # 156,661,760 parameters: the count printed in the original report. The report's script
    # is not public in full, so the layout is a reconstruction with the same size.
    "original": ModelConfig(
        d_model=1024, layers=12, heads=16, ffn=4096, vocab=2560, seq=256, batch=8
    ),
    # Seconds in total, for the test suite.
    "smoke": ModelConfig(d_model=32, layers=1, heads=2, ffn=64, vocab=64, seq=8, batch=2),
}
# Per preset: warm-up steps, blocks, steps per block. Three warm-up steps cover XLA's two
# compilations for torch.optim (its state is created lazily in the first step).
SCHEDULES = {"default": (3, 10, 2), "original": (3, 10, 2), "smoke": (3, 2, 2)}


def runs_on(mode: str, device: str) -> bool:
    """Whether ``mode`` exists on ``device`` (syncfree needs XLA; fused AdamW, cpu or cuda)."""
    return device in ONLY_ON.get(mode, DEVICES)


def recipe(mode: str) -> str:
    """The recipe of a mode: ``"pertensor"`` for ``"pertensor-fused"``, ``"mpfunc"`` for
    ``"mpfunc-remainder"``."""
    if mode in STRATEGY_MODES or mode in BACKWARD_MODES:
        return "mpfunc"
    if mode in PEER_MODES:
        return "peer"
    return mode[: -len(FUSED)] if mode.endswith(FUSED) else mode

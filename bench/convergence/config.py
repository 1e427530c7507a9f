"""The convergence study's rows, sizes and optimizer schedule.

The regime (measured; the report and ``bench.convergence``'s docstring say why): a
shared fp32 pretraining phase at a high learning rate, then every row fine-tunes from
the same checkpoint at a learning rate 60x smaller, where a bf16 weight swallows most
AdamW updates. This module imports no torch, so ``--render-only`` needs none.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from bench.common.peers import PEERS


class Row(NamedTuple):
    """One way to train, a row of the table.

    ``kind``: ``"torch"`` (``torch.optim.AdamW`` on a model of ``model_dtype``),
    ``"mixed"`` (bf16 model, fp32 masters, the three calls ``grads_to_fp32_``,
    ``apply_update_``, ``masters_to_model_``), ``"mpfunc"`` (bf16 model,
    ``init_master(strategy=)``, ``adamw(state_dtype=)``, one ``apply_update_(params=)``
    on the bf16 grads), ``"peer"`` (bf16 model, the ``bench.common.peers`` optimizer named
    by ``optimizer``) or ``"backward"`` (bf16 model, ``mpfunc.MasterOptimizer(...,
    step_in_backward=True)``, run where mpfunc has that option). Dtypes are ``torch``
    attribute names. ``optimizer``: ``"fused"`` for ``torch.optim.AdamW(fused=True)``, or
    the peer's name.
    """

    name: str
    kind: str
    model_dtype: str
    strategy: str | None = None
    state_dtype: str | None = None
    twin: bool = False  # also step fp32 masters on the same grads, and compare every step
    optimizer: str | None = None


STRATEGIES = ("fp32", "remainder", "kahan", "stochastic", "none")
STATE_DTYPES = {"float32": "f32", "bfloat16": "bf16", "uint8": "u8", "uint4": "u4"}

# Every row the study knows, in table order; add a row with one line here.
ROWS: dict[str, Row] = {
    r.name: r
    for r in (
        Row("fp32", "torch", "float32"),
        Row("fp32-fused", "torch", "float32", optimizer="fused"),
        Row("bf16", "torch", "bfloat16"),
        Row("mixed", "mixed", "bfloat16", "fp32", "float32"),
        *(
            Row(f"{s}/{short}", "mpfunc", "bfloat16", s, dtype, twin=s == "remainder")
            for s in STRATEGIES
            for dtype, short in STATE_DTYPES.items()
        ),
        Row("step-in-backward", "backward", "bfloat16", "fp32", "float32"),
        *(Row(f"peer/{name}", "peer", "bfloat16", optimizer=name) for name in PEERS),
    )
}
# "mixed" is the three-call path, bit-identical to "fp32/f32" by the API's contract:
# run it with --rows when that needs checking, not by default.
DEFAULT_ROWS = tuple(name for name in ROWS if name != "mixed")
REFERENCE = "fp32"

PRESETS: dict[str, dict[str, Any]] = {
    "default": {
        "pretrain_steps": 800,
        "pretrain_lr": 3e-3,
        "steps": 300,
        "lr": 5e-5,
        "batch": 16,
        "ctx": 64,
        "d_model": 64,
        "layers": 1,
        "heads": 4,
        "eval_every": 50,
        "eval_batches": 4,
        "final_eval_batches": 16,
        "diag_every": 10,
        "corpus_chars": 4_000_000,
    },
    "smoke": {
        "pretrain_steps": 6,
        "pretrain_lr": 3e-3,
        "steps": 6,
        "lr": 5e-5,
        "batch": 4,
        "ctx": 16,
        "d_model": 32,  # uint8/uint4 state takes leaves of at least one 32-element block
        "layers": 1,
        "heads": 2,
        "eval_every": 3,
        "eval_batches": 1,
        "final_eval_batches": 2,
        "diag_every": 2,
        "corpus_chars": 200_000,
    },
}
DEFAULT_SEEDS = {"default": "0,1", "smoke": "0,1"}
BETAS = (0.9, 0.99)
EPS = 1e-8
WEIGHT_DECAY = 0.01
WARMUP_FRACTION = 0.05

# Issue 10's targets, and issue 22's for 4-bit moments: (row, most persistent bytes per
# param, largest final val-loss gap to fp32, or None: bit-identical to the "fp32/f32" row
# through the whole run). The remainder's 12.13 is issue 22's 12.125 (12 plus its tie bits,
# the price of the bit-identity) to the table's 2 decimals.
TARGETS = (
    ("remainder/f32", 12.13, None),
    ("kahan/bf16", 8.0, 0.005),
    ("stochastic/u8", 4.2, 0.01),
    ("stochastic/u4", 3.2, 0.01),
)
IDENTICAL_TO = "fp32/f32"


def lr_at(step: int, steps: int, peak: float) -> float:
    """Linear warm-up over ``WARMUP_FRACTION`` of ``steps``, then constant ``peak``."""
    warmup = max(1, int(WARMUP_FRACTION * steps))
    return peak * min(1.0, (step + 1) / warmup)

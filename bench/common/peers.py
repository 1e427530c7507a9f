"""Other libraries' memory-saving AdamW, as the seed and convergence benchmarks run them.

Each peer is a ``torch.optim.Optimizer`` built on the bf16 model's own params; a peer
that does not import or cannot run here is reported as such, never silently dropped.
Add a peer with one line in ``PEERS``. This module imports no torch (parents read the
names); ``make`` imports the peer in the worker.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterable
from typing import Any, NamedTuple


class Peer(NamedTuple):
    """A peer optimizer: its label, ``"module:class"``, and the keywords that pick its mode."""

    label: str
    factory: str
    kwargs: tuple[tuple[str, Any], ...] = ()


PEERS: dict[str, Peer] = {
    "optimi-kahan": Peer(
        "torch-optimi AdamW kahan_sum=True", "optimi:AdamW", (("kahan_sum", True),)
    ),
    "bnb-8bit": Peer("bitsandbytes AdamW8bit (CPU backend)", "bitsandbytes.optim:AdamW8bit"),
    "torchao-8bit": Peer("torchao AdamW8bit (compiled)", "torchao.optim:AdamW8bit"),
    "torchao-4bit": Peer("torchao AdamW4bit (compiled)", "torchao.optim:AdamW4bit"),
    "torchao-bf16sr": Peer(
        "torchao _AdamW bf16_stochastic_round (compiled)",
        "torchao.optim:_AdamW",
        (("bf16_stochastic_round", True),),
    ),
    "flashoptim": Peer("FlashOptim FlashAdamW", "flashoptim:FlashAdamW"),
    # Its one mode that runs without CUDA: bf16 params and moments, no master bits.
    "flashoptim-bf16": Peer(
        "FlashOptim FlashAdamW plain bf16 (quantize=False, master_weight_bits=None)",
        "flashoptim:FlashAdamW",
        (("quantize", False), ("master_weight_bits", None), ("fused", False)),
    ),
}


# What a peer raises when it cannot run here: not installed, or a mode that needs a device
# this machine lacks (FlashOptim's quantized modes: "requires a CUDA device").
UNAVAILABLE = (ImportError, NotImplementedError)


def make(
    name: str,
    params: Iterable[Any],
    *,
    lr: Any,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
) -> Any:
    """The peer ``name``'s optimizer over ``params`` (raises whatever its import raises)."""
    # With torch_xla installed, Hugging Face-style libraries pick XLA at import unless told.
    os.environ.setdefault("USE_TORCH_XLA", "0")
    peer = PEERS[name]
    module, _, attr = peer.factory.partition(":")
    cls = getattr(importlib.import_module(module), attr)
    return cls(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **dict(peer.kwargs))

"""The seed benchmark's model and its training modes.

The flat-buffer and per-tensor recipes are baselines: they live here, never in mpfunc.
Every mode trains the same model from the same initial weights with AdamW, and computes
the loss in fp32.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

MODES = ("fp32", "bf16", "flat", "pertensor", "mpfunc", "autocast")

# AdamW hyperparameters: torch.optim.AdamW's defaults, spelled out for mpfunc.adamw.
LR, BETAS, EPS, WEIGHT_DECAY = 1e-3, (0.9, 0.999), 1e-8, 1e-2


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


class Block(nn.Module):
    """Pre-norm self-attention and MLP, each followed by dropout as in the original."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.d_model % cfg.heads:
            raise ValueError(f"d_model ({cfg.d_model}) must be a multiple of heads ({cfg.heads})")
        self.heads = cfg.heads
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc1 = nn.Linear(cfg.d_model, cfg.ffn)
        self.fc2 = nn.Linear(cfg.ffn, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        qkv = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.drop(self.proj(a.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.ln2(x)))))


class Model(nn.Module):
    """Token and position embeddings, ``layers`` blocks, a final norm and an untied head."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.drop(self.tok(tokens) + self.pos(positions))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def count(cfg: ModelConfig) -> tuple[int, int]:
    """(parameters, tensors) of the model, without building it."""
    d, f = cfg.d_model, cfg.ffn
    block = (3 * d * d + 3 * d) + (d * d + d) + (d * f + f) + (f * d + d) + 4 * d
    params = cfg.vocab * d + cfg.seq * d + cfg.layers * block + 2 * d + d * cfg.vocab
    return params, 2 + 12 * cfg.layers + 3


def _fp32_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def _torch_adamw(params: list[torch.Tensor], torch_optim: str) -> torch.optim.Optimizer:
    # "default" keeps torch's own choice: the single-tensor loop on cpu and xla (neither is
    # a foreach device for torch.optim), foreach on cuda. Its `step` counter stays a cpu
    # tensor, so on xla the bias corrections are host floats and nothing syncs the host.
    kwargs: dict[str, bool] = {}
    if torch_optim == "foreach":
        kwargs["foreach"] = True
    elif torch_optim == "fused":
        kwargs["fused"] = True
    return torch.optim.AdamW(
        params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, **kwargs
    )


def describe_torch_adamw(device: torch.device, torch_optim: str) -> str:
    """Which implementation torch.optim.AdamW runs for ``torch_optim`` on ``device``."""
    if torch_optim != "default":
        return f"torch.optim.AdamW ({torch_optim})"
    try:
        from torch.utils._foreach_utils import _get_foreach_kernels_supported_devices

        foreach = device.type in _get_foreach_kernels_supported_devices()
    except ImportError:  # a private helper; only the label depends on it
        return "torch.optim.AdamW (torch's default)"
    return f"torch.optim.AdamW (default: {'foreach' if foreach else 'single-tensor'})"


def make_step(
    mode: str,
    cfg: ModelConfig,
    device: torch.device,
    *,
    torch_optim: str = "default",
    seed: int = 0,
) -> tuple[Callable[[], torch.Tensor], str]:
    """Build the model for ``mode`` on ``device``.

    Returns a function running one training step, and the optimizer's name. The step
    returns the (fp32, 0-d, detached) loss and does not sync the host; on xla the caller
    ends the step with ``torch_xla.sync()``.
    """
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; expected one of {', '.join(MODES)}")
    torch.manual_seed(seed)
    model = Model(cfg)  # same fp32 initial weights in every mode
    gen = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(cfg.vocab, (cfg.batch, cfg.seq), generator=gen).to(device)
    targets = torch.randint(cfg.vocab, (cfg.batch, cfg.seq), generator=gen).to(device)
    low = mode in ("bf16", "flat", "pertensor", "mpfunc")
    model.to(device=device, dtype=torch.bfloat16 if low else torch.float32)
    model.train()
    torch_name = describe_torch_adamw(device, torch_optim)

    if mode in ("fp32", "bf16"):
        opt = _torch_adamw(list(model.parameters()), torch_optim)

        def step() -> torch.Tensor:
            loss = _fp32_loss(model(tokens), targets)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach()

        return step, torch_name

    if mode == "autocast":
        opt = _torch_adamw(list(model.parameters()), torch_optim)

        def step() -> torch.Tensor:
            with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
                logits = model(tokens)
            loss = _fp32_loss(logits, targets)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach()

        return step, torch_name

    low_params = list(model.parameters())

    if mode == "flat":
        # The original report's recipe, step for step: ONE flat fp32 buffer holds every
        # master, and grads and weights travel through offset slices of it.
        total = sum(p.numel() for p in low_params)
        flat = torch.zeros(total, dtype=torch.float32, device=device)
        offset = 0
        for p in low_params:
            flat.data[offset : offset + p.numel()].copy_(p.data.view(-1))
            offset += p.numel()
        flat_param = nn.Parameter(flat)
        flat_param.grad = flat.new_zeros(total)
        opt = _torch_adamw([flat_param], torch_optim)

        def step() -> torch.Tensor:
            loss = _fp32_loss(model(tokens), targets)
            loss.backward()
            assert flat_param.grad is not None
            flat_param.grad.data.zero_()  # as the report's zero_grad did
            offset = 0
            for p in low_params:
                assert p.grad is not None
                grad = p.grad.data
                flat_param.grad.data[offset : offset + grad.numel()].copy_(grad.view(-1))
                offset += grad.numel()
            opt.step()
            offset = 0
            for p in low_params:
                p.data.copy_(flat_param.data[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
            model.zero_grad(set_to_none=True)
            return loss.detach()

        return step, torch_name

    if mode == "pertensor":
        # The report's fix: one fp32 torch.optim parameter per model tensor, same shapes,
        # and a Python loop copying through them. Unlike the report we skip zeroing the
        # fp32 grads first, since the copy overwrites every element; the baseline is then
        # as fast as a careful user would write it.
        masters = [nn.Parameter(p.detach().float()) for p in low_params]
        for m in masters:
            m.grad = torch.zeros_like(m)
        opt = _torch_adamw(list(masters), torch_optim)

        def step() -> torch.Tensor:
            loss = _fp32_loss(model(tokens), targets)
            loss.backward()
            with torch.no_grad():
                for p, m in zip(low_params, masters):
                    assert p.grad is not None and m.grad is not None
                    m.grad.copy_(p.grad)
            opt.step()
            with torch.no_grad():
                for p, m in zip(low_params, masters):
                    p.copy_(m)
            model.zero_grad(set_to_none=True)
            return loss.detach()

        return step, torch_name

    # mode == "mpfunc": the library's in-place twins on its default (fastest) path.
    import mpfunc

    params = dict(model.named_parameters())
    masters = mpfunc.init_master(params, dtype=torch.float32)
    grads32 = mpfunc.init_master(params)  # preallocated fp32 grad buffers
    mopt = mpfunc.adamw(lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    carry = [masters, mopt.init(masters)]

    def step() -> torch.Tensor:
        loss = _fp32_loss(model(tokens), targets)
        loss.backward()
        grads = {name: p.grad for name, p in params.items()}
        g32 = mpfunc.grads_to_fp32_(grads, grads32)
        carry[0], carry[1] = mpfunc.apply_update_(carry[0], g32, carry[1], mopt)
        mpfunc.masters_to_model_(carry[0], params)
        model.zero_grad(set_to_none=True)
        return loss.detach()

    return step, "mpfunc.adamw (impl auto)"

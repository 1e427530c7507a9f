"""A real client: HF ``Trainer`` trains a tiny bf16 GPT-2 with ``MasterOptimizer``.

The same randomly initialised GPT-2 (tied input and output embeddings) is trained twice
by ``transformers.Trainer`` with a cosine schedule and grad clipping: once in bf16 with
``MasterOptimizer`` (fp32 masters, AdamW), once in fp32 with ``torch.optim.AdamW``.
The losses must agree within the bound below: the runs differ only by the bf16 forward
and backward, since the fp32 masters keep every update.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest
import torch

import mpfunc

# transformers and accelerate pick torch_xla's device whenever torch_xla imports, at their
# own import time; this test trains on the CPU, as a user without XLA would.
assert "accelerate" not in sys.modules and "transformers" not in sys.modules, (
    "test_hf_trainer must import transformers first, to keep it off the XLA device"
)
os.environ["USE_TORCH_XLA"] = "0"
transformers = pytest.importorskip("transformers")

VOCAB, SEQ, STEPS = 48, 16, 12
# |loss_bf16 - loss_fp32| per logged step (Trainer logs losses rounded to 1e-4; they fall
# from 3.69 to 3.11). Measured (torch 2.9, transformers 4.57.6): at most 3e-4 with
# MasterOptimizer; pure bf16 (torch.optim.AdamW on the bf16 params) drifts to 4.3e-3, so
# the bound also tells the masters' effect apart.
LOSS_BOUND = 1.5e-3


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Learnable sequences: each row counts up from a random start, modulo VOCAB."""

    def __init__(self, n: int = 64) -> None:
        gen = torch.Generator().manual_seed(0)
        starts = torch.randint(0, VOCAB, (n, 1), generator=gen)
        self.ids = (starts + torch.arange(SEQ)) % VOCAB

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def tiny_gpt2() -> Any:
    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_positions=SEQ,
        n_embd=32,
        n_layer=2,
        n_head=2,
        tie_word_embeddings=True,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def train(model: Any, opt: torch.optim.Optimizer, tmp: str) -> list[float]:
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=STEPS)
    args = transformers.TrainingArguments(
        output_dir=tmp,
        max_steps=STEPS,
        per_device_train_batch_size=8,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        seed=0,
        data_seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
        max_grad_norm=1.0,
    )
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=Tokens(), optimizers=(opt, sched)
    )
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


@pytest.mark.filterwarnings("ignore::FutureWarning:transformers.*")
def test_trainer_bf16_master_optimizer_tracks_fp32_adamw(tmp_path: Any) -> None:
    fp32 = tiny_gpt2()
    bf16 = tiny_gpt2().to(torch.bfloat16)
    assert bf16.lm_head.weight is bf16.transformer.wte.weight  # tied: one param
    ref = train(
        fp32,
        torch.optim.AdamW(fp32.parameters(), lr=3e-3, weight_decay=0.1),
        str(tmp_path / "fp32"),
    )
    opt = mpfunc.MasterOptimizer(bf16.parameters(), mpfunc.adamw, lr=3e-3, weight_decay=0.1)
    got = train(bf16, opt, str(tmp_path / "bf16"))
    assert len(got) == len(ref) == STEPS
    gaps = [abs(a - b) for a, b in zip(got, ref)]
    assert max(gaps) <= LOSS_BOUND, (gaps, got, ref)
    assert got[-1] < got[0] - 0.3, "the bf16 model did not learn"
    # The bf16 params are the masters rounded; the masters are fp32 and were trained.
    for p in bf16.parameters():
        master = opt.state[p]["master"]
        assert master.dtype == torch.float32
        assert torch.equal(p.detach(), master.to(torch.bfloat16))
    assert all(int(opt.state[p]["step"]) == STEPS for p in bf16.parameters())

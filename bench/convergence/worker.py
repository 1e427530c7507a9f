"""One convergence-study mode, trained in the benchmark's own process.

``train_mode`` trains one mode's model on the same batches as every other mode and
returns its loss curves and step times; ``Stale`` counts the updates that bf16 rounding
swallowed (see ``bench.convergence`` for what is compared).
"""

from __future__ import annotations

import gc
import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import mpfunc
from bench.convergence import data
from bench.convergence.config import BETAS, EPS, WEIGHT_DECAY, lr_at
from bench.convergence.model import CharLM, loss_fn


def windows(tokens: torch.Tensor, starts: torch.Tensor, ctx: int) -> tuple[torch.Tensor, ...]:
    """Inputs and next-token targets for windows of ``ctx`` tokens at ``starts``."""
    idx = starts[:, None] + torch.arange(ctx + 1)
    chunk = tokens[idx].long()
    return chunk[:, :-1], chunk[:, 1:]


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: list[tuple[torch.Tensor, ...]]) -> float:
    model.eval()
    losses = [loss_fn(model, x, y).item() for x, y in batches]
    model.train()
    return sum(losses) / len(losses)


class Stale:
    """Counts updates that a step's bf16 rounding swallowed.

    For every element whose AdamW update, computed in fp32 arithmetic from the
    step's inputs, is non-zero: ``stale`` when the bf16 model weight did not
    change, ``lost`` when the stored weight (the bf16 weight in ``bf16``, the fp32
    master in ``mixed``) did not change either, so the update is gone for good.
    """

    def __init__(self) -> None:
        self.nonzero = 0
        self.stale = 0
        self.lost = 0
        self.per_step: list[tuple[int, float, float]] = []

    def add(
        self,
        step: int,
        nonzero: list[torch.Tensor],
        weight_same: list[torch.Tensor],
        store_same: list[torch.Tensor],
    ) -> None:
        n_nonzero = sum(int(z.sum()) for z in nonzero)
        n_stale = sum(int((w & z).sum()) for w, z in zip(weight_same, nonzero))
        n_lost = sum(int((s & z).sum()) for s, z in zip(store_same, nonzero))
        self.nonzero += n_nonzero
        self.stale += n_stale
        self.lost += n_lost
        denom = max(1, n_nonzero)
        self.per_step.append((step, n_stale / denom, n_lost / denom))

    def summary(self) -> dict[str, Any]:
        return {
            "nonzero": self.nonzero,
            "stale": self.stale,
            "lost": self.lost,
            "stale_fraction": self.stale / max(1, self.nonzero),
            "lost_fraction": self.lost / max(1, self.nonzero),
            "per_step": self.per_step,
        }


def _adamw_delta_fp32(
    p: torch.Tensor,
    g: torch.Tensor,
    exp_avg: torch.Tensor | None,
    exp_avg_sq: torch.Tensor | None,
    step: float,
    lr: float,
) -> torch.Tensor:
    """The change AdamW makes to ``p`` this step, in fp32 arithmetic, from the state before it.

    ``step`` counts the steps taken so far; ``None`` moments mean a fresh state.
    """
    p32, g32 = p.detach().float(), g.float()
    m = torch.zeros_like(p32) if exp_avg is None else exp_avg.float()
    v = torch.zeros_like(p32) if exp_avg_sq is None else exp_avg_sq.float()
    t = step + 1
    b1, b2 = BETAS
    m = m.mul(b1).add_(g32, alpha=1 - b1)
    v = v.mul(b2).addcmul_(g32, g32, value=1 - b2)
    denom = v.sqrt_().div_(math.sqrt(1 - b2**t)).add_(EPS)
    return p32.mul(-lr * WEIGHT_DECAY).addcdiv_(m, denom, value=-lr / (1 - b1**t))


class Trainer:
    """One mode's model and optimizer; ``step`` trains on one batch."""

    def __init__(self, mode: str, cfg: dict[str, Any], device: torch.device) -> None:
        self.mode = mode
        self.diag_s = 0.0  # time spent counting stale updates, left out of step times
        torch.manual_seed(cfg["seed"])  # the same initial weights in every mode
        model = CharLM(len(data.VOCAB), cfg["ctx"], cfg["d_model"], cfg["layers"], cfg["heads"])
        if mode != "fp32":
            model = model.to(torch.bfloat16)
        self.model = model.to(device)
        self.params = dict(self.model.named_parameters())
        self.lr0 = lr_at(0, cfg)
        if mode == "mixed":
            self.masters = mpfunc.init_master(self.params)
            self.g32 = {k: torch.empty_like(m) for k, m in self.masters.items()}
            # A 0-d tensor lr is read at every step, so the schedule needs no new optimizer.
            self.lr = torch.tensor(self.lr0, dtype=torch.float32, device=device)
            self.opt = mpfunc.adamw(
                lr=self.lr, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, impl="auto"
            )
            self.state = self.opt.init(self.masters)
        else:
            self.torch_opt = torch.optim.AdamW(
                self.params.values(), lr=self.lr0, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY
            )

    def step(
        self, x: torch.Tensor, y: torch.Tensor, lr: float, stale: Stale | None, i: int
    ) -> float:
        for p in self.params.values():
            p.grad = None
        loss = loss_fn(self.model, x, y)
        loss.backward()
        if self.mode == "mixed":
            self._mixed_update(lr, stale, i)
        else:
            self._torch_update(lr, stale, i)
        return loss.item()

    def _torch_update(self, lr: float, stale: Stale | None, i: int) -> None:
        for group in self.torch_opt.param_groups:
            group["lr"] = lr
        if stale is None:
            self.torch_opt.step()
            return
        t0 = time.perf_counter()
        ps = list(self.params.values())
        with torch.no_grad():
            nonzero = []
            for p in ps:
                st = self.torch_opt.state.get(p, {})
                delta = _adamw_delta_fp32(
                    p, p.grad, st.get("exp_avg"), st.get("exp_avg_sq"), float(st.get("step", 0)), lr
                )
                nonzero.append(delta != 0)
            before = [p.detach().clone() for p in ps]
        self.diag_s += time.perf_counter() - t0
        self.torch_opt.step()
        t0 = time.perf_counter()
        same = [p.detach() == b for p, b in zip(ps, before)]
        stale.add(i, nonzero, same, same)
        self.diag_s += time.perf_counter() - t0

    def _mixed_update(self, lr: float, stale: Stale | None, i: int) -> None:
        grads = {k: p.grad for k, p in self.params.items()}
        mpfunc.grads_to_fp32_(grads, self.g32)
        self.lr.fill_(lr)
        if stale is not None:
            t0 = time.perf_counter()
            st = self.state
            nonzero = [
                _adamw_delta_fp32(
                    m, self.g32[k], st.exp_avg[k], st.exp_avg_sq[k], float(st.step[k]), lr
                )
                != 0
                for k, m in self.masters.items()
            ]
            masters_before = [m.clone() for m in self.masters.values()]
            params_before = [p.detach().clone() for p in self.params.values()]
            self.diag_s += time.perf_counter() - t0
        self.masters, self.state = mpfunc.apply_update_(
            self.masters, self.g32, self.state, self.opt
        )
        mpfunc.masters_to_model_(self.masters, self.params)
        if stale is not None:
            t0 = time.perf_counter()
            weight_same = [p.detach() == b for p, b in zip(self.params.values(), params_before)]
            master_same = [m == b for m, b in zip(self.masters.values(), masters_before)]
            stale.add(i, nonzero, weight_same, master_same)
            self.diag_s += time.perf_counter() - t0


def train_mode(
    mode: str,
    cfg: dict[str, Any],
    corpus: data.Corpus,
    device: torch.device,
    log: Callable[[str], None],
) -> dict[str, Any]:
    trainer = Trainer(mode, cfg, device)
    n_params = sum(p.numel() for p in trainer.params.values())
    gen = torch.Generator().manual_seed(cfg["seed"] + 1)  # the same batches in every mode
    ctx, batch = cfg["ctx"], cfg["batch"]
    train_starts = torch.randint(
        0, len(corpus.train) - ctx - 1, (cfg["steps"], batch), generator=gen
    )
    val_starts = torch.randint(
        0, len(corpus.val) - ctx - 1, (cfg["final_eval_batches"], batch), generator=gen
    )
    val_batches = [tuple(t.to(device) for t in windows(corpus.val, s, ctx)) for s in val_starts]
    curve_batches = val_batches[: cfg["eval_batches"]]
    stale = Stale() if mode != "fp32" else None

    train_loss: list[float] = []
    val_curve = [(0, evaluate(trainer.model, curve_batches))]
    step_s: list[float] = []
    t_mode = time.perf_counter()
    for i in range(cfg["steps"]):
        x, y = (t.to(device) for t in windows(corpus.train, train_starts[i], ctx))
        t0, diag0 = time.perf_counter(), trainer.diag_s
        train_loss.append(trainer.step(x, y, lr_at(i, cfg), stale, i))
        step_s.append(time.perf_counter() - t0 - (trainer.diag_s - diag0))
        if (i + 1) % cfg["eval_every"] == 0 or i + 1 == cfg["steps"]:
            val_curve.append((i + 1, evaluate(trainer.model, curve_batches)))
            log(
                f"[{mode:5}] step {i + 1:5d}/{cfg['steps']}  train {train_loss[-1]:.4f}  "
                f"val {val_curve[-1][1]:.4f}  {statistics.median(step_s) * 1e3:.0f} ms/step"
            )
    final_val = evaluate(trainer.model, val_batches)
    tail = max(1, cfg["steps"] // 10)
    result = {
        "mode": mode,
        "params": n_params,
        "train_loss": train_loss,
        "val_curve": val_curve,
        "final_val_loss": final_val,
        "final_train_loss": sum(train_loss[-tail:]) / tail,
        "step_ms_median": statistics.median(step_s) * 1e3,
        "wall_s": time.perf_counter() - t_mode,
        "stale": stale.summary() if stale else None,
    }
    del trainer
    gc.collect()
    return result

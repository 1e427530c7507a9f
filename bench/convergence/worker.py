"""Training the convergence study's rows, in the benchmark's own process.

``pretrain`` makes one seed's shared starting point; ``train_row`` fine-tunes one row
from it on the same batches as every other row and returns its curves, diagnostics,
persistent bytes and step times (see ``bench.convergence`` for what is compared).
"""

from __future__ import annotations

import gc
import hashlib
import math
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch

import mpfunc
from bench.common import peers
from bench.common.memory import measure_step, persistent_bytes
from bench.convergence import data
from bench.convergence.config import BETAS, EPS, WEIGHT_DECAY, Row, lr_at
from bench.convergence.model import CharLM, loss_fn

Log = Callable[[str], None]


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


def digest(tensors_by_name: Mapping[str, torch.Tensor]) -> str:
    """sha256 of the tensors' bytes in name order (a bit-for-bit fingerprint)."""
    h = hashlib.sha256()
    for k in sorted(tensors_by_name):
        t = tensors_by_name[k].detach().cpu().contiguous()
        h.update(k.encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


class Batches(NamedTuple):
    """One seed's data: window starts per step, and the held-out batches."""

    pretrain: torch.Tensor  # (pretrain_steps, batch)
    train: torch.Tensor  # (steps, batch)
    val: list[tuple[torch.Tensor, ...]]  # the final evaluation
    curve: list[tuple[torch.Tensor, ...]]  # a prefix of val, for the curves


def make_batches(cfg: dict[str, Any], corpus: data.Corpus, seed: int) -> Batches:
    gen = torch.Generator().manual_seed(seed + 1)
    ctx, batch = cfg["ctx"], cfg["batch"]
    hi = len(corpus.train) - ctx - 1
    pre = torch.randint(0, hi, (cfg["pretrain_steps"], batch), generator=gen)
    train = torch.randint(0, hi, (cfg["steps"], batch), generator=gen)
    val_starts = torch.randint(
        0, len(corpus.val) - ctx - 1, (cfg["final_eval_batches"], batch), generator=gen
    )
    val = [windows(corpus.val, s, ctx) for s in val_starts]
    return Batches(pre, train, val, val[: cfg["eval_batches"]])


def new_model(cfg: dict[str, Any]) -> CharLM:
    return CharLM(len(data.VOCAB), cfg["ctx"], cfg["d_model"], cfg["layers"], cfg["heads"])


def pretrain(
    cfg: dict[str, Any], corpus: data.Corpus, batches: Batches, seed: int, log: Log
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The shared starting point: an fp32 model trained at ``pretrain_lr``, then rounded
    to bf16 values, so that every row (fp32 included) starts from the same numbers."""
    torch.manual_seed(seed)
    model = new_model(cfg)
    opt = torch.optim.AdamW(
        model.parameters(), lr=cfg["pretrain_lr"], betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY
    )
    t0 = time.perf_counter()
    n = cfg["pretrain_steps"]
    for i in range(n):
        for group in opt.param_groups:
            group["lr"] = lr_at(i, n, cfg["pretrain_lr"])
        x, y = windows(corpus.train, batches.pretrain[i], cfg["ctx"])
        opt.zero_grad(set_to_none=True)
        loss_fn(model, x, y).backward()
        opt.step()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16))
    val = evaluate(model, batches.val)
    log(f"[seed {seed}] pretrained {n} steps: val {val:.4f} ({time.perf_counter() - t0:.0f} s)")
    info = {"seed": seed, "val_loss": val, "wall_s": time.perf_counter() - t0}
    return {k: v.clone() for k, v in model.state_dict().items()}, info


class Diag:
    """Per diagnostic step, fractions of all parameter elements:

    ``stale``: the update was non-zero but the model param did not change;
    ``lost``: the stored value the next step starts from (fp32 master, remainder,
    compensation, or the param itself) did not change: the update is gone;
    ``unchanged``: the model param did not change; ``ratio``: rms(update)/rms(weight).
    """

    FIELDS = ("stale", "lost", "unchanged", "ratio")

    def __init__(self) -> None:
        self.per_step: list[tuple[int, float, float, float, float]] = []

    def add(self, step: int, stale: float, lost: float, unchanged: float, ratio: float) -> None:
        self.per_step.append((step, stale, lost, unchanged, ratio))

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"per_step": self.per_step}
        for j, name in enumerate(self.FIELDS, start=1):
            vals = [r[j] for r in self.per_step]
            out[name] = sum(vals) / len(vals) if vals else float("nan")
        return out


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


def _rms_ratio(sq_updates: list[float], sq_weights: list[float]) -> float:
    """rms(update) / rms(weight) over all leaves, from each leaf's sums of squares."""
    return math.sqrt(sum(sq_updates) / max(sum(sq_weights), 1e-30))


class Trainer:
    """One row's model and optimizer; ``step`` trains on one batch."""

    def __init__(
        self, row: Row, cfg: dict[str, Any], start: dict[str, torch.Tensor], seed: int
    ) -> None:
        self.row = row
        model = new_model(cfg)
        model.load_state_dict(start)
        self.model = model.to(getattr(torch, row.model_dtype))
        self.params = dict(self.model.named_parameters())
        self.n = sum(p.numel() for p in self.params.values())
        self.diag = Diag()
        self.extra_s = 0.0  # time spent on the twin, left out of step times
        self.twin: Twin | None = None
        self.setup(cfg, seed)

    def setup(self, cfg: dict[str, Any], seed: int) -> None:
        raise NotImplementedError

    def update(self, lr: float, step: int, diag: bool) -> None:
        raise NotImplementedError

    def held(self) -> list[Any]:
        """The trees kept from one step to the next (not grads, not temporaries)."""
        raise NotImplementedError

    def fp32_values(self) -> dict[str, torch.Tensor]:
        """The exact fp32 values the next step starts from, by parameter name."""
        raise NotImplementedError

    def step(self, x: torch.Tensor, y: torch.Tensor, lr: float, i: int, diag: bool) -> float:
        for p in self.params.values():
            p.grad = None
        loss = loss_fn(self.model, x, y)
        loss.backward()
        self.update(lr, i, diag)
        return loss.item()


class Unsupported(RuntimeError):
    """The row's library or option is not installed here (reported, not a failure)."""


class TorchTrainer(Trainer):
    """``torch.optim.AdamW`` on the model itself (fp32, or pure bf16; ``fused=True`` where
    the row's ``optimizer`` is ``"fused"``)."""

    def setup(self, cfg: dict[str, Any], seed: int) -> None:
        self.opt = torch.optim.AdamW(
            self.params.values(),
            lr=cfg["lr"],
            betas=BETAS,
            eps=EPS,
            weight_decay=WEIGHT_DECAY,
            fused=True if self.row.optimizer == "fused" else None,
        )

    def held(self) -> list[Any]:
        return [self.params, list(self.opt.state.values())]

    def fp32_values(self) -> dict[str, torch.Tensor]:
        return {k: p.detach().float() for k, p in self.params.items()}

    def update(self, lr: float, step: int, diag: bool) -> None:
        for group in self.opt.param_groups:
            group["lr"] = lr
        if not diag:
            self.opt.step()
            return
        ps = list(self.params.values())
        with torch.no_grad():
            deltas = []
            for p in ps:
                st = self.opt.state.get(p, {})
                m, v, t = st.get("exp_avg"), st.get("exp_avg_sq"), float(st.get("step", 0))
                deltas.append(_adamw_delta_fp32(p, p.grad, m, v, t, lr))
            before = [p.detach().clone() for p in ps]
        self.opt.step()
        same = [p.detach() == b for p, b in zip(ps, before)]
        stale = sum(int((s & (d != 0)).sum()) for s, d in zip(same, deltas))
        unchanged = sum(int(s.sum()) for s in same)
        ratio = _rms_ratio(
            [float(d.square().sum()) for d in deltas],
            [float(b.float().square().sum()) for b in before],
        )
        # The param is the stored value: unchanged param, lost update.
        self.diag.add(step, stale / self.n, unchanged / self.n, unchanged / self.n, ratio)


class OptimTrainer(TorchTrainer):
    """A ``torch.optim.Optimizer`` other than AdamW on the bf16 model: a peer's
    (``bench.common.peers``), or ``mpfunc.MasterOptimizer(..., step_in_backward=True)``.
    Its state is its own, so the diagnostics count only unchanged params (stale and lost
    updates, which need the update AdamW would make, are not measured: NaN)."""

    def setup(self, cfg: dict[str, Any], seed: int) -> None:
        ps = list(self.params.values())
        hyper = {"lr": cfg["lr"], "betas": BETAS, "eps": EPS, "weight_decay": WEIGHT_DECAY}
        if self.row.kind == "peer":
            assert self.row.optimizer is not None
            try:
                self.opt = peers.make(self.row.optimizer, ps, **hyper)
            except peers.UNAVAILABLE as e:
                label = peers.PEERS[self.row.optimizer].label
                raise Unsupported(f"{label}: {e}") from e
            return
        state_dtype = getattr(torch, self.row.state_dtype or "float32")
        try:
            self.opt = mpfunc.MasterOptimizer(
                ps,
                strategy=self.row.strategy or "fp32",
                step_in_backward=True,
                state_dtype=state_dtype,
                **hyper,
            )
        except TypeError as e:
            if "step_in_backward" not in str(e):
                raise
            raise Unsupported(f"this mpfunc has no MasterOptimizer(step_in_backward=): {e}") from e

    def step(self, x: torch.Tensor, y: torch.Tensor, lr: float, i: int, diag: bool) -> float:
        # The lr first: with step_in_backward the update runs inside backward. torchao
        # keeps it as a tensor (its compiled step reads it), to be written in place.
        for group in self.opt.param_groups:
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr
        # The params before the backward: with step_in_backward they change inside it.
        self._before = [p.detach().clone() for p in self.params.values()] if diag else []
        return super().step(x, y, lr, i, diag)

    def update(self, lr: float, step: int, diag: bool) -> None:
        ps = list(self.params.values())
        before = self._before
        self.opt.step()  # after step_in_backward: no grad is left, nothing to do
        if diag:
            unchanged = sum(int((p.detach() == b).sum()) for p, b in zip(ps, before))
            nan = float("nan")
            self.diag.add(step, nan, nan, unchanged / self.n, nan)


class Twin:
    """Plain fp32 masters stepped beside a row on the same grads, with the same
    optimizer settings: does the row's strategy hold exactly these masters, every step,
    and are its params exactly ``Tensor.to(torch.bfloat16)`` of them?

    A training run cannot say so by itself: one param that differs changes the next
    forward pass, and the two runs part for good.
    """

    def __init__(self, params: dict[str, torch.Tensor], opt: Any) -> None:
        self.masters = mpfunc.init_master(params)
        self.opt = opt  # the row's own optimizer: the same hyperparameters, the same lr
        self.state = opt.init(self.masters)
        self.steps = 0
        self.master_steps_differ = 0  # steps after which some master differed
        self.masters_differ = 0  # (element, step) pairs
        self.params_differ = 0  # params that are not Tensor.to of the twin's master
        self.params_differ_at_ties = 0  # ... whose master's low 16 bits are 0x8000

    def step(
        self,
        grads: dict[str, torch.Tensor],
        values: dict[str, torch.Tensor],
        params: dict[str, torch.Tensor],
    ) -> None:
        """One twin step on ``grads``; ``values`` are the row's fp32 masters after its step."""
        mpfunc.apply_update_(self.masters, grads, self.state, self.opt)
        self.steps += 1
        differ = sum(int((values[k] != m).sum()) for k, m in self.masters.items())
        self.masters_differ += differ
        self.master_steps_differ += differ > 0
        for k, m in self.masters.items():
            d = params[k].detach() != m.to(torch.bfloat16)
            self.params_differ += int(d.sum())
            low = m.view(torch.int32) & 0xFFFF
            self.params_differ_at_ties += int((d & (low == 0x8000)).sum())

    def summary(self) -> dict[str, int]:
        return {
            "steps": self.steps,
            "master_steps_differ": self.master_steps_differ,
            "masters_differ": self.masters_differ,
            "params_differ": self.params_differ,
            "params_differ_at_ties": self.params_differ_at_ties,
        }


class MpfuncTrainer(Trainer):
    """A bf16 model trained through mpfunc: ``init_master(strategy=)``,
    ``adamw(state_dtype=)`` and one ``apply_update_(..., params=)`` on the bf16 grads
    (``kind == "mpfunc"``), or the three-call path with an fp32 grad tree (``"mixed"``)."""

    def setup(self, cfg: dict[str, Any], seed: int) -> None:
        row = self.row
        self.masters = mpfunc.init_master(self.params, strategy=row.strategy, seed=seed)
        # A 0-d tensor lr is read at every step, so the schedule needs no new optimizer.
        self.lr = torch.tensor(cfg["lr"], dtype=torch.float32)
        self.opt = mpfunc.adamw(
            lr=self.lr,
            betas=BETAS,
            eps=EPS,
            weight_decay=WEIGHT_DECAY,
            state_dtype=getattr(torch, row.state_dtype or "float32"),
        )
        self.state = self.opt.init(self.masters)
        self.stats = mpfunc.init_stats(self.masters)
        self.g32 = (
            {k: torch.empty_like(m) for k, m in self.masters.items()}
            if row.kind == "mixed"
            else None
        )
        self.twin = Twin(self.params, self.opt) if row.twin else None

    def held(self) -> list[Any]:
        return [self.params, self.masters, self.state, self.g32]

    def fp32_values(self) -> dict[str, torch.Tensor]:
        return mpfunc.masters_state_dict(self.masters)  # exact fp32 copies, any strategy

    def update(self, lr: float, step: int, diag: bool) -> None:
        self.lr.fill_(lr)
        grads = {k: p.grad for k, p in self.params.items()}
        stats = self.stats if diag else None
        if diag:
            params_before = {k: p.detach().clone() for k, p in self.params.items()}
            values_before = self.fp32_values()
        if self.g32 is None:
            mpfunc.apply_update_(
                self.masters, grads, self.state, self.opt, params=self.params, stats=stats
            )
        else:
            mpfunc.grads_to_fp32_(grads, self.g32)
            mpfunc.apply_update_(self.masters, self.g32, self.state, self.opt, stats=stats)
            mpfunc.masters_to_model_(self.masters, self.params)
        if self.twin is not None:
            t0 = time.perf_counter()
            self.twin.step(grads, self.fp32_values(), self.params)
            self.extra_s += time.perf_counter() - t0
        if not diag:
            return
        values_after = self.fp32_values()
        stale = 0.0
        lost = unchanged = 0
        sq_u: list[float] = []
        sq_w: list[float] = []
        for k, p in self.params.items():
            same_p = p.detach() == params_before[k]
            same_v = values_after[k] == values_before[k]
            s = self.stats[k]
            n = p.numel()
            if self.g32 is None:
                stale += float(s.swallowed) * n  # mpfunc's own count: u != 0, param unchanged
            else:  # stepped without params=: an fp32 master moves exactly when u != 0
                stale += int((same_p & ~same_v).sum())
            lost += int(same_v.sum())
            unchanged += int(same_p.sum())
            w2, r = float(values_before[k].square().sum()), float(s.ratio)
            if math.isfinite(r):  # NaN for an all-zero weight: no ratio to weigh
                sq_w.append(w2)
                sq_u.append(r * r * w2)
        self.diag.add(
            step, stale / self.n, lost / self.n, unchanged / self.n, _rms_ratio(sq_u, sq_w)
        )


def _trainer(row: Row, cfg: dict[str, Any], start: dict[str, torch.Tensor], seed: int) -> Trainer:
    kinds: dict[str, type[Trainer]] = {
        "torch": TorchTrainer,
        "peer": OptimTrainer,
        "backward": OptimTrainer,
    }
    return kinds.get(row.kind, MpfuncTrainer)(row, cfg, start, seed)


class Start(NamedTuple):
    """What every row of one seed shares: the settings, data and pretrained weights."""

    cfg: dict[str, Any]
    corpus: data.Corpus
    batches: Batches
    weights: dict[str, torch.Tensor]
    seed: int


def train_row(row: Row, start: Start, log: Log) -> dict[str, Any]:
    """Fine-tunes one row from ``start``; returns its curves and measurements, or the
    error that stopped it (``"error"``), so one failing row does not stop the study."""
    result: dict[str, Any] = {"row": row.name, "seed": start.seed}
    try:
        result.update(_train(row, start, log))
    except Unsupported as e:
        log(f"[{row.name}] not run here: {e}")
        result["unsupported"] = str(e)
    except Exception as e:  # reported in the table; the study goes on
        msg = f"{type(e).__name__}: {e}"
        log(f"[{row.name}] seed {start.seed} FAILED: {msg}")
        result["error"] = msg
    gc.collect()
    return result


def measure_memory(row: Row, start: Start) -> dict[str, float]:
    """The row's bytes per param on a trainer of its own (the run's trainer is left alone:
    profiling would skew its step times, and a twin's work is not the row's): held between
    steps, and the peak of a profiled step with activations apart (``bench.common.memory``),
    on the first batches of the run, after one step that makes lazy state."""
    cfg, batches = start.cfg, start.batches
    trainer = _trainer(row, cfg, start.weights, start.seed)
    trainer.twin = None
    lr = cfg["lr"]

    def batch(i: int) -> tuple[torch.Tensor, ...]:
        return windows(start.corpus.train, batches.train[i % len(batches.train)], cfg["ctx"])

    trainer.step(*batch(0), lr, 0, False)
    steps = iter(range(1, 3))

    def one() -> None:
        i = next(steps)
        trainer.step(*batch(i), lr, i, False)

    return measure_step(one, trainer.held()).per_param(trainer.n)


def _train(row: Row, start: Start, log: Log) -> dict[str, Any]:
    cfg, corpus, batches, seed = start.cfg, start.corpus, start.batches, start.seed
    memory = measure_memory(row, start)
    trainer = _trainer(row, cfg, start.weights, seed)
    held_bytes = persistent_bytes(*trainer.held())
    steps, every = cfg["steps"], cfg["diag_every"]
    train_loss: list[float] = []
    val_curve = [(0, evaluate(trainer.model, batches.curve))]
    step_s: list[float] = []
    t_row = time.perf_counter()
    for i in range(steps):
        x, y = windows(corpus.train, batches.train[i], cfg["ctx"])
        diag = i % every == every - 1
        t0, extra0 = time.perf_counter(), trainer.extra_s
        train_loss.append(trainer.step(x, y, lr_at(i, steps, cfg["lr"]), i, diag))
        if not diag:  # diagnostic steps do extra work: left out of the step times
            step_s.append(time.perf_counter() - t0 - (trainer.extra_s - extra0))
        if (i + 1) % cfg["eval_every"] == 0 or i + 1 == steps:
            val_curve.append((i + 1, evaluate(trainer.model, batches.curve)))
    final_val = evaluate(trainer.model, batches.val)
    # Bytes again after training: states made lazily (torch.optim's) exist by now.
    held_bytes = max(held_bytes, persistent_bytes(*trainer.held()))
    tail = max(1, steps // 10)
    wall = time.perf_counter() - t_row
    step_ms = statistics.median(step_s) * 1e3 if step_s else float("nan")
    log(
        f"[{row.name:14}] seed {seed}: val {final_val:.4f}  "
        f"{held_bytes / trainer.n:.2f} B/param (peak {memory['peak']:.2f})  "
        f"{step_ms:.0f} ms/step  {wall:.0f} s"
    )
    return {
        "params": trainer.n,
        "train_loss": train_loss,
        "val_curve": val_curve,
        "final_val_loss": final_val,
        "final_train_loss": sum(train_loss[-tail:]) / tail,
        "bytes_per_param": held_bytes / trainer.n,
        "memory_per_param": memory,
        "step_ms_median": step_ms,
        "wall_s": wall,
        "diag": trainer.diag.summary(),
        "twin": trainer.twin.summary()
        if isinstance(trainer, MpfuncTrainer) and trainer.twin
        else None,
        "params_sha256": digest({k: p.detach() for k, p in trainer.params.items()}),
        "fp32_sha256": digest(trainer.fp32_values()),
    }

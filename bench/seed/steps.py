"""One training step per seed-benchmark mode (see ``bench.seed.config`` for the modes).

The flat-buffer and per-tensor recipes are baselines: they live here, never in mpfunc.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn

from bench.common import peers
from bench.common.model import Model, fp32_loss
from bench.common.model_config import ModelConfig
from bench.seed.config import (
    BACKWARD_MODES,
    BETAS,
    EPS,
    FUSED,
    LR,
    MODES,
    PEER,
    STRATEGY_MODES,
    WEIGHT_DECAY,
    recipe,
)

Step = Callable[[], torch.Tensor]


class Mode(NamedTuple):
    """A built mode: its step, the optimizer's name, and what it keeps between steps."""

    step: Step
    optimizer: str
    held: Callable[[], list[Any]]  # the trees kept from one step to the next (no grads)
    params: list[torch.Tensor]  # the model's params (their count is the per-param divisor)


class Unsupported(RuntimeError):
    """The mode cannot run with the libraries installed here (reported, not a failure)."""


class UpdateClock:
    """Host seconds of the last step's update: from the end of backward to the end of the
    optimizer's work (grad copies or casts, the optimizer step, params written back). On
    XLA this is the update's share of the trace. One mode runs per worker process."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._t0 = 0.0

    def start(self) -> None:
        self._t0 = time.perf_counter()

    def stop(self) -> None:
        self.seconds = time.perf_counter() - self._t0


UPDATE = UpdateClock()


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
) -> Mode:
    """Build the model for ``mode`` on ``device``.

    Args:
        mode: one of ``bench.seed.config.MODES``.
        cfg: the model's size.
        device: where it trains.
        torch_optim: the torch.optim.AdamW implementation of the recipes without
            ``-fused`` (``"default"``, ``"foreach"`` or ``"fused"``).
        seed: initial weights and batch.

    Returns:
        The ``Mode``: a function running one training step, the optimizer's name, and the
        trees it keeps between steps. The step returns the (fp32, 0-d, detached) loss and
        does not sync the host; on xla the caller ends the step with ``torch_xla.sync()``.

    Raises:
        ValueError: an unknown mode.
        Unsupported: the mode's library or option is not available here.
    """
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; expected one of {', '.join(MODES)}")
    if mode.endswith(FUSED):
        torch_optim = "fused"
    kind = recipe(mode)
    torch.manual_seed(seed)
    model = Model(cfg)  # same fp32 initial weights in every mode
    gen = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(cfg.vocab, (cfg.batch, cfg.seq), generator=gen).to(device)
    targets = torch.randint(cfg.vocab, (cfg.batch, cfg.seq), generator=gen).to(device)
    low = kind in ("bf16", "flat", "pertensor", "mpfunc", "peer")
    model.to(device=device, dtype=torch.bfloat16 if low else torch.float32)
    model.train()
    torch_name = describe_torch_adamw(device, torch_optim)

    params = list(model.parameters())
    if kind in ("fp32", "bf16", "peer"):
        if kind == "peer":
            name = mode.removeprefix(PEER)
            try:
                opt = peers.make(
                    name, params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY
                )
            except peers.UNAVAILABLE as e:
                raise Unsupported(f"{peers.PEERS[name].label}: {e}") from e
            torch_name = peers.PEERS[name].label
        else:
            opt = _torch_adamw(params, torch_optim)

        def step() -> torch.Tensor:
            loss = fp32_loss(model(tokens), targets)
            loss.backward()
            UPDATE.start()
            opt.step()
            UPDATE.stop()
            opt.zero_grad(set_to_none=True)
            return loss.detach()

        return Mode(step, torch_name, lambda: [params, list(opt.state.values())], params)

    if kind == "autocast":
        opt = _torch_adamw(list(model.parameters()), torch_optim)

        def autocast_step() -> torch.Tensor:
            with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
                logits = model(tokens)
            loss = fp32_loss(logits, targets)
            loss.backward()
            UPDATE.start()
            opt.step()
            UPDATE.stop()
            opt.zero_grad(set_to_none=True)
            return loss.detach()

        return Mode(autocast_step, torch_name, lambda: [params, list(opt.state.values())], params)

    if kind == "syncfree":
        return _syncfree_step(model, tokens, targets, device)
    if kind == "flat":
        step, held = _flat_step(model, params, tokens, targets, device, torch_optim)
        return Mode(step, torch_name, held, params)
    if kind == "pertensor":
        step, held = _pertensor_step(model, params, tokens, targets, torch_optim)
        return Mode(step, torch_name, held, params)
    if mode in BACKWARD_MODES:
        return _backward_step(model, tokens, targets, mode)
    return _mpfunc_step(model, tokens, targets, mode)


def _syncfree_step(
    model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor, device: torch.device
) -> Mode:
    # torch_xla's AMP optimizer: one fused `_xla_adam_optimizer_step_` per tensor. It takes
    # that path only when given `found_inf` (without it, it is torch.optim.AdamW), as under
    # torch_xla's GradScaler; an fp32 model has nothing to unscale, so found_inf stays 0.
    from torch_xla.amp import syncfree

    opt = syncfree.AdamW(
        list(model.parameters()), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY
    )
    found_inf = torch.zeros((), dtype=torch.float32, device=device)

    def step() -> torch.Tensor:
        loss = fp32_loss(model(tokens), targets)
        loss.backward()
        UPDATE.start()
        opt.step(found_inf=found_inf)
        UPDATE.stop()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    params = list(model.parameters())
    held = lambda: [params, list(opt.state.values())]  # noqa: E731
    return Mode(step, "torch_xla.amp.syncfree.AdamW (found_inf given)", held, params)


def _flat_step(
    model: nn.Module,
    low_params: list[nn.Parameter],
    tokens: torch.Tensor,
    targets: torch.Tensor,
    device: torch.device,
    torch_optim: str,
) -> tuple[Step, Callable[[], list[Any]]]:
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
        loss = fp32_loss(model(tokens), targets)
        loss.backward()
        UPDATE.start()
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
        UPDATE.stop()
        model.zero_grad(set_to_none=True)
        return loss.detach()

    # The flat fp32 grad buffer is kept between steps, as in the report.
    return step, lambda: [low_params, flat_param, flat_param.grad, list(opt.state.values())]


def _pertensor_step(
    model: nn.Module,
    low_params: list[nn.Parameter],
    tokens: torch.Tensor,
    targets: torch.Tensor,
    torch_optim: str,
) -> tuple[Step, Callable[[], list[Any]]]:
    # The report's fix: one fp32 torch.optim parameter per model tensor, same shapes,
    # and a Python loop copying through them. Unlike the report we skip zeroing the
    # fp32 grads first, since the copy overwrites every element; the baseline is then
    # as fast as a careful user would write it.
    masters = [nn.Parameter(p.detach().float()) for p in low_params]
    for m in masters:
        m.grad = torch.zeros_like(m)
    opt = _torch_adamw(list(masters), torch_optim)

    def step() -> torch.Tensor:
        loss = fp32_loss(model(tokens), targets)
        loss.backward()
        UPDATE.start()
        with torch.no_grad():
            for p, m in zip(low_params, masters):
                assert p.grad is not None and m.grad is not None
                m.grad.copy_(p.grad)
        opt.step()
        with torch.no_grad():
            for p, m in zip(low_params, masters):
                p.copy_(m)
        UPDATE.stop()
        model.zero_grad(set_to_none=True)
        return loss.detach()

    # The fp32 grads are buffers kept between steps (the copy overwrites them).
    return step, lambda: [low_params, masters, [m.grad for m in masters], list(opt.state.values())]


def _mpfunc_step(
    model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor, mode: str = "mpfunc"
) -> Mode:
    # The library's single pass on its default (fastest) path: bf16 grads in, the masters,
    # moments and bf16 params written in one call (one XLA computation on XLA). With a
    # strategy mode, the masters and moments are kept as that strategy and dtype say.
    import mpfunc

    strategy, state_name = STRATEGY_MODES.get(mode, ("fp32", None))
    state_dtype = None if state_name is None else getattr(torch, state_name)
    params = dict(model.named_parameters())
    masters = mpfunc.init_master(params, strategy=strategy)
    mopt = mpfunc.adamw(
        lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, state_dtype=state_dtype
    )
    state = mopt.init(masters)

    def step() -> torch.Tensor:
        loss = fp32_loss(model(tokens), targets)
        loss.backward()
        UPDATE.start()
        grads = {name: p.grad for name, p in params.items()}
        mpfunc.apply_update_(masters, grads, state, mopt, params=params)
        UPDATE.stop()
        model.zero_grad(set_to_none=True)
        return loss.detach()

    name = "mpfunc.adamw (impl auto, params=)"
    if mode in STRATEGY_MODES:
        name = f"mpfunc.adamw (strategy={strategy!r}, state_dtype={state_name}, params=)"
    return Mode(step, name, lambda: [params, masters, state], list(params.values()))


def _backward_step(
    model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor, mode: str
) -> Mode:
    # MasterOptimizer stepping each leaf from its post-accumulate-grad hook and freeing its
    # grad, where mpfunc has the option. step() after backward then finds no grad left
    # (torch.optim's protocol skips a param without one); it is timed as the update.
    import mpfunc

    strategy, state_name = BACKWARD_MODES[mode]
    state_dtype = None if state_name is None else getattr(torch, state_name)
    params = list(model.parameters())
    try:
        opt = mpfunc.MasterOptimizer(
            params,
            strategy=strategy,
            step_in_backward=True,
            lr=LR,
            betas=BETAS,
            eps=EPS,
            weight_decay=WEIGHT_DECAY,
            state_dtype=state_dtype,
        )
    except TypeError as e:
        if "step_in_backward" not in str(e):
            raise
        raise Unsupported(f"this mpfunc has no MasterOptimizer(step_in_backward=): {e}") from e

    def step() -> torch.Tensor:
        loss = fp32_loss(model(tokens), targets)
        UPDATE.start()  # the update runs inside backward: the clock holds backward too
        loss.backward()
        opt.step()
        UPDATE.stop()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    name = (
        f"mpfunc.MasterOptimizer (strategy={strategy!r}, state_dtype={state_name}, "
        "step_in_backward=True)"
    )
    return Mode(step, name, lambda: [params, list(opt.state.values())], params)

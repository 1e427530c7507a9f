"""A deterministic little training run for the exact-resume tests, and the worker that
resumes it in a fresh process: ``python tests/resume_common.py DEVICE DIR K N``."""

from __future__ import annotations

import sys
from typing import Any

import torch

import mpfunc

CONFIGS = [(o, s) for o in ("sgd", "adam", "adamw") for s in (False, True)]


def config_name(opt: str, scaling: bool) -> str:
    return f"{opt}-{'scaled' if scaling else 'plain'}"


def device_of(name: str) -> torch.device:
    if name == "xla":
        import torch_xla

        return torch.device(torch_xla.device())
    return torch.device(name)


def sync(device: torch.device) -> None:
    if device.type == "xla":
        import torch_xla

        torch_xla.sync()


class Run:
    """Model, masters, optimizer state and loss scale of one configuration."""

    def __init__(self, device: torch.device, opt: str, scaling: bool) -> None:
        torch.manual_seed(0)
        low = torch.float16 if scaling else torch.bfloat16
        self.device = device
        self.model = (
            torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
            .to(low)
            .to(device)
        )
        self.params = dict(self.model.named_parameters())
        self.opt = {
            "sgd": mpfunc.sgd(lr=0.05, momentum=0.9, dampening=0.1),
            "adam": mpfunc.adam(lr=1e-2, weight_decay=1e-3, amsgrad=True),
            "adamw": mpfunc.adamw(lr=1e-2),
        }[opt]
        self.masters = mpfunc.init_master(self.params)
        self.state = self.opt.init(self.masters)
        self.gbuf = mpfunc.init_grads(self.params)
        # Large enough that the first steps overflow in fp16 and are skipped.
        self.scaler = (
            mpfunc.DynamicLossScale(2.0**24, growth_interval=2, device=device) if scaling else None
        )

    def tree(self) -> dict[str, Any]:
        return {
            "masters": self.masters,
            "opt": self.state,
            "scale": self.scaler,
            "params": self.params,
        }

    def set_tree(self, tree: dict[str, Any]) -> None:
        self.masters, self.state, self.scaler = tree["masters"], tree["opt"], tree["scale"]
        mpfunc.masters_to_model_(self.masters, self.params)

    def train(self, start: int, stop: int) -> None:
        low = next(iter(self.params.values())).dtype
        for step in range(start, stop):
            gen = torch.Generator().manual_seed(1000 + step)
            x = torch.randn(16, 8, generator=gen).to(low).to(self.device)
            y = torch.randn(16, 4, generator=gen).to(self.device)
            loss = torch.nn.functional.mse_loss(self.model(x).float(), y)
            (self.scaler.scale(loss) if self.scaler else loss).backward()
            grads = {n: p.grad for n, p in self.params.items()}
            g32 = mpfunc.grads_to_fp32_(grads, self.gbuf, scale=self.scaler)
            finite = mpfunc.all_finite(g32)
            mpfunc.apply_update_(self.masters, g32, self.state, self.opt, skip=~finite)
            mpfunc.masters_to_model_(self.masters, self.params)
            if self.scaler is not None:
                self.scaler = self.scaler.adjust(finite)
            self.model.zero_grad(set_to_none=True)
            sync(self.device)


def resume(device_name: str, folder: str, k: int, n: int) -> None:
    """Loads each configuration's step-k checkpoint into a fresh run, trains to step n,
    and saves the result."""
    device = device_of(device_name)
    for opt, scaling in CONFIGS:
        name = config_name(opt, scaling)
        run = Run(device, opt, scaling)
        run.set_tree(mpfunc.load(f"{folder}/{name}-step{k}.pt", like=run.tree()))
        run.train(k, n)
        mpfunc.save(f"{folder}/{name}-resumed{n}.pt", run.tree())


if __name__ == "__main__":
    resume(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))

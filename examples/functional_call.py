"""A pure training loop: torch.func.functional_call and torch.func.grad, no module state.

The bf16 parameters, the fp32 masters and the optimizer state are plain trees
passed in and returned; the module is only a function. Every mpfunc call here is
the pure form, so each step returns new trees and mutates nothing.

    python examples/functional_call.py
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.func import functional_call, grad

import mpfunc


def main(argv: list[str] | None = None) -> float:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args(argv)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1))
    policy = mpfunc.Policy.parse("params=bfloat16,compute=bfloat16,output=float32")
    params = policy.cast_to_param({k: v.detach() for k, v in model.named_parameters()})
    masters = mpfunc.init_master(params)
    opt = mpfunc.adam(lr=1e-2)
    state = opt.init(masters)
    w_true = torch.randn(16, 1)

    def loss_fn(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = policy.cast_to_output(functional_call(model, p, (policy.cast_to_compute(x),)))
        return nn.functional.mse_loss(out, y)  # in fp32

    grad_fn = grad(loss_fn)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    loss = torch.zeros(())
    for step in range(args.steps):
        x = torch.randn(32, 16)
        y = torch.sin(x @ w_true)
        grads = grad_fn(params, x, y)  # bf16 grads, a new tree
        g32 = mpfunc.grads_to_fp32(grads)
        masters, state = mpfunc.apply_update(masters, g32, state, opt)
        params = mpfunc.masters_to_model(masters, params)
        if step % 50 == 0 or step == args.steps - 1:
            loss = loss_fn(params, x, y)
            print(f"step {step:4d} loss {float(loss):.4f}", flush=True)
    # The module itself was never touched.
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    return float(loss)


if __name__ == "__main__":
    main()

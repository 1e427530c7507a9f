"""A complete custom training loop with mpfunc, on eager CPU/CUDA or XLA.

bf16 (or fp16) model, fp32 loss, fp32 master weights, global-norm clipping,
in-place updates, and for fp16 a dynamic loss scale that skips overflow steps on
the device. Nothing in the step reads a tensor back to the host, so on XLA each
step is one graph.

    python examples/train_loop.py --device cpu --dtype bf16
    PJRT_DEVICE=CPU python examples/train_loop.py --device xla --dtype fp16
    python examples/train_loop.py --steps 100 --ckpt run.pt   # saves at the end
    python examples/train_loop.py --steps 100 --ckpt run.pt   # resumes from step 100
"""

from __future__ import annotations

import argparse
import os

import torch
from torch import nn

import mpfunc


def get_device(name: str) -> torch.device:
    if name == "xla":
        import torch_xla

        return torch.device(torch_xla.device())
    return torch.device(name)


def end_step(device: torch.device) -> None:
    if device.type == "xla":
        import torch_xla

        torch_xla.sync()


class MLP(nn.Module):
    def __init__(self, d_in: int, d_hidden: int, n_classes: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(d_in, d_hidden), nn.LayerNorm(d_hidden), nn.GELU(),
            nn.Linear(d_hidden, n_classes),
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def main(argv: list[str] | None = None) -> float:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", help="cpu, cuda or xla")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--ckpt", help="resume from this file if it exists; save to it at the end")
    args = ap.parse_args(argv)

    device = get_device(args.device)
    low = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    torch.manual_seed(0)
    d_in, n_classes = 32, 10
    teacher = torch.randn(d_in, n_classes)  # the task: classify by a hidden linear map

    model = MLP(d_in, args.hidden, n_classes).to(low).to(device)
    params = dict(model.named_parameters())
    masters = mpfunc.init_master(params)  # fp32, one per tensor
    g32_buf = mpfunc.init_grads(params)  # preallocated fp32 grads
    lr = torch.tensor(3e-3, device=device)  # a tensor: change it in place, no recompile
    opt = mpfunc.partition(
        {"decay": mpfunc.adamw(lr=lr, weight_decay=0.05),
         "no_decay": mpfunc.adamw(lr=lr, weight_decay=0.0)},
        lambda path, p: "no_decay" if p.ndim < 2 else "decay",  # biases, norms
    )  # fmt: skip
    state = opt.init(masters)
    # fp16 needs loss scaling; bf16 has fp32's range and does not.
    scaler = mpfunc.DynamicLossScale(device=device) if low == torch.float16 else None

    # Everything that must survive a restart, as one tree. The model's bf16 params are
    # not in it: they are the masters rounded, restored by masters_to_model_.
    def checkpoint() -> dict:
        return {"masters": masters, "opt": state, "scale": scaler, "lr": lr, "step": step_t}

    step_t = torch.zeros((), dtype=torch.int64)  # steps done, kept on the host
    if args.ckpt and os.path.exists(args.ckpt):
        restored = mpfunc.load(args.ckpt, like=checkpoint())  # checks every key first
        masters, state, scaler = restored["masters"], restored["opt"], restored["scale"]
        lr.copy_(restored["lr"])
        step_t = restored["step"]
        mpfunc.masters_to_model_(masters, params)
        print(f"resumed from {args.ckpt} at step {int(step_t)}", flush=True)
    first = int(step_t)
    torch.manual_seed(first)  # the data stream continues from here

    loss_value = torch.zeros((), device=device)
    for step in range(first, first + args.steps):
        x = torch.randn(args.batch, d_in)
        y = (x @ teacher).argmax(-1)
        x, y = x.to(low).to(device), y.to(device)

        logits = model(x).float()  # the loss in fp32
        loss = nn.functional.cross_entropy(logits, y)
        (scaler.scale(loss) if scaler else loss).backward()

        grads = {n: p.grad for n, p in params.items()}
        g32 = mpfunc.grads_to_fp32_(grads, g32_buf, scale=scaler)  # exact upcast (and unscale)
        finite = mpfunc.all_finite(g32)  # a 0-d device tensor, never read here
        g32, _norm = mpfunc.clip_by_global_norm_(g32, max_norm=1.0)
        mpfunc.apply_update_(masters, g32, state, opt, skip=~finite)
        mpfunc.masters_to_model_(masters, params)  # round into the low-precision model
        if scaler:
            scaler = scaler.adjust(finite)
        model.zero_grad(set_to_none=True)
        lr.mul_(0.999)  # a schedule, on the device
        loss_value = loss.detach()
        end_step(device)
        if step % 50 == 0 or step == first + args.steps - 1:
            scale = f" scale {float(scaler.loss_scale):g}" if scaler else ""
            print(f"step {step:4d} loss {float(loss_value):.4f}{scale}", flush=True)
    step_t = torch.tensor(first + args.steps)
    if args.ckpt:
        mpfunc.save(args.ckpt, checkpoint())  # atomic: a crash here keeps the old file
        print(f"saved {args.ckpt} at step {int(step_t)}", flush=True)
    return float(loss_value)


if __name__ == "__main__":
    main()

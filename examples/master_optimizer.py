"""MasterOptimizer: fp32 masters behind a plain torch.optim loop, with a scheduler.

A bf16 (or fp16) model trains through the torch.optim protocol, so anything that drives
a torch optimizer drives this one: param groups (no weight decay on biases and norms),
a frozen embedding that gets no master and no state, OneCycleLR (which also cycles
AdamW's beta1), GradScaler for fp16, and a checkpoint in torch's own format.

    python examples/master_optimizer.py --dtype bf16
    python examples/master_optimizer.py --dtype fp16           # with torch.amp.GradScaler
    PJRT_DEVICE=CPU python examples/master_optimizer.py --device xla
    python examples/master_optimizer.py --ckpt run.pt          # saves; a second run resumes
"""

from __future__ import annotations

import argparse
import os

import torch
from torch import nn

import mpfunc


def main(argv: list[str] | None = None) -> float:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda", "xla"])
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--ckpt", default=None)
    args = ap.parse_args(argv)

    if args.device == "xla":
        import torch_xla

        device = torch.device(torch_xla.device())
    else:
        device = torch.device(args.device)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16

    torch.manual_seed(0)
    vocab = 32
    model = nn.Sequential(
        nn.Embedding(vocab, args.hidden), nn.Linear(args.hidden, args.hidden), nn.GELU(),
        nn.LayerNorm(args.hidden), nn.Linear(args.hidden, vocab),
    ).to(device=device, dtype=dtype)  # fmt: skip
    model[0].weight.requires_grad_(False)  # frozen (as LoRA's base weights): no master, no state

    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = mpfunc.MasterOptimizer(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        mpfunc.adamw, lr=3e-3,
    )  # fmt: skip
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=args.steps)
    # fp16 needs a loss scale; GradScaler hands it to the step, which unscales in fp32 and
    # skips on inf/NaN on the device. (bf16 needs none.)
    use_scaler = dtype == torch.float16 and device.type != "xla"
    scaler = torch.amp.GradScaler(device.type, enabled=use_scaler)

    start = 0
    if args.ckpt and os.path.exists(args.ckpt):
        ckpt = torch.load(args.ckpt, map_location=device, weights_only=True)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])  # fp32 masters and moments, bit for bit
        sched.load_state_dict(ckpt["sched"])
        scaler.load_state_dict(ckpt["scaler"])
        start = ckpt["step"]
        print(f"resumed from {args.ckpt} at step {start}")

    gen = torch.Generator().manual_seed(1)
    loss = torch.zeros(())
    for step in range(start, start + args.steps // 2 if args.ckpt else args.steps):
        x = torch.randint(0, vocab, (32,), generator=gen).to(device)
        y = (x * 7 + 3) % vocab  # a fixed permutation to learn
        logits = model(x).float()  # low-precision forward, loss in fp32
        loss = nn.functional.cross_entropy(logits, y)
        scaler.scale(loss).backward()
        if not use_scaler:
            nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        scaler.step(opt)  # = opt.step() without a scaler
        scaler.update()
        sched.step()
        opt.zero_grad()
        if device.type == "xla":
            import torch_xla

            torch_xla.sync()
        if step % 50 == 0 or step == start:
            lr, beta1 = opt.param_groups[0]["lr"], opt.param_groups[0]["betas"][0]
            print(f"step {step:4d}  loss {loss.item():.4f}  lr {lr:.2e}  beta1 {beta1:.3f}")

    trained = sum(1 for p in model.parameters() if p in opt.state)
    print(f"{trained} params with fp32 masters and state; the frozen embedding has none")
    if args.ckpt:
        state = {"model": model.state_dict(), "opt": opt.state_dict(),
                 "sched": sched.state_dict(), "scaler": scaler.state_dict(),
                 "step": start + args.steps // 2}  # fmt: skip
        torch.save(state, args.ckpt)
        print(f"saved {args.ckpt}")
    return float(loss.item())


if __name__ == "__main__":
    main()

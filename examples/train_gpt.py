"""Train a small GPT with autoshard.

    torchrun --nproc-per-node 2 -m autoshard.examples.train_gpt [--steps 20] [--layers 4]

(in a checkout, ``torchrun --nproc-per-node 2 examples/train_gpt.py`` is the same script).

Runs on CPU (gloo) or GPU (NCCL, one device per rank): autoshard sets up the process group
from torchrun's environment. The loop is a plain PyTorch loop.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

from autoshard import autoshard
from autoshard.core.models import GPT, gpt_loss


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8, help="per rank")
    args = ap.parse_args()

    torch.manual_seed(0)  # every rank builds the same model; autoshard keeps its own rows
    model = GPT(vocab=512, dim=args.dim, heads=4, layers=args.layers, seq=64)
    model = autoshard(model)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = next(model.parameters()).device
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    gen = torch.Generator().manual_seed(1234 + rank)  # each rank its own data
    for step in range(args.steps):
        x = torch.randint(0, 512, (args.batch, 65), generator=gen).to(device)
        t0 = time.perf_counter()
        loss = gpt_loss(model(x[:, :-1]), x[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        if device.type == "cuda":
            torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) * 1e3
        if rank == 0 and (step % 5 == 0 or step == args.steps - 1):
            print(f"step {step:3d}  loss {loss.item():.4f}  {ms:7.1f} ms")
    if rank == 0:
        print(f"\n{world} ranks, {device.type}; units:\n{model.plan.units_table()}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""What the ranks' agreement costs per step: before each forward and each backward every rank
all-gathers a 32-byte digest of what it is about to run (``autoshard.runtime.dist.Agreement``).

    python -m bench.agreement [--world-size 2] [--calls 400]

Times the agreement alone (median over calls) and, for scale, the median step of the small
GPT with the module policy; prints both and their ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank(rank: int, world: int, calls: int, store: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    from autoshard import Config, autoshard
    from autoshard.core.models import GPT, gpt_loss
    from autoshard.runtime.dist import Agreement

    agree = Agreement(autoshard(torch.nn.Linear(2, 2))._autoshard.mesh, 300)
    times = []
    for i in range(calls):
        t0 = time.perf_counter()
        agree(f"step {i}: forward", "args[0] int64[4, 64] (train, grad)", exact="key")
        times.append(time.perf_counter() - t0)
    torch.manual_seed(0)
    model = autoshard(GPT(vocab=256, dim=64, heads=4, layers=4, seq=64),
                      config=Config(policy="module"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(rank))
    steps = []
    for i in range(25):
        t0 = time.perf_counter()
        gpt_loss(model(x), x).backward()
        opt.step()
        opt.zero_grad()
        steps.append(time.perf_counter() - t0)
    if rank == 0:
        torch.save({"agree": statistics.median(times), "step": statistics.median(steps[5:])},
                   out)
    dist.barrier()
    os._exit(0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--calls", type=int, default=400)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.pt")
        mp.spawn(_rank, args=(args.world_size, args.calls, os.path.join(tmp, "store"), out),
                 nprocs=args.world_size, join=True)
        r = torch.load(out)
    per_step = 2 * r["agree"]
    print(f"gloo, world size {args.world_size}: one agreement {r['agree'] * 1e6:.0f} us "
          f"(median of {args.calls}); two per training step = {per_step * 1e6:.0f} us; "
          f"GPT (4 layers, dim 64, seq 64) step {r['step'] * 1e3:.2f} ms: "
          f"{100 * per_step / r['step']:.2f}% of it")


if __name__ == "__main__":
    main()

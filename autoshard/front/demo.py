"""``python -m autoshard demo``: train a small GPT on 2 gloo ranks beside an unsharded
reference, then show the units, the schedule and what each rank stores."""

from __future__ import annotations

import copy
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tabulate import tabulate

from autoshard import Config, autoshard
from autoshard.core import _compat
from autoshard.core.models import GPT, gpt_loss


def _rank_main(rank: int, world: int, steps: int, store: str, layers: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)

    torch.manual_seed(0)
    model = GPT(vocab=256, dim=64, heads=4, layers=layers, seq=32)
    reference = copy.deepcopy(model)
    full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    # one unit per transformer block, as FSDP's transformer policy would wrap it; the default
    # policy, "auto", would pick units from the cost model (one unit, for a model this small)
    sharded = autoshard(model, config=Config(policy="module"))
    opt = torch.optim.AdamW(sharded.parameters(), lr=3e-3)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    # a learnable toy task: continue a sequence that repeats with period 8
    base = torch.randint(0, 256, (8 * world, 8), generator=gen)

    if rank == 0:
        print(f"training a {layers}-layer GPT ({full_bytes / 2**20:.2f} MiB of parameters) on "
              f"{world} gloo ranks; the reference is the unsharded model in one process\n")
        print(f"{'step':>4}  {'sharded loss':>12}  {'reference':>12}  {'|diff|':>9}  {'ms':>6}")
    for step in range(steps):
        rows = base[torch.randperm(base.shape[0], generator=gen)]
        seq = rows.repeat(1, 5)[:, :33]
        x, y = seq[:, :-1], seq[:, 1:]
        t0 = time.perf_counter()
        xr, yr = x.chunk(world)[rank], y.chunk(world)[rank]
        loss = gpt_loss(sharded(xr), yr)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ms = (time.perf_counter() - t0) * 1e3
        t = torch.tensor([loss.item()])
        dist.all_reduce(t)
        if rank == 0:
            ref = 0.0
            for xc, yc in zip(x.chunk(world), y.chunk(world)):
                lc = gpt_loss(reference(xc), yc)
                (lc / world).backward()
                ref += lc.item() / world
            ref_opt.step()
            ref_opt.zero_grad()
            mine = t.item() / world
            note = "  (includes capture + compile)" if step == 0 else ""
            print(f"{step:4d}  {mine:12.6f}  {ref:12.6f}  {abs(mine - ref):9.2e}  {ms:6.1f}{note}")

    local = sum(p.to_local().numel() * p.element_size() for p in sharded.parameters())
    per_rank = torch.zeros(world, dtype=torch.long)
    _compat.all_gather_tensor(per_rank, torch.tensor([local]))
    per_rank = per_rank.tolist()
    if rank == 0:
        plan = sharded.plan
        print("\nunits (policy 'module')\n" + plan.units_table())
        print("\nschedule (forward, then backward)\n" + plan.schedule_table())
        full = f"{full_bytes / 2**10:.1f} KiB"
        rows = [(r, f"{b / 2**10:.1f} KiB", full, f"{b / full_bytes:.3f}")
                for r, b in enumerate(per_rank)]
        print("\nparameter bytes per rank\n"
              + tabulate(rows, headers=["rank", "stored", "unsharded model", "ratio"]))
    dist.barrier()
    dist.destroy_process_group()


def main(steps: int = 8, world: int = 2, layers: int = 2) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank_main, args=(world, steps, os.path.join(tmp, "store"), layers),
                 nprocs=world, join=True)

"""Run a function on N gloo ranks (spawned processes) and collect what each rank returns."""

from __future__ import annotations

import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank, world, fn, payload, tmp):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=world)
    out = fn(rank, world, payload)
    torch.save(out, os.path.join(tmp, f"result{rank}.pt"))
    dist.barrier()
    # The result is on disk; leave without running the process group's and the profiler's
    # C++ teardown, which can abort ("terminate called without an active exception") when
    # their threads are destroyed in an unlucky order at exit.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(world: int, fn, payload=None) -> list:
    """``fn(rank, world, payload)`` on ``world`` processes; returns each rank's result."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_entry, args=(world, fn, payload, tmp), nprocs=world, join=True)
        return [torch.load(os.path.join(tmp, f"result{r}.pt"), weights_only=False)
                for r in range(world)]

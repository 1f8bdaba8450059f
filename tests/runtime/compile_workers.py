"""What each rank runs in the compiled-graph tests (``Config(compile=True)``)."""

from __future__ import annotations

import torch

from autoshard import Config, autoshard
from autoshard.runtime.compiled import planned_order
from models import build
from parity_workers import _train


def compile_worker(rank, world, names):
    """Each model with one unit per block, its graphs compiled by inductor; what it trained
    to, and the order of collectives in the generated code against the graph's."""
    out = {}
    for name in names:
        model = autoshard(build(name), config=Config(policy="module", compile=True))
        losses, _ = _train(model, name, rank, world)
        prog = model._autoshard.last
        full = model.full_state_dict()  # a collective: every rank calls it
        out[name] = {
            "losses": losses,
            "params": full if rank == 0 else None,
            "orders": [(g.order, planned_order(g.gm)) for g in (prog.fwd, prog.bwd)],
            "schedule": len(model.plan.schedule),
        }
    return out


def cuda_worker(rank, world, name):
    """One NCCL rank on a GPU: compiled and uncompiled steps from the same init and data."""
    from parity_workers import batches
    from models import CASES, call

    torch.cuda.set_device(0)
    losses = {}
    for compiled in (False, True):
        torch.manual_seed(0)
        model = autoshard(build(name).cuda(), config=Config(policy="module", compile=compiled))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses[compiled] = []
        for step in range(3):
            x, y = (t.cuda() for t in batches(name, step))
            loss = CASES[name][3](call(name, model, x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses[compiled].append(loss.item())
    return losses

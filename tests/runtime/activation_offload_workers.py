"""What each rank runs in the activation offload parity test."""

from __future__ import annotations

import torch

from autoshard import Config, autoshard
from autoshard.models import GPT, gpt_loss


def train(offload: bool, rank: int = 0, world: int = 1, steps: int = 3):
    """A tiny GPT under ``Config(offload_activations=offload)``, ``steps`` AdamW steps on
    this rank's share of the batch: (the sharded model, its losses, its parameters' local
    values after each step's update, whether any step changed them)."""
    torch.manual_seed(0)
    sharded = autoshard(GPT(seq=16, layers=2), config=Config(
        policy="module", verify=True, offload_activations=offload))
    start = [p.detach().to_local().clone() if hasattr(p, "to_local") else p.detach().clone()
             for p in sharded.parameters()]
    opt = torch.optim.AdamW(sharded.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x = torch.randint(0, 96, (4 * world, 16), generator=g).chunk(world)[rank]
        loss = gpt_loss(sharded(x), x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    params = [p.detach().to_local().clone() if hasattr(p, "to_local") else p.detach().clone()
              for p in sharded.parameters()]
    trained = not all(torch.equal(a, b) for a, b in zip(start, params))
    return sharded, losses, params, trained


def parity_worker(rank, world, _):
    """Whether this rank's losses and parameter shards are bit for bit the same with the
    saved activations offloaded as without, and how many copies each plan made."""
    from autoshard import meta

    moved, losses, params, trained = train(True, rank, world)
    kept, ref_losses, ref_params, _ = train(False, rank, world)

    def copies(sharded):
        return sum(meta.tag(n, meta.COMM) == meta.ACT_D2H
                   for n in sharded._autoshard.last.fwd.graph.nodes)

    return {"equal": all(torch.equal(a, b) for a, b in zip(losses, ref_losses))
            and all(torch.equal(a, b) for a, b in zip(params, ref_params)),
            "trained": trained, "copies": (copies(moved), copies(kept)),
            "recompute": (moved.plan.recompute, kept.plan.recompute)}

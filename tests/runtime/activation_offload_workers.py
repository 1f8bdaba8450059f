"""What each rank runs in the activation offload parity test."""

from __future__ import annotations

import torch

from autoshard import Config, autoshard
from autoshard.core.models import GPT, gpt_loss
import harness
from harness import Recipe


def _tokens(world, step):
    """Step ``step``'s global batch: the ``step + 1``-th draw of a generator seeded 1."""
    g = torch.Generator().manual_seed(1)
    for _ in range(step + 1):
        x = torch.randint(0, 96, (4 * world, 16), generator=g)
    return (x,)


def _gpt():
    torch.manual_seed(0)
    return GPT(seq=16, layers=2)


def _local(model) -> list:
    return [p.detach().to_local().clone() if hasattr(p, "to_local") else p.detach().clone()
            for p in model.parameters()]


def train(offload: bool, rank: int = 0, world: int = 1, steps: int = 3):
    """A tiny GPT under ``Config(offload_activations=offload)``, ``steps`` AdamW steps on
    this rank's share of the batch (``harness.train``): (the sharded model, its losses, its
    parameters' local values after each step's update, whether any step changed them)."""
    sharded = autoshard(_gpt(), config=Config(
        policy="module", verify=True, offload_activations=offload))
    start = _local(sharded)
    recipe = Recipe(build=_gpt, data=lambda step: _tokens(world, step),
                    loss=lambda model, x: gpt_loss(model(x), x), steps=steps,
                    optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    losses = harness.train(sharded, recipe, rank, world, local=True)
    params = _local(sharded)
    trained = not all(torch.equal(a, b) for a, b in zip(start, params))
    return sharded, losses, params, trained


def parity_worker(rank, world, _):
    """Whether this rank's losses and parameter shards are bit for bit the same with the
    saved activations offloaded as without, and how many copies each plan made."""
    from autoshard.core import meta

    moved, losses, params, trained = train(True, rank, world)
    kept, ref_losses, ref_params, _ = train(False, rank, world)

    def copies(sharded):
        return sum(meta.tag(n, meta.COMM) == meta.ACT_D2H
                   for n in sharded._autoshard.last.fwd.graph.nodes)

    return {"equal": losses == ref_losses
            and all(torch.equal(a, b) for a, b in zip(params, ref_params)),
            "trained": trained, "copies": (copies(moved), copies(kept)),
            "recompute": (moved.plan.recompute, kept.plan.recompute)}

"""What each rank runs in tests/runtime/test_rank_local.py: a model whose forward reads a
plain attribute that one rank alone changes between steps (as the Trainer's save on rank 0
writes ``config.architectures``), trained sharded beside its eager twin."""

from __future__ import annotations

import torch
import torch.nn as nn

from harness import Recipe, eager_and_sharded, train

STEPS = 4


class Tagged(nn.Module):
    """Two linear layers; ``forward`` reads ``self.tags`` (a list it does not compute with)
    and ``self.power`` (an int it does)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)
        self.tags, self.power = ["first"], 1

    def forward(self, x):
        h = torch.relu(self.a(x)) ** self.power
        return self.b(h) if self.tags else -self.b(h)


def _batch(step, world):
    """Step ``step``'s global batch: each rank's rows the ``step + 1``-th draw of a generator
    seeded with the rank."""
    rows = []
    for r in range(world):
        g = torch.Generator().manual_seed(r)
        for _ in range(step + 1):
            x = torch.randn(4, 8, generator=g)
        rows.append(x)
    return (torch.cat(rows),)


def rank_local_worker(rank, world, change: str):
    """``change``: "tags" (rank 0 appends to the list after step 2: nothing computed
    changes) or "power" (rank 0 sets 2: its forward computes another function). The eager
    twin trains on the rank's data too, its gradients averaged over the ranks (as DDP does):
    with a rank-local change, one process cannot run every rank's step."""
    ref, sharded = eager_and_sharded(Tagged)
    recipe = Recipe(build=Tagged, data=lambda step: _batch(step, world),
                    loss=lambda model, x: model(x).square().mean(), steps=STEPS,
                    optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))

    def on_rank0(step, model):
        if step == 2 and rank == 0:
            if change == "tags":
                model.tags.append("saved")
            else:
                model.power = 2

    def averaged(step, i, model):
        for p in model.parameters():
            torch.distributed.all_reduce(p.grad)
            p.grad /= world

    losses = train(sharded, recipe, rank, world, before_step=on_rank0)
    train(ref, recipe, rank, world, local=True, before_step=on_rank0, after_backward=averaged)
    full = sharded.full_state_dict()
    return {"losses": losses, "diff": max((full[k] - v).abs().max().item()
                                          for k, v in ref.state_dict().items())}

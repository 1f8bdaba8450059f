"""What each rank runs in tests/runtime/test_rank_local.py: a model whose forward reads a
plain attribute that one rank alone changes between steps (as the Trainer's save on rank 0
writes ``config.architectures``), trained sharded beside its eager twin."""

from __future__ import annotations

import torch
import torch.nn as nn

from harness import eager_and_sharded, train_step

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


def rank_local_worker(rank, world, change: str):
    """``change``: "tags" (rank 0 appends to the list after step 2: nothing computed
    changes) or "power" (rank 0 sets 2: its forward computes another function)."""
    ref, sharded = eager_and_sharded(Tagged)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, sharded)]
    g = torch.Generator().manual_seed(rank)
    losses = []
    for step in range(STEPS):
        if step == 2 and rank == 0:
            for m in (ref, sharded):
                if change == "tags":
                    m.tags.append("saved")
                else:
                    m.power = 2
        x = torch.randn(4, 8, generator=g)
        losses.append(train_step(sharded(x).square().mean(), opts[1], world))
        ref(x).square().mean().backward()
        for p in ref.parameters():  # the gradients averaged over the ranks, as DDP does
            torch.distributed.all_reduce(p.grad)
            p.grad /= world
        opts[0].step()
        opts[0].zero_grad()
    full = sharded.full_state_dict()
    return {"losses": losses, "diff": max((full[k] - v).abs().max().item()
                                          for k, v in ref.state_dict().items())}

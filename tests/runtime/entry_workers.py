"""What each rank runs in the entry tests: a chunked loss calling the sharded model's
``lm_head`` directly, a block called alone, and a registered method."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from autoshard import autoshard
import harness
from harness import Recipe

STEPS = 3


class Trunk(nn.Module):
    """A language model whose forward stops at the hidden states; the loss calls
    ``lm_head`` chunk by chunk, as torchtitan's chunked cross-entropy does."""

    def __init__(self, vocab=32, dim=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim),
                                                  nn.GELU()) for _ in range(2))
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, x):
        h = self.emb(x)
        for blk in self.blocks:
            h = h + blk(h)
        return h

    def encode(self, x):  # reads the parameters outside forward: a registered method
        return self.forward(x).mean(1) @ self.lm_head.weight.t()


def chunked_loss(model, x, y, chunk=4):
    h = model(x)
    total = 0.0
    for i in range(0, x.shape[1], chunk):
        logits = model.lm_head(h[:, i:i + chunk])
        total = total + F.cross_entropy(logits.flatten(0, 1), y[:, i:i + chunk].flatten(),
                                        reduction="sum")
    return total / y.numel()


def data(step, batch=4, seq=8):
    """Step ``step``'s tokens, targets, and hidden states for the block called alone."""
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randint(0, 32, (batch, seq), generator=g), \
        torch.randint(0, 32, (batch, seq), generator=g)
    return x, y, torch.randn(batch, 3, 16, generator=torch.Generator().manual_seed(step))


def _loss(model, x, y, h):
    return chunked_loss(model, x, y) + model.blocks[1](h).square().mean() \
        + model.encode(x).square().mean()


RECIPE = Recipe(build=Trunk, data=data, loss=_loss, steps=STEPS,
                optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2))


def train(model, rank, world):
    """The chunked loss, a block called alone and the registered method, each in the loss,
    over this rank's share of the batch (``harness.train``); returns this rank's losses."""
    return harness.train(model, RECIPE, rank, world, local=True)


def entry_worker(rank, world, _):
    torch.manual_seed(0)
    model = Trunk()
    ref = Trunk()
    ref.load_state_dict(model.state_dict())
    sharded = autoshard(model)
    sharded.register_forward_method("encode")
    losses = train(sharded, rank, world)
    ref_losses = train(ref, 0, 1) if rank == 0 else None
    full = sharded.full_state_dict()
    return {"losses": losses, "ref_losses": ref_losses,
            "params": full if rank == 0 else None,
            "ref_params": ref.state_dict() if rank == 0 else None}


def generate_worker(rank, world, _):
    """Hugging Face ``generate`` with its KV cache on a sharded Llama: each rank its own
    prompts, ``synced_gpus`` so that every rank runs the same number of forwards (as with
    FSDP2 or ZeRO-3)."""
    from autoshard.core.models import tiny_hf

    torch.manual_seed(0)
    model = tiny_hf("llama", use_cache=True).eval()
    ref = tiny_hf("llama", use_cache=True).eval()
    ref.load_state_dict(model.state_dict())
    prompts = torch.randint(1, 96, (2 * world, 5), generator=torch.Generator().manual_seed(7))
    mine = prompts.chunk(world)[rank]
    sharded = autoshard(model)
    kw = dict(max_new_tokens=5, do_sample=False, attention_mask=torch.ones_like(mine))
    got = sharded.generate(mine, synced_gpus=world > 1, **kw)
    want = ref.generate(mine, **kw)
    return {"got": got, "want": want}

"""Offloaded activations on a CPU (the host is the device): the copies run, and the step
computes bit for bit what the same plan without them does."""

import warnings

import torch

from autoshard import Config, autoshard, meta
from autoshard.models import GPT, gpt_loss


def _train(offload: bool):
    torch.manual_seed(0)
    model = GPT(seq=16, layers=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # world size 1 says so
        sharded = autoshard(model, config=Config(policy="module", verify=True,
                                                 offload_activations=offload))
    start = [p.detach().clone() for p in sharded.parameters()]
    opt = torch.optim.AdamW(sharded.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(3):
        x = torch.randint(0, 96, (4, 16), generator=g)
        loss = gpt_loss(sharded(x), x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    assert not all(torch.equal(a, p) for a, p in zip(start, sharded.parameters()))  # it trained
    return sharded, losses, [p.detach().clone() for p in sharded.parameters()]


def test_offloaded_activations_train_bit_for_bit_as_the_plan_without():
    moved, losses, params = _train(True)
    kept, ref_losses, ref_params = _train(False)
    program = moved._autoshard.last
    assert moved.plan.recompute == "offload 2/2" and kept.plan.recompute == "min-cut"
    outs = [n for n in program.fwd.graph.nodes if meta.tag(n, meta.COMM) == meta.ACT_D2H]
    ins = [n for n in program.bwd.graph.nodes if meta.tag(n, meta.COMM) == meta.ACT_H2D]
    assert outs and len(ins) == len(outs)
    assert not any(meta.tag(n, meta.COMM) == meta.ACT_D2H
                   for n in kept._autoshard.last.fwd.graph.nodes)
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses))
    assert all(torch.equal(a, b) for a, b in zip(params, ref_params))

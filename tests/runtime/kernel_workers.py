"""What each rank runs in test_kernels.py, and the unsharded eager reference: small models
whose kernels depend on more than their arguments' values (the grad mode, a parameter's
layout), trained with AdamW."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import autoshard
from autoshard import Config
import harness
from harness import Recipe
from models import Recurrent, TinyNorm

STEPS = 4
BATCH = 4
LR = 1e-2

# name -> model factory (seeded by ``build``); every nn.LSTM / nn.GRU flavour the tests cover
RECURRENT = {
    "lstm": lambda: Recurrent(nn.LSTM, batch_first=True),
    "lstm_time_first_dropout": lambda: Recurrent(nn.LSTM, batch_first=False, dropout=0.25),
    "gru": lambda: Recurrent(nn.GRU, batch_first=False),
    "gru_dropout": lambda: Recurrent(nn.GRU, batch_first=True, dropout=0.25),
    # the layer under torch.utils.checkpoint: the backward recomputes the LSTM kernel
    "lstm_checkpointed": lambda: Recurrent(nn.LSTM, checkpointed=True),
}
MODELS = {**RECURRENT, "tiny_norm": TinyNorm}


def build(name):
    torch.manual_seed(0)
    return MODELS[name]()


def batch(name, step):
    gen = torch.Generator().manual_seed(100 + step)
    shape = (BATCH, 6) if name == "tiny_norm" else (BATCH, 7, 5)
    return torch.randn(*shape, generator=gen), torch.randn(BATCH, *(
        (3,) if name == "tiny_norm" else (7, 3)), generator=gen)


def _seed(step, rank):
    torch.manual_seed(1000 * step + rank)  # the same dropout masks in eager and sharded


def recipe(name) -> Recipe:
    """Model ``name`` trained with AdamW on the mean squared error, dropout seeded per step
    and rank."""
    return Recipe(build=lambda: build(name), data=lambda step: batch(name, step),
                  loss=lambda model, x, y: F.mse_loss(model(x), y), steps=STEPS,
                  optimizer=lambda ps: torch.optim.AdamW(ps, lr=LR), seed=_seed)


def reference(name, world):
    """Unsharded eager training in one process (``harness.reference``): each rank's
    micro-batch in turn, gradients averaged over ranks, then AdamW; the losses and the
    parameters."""
    losses, state = harness.reference(recipe(name), world)
    params = {k for k, _ in build(name).named_parameters()}
    return losses, {k: v for k, v in state.items() if k in params}


def _train(model, name, rank, world):
    return harness.train(model, recipe(name), rank, world)


def _full_params(model):
    return {k: v.full_tensor().detach().clone() for k, v in model.named_parameters()}


def kernel_worker(rank, world, names):
    """Each model trained by autoshard, then checked by ``autoshard.check`` on one step;
    the tiny-norm model also trained by FSDP2 (fully_shard of the root)."""
    from torch.distributed.fsdp import fully_shard

    results = {}
    for name in names:
        sharded = autoshard.autoshard(build(name), config=Config(policy="module", verify=True))
        losses = _train(sharded, name, rank, world)
        params = _full_params(sharded)
        x, _ = batch(name, 0)
        _seed(0, rank)
        report = autoshard.check(build(name), (x.chunk(world)[rank],),
                                 config=Config(policy="module"), localise=True)
        results[name] = {"losses": losses, "params": params,
                         "check": (report.ok, report.first_difference, str(report))}
    if "tiny_norm" in names:
        model = build("tiny_norm")
        fully_shard(model)
        results["fsdp2:tiny_norm"] = {"losses": _train(model, "tiny_norm", rank, world),
                                      "params": _full_params(model)}
    return results

"""What each rank runs in the gradient-divide tests: the GPT trained with its loss summed over
the tokens (not averaged), the gradients reduced to their sum over the ranks, under autoshard
and under FSDP2, and the unsharded eager reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from autoshard import Config, autoshard
import harness
from harness import Recipe
from models import build
from parity_workers import _blocks, batches

STEPS = 4
LR = 1e-3  # SGD: a gradient twice as large moves every parameter twice as far


def sum_loss(logits, y):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1),
                           reduction="sum")


# run -> what each step's reduced gradient is divided by, on 2 ranks: "setter" compiles its
# first step with the default (the mean: / 2), then set_gradient_divide_factor(1.0) (the
# sum); "forced" keeps the mean with sum collectives; "config": the sum from the start
DIVIDE = {"setter": [2, 1, 1, 1], "forced": [2, 2, 2, 2], "config": [1, 1, 1, 1]}


def recipe(divide) -> Recipe:
    """The GPT trained with SGD on its summed loss, the gradients summed over the ranks
    divided by ``divide[step]`` (and the loss reported with them)."""
    return Recipe(build=lambda: build("gpt"), data=lambda step: batches("gpt", step),
                  loss=lambda model, x, y: sum_loss(model(x), y), steps=STEPS,
                  optimizer=lambda ps: torch.optim.SGD(ps, lr=LR),
                  divide=lambda step: divide[step])


def reference(divide, world=2):
    """Unsharded eager SGD in one process (``harness.reference``): each step the summed
    gradients of the ranks' batches, divided by ``divide[step]``."""
    return harness.reference(recipe(divide), world)


def _train(model, rank, world, divide, switch=None):
    """SGD on this rank's rows of each batch; ``switch(model)`` runs after the first step."""
    def before_step(step, model):
        if step == 1 and switch is not None:
            switch(model)

    return harness.train(model, recipe(divide), rank, world, before_step=before_step)


def _fsdp2_sum(model):
    # gloo has no PREMUL_SUM, which FSDP2 uses for a factor other than the world size;
    # its sum-only path (SUM, then a division, skipped for 1.0) runs on gloo
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)


def divide_worker(rank, world, _=None):
    from torch.distributed.fsdp import fully_shard

    out = {}
    runs = {
        "setter": (Config(policy="module", verify=True),
                   lambda m: m.set_gradient_divide_factor(1.0)),
        "forced": (Config(policy="module", force_sum_reduction_for_comms=True, verify=True),
                   None),
        "config": (Config(policy="module", strategy="ddp", gradient_divide_factor=1.0,
                          verify=True), None),
    }
    for run, (config, switch) in runs.items():
        sharded = autoshard(build("gpt"), config=config)
        losses = _train(sharded, rank, world, DIVIDE[run], switch)
        full = sharded.full_state_dict()
        plan = sharded.plan
        out[run] = {"losses": losses, "params": full if rank == 0 else None,
                    "reduction": plan.reduction,
                    "ops": sorted({e.op for e in plan.schedule} - {"wait", "free"}),
                    "programs": len(sharded._autoshard.programs)}
    model = build("gpt")
    for blk in _blocks(model):
        fully_shard(blk)
    fully_shard(model)
    losses = _train(model, rank, world, DIVIDE["setter"], _fsdp2_sum)
    full = {k: v.full_tensor() for k, v in model.state_dict().items()}
    out["fsdp2"] = {"losses": losses, "params": full if rank == 0 else None}
    return out

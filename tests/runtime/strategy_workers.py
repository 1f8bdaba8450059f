"""What each rank runs in the strategy tests: every Config.strategy, hybrid sharding on a
2-D mesh (against FSDP2's HSDP too), and gradient accumulation without sync."""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from autoshard import Config, autoshard
from harness import train
from models import build, call
from parity_workers import STEPS, batches, fsdp2_worker, recipe

STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "auto")
NAMES = ("gpt", "odd", "hf_llama")
ACCUMULATE = 2  # micro-batches per optimizer step in the accumulation runs


def _train(model, name, rank, world, steps=STEPS, accumulate=1):
    """``parity_workers.recipe(name)`` on this rank, ``accumulate`` micro-batches per step,
    all but the last without gradient sync: the losses, and the plan of each micro-batch of
    the first step."""
    plans = []

    def first_plans(step, i, model):
        if step == 0 and hasattr(model, "plan"):
            plans.append(model.plan)

    losses = train(model, recipe(name, steps, accumulate), rank, world,
                   after_backward=first_plans)
    return losses, plans


def _result(sharded, losses, rank, plans=()):
    full = sharded.full_state_dict()
    plan = sharded.plan
    return {
        "losses": losses,
        "params": {k: v.clone() for k, v in full.items()} if rank == 0 else None,
        "strategy": plan.strategy,
        "sent": plan.predicted["sent_bytes"],
        "ops": sorted({e.op for e in plan.schedule} - {"wait", "free"}),
        "gathered_in": sorted({e.region for e in plan.schedule if e.op == "all_gather"}),
        "placements": sorted({str(p.placements) for p in sharded.parameters()}),
        "local_numel": sum(p.to_local().numel() for p in sharded.parameters()),
        "sync": [p.grad_sync for p in plans],
        "local_grads": [p.predicted["local_grad_bytes"] for p in plans],
        # global bytes of the trainable parameters (DTensor numel is the full size)
        "param_bytes": sum(p.numel() * p.element_size() for p in sharded.parameters()
                           if p.requires_grad),
        "state_keys": sorted(sharded.state_dict()),
    }


def strategy_worker(rank, world, names=NAMES):
    """Every strategy on a 1-D mesh over all ranks, and the accumulation runs."""
    out, trained = {}, {}
    for name in names:
        for strategy in STRATEGIES:
            sharded = autoshard(build(name), config=Config(policy="module", strategy=strategy,
                                                           verify=True))
            losses, _ = _train(sharded, name, rank, world)
            out[(name, strategy)] = _result(sharded, losses, rank)
            trained[(name, strategy)] = sharded
    out["moved"] = _checkpoints_move(rank, world, trained)
    for strategy in ("ddp", "zero1", "zero3"):
        sharded = autoshard(build("gpt"), config=Config(policy="module", strategy=strategy,
                                                        verify=True))
        losses, plans = _train(sharded, "gpt", rank, world, steps=3, accumulate=ACCUMULATE)
        out[("accumulate", strategy)] = _result(sharded, losses, rank, plans)
    return out


def _checkpoints_move(rank, world, trained):
    """A DCP checkpoint of the GPT saved under one strategy, loaded under another: the
    largest difference of any parameter and of the next call's logits. The ZeRO-1 model has
    run once before the load, so its replicas must be gathered again."""
    import shutil

    base = os.path.join(tempfile.gettempdir(), f"autoshard-strategies-{os.getppid()}")
    xr = batches("gpt", 0)[0].chunk(world)[rank]
    out = {}
    for src, dst in (("ddp", "zero3"), ("ddp", "zero1"), ("zero3", "ddp")):
        saved = trained[("gpt", src)]
        autoshard.save(f"{base}-{src}", saved)
        model = autoshard(build("gpt"), config=Config(policy="module", strategy=dst))
        with torch.no_grad():
            call("gpt", model, xr)
            autoshard.load_checkpoint(f"{base}-{src}", model)
            dlogits = (call("gpt", model, xr) - call("gpt", saved, xr)).abs().max().item()
        theirs, mine = saved.full_state_dict(), model.full_state_dict()
        out[(src, dst)] = (max((theirs[k] - mine[k]).abs().max().item() for k in theirs),
                           dlogits)
    dist.barrier()
    if rank == 0:
        for src in ("ddp", "zero3"):
            shutil.rmtree(f"{base}-{src}", ignore_errors=True)
    return out


def hsdp_worker(rank, world, names=("gpt", "hf_llama")):
    """Hybrid sharding on a 2 x 2 ("replicate", "shard") mesh, each model with zero3 and
    zero2, and the GPT under FSDP2's HSDP on the same mesh."""
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    out = {}
    for name in names:
        for strategy in ("zero3", "zero2"):
            sharded = autoshard(build(name), mesh=mesh,
                                config=Config(policy="module", strategy=strategy, verify=True))
            losses, _ = _train(sharded, name, rank, world)
            out[(name, strategy)] = _result(sharded, losses, rank)
    sharded = autoshard(build("gpt"), mesh=mesh,
                        config=Config(policy="module", strategy="zero3", verify=True))
    losses, plans = _train(sharded, "gpt", rank, world, steps=3, accumulate=ACCUMULATE)
    out[("accumulate", "hsdp")] = _result(sharded, losses, rank, plans)
    out["fsdp2"] = fsdp2_worker(rank, world, "gpt", mesh=mesh)
    out["hpz"] = hpz_worker(rank, world, mesh)
    return out


HPZ_STEPS = 3


def hpz_worker(rank, world, hybrid_mesh):
    """hpZ (reshard_after_forward=2): the GPT on a 1-D mesh of ``world`` ranks, and under
    FSDP2's ``reshard_after_forward=2``, and on a 1 x 4 ("replicate", "shard") mesh; on the
    2 x 2 mesh (shard size 2) 2 is False's
    meaning, 1 True's, and 4 is refused."""
    out = {}
    sharded = autoshard(build("gpt"), config=Config(policy="module", reshard_after_forward=2,
                                                    verify=True))
    losses, _ = _train(sharded, "gpt", rank, world, steps=HPZ_STEPS)
    out["1d"] = dict(_result(sharded, losses, rank), reshard=sharded.plan.reshard,
                     groups=[u.group for u in sharded.plan.units],
                     ranks=sorted({e.ranks for e in sharded.plan.schedule
                                   if e.op == "all_gather" and e.region == "bwd"}))
    out["fsdp2"] = fsdp2_worker(rank, world, "gpt", reshard=2, steps=HPZ_STEPS)
    # the 2-D (HSDP) code path with a shard dimension hpZ can split: 1 x 4
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("replicate", "shard"))
    sharded = autoshard(build("gpt"), mesh=mesh,
                        config=Config(policy="module", reshard_after_forward=2, verify=True))
    losses, _ = _train(sharded, "gpt", rank, world, steps=HPZ_STEPS)
    out["2d"] = dict(_result(sharded, losses, rank), reshard=sharded.plan.reshard)
    x = batches("gpt", 0)[0].chunk(world)[rank]
    for k in (2, 1, 4):
        sharded = autoshard(build("gpt"), mesh=hybrid_mesh,
                            config=Config(policy="module", reshard_after_forward=k))
        try:
            call("gpt", sharded, x)
            out[("hsdp", k)] = sharded.plan.reshard
        except ValueError as e:
            out[("hsdp", k)] = str(e)
    return out


def submesh_worker(rank, world, _=None):
    """A 1-D mesh over half the ranks is refused, and accepted with partial_mesh."""
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    msgs = []
    try:
        autoshard(build("mlp"), mesh=mesh["shard"])
    except ValueError as e:
        msgs.append(str(e))
    sharded = autoshard(build("mlp"), mesh=mesh["shard"],
                        config=Config(partial_mesh=True, strategy="ddp"))
    msgs.append(type(sharded).__name__)
    bad = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("a", "b"))
    try:
        autoshard(build("mlp"), mesh=bad)
    except ValueError as e:
        msgs.append(str(e))
    return msgs

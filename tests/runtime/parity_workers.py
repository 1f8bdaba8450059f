"""What each rank runs in the parity tests, and the single-process eager reference."""

from __future__ import annotations

import contextlib
import copy

import torch

from autoshard import Config, Offload, autoshard
import harness
from harness import Recipe
from models import CASES, build, call

STEPS = 10
BATCH = 8
LR = 1e-3


def batches(name, step):
    gen = torch.Generator().manual_seed(1000 + step)
    return CASES[name][1](gen, BATCH)


def recipe(name, steps=STEPS, accumulate=1, lr=LR) -> Recipe:
    """Model ``name`` of tests/models.py trained with AdamW on its batches of 8."""
    return Recipe(build=lambda: build(name), data=lambda step: batches(name, step),
                  loss=lambda model, x, y: CASES[name][3](call(name, model, x), y),
                  steps=steps, optimizer=lambda ps: torch.optim.AdamW(ps, lr=lr),
                  accumulate=accumulate)


def reference(name, world, steps=STEPS, accumulate=1):
    """Unsharded eager training in one process (``harness.reference``): each rank's
    micro-batch in turn, gradients averaged over ranks (what data-parallel training
    computes), then AdamW; ``accumulate``: each rank's batch in that many micro-batches,
    their losses averaged."""
    return harness.reference(recipe(name, steps, accumulate), world)


def _train(model, name, rank, world, replica=None):
    """``model`` trained on this rank by ``recipe(name)``: its losses and, with an eager
    ``replica`` given the model's values and run on the rank's data before each step, the
    largest difference of their buffers (BatchNorm statistics a forward updates)."""
    buf_diff = [0.0]

    def replica_forward(step, model):
        full = model.full_state_dict()
        replica.load_state_dict(full)
        call(name, replica, batches(name, step)[0].chunk(world)[rank])

    def compare_buffers(step, i, model):
        mine, ref = dict(model.named_buffers()), dict(replica.named_buffers())
        buf_diff[0] = max([buf_diff[0]] + [(mine[k].float() - ref[k].float()).abs().max().item()
                                           for k in ref])

    hooks = {} if replica is None else {"before_step": replica_forward,
                                        "after_backward": compare_buffers}
    losses = harness.train(model, recipe(name), rank, world, **hooks)
    return losses, buf_diff[0]


# the GPT also with the "auto" unit policy and with the planner's resharding choice (which
# keeps every unit gathered from forward to backward where there is room), and two models
# with each other recomputation choice (the default is the min cut): nothing recomputed,
# every block recomputed whole
EXTRA = ["gpt:auto", "gpt:search", "gpt:none", "gpt:blocks", "hf_llama:none", "hf_llama:blocks"]
RECOMPUTE = {"none": False, "blocks": "blocks"}


def parity_worker(rank, world, names):
    """Each model with one unit per repeated block (the module policy), and the variants of
    ``EXTRA``."""
    results = {}
    for key in names + EXTRA:
        name, _, variant = key.partition(":")
        policy = "auto" if variant == "auto" else "module"
        recompute = RECOMPUTE.get(variant, True)
        model = build(name)
        # models whose forward updates buffers (BatchNorm statistics) are also compared with
        # an eager replica on every rank
        mutates = any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
                      for m in model.modules())
        replica = copy.deepcopy(model) if mutates else None
        reshard = "search" if variant == "search" else "auto"
        sharded = autoshard(model, config=Config(policy=policy, recompute=recompute,
                                                 reshard_after_forward=reshard, verify=True))
        losses, buf_diff = _train(sharded, name, rank, world, replica)
        full = sharded.full_state_dict()
        results[key] = {
            "losses": losses,
            "params": full if rank == 0 else None,
            "buf_diff": buf_diff,
            "units": [u.name for u in sharded.units],
            "kept": [u.kept for u in sharded.plan.units],
            "local_numel": sum(p.to_local().numel() for p in sharded.parameters()),
        }
    results["fsdp2:gpt"] = fsdp2_worker(rank, world, "gpt")
    for name in OFFLOAD_NAMES:
        results[f"offload:{name}"] = offload_worker(rank, world, name)
    for name in MP_NAMES:
        results[f"mp:{name}"] = mp_worker(rank, world, name)
        with traced_mask():  # FSDP2's eager runs the attention autoshard's capture traced
            results[f"fsdp2-mp:{name}"] = fsdp2_worker(rank, world, name, mp=True)
    return results


@contextlib.contextmanager
def traced_mask():
    """Eager Hugging Face models build the explicit causal mask that transformers builds when
    it traces. Since transformers 5, eager reads the position ids to make sure they hold no
    packed sequences and then leaves the mask out (SDPA ``is_causal``, and for grouped-query
    attention SDPA's own key/value head sharing); on fake tensors it cannot read them, so the
    traced step masks explicitly and repeats the key/value heads (``repeat_kv``). The two are
    the same in exact arithmetic, but in bf16 the second rounds each query head's key/value
    gradient before summing them. With the same mask, eager and the captured step run the
    same ops."""
    try:
        import transformers.masking_utils as masking
    except ImportError:  # no Hugging Face model to run
        yield
        return
    name = "_ignore_causal_mask_sdpa"
    saved = getattr(masking, name)  # an AttributeError if transformers renamed it
    setattr(masking, name, lambda *a, **k: False)
    try:
        yield
    finally:
        setattr(masking, name, saved)


# CPUOffloadPolicy: the same programs with every offloaded shard copied in and its gradient
# shard out; half the resharded units copy their shards in again for the backward, the others
# hold the forward's copy. Offloaded: all of the state (None), or the last half of it
OFFLOAD = {"gpt": None, "hf_llama": 0.5}
OFFLOAD_NAMES = list(OFFLOAD)


def offload_worker(rank, world, name):
    model = autoshard(build(name), config=Config(
        policy="module", offload_policy=Offload(state=OFFLOAD[name], params=0.5,
                                                pin_memory=False), verify=True))
    losses, _ = _train(model, name, rank, world)
    homes = {p.to_local().device.type for p in model.parameters()}
    full = model.full_state_dict()  # every rank takes part in gathering it
    return {"losses": losses, "params": full if rank == 0 else None, "homes": homes,
            "held": [u.held for u in model.plan.units if not u.kept],
            "hosted": [u.hosted for u in model.plan.units]}


# bf16 parameters and compute, fp32 reduce-scatter, fp32 outputs (the usual FSDP2 setup)
MP_NAMES = ["gpt", "hf_llama"]


def mp_policy(root=True):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                output_dtype=torch.float32 if root else None)


def mp_worker(rank, world, name):
    model = autoshard(build(name), config=Config(policy="module", mp_policy=mp_policy(),
                                                 verify=True))
    losses, _ = _train(model, name, rank, world)
    full = model.full_state_dict()
    grads_fp32 = all(p.dtype == torch.float32 for p in model.parameters())
    return {"losses": losses, "params": full if rank == 0 else None, "fp32": grads_fp32}


def _blocks(model):
    """The repeated blocks FSDP2 wraps one by one (the units of autoshard's module policy)."""
    if hasattr(model, "blocks"):
        return list(model.blocks)
    inner = getattr(model, "model", None)
    return list(inner.layers) if inner is not None and hasattr(inner, "layers") else []


def fsdp2_worker(rank, world, name, mp=False, mesh=None, reshard=None, steps=STEPS):
    """The same training under FSDP2: fully_shard per block, then the root (on ``mesh``:
    a 2-D one is FSDP2's HSDP), each with ``reshard_after_forward=reshard`` (None: FSDP2's
    default)."""
    from torch.distributed.fsdp import fully_shard

    model = build(name)
    for blk in _blocks(model):
        fully_shard(blk, mesh=mesh, reshard_after_forward=reshard,
                    **({"mp_policy": mp_policy(root=False)} if mp else {}))
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard,
                **({"mp_policy": mp_policy()} if mp else {}))
    losses = harness.train(model, recipe(name, steps), rank, world)
    full = {k: v.full_tensor() for k, v in model.state_dict().items()}
    return {"losses": losses, "params": full if rank == 0 else None}

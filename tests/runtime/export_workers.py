"""What each rank runs in the export tests of every strategy and of a 2-D mesh: a model is
trained, probed (one forward and backward on a fixed batch), exported; fresh ranks load the
export on the same mesh and at another world size and probe the same batch."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import autoshard
from autoshard import Config
from autoshard.core.models import GPT, gpt_loss
from harness import Recipe, train

# case -> (Config.strategy, mesh shape at export)
CASES = {"zero1": ("zero1", (4,)), "ddp": ("ddp", (4,)), "auto": ("auto", (4,)),
         "hsdp": ("zero3", (2, 2)), "hsdp_zero1": ("zero1", (2, 2)), "hpz": ("zero3", (4,))}
# other Config fields of a case: hpZ, each unit resharded to groups of 2 of the 4 ranks (the
# export names rank 0's group; each loading rank maps it to its own)
OPTIONS = {"hpz": {"reshard_after_forward": 2}}
# what the load runs: each case, and the DDP export rewritten as format version 2 wrote it
LOADED = {**CASES, "ddp_v2": CASES["ddp"]}
GLOBAL, SEQ, VOCAB = 4, 8, 64


def _mesh(shape):
    if len(shape) == 1:
        return None  # the default: 1-D over every rank
    return init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))


def _batch(step):
    """The global batch of ``step``: tokens and their next tokens."""
    g = torch.Generator().manual_seed(200 + step)
    x = torch.randint(0, VOCAB, (GLOBAL, SEQ), generator=g)
    return x, torch.roll(x, -1, 1)


def _data(step, world, rank):
    """Rank ``rank``'s rows of the global batch of ``step`` (every rank its own rows, as
    on a 1-D mesh, also on a 2-D one: HSDP is data parallel over all ranks)."""
    return tuple(t.chunk(world)[rank] for t in _batch(step))


def _gpt():
    torch.manual_seed(0)
    return GPT(vocab=VOCAB, layers=2)


# one SGD step on the first batch, as each case trains before it is exported
RECIPE = Recipe(build=_gpt, data=_batch,
                loss=lambda model, x, y: gpt_loss(model(x), y), steps=1,
                optimizer=lambda ps: torch.optim.SGD(ps, lr=0.5))


def _gathered(t, world):
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts)


def probe(model, rank, world) -> dict:
    """One forward and backward on the probe batch: the global logits, the loss averaged
    over the ranks, every full gradient; the gradients are zeroed after."""
    x, y = _data(99, world, rank)
    logits = model(x)
    loss = gpt_loss(logits, y)
    loss.backward()
    grads = {f: p.grad.full_tensor() for f, p in model.named_parameters()}
    model.zero_grad()
    prog = model._autoshard.last
    return {"logits": _gathered(logits.detach(), world),
            "loss": _gathered(loss.detach().reshape(1), world).mean(),
            "grads": grads, "strategy": prog.plan.strategy,
            "replicas": sorted(s.fqn for s in prog.captured.params if s.replica),
            "placements": sorted({str(p.placements) for p in model.parameters()}),
            "mesh_shape": list(model._autoshard.mesh.shape),
            "reshard_to": sorted({u.group for u in prog.plan.units})}


def export_cases(rank, world, root):
    """Each case: trained one SGD step, probed, compiled for the per-rank batch of world
    size 2 too, exported."""
    out = {}
    for name, (strategy, shape) in CASES.items():
        model = autoshard.autoshard(_gpt(), mesh=_mesh(shape),
                                    config=Config(strategy=strategy,
                                                  **OPTIONS.get(name, {})))
        train(model, RECIPE, rank, world, local=True)
        out[name] = probe(model, rank, world)
        out[name]["collectives"] = collective_dims(model)  # the probe's program's
        model.precompile(torch.zeros(GLOBAL // 2, SEQ, dtype=torch.long))
        model.export(os.path.join(root, name))
        out[name]["groups"] = export_groups(model)
    return out


def export_groups(model) -> list:
    from autoshard.runtime import dist as _dist

    names = _dist.group_name(model._autoshard.mesh)
    return [names] if isinstance(names, str) else list(names)


def collective_dims(model) -> dict:
    """On which of this process's mesh groups the collectives of the program that ran last
    run: {op: the mesh dimensions whose group (here) its nodes name}; a group that is no
    mesh dimension's here (hpZ's groups of k, or a group of another process) by its name."""
    from torch._ops import OpOverload

    names, split = export_groups(model), model._autoshard.last.split
    found: dict = {}
    for gm in (split.fwd, split.bwd):
        for n in gm.graph.nodes if gm is not None else ():
            t = n.target
            if not (n.op == "call_function" and isinstance(t, OpOverload)
                    and t.namespace == "_c10d_functional"):
                continue
            args = [a.name for a in t._schema.arguments]
            if "group_name" not in args:
                continue
            at = args.index("group_name")
            group = n.args[at] if at < len(n.args) else n.kwargs["group_name"]
            found.setdefault(t._opname, set()).add(
                names.index(group) if group in names else group)
    return {op: sorted(dims, key=str) for op, dims in found.items()}


def load_cases(rank, world, root):
    """Each export loaded on this world's ranks (its own mesh shape at world size 4, a 1-D
    mesh otherwise) and probed. A group made first advances this process's count of groups,
    which names them, so that the export's names are seldom this process's own (they may
    coincide: how many groups a run makes differs between torch versions)."""
    dist.new_group(list(range(world)))
    out = {}
    for name, (_, shape) in LOADED.items():
        mesh = _mesh(shape) if world == 4 else None
        try:
            model = autoshard.load(os.path.join(root, name), mesh=mesh)
            out[name] = probe(model, rank, world)
        except autoshard.AutoshardError as e:
            out[name] = {"refused": str(e)}
            continue
        out[name]["same"] = model._autoshard.exported.same
        out[name]["groups"] = export_groups(model)
        out[name]["collectives"] = collective_dims(model)
    return out

"""What each rank runs in the compiled-graph tests (``Config(compile=True)``)."""

from __future__ import annotations

import torch

from autoshard import Config, autoshard
from autoshard.runtime.inductor import planned_order
from models import CASES, build, call
from parity_workers import _train, batches


def compile_worker(rank, world, names):
    """Each model with one unit per block, its graphs compiled by inductor; what it trained
    to, the order of collectives in the generated code against the graph's, and what its
    graphs could hold longer than the fx graphs do."""
    out = {}
    for name in names:
        model = autoshard(build(name), config=Config(policy="module", compile=True))
        losses, _ = _train(model, name, rank, world)
        prog = model._autoshard.last
        full = model.full_state_dict()  # a collective: every rank calls it
        out[name] = {
            "losses": losses,
            "params": full if rank == 0 else None,
            "orders": [(g.order, planned_order(g.gm)) for g in (prog.fwd, prog.bwd)],
            "schedule": len(model.plan.schedule),
            "held": [_held(g) for g in (prog.fwd, prog.bwd)],
        }
    return out


def _held(g) -> dict:
    """What the compiled graph ``g`` could hold longer than the fx graph frees it: gathered
    buffers allocated apart from the all-gather (the forward saves one for the backward to
    free), concatenations of gradients inductor would allocate before their first gradient,
    inputs the code takes and never reads."""
    from autoshard.core import meta
    from autoshard.runtime.inductor import functional
    from autoshard.core.ops import pack_op

    f = functional(g.gm)
    nodes = list(f.graph.nodes)
    return {
        "buffers": sum(meta.tag(n, meta.COMM) == meta.AG_BUFFER for n in nodes),
        "cats": sum(n.target is torch.ops.aten.cat.default
                    and meta.tag(n, meta.COMM) == meta.RS_PACK for n in nodes),
        "packs": sum(n.target is pack_op for n in nodes),
        "reduce_scatters": sum(meta.tag(n, meta.COMM) == meta.RS_ISSUE for n in nodes),
        "unread_inputs_taken": len(g.graph.find_nodes(op="placeholder")) - len(g.unused)
        - sum(bool(n.users) for n in f.graph.find_nodes(op="placeholder")),
        "packs_in_code": g.source.count("torch.ops.autoshard.pack.default("),
    }


def cuda_worker(rank, world, name):
    """One NCCL rank on a GPU: compiled and uncompiled steps from the same init and data
    (each rank's own losses, on the device; ``harness.train`` runs on the host's batches)."""
    torch.cuda.set_device(0)
    losses = {}
    for compiled in (False, True):
        torch.manual_seed(0)
        model = autoshard(build(name).cuda(), config=Config(policy="module", compile=compiled))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses[compiled] = []
        for step in range(3):
            x, y = (t.cuda() for t in batches(name, step))
            loss = CASES[name][3](call(name, model, x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses[compiled].append(loss.item())
    return losses

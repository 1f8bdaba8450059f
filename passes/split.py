"""split: the joint graph -> a forward graph, a backward graph and the saved list."""

from __future__ import annotations

import dataclasses

import torch.fx as fx

from autoshard.core import _compat, meta
from autoshard.core.captured import SplitProgram
from autoshard.core.graph import partition


def _copy_into(graph: fx.Graph, nodes, env: dict) -> None:
    for n in nodes:
        new = _compat.node_copy(graph, n, lambda a: env[a], meta=n.meta)
        env[n] = new


def split_pass(gm: fx.GraphModule, ctx, *,
               options) -> tuple[fx.GraphModule, dict]:
    """Partition by region tag and record the result in ``ctx.split``.

    Needs: every node tagged with a region (capture; passes tag what they add).
    Guarantees: the forward graph runs every ``fwd`` node in joint order and returns the user
    outputs, the mutated buffers, then each forward value a backward node reads (the saved
    list, in joint order); the backward graph runs every ``bwd`` node in joint order. The joint
    graph itself is returned unchanged. With no backward region, ``ctx.split.bwd`` is None.
    """
    part = partition(gm)
    roles, values = part.roles, part.values
    fwd_nodes, bwd_nodes, saved = part.fwd, part.bwd, part.saved
    fwd_idx, bwd_idx = part.fwd_idx, part.bwd_idx

    fwd_graph, env = fx.Graph(), {}
    for n in fwd_nodes:
        if n.op == "placeholder":
            env[n] = fwd_graph.placeholder(n.name)
            env[n].meta = n.meta
    _copy_into(fwd_graph, [n for n in fwd_nodes if n.op != "placeholder"], env)
    fwd_graph.output([env[values[i]] for i in fwd_idx] + [env[n] for n in saved])

    bwd = None
    tangents = [n for n in bwd_nodes if meta.is_tangent(n)]
    accs = [n for n in bwd_nodes if meta.is_grad_acc(n)]
    if bwd_nodes:
        bwd_graph, benv = fx.Graph(), {}
        for n in saved:
            benv[n] = bwd_graph.placeholder(f"saved_{n.name}")
            benv[n].meta = n.meta
        for n in tangents + accs:
            benv[n] = bwd_graph.placeholder(n.name)
            benv[n].meta = n.meta
        _copy_into(bwd_graph, [n for n in bwd_nodes if n.op != "placeholder"], benv)
        bwd_graph.output([benv[values[i]] for i in bwd_idx])
        bwd = _compat.graph_module(gm, bwd_graph)
    return gm, {"split": SplitProgram(
        fwd=_compat.graph_module(gm, fwd_graph),
        bwd=bwd,
        fwd_roles=[roles[i] for i in fwd_idx],
        bwd_roles=[roles[i] for i in bwd_idx],
        saved=[n.name for n in saved],
        n_tangents=len(tangents),
        acc_fqns=[meta.tag(n, meta.FQN) for n in accs],
    )}

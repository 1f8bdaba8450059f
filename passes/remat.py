"""recompute_activations: save fewer bytes from forward to backward by recomputing cheap ops.

Eager autograd (and so DDP and FSDP2) keeps every tensor a backward formula asks for:
``gelu(h)`` and ``h``, a LayerNorm's output and its input. Holding the whole step as one
graph, autoshard chooses what crosses instead: the set of saved tensors with the fewest bytes
from which the backward can recompute the rest with cheap ops (pointwise, views, small
reductions, normalisations). That is a minimum cut, as in the min-cut partitioners of
compiler autograd (AOTAutograd's), computed here with networkx over the forward graph:

    source ─∞─▶ every input, and every op that must run in forward (matmuls, attention,
                anything random, written in place, or a user output)
    v_in ──bytes(v)──▶ v_out       for each forward value v: cutting it = saving v
    u_out ─∞─▶ v_in                for each edge u → v of the forward
    v_out ─∞─▶ sink                for each forward value a backward node reads

The cut's edges name the values to save; every forward value on the sink side that the
backward needs is copied into the backward, right before its first reader there.
"""

from __future__ import annotations

import operator

import networkx as nx
import torch
import torch.fx as fx

from autoshard.core import _compat, meta
from autoshard.core.cost import tensor_bytes
from autoshard.core.graph import (
    aliased_arg,
    copy_into_backward,
    mutated_storages,
    reads_mutated,
    written_inputs,
)

_aten = torch.ops.aten
# cheap enough to run twice: memory-bound, and no larger than what they read
_CHEAP = {
    _aten._to_copy.default, _aten.mean.dim, _aten.sum.dim_IntList, _aten.var_mean.correction,
    _aten.native_layer_norm.default, _aten.amax.default,
}


def _recomputable(n: fx.Node, mutated: set, region) -> bool:
    """Cheap (or inside a checkpoint region), deterministic, writes nothing, and reads only
    storages no node ever writes: then its inputs hold the same values in backward as in
    forward, and so does its copy."""
    t = n.target
    if n.op != "call_function" or written_inputs(n) or reads_mutated(n, mutated):
        return False
    if t is operator.getitem:
        return True
    if not isinstance(t, _compat.OpOverload) or torch.Tag.nondeterministic_seeded in t.tags:
        return False
    # inside a torch.utils.checkpoint region (or a block the plan recomputes whole)
    # recomputation was asked for: any op
    return (t in _CHEAP or torch.Tag.pointwise in t.tags or aliased_arg(n) is not None
            or region(n) is not None)


def _enters_region(n: fx.Node, region) -> bool:
    """Whether a checkpoint region other than ``n``'s own reads ``n``: as in eager activation
    checkpointing, a region recomputes from its saved inputs, never across other regions
    (which would recompute the whole chain before it, once for each region)."""
    own = region(n)
    return any(region(u) not in (None, own) for u in n.users)


# "offload": the min cut, its saved values then moved to the host (autoshard.passes.offload)
MODES = ("keep", "min-cut", "block", "offload")


def _regions(modes: dict):
    """(region of a node, whether the node's block keeps everything): a node's checkpoint
    region, else ("block", path) when its repeated block ``path`` is recomputed whole."""

    def block(n):
        parts = (meta.tag(n, meta.MODULE) or "").split(".")
        for k in range(1, len(parts) + 1):
            path = ".".join(parts[:k])
            if path in modes:
                return path
        return None

    def region(n):
        ck = meta.tag(n, meta.CHECKPOINT)
        if ck is not None or not modes:
            return ck
        path = block(n)
        return ("block", path) if path is not None and modes[path] == "block" else None

    def kept(n):
        path = block(n) if modes else None
        return path is not None and modes[path] == "keep"

    return region, kept


def recompute_activations_pass(gm: fx.GraphModule, ctx, *, options) -> fx.GraphModule:
    """Replace saved forward values by recomputation in backward where that saves bytes.

    Needs: region tags (capture); runs first, on the joint graph (before any collective).
    Guarantees: the backward reads only forward values the cut saves, graph inputs, and
    copies (tagged ``recomputed``, region bwd) of cheap forward ops placed before their
    first backward reader; the forward computes what it did. Never recomputes an op that is
    random, writes into a tensor, or reads or is a storage that any node writes into (through
    any view): what it reads is then the same at recompute time, and so is its value. Does
    nothing when no cheaper cut exists (the saved bytes never grow) or with no backward.

    Options: ``blocks`` — ``{module path: mode}`` for repeated blocks (a plan's decision per
    block): "min-cut" (the default, as above), "keep" (nothing of the block is recomputed:
    what eager autograd saves) or "block" (any deterministic op of the block may be, as if
    the block ran under torch.utils.checkpoint: what crosses is in effect the block's input).
    ``cut_cache`` — a dict kept across runs on copies of one graph (the planner's choices):
    the cut, by what decides it (each forward node's name, region and keep), is computed
    once; at GPT-175B five of the ten choices cut alike (the min cut and its offloads).
    """
    region, kept = _regions(options.get("blocks") or {})
    graph = gm.graph
    nodes = list(graph.nodes)
    fwd = [n for n in nodes if meta.is_forward(n) and n.op != "output"]
    fwd_set = set(fwd)
    needed = {a for n in nodes if meta.is_backward(n) for a in n.all_input_nodes
              if a in fwd_set}
    if not needed:
        return gm
    cache, key = options.get("cut_cache"), None
    if cache is not None:  # what decides the cut: each forward node's region and keep
        key = tuple((n.name, region(n), kept(n)) for n in fwd)
    if key is not None and key in cache:
        names = cache[key]
        saved = None if names is None else {n for n in fwd if n.name in names}
    else:
        saved = _min_cut(gm, fwd, fwd_set, needed, region, kept)
        if key is not None:
            cache[key] = None if saved is None else {n.name for n in saved}
    if saved is None:
        return gm

    # forward values the backward needs but the cut does not save, with what they read
    todo, recompute = [n for n in needed if n not in saved and n.op != "placeholder"], set()
    while todo:
        n = todo.pop()
        if n in recompute:
            continue
        recompute.add(n)
        todo.extend(a for a in n.all_input_nodes
                    if a in fwd_set and a not in saved and a.op != "placeholder")
    order = {n: i for i, n in enumerate(nodes)}
    ordered = sorted(recompute, key=order.__getitem__)
    copy_into_backward(gm, ordered)
    for n in reversed(ordered):  # what only the backward read now runs there alone
        if not n.users:
            graph.erase_node(n)
    graph.lint()
    gm.recompile()
    return gm


def _min_cut(gm, fwd, fwd_set, needed, region, kept):
    """The forward values to save (the minimum cut above), or None when no cut saves fewer
    bytes than the backward reads now."""
    mutated = mutated_storages(list(gm.graph.nodes))
    user_out = set(meta.output_node(gm).all_input_nodes)

    g = nx.DiGraph()
    for n in fwd:
        inp = n.op == "placeholder"
        if (inp or kept(n) or not _recomputable(n, mutated, region) or n in user_out
                or _enters_region(n, region)):
            g.add_edge("source", (n, "in"))  # no capacity: infinite
        # inputs cost nothing to keep (the backward reads them anyway); a view costs little
        # more than its base so that the base is what gets saved; a tuple is never saved
        # whole, only the tensors taken out of it
        val = n.meta.get("val")
        if not isinstance(val, (tuple, list)):
            g.add_edge((n, "in"), (n, "out"), capacity=0 if inp else tensor_bytes(val) + 1)
        else:
            g.add_edge((n, "in"), (n, "out"))
        for a in n.all_input_nodes:
            if a in fwd_set:
                g.add_edge((a, "out"), (n, "in"))
        if n in needed:
            g.add_edge((n, "out"), "sink")
    before = sum(tensor_bytes(n.meta.get("val")) for n in needed if n.op != "placeholder")
    cut, (reach, _) = nx.minimum_cut(g, "source", "sink")
    if cut >= before:
        return None
    return {n for n in fwd if (n, "in") in reach and (n, "out") not in reach}

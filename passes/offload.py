"""offload_activations: keep saved activations in host memory between forward and backward.

A saved activation (a forward value the backward reads) holds device memory from where the
forward makes it to where the backward last reads it. Recomputation (``remat``) spends
compute to drop it; offload spends the host link instead: the value is copied to the host
right after its last forward read and freed on the device, and copied back in the backward
before its first reader there, which reads the copy. Both copies are graph nodes tagged
``meta.ACT_D2H`` / ``meta.ACT_H2D``; ``prefetch`` moves the copies in earlier, as it moves
all-gathers, and the simulator runs them beside the compute when the host is not the device
(``DeviceProfile.host_bandwidth``)::

    forward:   x = op(...) ... last fwd read of x ─▶ h = copy(x, cpu) ─▶ free(x)
    backward:  ... x' = copy(h, device) ─▶ free(h) ... readers of x now read x'

On a CPU the host is the device: the copies are exact copies, so the step computes the same
values bit for bit, only with two more copies.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from autoshard.core import _compat, meta
from autoshard.core.graph import (
    aliased_arg,
    alias_closure,
    mutated_storages,
    param_derived,
    positions,
)
from autoshard.core.ops import free_op

_TO_COPY = torch.ops.aten._to_copy.default
HOST = torch.device("cpu")


def _in_blocks(n: fx.Node, blocks) -> bool:
    """Whether ``n`` was made by the code of one of the module paths ``blocks`` (None: any)."""
    if blocks is None:
        return True
    path = meta.tag(n, meta.MODULE) or ""
    return any(path == b or path.startswith(b + ".") for b in blocks)


def offloadable(gm: fx.GraphModule, blocks=None) -> list:
    """The saved activations ``offload_activations_pass`` may move, in graph order: forward
    values a backward node reads, made by the code of ``blocks`` (module paths; None: any),
    that own their storage and whose storage is safe to drop on the device after the forward.

    A value the backward reads through views of it counts (the views are made again from
    the copy back). Left out, to stay correct: graph inputs and what parameters alone
    compute (the backward recomputes or re-gathers those), views (their base is what moves),
    values whose storage any node writes into (through any view), user outputs and values a
    view of which the output returns, tuples, and values with no bytes."""
    nodes = list(gm.graph.nodes)
    fwd = {n for n in nodes if meta.is_forward(n)}
    mutated = mutated_storages(nodes)
    derived = param_derived(gm)
    out = []
    for n in nodes:
        if n not in fwd or n.op != "call_function" or n in derived or n in mutated:
            continue
        val = n.meta.get("val")
        if not isinstance(val, torch.Tensor) or val.numel() == 0 or meta.is_comm(n):
            continue
        if aliased_arg(n) is not None or not _in_blocks(n, blocks):
            continue
        aliases = alias_closure(n)
        users = [u for a in aliases for u in a.users]
        if any(u.op == "output" for u in users) or not any(meta.is_backward(u) for u in users):
            continue
        out.append(n)
    return out


def _tags(kind: str, region: str, n: fx.Node) -> dict:
    return {meta.COMM: kind, meta.REGION: region, meta.MODULE: meta.tag(n, meta.MODULE),
            meta.OFFLOADED: n.name}


def _copy(graph: fx.Graph, src: fx.Node, device: torch.device, like) -> fx.Node:
    """``aten._to_copy(src, device=device)`` with its fake value. Between a CUDA device and
    the host the copy is asynchronous (``non_blocking``; ``_to_copy`` then puts the host
    copy in pinned memory, which it does only so): ordered on the device's stream with
    what reads it, and pinned host blocks are reused only once the copies that read them
    have ended (torch's caching host allocator)."""
    kwargs = {"device": device}
    if like.device.type == "cuda":
        kwargs["non_blocking"] = True
    c = graph.call_function(_TO_COPY, (src,), kwargs)
    with like.fake_mode:
        c.meta["val"] = torch.empty_strided(like.shape, like.stride(), dtype=like.dtype,
                                            device=device)
    return c


def _rewire(graph: fx.Graph, aliases: list, back: fx.Node, before: fx.Node) -> None:
    """Backward readers of ``aliases`` (a value, then its views in graph order) read ``back``
    instead, or views made again from it (copies of the forward's, before ``before``, tagged
    region bwd) for the views they read."""
    env = {aliases[0]: back}
    needed = set()
    for a in reversed(aliases):  # a view is needed if the backward reads it or a view of it
        if any(meta.is_backward(u) or u in needed for u in a.users):
            needed.add(a)
    for a in aliases[1:]:
        if a in needed:
            with graph.inserting_before(before):
                c = _compat.node_copy(graph, a, lambda v: env.get(v, v))
            c.meta[meta.KEY] = {**meta.tags(a), meta.REGION: meta.BWD,
                                meta.OFFLOADED: aliases[0].name}
            env[a] = c
    for a in aliases:
        for u in [u for u in a.users if meta.is_backward(u) and u not in env.values()]:
            u.replace_input_with(a, env[a])


def offload_activations_pass(gm: fx.GraphModule, ctx, *, options) -> fx.GraphModule:
    """Copy saved activations to the host after the forward and back before the backward.

    Needs: region and module tags (capture); runs after ``recompute_activations`` (it moves
    what that pass leaves saved) and before the collectives. Options: ``blocks`` — module
    paths whose saved activations move (each repeated block's, as the plan decides; None:
    every one ``offloadable`` allows; an empty list: none). Guarantees, for each value ``x``
    moved: a host copy (``ACT_D2H``, region fwd) right after the last forward read of ``x``
    or of any view of it, a free of ``x`` right after that copy, a copy back (``ACT_H2D``,
    region bwd) right before the first backward reader of ``x`` or of a view of it; every
    backward reader of ``x`` now reads the copy back, and every backward reader of a view
    of ``x`` the same view made again from it (forward view nodes copied, region bwd, tagged
    ``offloaded``); a free of the host copy right after the copy back. Each new node
    is tagged ``offloaded`` with ``x``'s name. The forward's other values and every value
    computed are as before. Does nothing when no value qualifies or with no backward.
    """

    blocks = options.get("blocks")
    if blocks is not None and not blocks:
        return gm
    graph = gm.graph
    moved = offloadable(gm, blocks)
    pos = positions(graph)
    for x in moved:
        val = x.meta["val"]
        # the backward's own views of x (recomputed) read x or a forward view of it
        aliases = sorted((a for a in alias_closure(x) if meta.is_forward(a)),
                         key=pos.__getitem__)
        last = max((u for a in aliases for u in a.users if meta.is_forward(u)),
                   key=pos.__getitem__, default=x)
        first = min((u for a in aliases for u in a.users if meta.is_backward(u)),
                    key=pos.__getitem__)
        with graph.inserting_after(last):
            host = _copy(graph, x, HOST, val)
        meta.tags(host).update(_tags(meta.ACT_D2H, meta.FWD, x))
        with graph.inserting_after(host):
            free = graph.call_function(free_op, ([x],))
        free.meta["val"] = None
        meta.tags(free).update(_tags(meta.FREE, meta.FWD, x))
        with graph.inserting_before(first):
            back = _copy(graph, host, val.device, val)
        meta.tags(back).update(_tags(meta.ACT_H2D, meta.BWD, x))
        with graph.inserting_after(back):
            free_host = graph.call_function(free_op, ([host],))
        free_host.meta["val"] = None
        meta.tags(free_host).update(_tags(meta.FREE, meta.BWD, x))
        _rewire(graph, aliases, back, first)
    if moved:
        graph.lint()
        gm.recompile()
    return gm


def offloaded_bytes(gm: fx.GraphModule) -> dict:
    """``{module path: bytes}`` of the activations a graph copies to the host (its
    ``ACT_D2H`` nodes), by the module code that made them ("-": none)."""
    out: dict = {}
    for n in gm.graph.nodes:
        if meta.tag(n, meta.COMM) == meta.ACT_D2H:
            path = meta.tag(n, meta.MODULE) or "-"
            out[path] = out.get(path, 0) + meta.val_bytes(n)
    return out

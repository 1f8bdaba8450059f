"""The verifier: proves DESIGN.md's invariants on a graph after a pass."""

from __future__ import annotations

import torch.fx as fx

from autoshard.core import meta
from autoshard.core.graph import (alias_base, alias_bases, alias_closure, positions,
                                  writes_input, written_inputs)
from autoshard.passes.prefetch import gathered_spans, prefetched


class VerificationError(AssertionError):
    """A pass broke an invariant; the message names the nodes."""


def _fail(msg: str):
    raise VerificationError(msg)


def verify(gm: fx.GraphModule, ctx) -> None:
    """Check every invariant that applies at this stage of the pipeline.

    Always: each node has a region; forward nodes never read backward nodes; no node writes
    into a graph input (buffers are updated through outputs); a recomputed node reads no
    storage that any node writes into, so it computes in backward what the forward did —
    checked on the joint graph and, once split, on the forward and backward graphs that run.
    Once collectives are inserted:
      1. every read of a sharded parameter goes through an all-gather and its wait;
      2. no node reads a freed storage after its free, and a collective's input stays alive
         until its wait;
      3. no gathered parameter (or view of one) is read across forward -> backward unless
         its unit is kept (``Unit.stays_gathered``, from ``reshard_after_forward``);
      4. each gradient is reduced exactly once, after its last accumulation, over every
         mesh dimension as its ``ParamSpec.reduction`` says (reduce-scattered over the
         dimension it is sharded over, all-reduced over each it is replicated over, in that
         order), each with the reduce op its ``ParamSpec.scaling`` says, or, with
         ``ctx.grad_sync`` off, not at all (returned full and local);
      1 holds for gathered parameters (``ParamSpec.gathers``); the others are read whole.
      5. with a prefetch bound, the gathered bytes in flight never exceed it where an
         all-gather is issued ahead of its wait (``prefetched``): one issued where it is
         read is what a plan without prefetch gathers, a unit larger than the bound alone;
      6. hpZ (``Unit.group`` k): what crosses forward -> backward for such a unit is only its
         ``autoshard::chunk`` of k, copied in the forward out of the unit's own forward
         gathered buffer, read in the backward by nothing but the unit's all-gathers over k
         ranks, and freed; every backward all-gather of the unit sends such a chunk; no
         other unit has a chunk.
    """
    graph = gm.graph
    pos = positions(graph)
    base = alias_bases(graph.nodes).__getitem__  # alias_base, for every node at once
    for n in graph.nodes:
        if n.op == "output":
            continue
        if meta.tag(n, meta.REGION) not in (meta.FWD, meta.BWD):
            _fail(f"node {n.name} has no region tag")
        if meta.is_forward(n) and any(meta.is_backward(a) for a in n.all_input_nodes):
            _fail(f"forward node {n.name} reads a backward node")
        for w in written_inputs(n):
            if base(w).op == "placeholder":
                _fail(f"{n.name} writes into graph input {base(w).name} in place")
    _check_recomputed(list(graph.nodes), lambda n: n, base)
    if ctx.split is not None:
        _check_split_recomputed(ctx.split)
    if not ctx.collectives_inserted:
        return
    specs = {p.fqn: p for p in ctx.captured.params}
    _check_gathers(gm, specs)
    _check_frees(gm, pos, base)
    _check_crossing(gm, ctx, base)
    _check_chunks(gm, ctx, base)
    _check_reductions(gm, pos, specs, ctx.grad_sync, base)
    if ctx.prefetch_cap is not None:
        _check_inflight(gm, ctx.prefetch_cap)


def _check_inflight(gm, cap: int):
    pos = positions(gm.graph)
    for region in (meta.FWD, meta.BWD):
        found = gathered_spans(gm, region)
        spans = [(pos[i], size, rel) for i, size, rel in found]
        for (issue, _, _), (p, size, _) in zip(found, spans):
            if not prefetched(issue):
                continue  # gathered where it is read, as without prefetch: the bound is moot
            live = sum(s for q, s, r in spans if q <= p < r or q == p)
            if live > cap:
                _fail(f"{live} gathered bytes in flight at position {p} of the {region} "
                      f"exceed the prefetch bound of {cap}")


def _check_gathers(gm, specs):
    """In one sweep in graph order: the gathered parameters' shards each node reads along a
    path through no all-gather wait; only moving them in (a copy from the host, packing,
    the all-gather issue, a free) may, so the first other node is named, the same on every
    run."""
    allowed = (meta.H2D, meta.AG_PACK, meta.AG_ISSUE, meta.FREE)
    reach = {}  # node -> the shards (placeholders) it reads ungathered; only non-empty sets
    for d in gm.graph.nodes:
        if meta.tag(d, meta.COMM) == meta.AG_WAIT:
            continue  # gathered: what reads it reads the full parameter
        if meta.is_param(d):
            if specs[meta.tag(d, meta.FQN)].gathers:
                reach[d] = (d,)
            continue
        shards = [p for a in d.all_input_nodes if a in reach for p in reach[a]]
        if not shards:
            continue
        if d.op == "output":
            _fail(f"parameter shard {shards[0].name} is returned without being gathered")
        if meta.tag(d, meta.COMM) not in allowed:
            _fail(f"node {d.name} reads parameter {meta.tag(shards[0], meta.FQN)} without an "
                  "all-gather wait before it")
        reach[d] = tuple(dict.fromkeys(shards))


def _check_frees(gm, pos, base):
    for f in gm.graph.nodes:
        if not meta.is_free(f):
            continue
        for t in f.args[0]:
            for a in alias_closure(base(t)):
                for u in a.users:
                    if meta.is_free(u) or u.op == "output":
                        continue
                    end = u
                    if meta.is_collective_issue(u):
                        end = next(w for w in u.users if meta.is_wait(w))
                    if pos[end] > pos[f]:
                        _fail(f"{end.name} reads {a.name} after it is freed by {f.name}")


def _check_crossing(gm, ctx, base):
    kept = {u.index for u in ctx.units or () if u.stays_gathered}
    for n in gm.graph.nodes:
        if not meta.is_backward(n):
            continue
        for a in n.all_input_nodes:
            root = base(a)
            if (meta.is_forward(a) and meta.tag(root, meta.COMM) in meta.GATHERED
                    and meta.tag(root, meta.UNIT) not in kept):
                _fail(
                    f"backward node {n.name} reads {a.name}, a gathered parameter (or view) "
                    "from the forward; it must be re-gathered in backward"
                )


def _check_chunks(gm, ctx, base):
    groups = {u.index: u.group for u in ctx.units or () if not u.stays_gathered and u.group}
    freed = {a for f in gm.graph.nodes if meta.is_free(f) for a in f.args[0]}
    for c in gm.graph.nodes:
        unit = meta.tag(c, meta.UNIT)
        if meta.tag(c, meta.COMM) == meta.AG_ISSUE and meta.is_backward(c) and unit in groups:
            sent = base(c.args[0])
            if meta.tag(sent, meta.COMM) != meta.AG_CHUNK or meta.group_size(c) != groups[unit]:
                _fail(f"backward all-gather {c.name} of unit {unit}, resharded to groups of "
                      f"{groups[unit]}, must send its chunk over {groups[unit]} ranks; it "
                      f"sends {sent.name} over {meta.group_size(c)}")
        if meta.tag(c, meta.COMM) != meta.AG_CHUNK:
            continue
        k = groups.get(unit, 0)
        if not k or c.args[1] != k:
            _fail(f"{c.name} copies a chunk of 1/{c.args[1]} for unit {unit}, which is "
                  f"resharded after the forward to {f'groups of {k}' if k else 'no group'}")
        src = c.args[0]
        if (not meta.is_forward(c) or not meta.is_forward(src)
                or meta.tag(base(src), meta.COMM) not in meta.GATHERED
                or meta.tag(base(src), meta.UNIT) != unit):
            _fail(f"{c.name} must copy, in the forward, out of unit {unit}'s forward gathered "
                  f"buffer; it reads {src.name}")
        for u in c.users:
            if meta.is_free(u):
                continue
            if not (meta.tag(u, meta.COMM) == meta.AG_ISSUE and meta.is_backward(u)
                    and meta.tag(u, meta.UNIT) == unit and meta.group_size(u) == k):
                _fail(f"{u.name} reads chunk {c.name} of unit {unit}; only the unit's backward "
                      f"all-gather over its group of {k} may")
        if c not in freed:
            _fail(f"chunk {c.name} of unit {unit} is never freed")


def _check_reductions(gm, pos, specs, sync: bool, base):
    out = meta.output_node(gm)
    for v, r in zip(out.args[0], meta.tags(out)[meta.OUTPUTS]):
        if r[meta.ROLE] != meta.OUT_GRAD:
            continue
        root = base(v)
        while meta.tag(root, meta.COMM) in (meta.RS_UNPACK, meta.D2H):  # cast, or copied out
            root = base(root.args[0])
        done = []  # the reductions it went through, last first
        while meta.is_collective_issue(root):
            kind = "rs" if meta.tag(root, meta.COMM) == meta.RS_ISSUE else "ar"
            done.append((kind, meta.group_size(root)))
            op = specs[r[meta.FQN]].scaling[0]
            if root.args[1] != op:
                _fail(f"gradient of {r[meta.FQN]} is reduced by {root.name} with reduce op "
                      f"{root.args[1]!r}; its ParamSpec.scaling says {op!r}")
            root = base(root.args[0])
        want = [(k, n) for k, _, n in specs[r[meta.FQN]].reduction] if sync else []
        if done[::-1] != want:
            def say(steps):
                return " then ".join(f"{'reduce-scatter' if k == 'rs' else 'all-reduce'} over "
                                     f"{n}" for k, n in steps) or "reduction"

            _fail(f"gradient of {r[meta.FQN]} is returned without a {say(want)} as its "
                  f"ParamSpec says (it went through {say(done[::-1]) if done else 'none'})")
    for rs in gm.graph.nodes:
        if (not meta.is_collective_issue(rs) or meta.tag(rs, meta.COMM) == meta.AG_ISSUE
                or meta.is_collective_issue(base(rs.args[0]))):
            continue  # not a reduction's first step
        # the full gradients packed into this reduction: pack nodes' non-pack inputs
        stack, fulls, seen = [rs], set(), set()
        while stack:
            n = stack.pop()
            for a in n.all_input_nodes:
                if a in seen:
                    continue
                seen.add(a)
                if meta.tag(a, meta.COMM) == meta.RS_PACK:
                    stack.append(a)
                else:
                    fulls.add(a)
        for full in fulls:
            # a lone gradient already flat is reduced as it is: the issue is its packing
            packs = [u for u in full.users
                     if meta.tag(u, meta.COMM) == meta.RS_PACK or u is rs]
            if len({meta.tag(p, meta.UNIT) for p in packs}) != 1:
                _fail(f"full gradient {full.name} is reduced more than once")
            for a in alias_closure(base(full)):
                for u in a.users:
                    if pos[u] > pos[rs] and writes_input(u) and not meta.is_free(u):
                        _fail(f"{u.name} updates gradient {full.name} after its reduction")


def _check_recomputed(nodes: list, storage, base=None) -> None:
    """No recomputed node is, or reads, a storage some node writes (``storage`` maps an
    ``alias_base`` node to the storage it stands for)."""
    base = base or alias_bases(nodes).__getitem__
    mutated = {storage(base(w)) for n in nodes if not meta.is_comm(n)
               for w in written_inputs(n)}
    for r in nodes:
        if not meta.tag(r, meta.RECOMPUTED):
            continue
        for a in (r, *r.all_input_nodes):
            if storage(base(a)) in mutated:
                _fail(f"recomputed node {r.name} (a copy of {meta.tag(r, meta.RECOMPUTED)}) "
                      f"reads {a.name}, whose storage is written in place during the step: "
                      "its value at recompute time may differ from the forward's")


def _check_split_recomputed(split) -> None:
    """The same on the graphs that run: a saved backward input stands for the storage of
    the forward value it carries, so writes in either graph count."""
    if split.bwd is None:
        return
    fwd_out = list(meta.output_node(split.fwd).args[0])
    saved_vals = fwd_out[len(fwd_out) - len(split.saved):]
    phs = [n for n in split.bwd.graph.nodes if n.op == "placeholder"][: len(split.saved)]
    carries = {p: alias_base(v) for p, v in zip(phs, saved_vals)}
    nodes = list(split.fwd.graph.nodes) + list(split.bwd.graph.nodes)
    _check_recomputed(nodes, lambda b: carries.get(b, b))

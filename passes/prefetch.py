"""prefetch: issue all-gathers early and wait for reduce-scatters late, within a byte bound."""

from __future__ import annotations

import torch.fx as fx

from autoshard.core import meta
from autoshard.core.cost import collective_time, node_time
from autoshard.core.graph import alias_base


def _issue_block(issue: fx.Node) -> list:
    """The pack nodes feeding ``issue`` (contiguous before it), then the issue."""
    block = [issue]
    n = issue.prev
    packing = (meta.H2D, meta.AG_PACK, meta.AG_BUFFER, meta.RS_PACK)
    while meta.tag(n, meta.COMM) in packing and meta.tag(n, meta.UNIT) == meta.tag(issue,
                                                                                   meta.UNIT):
        block.insert(0, n)
        n = n.prev
    return block


def _wait_block(wait: fx.Node) -> list:
    """``wait`` and the frees, unpacks and further reduction steps (an all-reduce after a
    reduce-scatter, and its wait) of its unit that follow it."""
    block, n = [wait], wait.next
    unit = meta.tag(wait, meta.UNIT)
    while (meta.tag(n, meta.COMM) in (meta.FREE, meta.RS_UNPACK, meta.D2H, meta.AR_ISSUE,
                                      meta.AR_WAIT)
           and meta.tag(n, meta.UNIT) == unit):
        block.append(n)
        n = n.next
    return block


def _wait_of(issue: fx.Node) -> fx.Node:
    return next(u for u in issue.users if meta.is_wait(u))


def prefetched(issue: fx.Node) -> bool:
    """Whether ``issue`` (an all-gather) was moved ahead of its wait: compute runs between
    them. One that was not is where ``insert_collectives`` put it, before its first reader;
    the byte bound does not move it, so a unit larger than the bound is gathered alone."""
    n, wait = issue.next, _wait_of(issue)
    while n is not wait:
        if not meta.is_comm(n):
            return True
        n = n.next
    return False


def gathered_spans(gm: fx.GraphModule, region: str) -> list:
    """Per all-gather of ``region``, in order: (issue node, bytes, position where the last of
    its gathered storages is freed)."""
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    release = {}
    for n in nodes:
        if meta.is_free(n):
            for t in n.args[0]:
                root = alias_base(t)
                if meta.tag(root, meta.COMM) in meta.GATHERED:
                    key = (meta.tag(root, meta.UNIT), meta.tag(root, meta.REGION))
                    release[key] = max(release.get(key, 0), pos[n])
    return [(n, meta.val_bytes(n), release.get((meta.tag(n, meta.UNIT), region), pos[n]))
            for n in nodes if meta.tag(n, meta.COMM) == meta.AG_ISSUE
            and meta.tag(n, meta.REGION) == region]


def prefetch_pass(gm: fx.GraphModule, ctx, *,
                  options) -> tuple[fx.GraphModule, dict]:
    """Move each all-gather (with its packing) earlier, and each reduce-scatter's wait later.

    Needs: the tags insert_collectives writes; ``ctx.profile`` for compute times.
    Options: ``max_inflight_bytes`` — bound on the gathered bytes of units whose all-gather is
    issued and whose gathered parameters are not yet all freed, at each gather moved ahead
    (one left where it is read may exceed it: a unit larger than the bound, or the units one
    node reads; default: no bound beyond ``max_depth``); ``max_depth`` — how many units
    ahead a gather may be issued (default 2);
    ``max_copy_bytes`` — bound on the offloaded activations copied back and not yet read
    (``_prefetch_copies``; default: none but the compute that covers each copy).
    Guarantees: the same nodes in an order every rank computes alike; every wait still
    precedes every use; within a region, the all-gather of unit k is issued right after the
    wait of unit k-d, with d >= 1 the smallest depth whose compute in between covers the
    gather's predicted time, capped by ``max_depth`` and the byte bound (d = 0, no move, when
    the bound does not allow one unit ahead); the wait of each reduce-scatter moves to just
    before the next reduce-scatter's packing (one in flight, as FSDP2 does).
    Does nothing with fewer than two units in a region. Reorder-only::

        before:  AG0 W0 [fwd 0] AG1 W1 [fwd 1] AG2 W2 [fwd 2]
        after:   AG0 W0 AG1 [fwd 0] W1 AG2 [fwd 1] W2 [fwd 2]

        before:  [bwd 2] RS2 W2 [bwd 1] RS1 W1 [bwd 0] RS0 W0
        after:   [bwd 2] RS2 [bwd 1] W2 RS1 [bwd 0] W1 RS0 W0
    """
    cap = options.get("max_inflight_bytes")
    max_depth = options.get("max_depth", 2)
    profile = ctx.profile
    for region in (meta.FWD, meta.BWD):
        nodes = list(gm.graph.nodes)
        pos = {n: i for i, n in enumerate(nodes)}
        times = [0.0]
        for n in nodes:
            t = node_time(n, profile) if profile is not None and not meta.is_comm(n) else 0.0
            times.append(times[-1] + t)
        spans = gathered_spans(gm, region)
        issues = [s[0] for s in spans]
        sizes = [s[1] for s in spans]
        releases = [s[2] for s in spans]
        waits = [_wait_of(i) for i in issues]
        at = [pos[i] for i in issues]  # where each gather is issued, as placed so far

        def inflight(point: float, k: int) -> int:
            return sizes[k] + sum(sizes[j] for j in range(k) if at[j] <= point < releases[j])

        tail = {}  # anchor -> last node placed after it, so issue order stays unit order
        for k in range(1, len(issues)):
            need = (collective_time(sizes[k], meta.group_size(issues[k]), profile)
                    if profile else 0.0)
            depth = 0
            for d in range(1, min(max_depth, k) + 1):
                point = pos[waits[k - d]] + 0.5
                if cap is not None and inflight(point, k) > cap:
                    break
                depth = d
                if times[pos[waits[k]]] - times[pos[waits[k - d]] + 1] >= need:
                    break
            if depth:
                anchor = waits[k - depth]
                at[k] = pos[anchor] + 0.5
                block = _issue_block(issues[k])
                where = tail.get(anchor, anchor)
                for n in reversed(block):
                    where.append(n)
                tail[anchor] = block[-1]
    # reduction waits: defer each to just before the next reduction's packing (a reduction's
    # first step: its input is no collective's)
    rs = [n for n in gm.graph.nodes if meta.tag(n, meta.COMM) in (meta.RS_ISSUE, meta.AR_ISSUE)
          and not meta.is_collective_issue(alias_base(n.args[0]))]
    for k in range(len(rs) - 1):
        block = _wait_block(_wait_of(rs[k]))
        first_pack = _issue_block(rs[k + 1])[0]
        for n in block:
            first_pack.prepend(n)
    _prefetch_copies(gm, profile, options.get("max_copy_bytes"))
    gm.recompile()
    return gm, {"prefetch_cap": cap}


def _prefetch_copies(gm: fx.GraphModule, profile, cap) -> None:
    """Move each offloaded activation's copy back to the device (with the free of its host
    copy) earlier in the backward: to after the latest compute node from which the compute up
    to its reader covers the copy's time at ``profile.host_bandwidth``; never before the
    backward starts nor before the copy placed ahead of it (the copies run in order), and
    with ``cap``, never where the bytes copied in and not yet read would exceed it. Nothing
    moves without a host link (the host is the device: an early copy only takes memory)."""
    if profile is None or not profile.host_bandwidth:
        return
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    copies = [n for n in nodes if meta.tag(n, meta.COMM) == meta.ACT_H2D]
    if not copies:
        return
    times = [0.0]
    for n in nodes:
        times.append(times[-1] + (0.0 if meta.is_comm(n) else node_time(n, profile)))
    spans, floor = [], min(pos[n] for n in nodes if meta.is_backward(n))
    for c in copies:
        reader = min((pos[u] for u in c.users if not meta.is_free(u)), default=pos[c])
        need, size = meta.val_bytes(c) / profile.host_bandwidth, meta.val_bytes(c)
        p, at = pos[c] - 1, pos[c]
        while p > floor and times[reader] - times[p + 1] < need:
            if cap is not None and size + sum(s for a, r, s in spans if a <= p < r) > cap:
                break
            if not meta.is_comm(nodes[p]) and meta.is_backward(nodes[p]):
                at = p + 0.5
            p -= 1
        if at != pos[c]:
            anchor = nodes[int(at)]
            block = [c, c.next] if meta.is_free(c.next) else [c]
            for n in reversed(block):
                anchor.append(n)
        spans.append((at, reader, size))
        floor = int(at) if at != pos[c] else pos[c]


prefetch_pass.reorder_only = True

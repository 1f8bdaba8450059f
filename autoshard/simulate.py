"""Predict a compiled step: when each node runs, what communication is exposed, and how many
bytes each rank holds at every point.

Time: one compute stream and one communication stream. A collective starts when it is issued
and the communication stream is free; a wait holds compute until its collective ends (the
exposed time). Memory: the forward, then the backward graph run in order. A node allocates its
output unless it is a view; a storage is released by a free node, or once no live value views
it: values die after their last use, as the generated code drops them. The forward's saved
tensors live until their last use in the (boxed) backward; its user outputs until the end of
the step; the gradient shards it returns stay.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from autoshard import meta
from autoshard.cost import DeviceProfile, collective_time, node_time
from autoshard.graph import _aliased_arg


@dataclasses.dataclass
class Prediction:
    compute: float  # seconds of compute
    exposed_comm: float  # seconds compute waited on communication
    total: float
    peak_bytes: int
    peak_at: str  # "<graph>:<node>"
    timeline: list  # [time, live bytes, graph, node name] per node
    events: list  # [lane, name, start, duration, unit]: compute groups and collectives
    comm_bytes: int  # collective buffer bytes per step
    sent_bytes: int  # bytes each rank sends per step (ring)


def _size(n: fx.Node) -> int:
    v = n.meta.get("val")
    return v.numel() * v.element_size() if isinstance(v, torch.Tensor) else 0


class _Storages:
    """Reference-counted storages: a live value holds one reference on its storage."""

    def __init__(self, base: int):
        self.bytes, self.refs, self.total = {}, {}, base

    def acquire(self, sid, size: int):
        if sid not in self.refs:
            self.refs[sid], self.bytes[sid] = 0, size
            self.total += size
        self.refs[sid] += 1

    def release(self, sid):
        self.refs[sid] -= 1
        if self.refs[sid] == 0:
            self.total -= self.bytes.pop(sid)
            del self.refs[sid]

    def free(self, sid):
        if sid in self.bytes:
            self.total -= self.bytes[sid]
            self.bytes[sid] = 0


def simulate(fwd: fx.GraphModule, bwd, profile: DeviceProfile, world_size: int,
             static_bytes: int, n_user_outputs: int) -> Prediction:
    """``static_bytes``: what each rank holds throughout the step (parameter shards, optimizer
    state, buffers, inputs); the forward's first ``n_user_outputs`` outputs are the user's."""
    mem = _Storages(static_bytes)
    clock = {"compute": 0.0, "comm": 0.0, "exposed": 0.0, "busy": 0.0}
    pending, timeline, events = {}, [], []
    totals = {"comm": 0, "sent": 0}
    peak = [static_bytes, "start"]
    group = []  # the open compute group, [lane, name, start, dur, unit]

    def close_group():
        if group and group[0][3] > 0:
            events.append(group[0])
        group.clear()

    def step_time(n, gname):
        kind = meta.tag(n, meta.COMM)
        if kind in meta.COLLECTIVE_ISSUES:
            size = _size(n) if kind == meta.AG_ISSUE else _size(n.args[0])
            dur = collective_time(size, world_size, profile)
            start = max(clock["compute"], clock["comm"])
            clock["comm"] = pending[n] = start + dur
            totals["comm"] += size
            totals["sent"] += size * (world_size - 1) // world_size
            events.append(["comm", f"{kind} unit {meta.tag(n, meta.UNIT)}", start, dur,
                           meta.tag(n, meta.UNIT)])
        elif kind in (meta.AG_WAIT, meta.RS_WAIT):
            end = pending.get(n.args[0], 0.0)
            if end > clock["compute"]:
                clock["exposed"] += end - clock["compute"]
                close_group()
                clock["compute"] = end
        else:
            dur = node_time(n, profile)
            if dur:
                name = f"{gname}:{meta.tag(n, meta.MODULE) or '-'}"
                if not group or group[0][1] != name:
                    close_group()
                    group.append(["compute", name, clock["compute"], 0.0, meta.tag(n, meta.UNIT)])
                group[0][3] += dur
                clock["compute"] += dur
                clock["busy"] += dur

    def run(gm, gname, sids):
        """Run one graph; ``sids`` maps its placeholders to storages already held (or None
        for static ones). Returns (output nodes, their storage ids)."""
        nodes = list(gm.graph.nodes)
        last = {}
        for i, n in enumerate(nodes):
            for a in n.all_input_nodes:
                last[a] = i
        out = nodes[-1]
        returned = set(out.all_input_nodes)
        for i, n in enumerate(nodes):
            if n.op == "placeholder":
                if sids.get(n) is not None and not n.users:
                    mem.release(sids[n])
                continue
            if n.op == "output":
                break
            step_time(n, gname)
            if meta.is_free(n):
                for t in n.args[0]:
                    mem.free(sids[t])
            elif isinstance(n.meta.get("val"), torch.Tensor):
                src = _aliased_arg(n)
                sids[n] = sids.get(src) if src is not None else n
                if sids[n] is not None:
                    mem.acquire(sids[n], _size(n))
            timeline.append([clock["compute"], mem.total, gname, n.name])
            if mem.total > peak[0]:
                peak[0], peak[1] = mem.total, f"{gname}:{n.name}"
            if not n.users and sids.get(n) is not None and n not in returned:
                mem.release(sids[n])
            for a in n.all_input_nodes:
                if last.get(a) == i and a not in returned and sids.get(a) is not None:
                    mem.release(sids[a])
        close_group()
        values = [a for a in out.args[0]]
        held = [sids.get(a) if isinstance(a, fx.Node) else None for a in values]
        for sid in held:  # one reference per returned position
            if sid is not None:
                mem.acquire(sid, 0)
        for n in returned:  # the values themselves die with the graph
            if sids.get(n) is not None:
                mem.release(sids[n])
        return held

    fwd_sids = {n: None for n in fwd.graph.nodes if n.op == "placeholder"}
    held = run(fwd, "fwd", fwd_sids)
    user, rest = held[:n_user_outputs], held[n_user_outputs:]
    if bwd is not None:
        phs = [n for n in bwd.graph.nodes if n.op == "placeholder"]
        n_saved = len(phs) - sum(meta.is_tangent(p) for p in phs)
        mutated = rest[: len(rest) - n_saved]
        saved = rest[len(rest) - n_saved:]
        for sid in mutated:  # copied into the buffers, then dropped
            if sid is not None:
                mem.release(sid)
        bwd_sids = {}
        for p, sid in zip(phs[:n_saved], saved):
            bwd_sids[p] = sid
        for p in phs[n_saved:]:  # tangents: made by the loss's backward
            bwd_sids[p] = ("tangent", p.name)
            mem.acquire(bwd_sids[p], _size(p))
        run(bwd, "bwd", bwd_sids)
    for sid in user:
        if sid is not None:
            mem.release(sid)
    return Prediction(
        compute=clock["busy"], exposed_comm=clock["exposed"], total=clock["compute"],
        peak_bytes=peak[0], peak_at=peak[1], timeline=timeline, events=events,
        comm_bytes=totals["comm"], sent_bytes=totals["sent"],
    )

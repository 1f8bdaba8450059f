"""Predict a compiled step: when each node runs, what communication is exposed, and how many
bytes each rank holds at every point.

Time: one compute stream and one communication stream. A collective starts when it is issued
and the communication stream is free; a wait holds compute until its collective ends (the
exposed time). Memory: the forward, then the backward graph run in order. A node allocates its
output unless it is a view; a storage is released by a free node, or once no live value views
it: values die after their last use, as the generated code drops them. The forward's saved
tensors live until their last use in the (boxed) backward; its user outputs until the end of
the step; the gradient shards it returns stay. An offloaded parameter's shard, gradient shard
and optimizer state are host memory and not counted; its copy to the device is, until packed.

Offloaded activations (``autoshard.passes.offload``): where the host is not the device
(``DeviceProfile.host_bandwidth`` > 0) each copy runs on a copy lane of its own (a side
stream) at that bandwidth, one after another, beside the compute; a node reading a copy
waits for it (exposed time), and a free of a value a copy still reads takes effect when the
copy ends. The host copy is host memory. Where the host is the device, a copy is a compute
node like any other and its output device memory: offload then saves nothing.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from autoshard.core import meta
from autoshard.core.cost import DeviceProfile, MAX_FINITE, collective_time, node_time, ring_rounds
from autoshard.core.graph import aliased_arg, param_derived, partition


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
    host_peak_bytes: int = 0  # host memory: offloaded state, gradient shards copied out
    # device and host bytes at once: what a machine whose host is its device (a CPU) holds
    both_peak_bytes: int = 0


_NO_TAGS: dict = {}


def _size(n: fx.Node) -> int:
    v = n.meta.get("val")
    return v.numel() * v.element_size() if isinstance(v, torch.Tensor) else 0


class _Storages:
    """Reference-counted storages: a live value holds one reference on its storage. Device
    bytes are ``total``, host bytes (offloaded state, gradient shards copied out)
    ``host_total``."""

    def __init__(self, base: int, host_base: int = 0):
        self.bytes, self.refs, self.total, self.host_total = {}, {}, base, host_base
        self.host = set()

    def _add(self, sid, size: int):
        if sid in self.host:
            self.host_total += size
        else:
            self.total += size

    def acquire(self, sid, size: int, host: bool = False):
        if sid not in self.refs:
            if host:
                self.host.add(sid)
            self.refs[sid], self.bytes[sid] = 0, size
            self._add(sid, size)
        self.refs[sid] += 1

    def release(self, sid):
        self.refs[sid] -= 1
        if self.refs[sid] == 0:
            self._add(sid, -self.bytes.pop(sid))
            del self.refs[sid]
            self.host.discard(sid)

    def free(self, sid):
        if sid in self.bytes:
            self._add(sid, -self.bytes[sid])
            self.bytes[sid] = 0


class _Sim:
    """One predicted run: a compute clock, a communication clock, and the live storages."""

    def __init__(self, profile: DeviceProfile, static_bytes: int, host_bytes: int = 0):
        self.profile = profile
        self.mem = _Storages(static_bytes, host_bytes)
        self.host_peak = self.both_peak = host_bytes + static_bytes
        self.tc = self.tq = self.busy = self.exposed = 0.0
        self.pending, self.timeline, self.events, self.group = {}, [], [], None
        self.scratch = []  # (completion time, storage id) of collectives' scratch copies
        self.held_inputs = {}  # collective issue -> storage of its input, held until the wait
        self.comm = self.sent = 0
        self.peak, self.peak_at = static_bytes, "start"
        # offloaded activations: the copy lane's clock, when each copy's value is ready,
        # until when a copy reads its source, and the storages copies hold: (end, storage)
        self.th, self.ready, self.reading, self.later = 0.0, {}, {}, []
        self.host_copies = profile.host_bandwidth > 0

    def close_group(self):
        if self.group is not None and self.group[3] > 0:
            self.events.append(self.group)
        self.group = None

    def copy(self, n: fx.Node, kind) -> None:
        """An offloaded activation's copy on the copy lane, after the one before it."""
        size = _size(n)
        start = max(self.tc, self.th)
        self.th = self.ready[n] = self.reading[n.args[0]] = start + size / (
            self.profile.host_bandwidth)
        self.events.append(["copy", f"{kind} {meta.tag(n, meta.OFFLOADED)}", start,
                            self.th - start, None])

    def wait_ready(self, n: fx.Node) -> None:
        """Hold compute until every offload copy ``n`` reads has ended."""
        end = max((self.ready.get(a, 0.0) for a in n.all_input_nodes), default=0.0)
        if end > self.tc:
            self.exposed += end - self.tc
            self.close_group()
            self.tc = end

    def step_time(self, n: fx.Node, gname: str, kind):
        """Advance the clocks over ``n``; ``kind``: its ``meta.COMM`` tag."""
        if self.ready and kind != meta.FREE:
            self.wait_ready(n)
        if kind in (meta.ACT_D2H, meta.ACT_H2D) and self.host_copies:
            self.copy(n, kind)
        elif kind in meta.COLLECTIVE_ISSUES:
            size = _size(n) if kind == meta.AG_ISSUE else _size(n.args[0])
            world = meta.group_size(n)
            rounds = ring_rounds(kind)
            dur = collective_time(size, world, self.profile, rounds,
                                  meta.tag(n, meta.STRIDE, 1))
            start = max(self.tc, self.tq)
            self.tq = self.pending[n] = start + dur
            held = dur * (1 - self.profile.comm_overlap)  # what compute cannot run beside
            if held:
                self.close_group()
                self.tc += held
                self.exposed += held
            scratch = int(size * self.profile.collective_scratch)
            if scratch:  # the backend's own copy, held until the collective completes
                self.mem.acquire(("scratch", n), scratch)
                self.scratch.append((self.tq, ("scratch", n)))
            self.comm += size
            self.sent += rounds * size * (world - 1) // world
            self.events.append(["comm", f"{kind} unit {meta.tag(n, meta.UNIT)}", start, dur,
                                meta.tag(n, meta.UNIT)])
        elif kind in meta.WAITS:
            end = self.pending.get(n.args[0], 0.0)
            if end > self.tc:
                self.exposed += end - self.tc
                self.close_group()
                self.tc = end
        else:
            dur = node_time(n, self.profile)
            if dur:
                key = (gname, meta.tag(n, meta.MODULE) or "-")
                if self.group is None or self.group_key != key:
                    self.close_group()
                    self.group = ["compute", "%s:%s" % key, self.tc, 0.0, meta.tag(n, meta.UNIT)]
                    self.group_key = key
                self.group[3] += dur
                self.tc += dur
                self.busy += dur

    def run(self, nodes: list, outputs: list, gname: str, sids: dict,
            hold_outputs: bool = True, uncounted=()):
        """Run ``nodes`` (a graph's, in order, without its output node) returning
        ``outputs``; ``sids`` maps the values they read from elsewhere (placeholders, or a
        forward's saved values) to storages already held (None for static ones),
        ``uncounted`` are nodes whose values are not counted. Returns the storage held for
        each returned value (one reference per returned position), or nothing when
        ``hold_outputs`` is False (what only the output reads dies as soon as it is made)."""
        mem = self.mem
        last = {}
        inputs = [n.all_input_nodes for n in nodes]  # once: a property that builds a list
        for i, ins in enumerate(inputs):
            for a in ins:
                last[a] = i
        returned = {a for a in outputs if isinstance(a, fx.Node)} if hold_outputs else set()
        timeline, tensor = self.timeline, torch.Tensor
        for i, n in enumerate(nodes):
            if n.op == "placeholder":
                if sids.get(n) is not None and n not in last and n not in returned:
                    mem.release(sids[n])
                continue
            kind = n.meta.get(meta.KEY, _NO_TAGS).get(meta.COMM)
            self.step_time(n, gname, kind)
            while self.scratch and self.scratch[0][0] <= self.tc:
                mem.release(self.scratch.pop(0)[1])
            if self.later:
                self.free_later()
            if kind in meta.COLLECTIVE_ISSUES and sids.get(n.args[0]) is not None:
                self.held_inputs[n] = sids[n.args[0]]  # the backend holds its input
                mem.acquire(self.held_inputs[n], 0)
            elif kind in meta.WAITS and n.args[0] in self.held_inputs:
                mem.release(self.held_inputs.pop(n.args[0]))
            if (kind in (meta.ACT_D2H, meta.ACT_H2D) and self.host_copies
                    and sids.get(n.args[0]) is not None):  # the copy holds what it reads
                mem.acquire(sids[n.args[0]], 0)
                self.later.append((self.ready[n], sids[n.args[0]]))
            if kind == meta.FREE:
                for t in n.args[0]:
                    # a copy still reading it holds it: it goes when the copy ends
                    if self.reading.get(t, 0.0) <= self.tc:
                        mem.free(sids[t])
            elif isinstance(n.meta.get("val"), tensor):
                src = aliased_arg(n)
                sids[n] = sids.get(src) if src is not None else (None if n in uncounted else n)
                if sids[n] is not None:  # a gradient shard copied out lands in host memory
                    mem.acquire(sids[n], _size(n), host=kind == meta.D2H or (
                        kind == meta.ACT_D2H and self.host_copies))
            total, host_total = mem.total, mem.host_total
            timeline.append([self.tc, total, gname, n.name])
            if total > self.peak:
                self.peak, self.peak_at = total, f"{gname}:{n.name}"
            if host_total > self.host_peak:
                self.host_peak = host_total
            if total + host_total > self.both_peak:
                self.both_peak = total + host_total
            if n not in last and sids.get(n) is not None and n not in returned:
                mem.release(sids[n])
            for a in inputs[i]:
                if last.get(a) == i and a not in returned and sids.get(a) is not None:
                    mem.release(sids[a])
        self.close_group()
        if not hold_outputs:
            return []
        held = [sids.get(a) if isinstance(a, fx.Node) else None for a in outputs]
        for sid in held:
            if sid is not None:
                mem.acquire(sid, 0)
        for n in returned:  # the values themselves die with the graph
            if sids.get(n) is not None:
                mem.release(sids[n])
        return held

    def free_later(self) -> None:
        """Release what the copies ended by now held."""
        done = [x for x in self.later if x[0] <= self.tc]
        for _, sid in done:
            self.mem.release(sid)
        self.later = [x for x in self.later if x[0] > self.tc]

    def prediction(self) -> Prediction:
        return Prediction(
            compute=self.busy, exposed_comm=self.exposed, total=self.tc,
            peak_bytes=self.peak, peak_at=self.peak_at, timeline=self.timeline,
            events=self.events, comm_bytes=self.comm, sent_bytes=self.sent,
            host_peak_bytes=self.host_peak, both_peak_bytes=self.both_peak,
        )


def simulate(fwd: fx.GraphModule, bwd, profile: DeviceProfile, static_bytes: int,
             n_user_outputs: int, host_bytes: int = 0) -> Prediction:
    """``static_bytes``: what each rank holds throughout the step on the device (parameter
    shards, optimizer state, buffers, inputs), ``host_bytes`` in host memory (offloaded shards
    and optimizer state); the forward's first ``n_user_outputs`` outputs are the user's."""
    def body(gm):
        nodes = list(gm.graph.nodes)
        return nodes[:-1], list(nodes[-1].args[0])

    fwd_nodes, fwd_out = body(fwd)
    bwd_part = None
    if bwd is not None:
        nodes, out = body(bwd)
        phs = [n for n in nodes if n.op == "placeholder"]
        n_saved = len(phs) - sum(meta.is_tangent(p) for p in phs)
        bwd_part = (nodes, out, phs[:n_saved])
    return _simulate(fwd_nodes, fwd_out, bwd_part, profile, static_bytes, n_user_outputs,
                     host_bytes)


def simulate_joint(joint: fx.GraphModule, profile: DeviceProfile, static_bytes: int,
                   host_bytes: int = 0) -> Prediction:
    """``simulate`` of the program ``autoshard.passes.split`` would make of ``joint``, without
    making it (the same prediction: the same nodes in the same order with the same saved
    values)."""
    part = partition(joint)
    n_user = sum(part.roles[i][meta.ROLE] == meta.OUT_FWD for i in part.fwd_idx)
    bwd = (part.bwd, part.bwd_outputs(), part.saved) if part.bwd else None
    return _simulate(part.fwd, part.fwd_outputs(), bwd, profile, static_bytes, n_user,
                     host_bytes)


def _simulate(fwd_nodes, fwd_out, bwd, profile, static_bytes, n_user_outputs, host_bytes):
    """``bwd``: None, or (its nodes, its outputs, the values standing for the forward's saved
    ones, in the order the forward returns them after its user outputs and buffers)."""
    sim = _Sim(profile, static_bytes, host_bytes)
    held = sim.run(fwd_nodes, fwd_out, "fwd",
                   {n: None for n in fwd_nodes if n.op == "placeholder"})
    user, rest = held[:n_user_outputs], held[n_user_outputs:]
    if bwd is not None:
        nodes, out, saved = bwd
        n_saved = len(saved)
        for sid in rest[: len(rest) - n_saved]:  # mutated buffers: copied in, then dropped
            if sid is not None:
                sim.mem.release(sid)
        sids = dict(zip(saved, rest[len(rest) - n_saved:]))
        for p in nodes:  # made by the loss's backward
            if meta.is_tangent(p):
                sids[p] = ("tangent", p.name)
                sim.mem.acquire(sids[p], _size(p))
        sim.run(nodes, out, "bwd", sids)
    for sid in user:
        if sid is not None:
            sim.mem.release(sid)
    return sim.prediction()


_BYTES_ONLY: dict = {}  # host -> activations' profile


def _bytes_only(host: bool) -> DeviceProfile:
    """``activations``' profile: it counts bytes, not time. One object per ``host`` for the
    process, so that the times nodes get under it are kept with them (``node_time`` keys them
    by the profile) for every later call on the graph or its copies."""
    if host not in _BYTES_ONLY:
        _BYTES_ONLY[host] = DeviceProfile("none", 1.0, 1.0, 0.0, 0.0, 1,
                                          host_bandwidth=MAX_FINITE if host else 0)
    return _BYTES_ONLY[host]


def activations(joint: fx.GraphModule, host: bool = False) -> tuple:
    """``(peak, live)``: the peak bytes of everything but the parameters over the joint graph
    (before collectives: what a step holds besides the model state and the gathered units)
    and, per node name, the activation bytes live while the node runs (its output included).
    Values computed from parameters alone are not counted: the step recomputes them where the
    backward reads them (``autoshard.passes.collectives``), so what is counted is live in any
    plan. ``host``: whether offloaded activations' host copies are host memory (a profile
    with a host link), their copies then taken as instant (the least the device holds)."""
    sim = _Sim(_bytes_only(host), 0)
    sids = {n: None for n in joint.graph.nodes if n.op == "placeholder"}
    for n in sids:
        if meta.is_tangent(n):
            sids[n] = n
            sim.mem.acquire(n, _size(n))
    nodes = list(joint.graph.nodes)
    sim.run(nodes[:-1], list(nodes[-1].args[0]), "joint", sids, hold_outputs=False,
            uncounted=param_derived(joint))
    return sim.peak, {name: live for _, live, _, name in sim.timeline}

"""Host<->device copies on copy streams of their own, ordered by events (CUDA only).

The passes write every copy between host and device memory as a graph node tagged with a kind
in ``meta.COPIES`` (an offloaded shard copied in before its all-gather, a gradient shard copied
out after its reduce-scatter; activations copied out and in join with their own kinds). Run as
written, on one stream, a copy holds up the compute queued behind it. On a GPU the executor
runs the graphs ``route`` rewrites instead: each copy goes to one copy stream per direction
(host to device, device to host), and event waits put back exactly the order the data needs::

    compute  - a - b -+- c - d - wait(ev) - e(reads y) - ...      (waits just before y's
                      | (y reads b's output)   ^                    first reader)
    d2h               +- wait - copy y - record ev

What ``route``'s graph guarantees, per copy node ``y``:

- it is issued where the graph has it, on its direction's stream; that stream first waits for
  the compute stream (all queued so far, the producer included) when the copy reads device
  memory, and waits for nothing when it reads host memory only (a shard copied in starts at
  once, ahead of the compute it feeds);
- a copy to the device is ``non_blocking`` from the host tensor (offloaded shards are pinned,
  ``runtime.storage``); a copy to the host goes into a freshly allocated pinned tensor, so it
  is asynchronous too (a destination that is not pinned makes the host wait at once);
- before ``y``'s first reader on each side an event recorded after the copy is waited for:
  by the compute stream (a device value), by the host (a host value read by a host op), or
  by the other copy stream (a copy reading a copy);
- an ``autoshard::free`` of device memory a copy read first makes the compute stream wait for
  that copy, so the storage is released only after the copy is done with it; the caching
  allocator is also told (``record_stream``) of every device tensor used on a stream it was
  not allocated on, so memory dropped by reference is not reused under a running copy either;
- before the graph returns, the host waits for every copy it issued: the caller gets only
  finished values (the optimizer steps on host gradient shards, and writes the host shards
  copies in read), and nothing is pending from one graph to the next.

The cost: a device value copied in is allocated from its copy stream's pool of the caching
allocator, and the host waits at the end of each graph for its last copies (at the end of the
forward, for activations copied out last). On a CPU nothing is routed: the graphs run as the
passes wrote them. ``Config(compile=True)`` does not route either: inductor's code runs the
copies in order on the compute stream, as the plan prices them; ``Program.run_instrumented``
(``autoshard.check``) runs the unrouted graphs too.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.fx as fx

from autoshard.core import meta
from autoshard.core.graph import alias_base, clone_graph
from autoshard.core.ops import free_op

_TO_COPY = torch.ops.aten._to_copy.default
H2D, D2H = "h2d", "d2h"  # the two copy streams, by direction
COMPUTE, HOST = "compute", "host"  # where else a copy's reader runs


def _on_host(node) -> Optional[bool]:
    """Whether ``node``'s value is in host memory; None when it is no tensor."""
    v = node.meta.get("val") if isinstance(node, fx.Node) else None
    return v.device.type == "cpu" if isinstance(v, torch.Tensor) else None


def copy_nodes(gm: fx.GraphModule) -> dict:
    """``{node: direction}`` (``H2D`` or ``D2H``) for the nodes of ``gm`` tagged with a kind in
    ``meta.COPIES`` that really cross: their value is on one side (host or device) and a tensor
    they read on the other, as ``meta["val"]`` says. Graph order."""
    out = {}
    for n in gm.graph.nodes:
        if n.op != "call_function" or meta.tag(n, meta.COMM) not in meta.COPIES:
            continue
        to_host = _on_host(n)
        if to_host is None:
            continue
        if any(_on_host(a) is (not to_host) for a in n.all_input_nodes):
            out[n] = D2H if to_host else H2D
    return out


class CudaStreams:
    """What a routed graph calls on a GPU: one copy stream per direction on ``device``,
    created on first use, and the events that order them. One per ``Program``."""

    def __init__(self, device):
        self.device = torch.device(device)
        self._streams = {}

    def stream(self, direction: str):
        s = self._streams.get(direction)
        if s is None:
            s = self._streams[direction] = torch.cuda.Stream(self.device)
        return s

    def issue(self, direction: str, reads_device: bool, op, args, kwargs):
        """Run the copy ``op(*args, **kwargs)`` on ``direction``'s stream; returns (its value,
        an event recorded after it)."""
        compute = torch.cuda.current_stream(self.device)
        side = self.stream(direction)
        if reads_device:
            side.wait_stream(compute)
        with torch.cuda.stream(side):
            out = _async_copy(op, args, kwargs)
            done = torch.cuda.Event()
            done.record(side)
        for t in args:
            if isinstance(t, torch.Tensor) and t.is_cuda:
                t.record_stream(side)
        if out.is_cuda:
            out.record_stream(compute)
        elif not out.is_pinned():
            done.synchronize()  # a pageable destination: the host reads it as soon as it asks
        return out, done

    def wait(self, event, place: str) -> None:
        """Make ``place`` (``COMPUTE``, ``HOST`` or a copy stream's direction) wait for
        ``event``."""
        if place == HOST:
            event.synchronize()
        elif place == COMPUTE:
            torch.cuda.current_stream(self.device).wait_event(event)
        else:
            self.stream(place).wait_event(event)

    def drain(self, events) -> None:
        """The host waits for every one of ``events``."""
        for e in events:
            e.synchronize()


def _async_copy(op, args, kwargs):
    """``op(*args, **kwargs)``, asynchronous where it is ``_to_copy`` to another device: a
    copy in with ``non_blocking``, a copy out into a pinned tensor of ``_to_copy``'s layout."""
    if op is not _TO_COPY or kwargs.get("device") is None:
        return op(*args, **kwargs)
    x, dst = args[0], torch.device(kwargs["device"])
    if dst.type != "cpu":
        return op(*args, **{**kwargs, "non_blocking": True})
    out = torch.empty_like(x, dtype=kwargs.get("dtype") or x.dtype, device=dst,
                           memory_format=kwargs.get("memory_format") or torch.preserve_format,
                           pin_memory=True)
    return out.copy_(x, non_blocking=True)


def route(gm: fx.GraphModule, streams) -> fx.GraphModule:
    """A copy of ``gm`` whose copy nodes (``copy_nodes``) run on ``streams`` (a
    ``CudaStreams``, or any object with its ``issue``, ``wait`` and ``drain``), with the waits
    the module docstring lists; ``gm`` itself when it holds no copy. The copy is for running
    only: its new nodes call closures (it neither prints nor exports as the plan's graph),
    and it computes what ``gm`` computes. The original keeps its codegen (a boxed backward is
    made boxed after routing)."""
    if not copy_nodes(gm):
        return gm
    g = clone_graph(gm)
    copies = copy_nodes(g)
    events = {}  # copy node name -> the event of its latest issue, for one run of the graph
    read_by = {}  # device storage a copy read -> those copies
    waited = set()  # (copy, place): waits already in the graph before the current node
    for node in list(g.graph.nodes):
        for c, place in _waits_before(node, copies, read_by):
            if (c, place) not in waited:
                waited.add((c, place))
                with g.graph.inserting_before(node):
                    g.graph.call_function(_waiter(streams, events, c.name, place))
        if node.op == "output":
            with g.graph.inserting_before(node):
                g.graph.call_function(_drainer(streams, events))
        elif node in copies:
            reads_device = False
            for a in node.all_input_nodes:
                if _on_host(a) is False:
                    reads_device = True
                    read_by.setdefault(alias_base(a), []).append(node)
            node.target = _issuer(streams, events, node.name, copies[node], reads_device,
                                  node.target)
    g.recompile()
    return g


def _waits_before(node, copies: dict, read_by: dict) -> list:
    """``[(copy, place)]``: the copies ``node`` must wait for, and where it runs: each copy
    it reads (on its own stream if it is a copy, else on the compute stream for a device
    value and on the host for a host value), and, for a free, each copy that read device
    memory it releases. The output node waits in the drain instead."""
    if node.op == "output":
        return []
    free = meta.is_free(node) or node.target is free_op
    out = []
    for a in node.all_input_nodes:
        if a not in copies:
            continue
        on_host = _on_host(a)
        if free and on_host:
            continue  # pinned host memory: the host allocator keeps it until the copy ends
        out.append((a, copies[node] if node in copies else HOST if on_host else COMPUTE))
    if free:
        for t in node.all_input_nodes:
            out += [(c, COMPUTE) for c in read_by.get(alias_base(t), ())]
    return out


def _issuer(streams, events: dict, name: str, direction: str, reads_device: bool,
            op) -> Callable:
    def side_copy(*args, **kwargs):
        out, events[name] = streams.issue(direction, reads_device, op, args, kwargs)
        return out

    return side_copy


def _waiter(streams, events: dict, name: str, place: str) -> Callable:
    def wait_for_copy():
        streams.wait(events[name], place)

    return wait_for_copy


def _drainer(streams, events: dict) -> Callable:
    def drain_copies():
        streams.drain(list(events.values()))
        events.clear()

    return drain_copies


def for_device(fwd: fx.GraphModule, bwd: Optional[fx.GraphModule], device_type: str):
    """``(fwd, bwd)`` as the executor runs them: on CUDA, each routed (``route``) over one
    ``CudaStreams`` of the device its copies reach; otherwise, or with the environment
    variable ``AUTOSHARD_COPY_STREAMS=0`` (the copies then run in order on the compute
    stream), the graphs themselves."""
    import os

    if device_type != "cuda" or os.environ.get("AUTOSHARD_COPY_STREAMS", "1") == "0":
        return fwd, bwd
    graphs = [g for g in (fwd, bwd) if g is not None]
    device = next((_device_side(n) for g in graphs for n in copy_nodes(g)), None)
    if device is None:
        return fwd, bwd
    streams = CudaStreams(device)
    return route(fwd, streams), (route(bwd, streams) if bwd is not None else None)


def _device_side(node) -> torch.device:
    """The device (not host) memory a copy node reads or writes."""
    for n in (node, *node.all_input_nodes):
        if _on_host(n) is False:
            return n.meta["val"].device
    raise AssertionError(f"{node.name} crosses no device")

"""Record what a step actually did: the communication events in order and the bytes live on
this rank over the step, to hold against the plan's predictions.

Events come from a dispatch mode that sees every collective, wait and free the program runs.
Memory comes from the allocator, through torch.profiler's memory events (CPU) or the CUDA
caching allocator's counters, on top of the bytes the model state holds when the step starts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Optional

import torch
from torch.distributed.tensor import DTensor

from autoshard.core import _compat
from autoshard.core.cost import tensor_bytes
from autoshard.core.ops import free_op
from autoshard.runtime.dist import mesh_device

_OPS = {
    torch.ops._c10d_functional.all_gather_into_tensor_out.default: "all_gather",
    torch.ops._c10d_functional.reduce_scatter_tensor.default: "reduce_scatter",
    torch.ops._c10d_functional.all_reduce.default: "all_reduce",
    torch.ops._c10d_functional.wait_tensor.default: "wait",
}


@dataclasses.dataclass
class Recording:
    events: list = dataclasses.field(default_factory=list)  # (op, bytes) in order
    baseline_bytes: int = 0  # model state live when the step began
    memory: list = dataclasses.field(default_factory=list)  # live bytes after each alloc/free
    peak_bytes: int = 0
    # per collective: [op, bytes, issue returned, wait called, wait returned]: perf_counter
    # seconds on the CPU; on a GPU, CUDA events recorded on the stream that runs the step,
    # since there the host does not wait for a collective (NCCL's wait returns at once, and
    # the stream waits): the stream's time between the events before and after the wait is
    # what it stalled
    collectives: list = dataclasses.field(default_factory=list)

    def timings(self) -> list:
        """``collectives`` with every time in seconds (events read once the device has run
        them, relative to the first one)."""
        marks = [t for c in self.collectives for t in c[2:] if t is not None]
        if not marks or isinstance(marks[0], float):
            return self.collectives
        marks[-1].synchronize()
        first = marks[0]
        sec = lambda e: None if e is None else first.elapsed_time(e) / 1e3  # noqa: E731
        return [[op, nbytes, sec(a), sec(b), sec(c)] for op, nbytes, a, b, c in self.collectives]

    def overlap(self) -> dict:
        """Seconds some collective was in flight (from its issue returning to its wait
        returning; overlapping collectives count once), of which this rank waited (exposed)
        and the rest it computed through (hidden)."""
        collectives = self.timings()
        spans = sorted((c[2], c[4]) for c in collectives if c[4] is not None)
        flight, end = 0.0, float("-inf")
        for a, b in spans:
            if b > end:
                flight += b - max(a, end)
                end = b
        exposed = sum(c[4] - c[3] for c in collectives if c[4] is not None)
        return {"in_flight_s": flight, "exposed_s": exposed, "hidden_s": flight - exposed}

    def to_chrome_trace(self, path) -> None:
        """The measured timeline: each collective from issue to completion on one lane, the
        waits on another, compute (everything else) on a third."""
        import json

        collectives = self.timings()
        if not collectives:
            return
        t0 = min(c[2] for c in collectives)
        us = lambda t: (t - t0) * 1e6  # noqa: E731
        ev = [{"ph": "M", "name": "thread_name", "pid": 0, "tid": i, "args": {"name": n}}
              for i, n in enumerate(("compute", "collective in flight", "waiting"))]
        waits = sorted((c[3], c[4]) for c in collectives if c[4] is not None)
        start = t0
        for ws, we in waits:
            if ws > start:
                ev.append({"ph": "X", "pid": 0, "tid": 0, "name": "compute", "ts": us(start),
                           "dur": us(ws) - us(start)})
            start = max(start, we)
        for op, nbytes, issued, ws, we in collectives:
            if we is None:
                continue
            ev.append({"ph": "X", "pid": 0, "tid": 1, "name": op, "ts": us(issued),
                       "dur": us(we) - us(issued), "args": {"bytes": nbytes}})
            ev.append({"ph": "X", "pid": 0, "tid": 2, "name": f"wait {op}", "ts": us(ws),
                       "dur": us(we) - us(ws)})
        with open(path, "w") as f:
            json.dump({"traceEvents": ev}, f)


def _now() -> float:
    return time.perf_counter()


def _cuda_mark():
    """A CUDA event recorded now on the current stream (read in ``Recording.timings``)."""
    ev = torch.cuda.Event(enable_timing=True)
    ev.record()
    return ev


class _CommLog(_compat.TorchDispatchMode):
    def __init__(self, rec: Recording):
        super().__init__()
        self.events, self.collectives, self.pending = rec.events, rec.collectives, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = _OPS.get(func)
        if (kind is not None or func is free_op) and _compat.is_fake(args[0]):
            return func(*args, **kwargs)  # compiling: tracing a collective, not running it
        if func is free_op:
            self.events.append(("free", tensor_bytes(args[0])))
        clock = _now if kind is None or not args[0].is_cuda else _cuda_mark
        t = clock()
        out = func(*args, **kwargs)
        if kind is None:
            return out
        if kind != "wait":
            t = clock()  # in flight once issued: issuing is this rank's own work
        nbytes = tensor_bytes(out) if kind == "all_gather" else tensor_bytes(args[0])
        self.events.append((kind, nbytes))
        if kind == "wait":
            c = self.pending.pop(id(args[0]), None)
            if c is not None:
                c[3], c[4] = t, clock()
        else:
            c = [kind, nbytes, t, None, None]
            self.collectives.append(c)
            self.pending[id(out)] = c
        return out


def state_bytes(model: torch.nn.Module, optimizer=None, device=None) -> int:
    """Bytes this rank holds for the model: parameter shards, gradients, buffers, optimizer
    state (each storage once); only those on ``device``'s type when given."""
    seen, total = set(), 0

    def add(t):
        nonlocal total
        if isinstance(t, torch.Tensor):
            local = t.to_local() if hasattr(t, "to_local") else t
            if device is not None and local.device.type != device.type:
                return
            key = local.untyped_storage().data_ptr()
            if key not in seen and local.untyped_storage().nbytes():
                seen.add(key)
                total += local.untyped_storage().nbytes()

    for p in model.parameters():
        add(p)
        add(p.grad)
    for b in model.buffers():
        add(b)
    if optimizer is not None:
        for st in optimizer.state.values():
            for v in st.values():
                add(v)
    return total


def _step_device(model: torch.nn.Module) -> torch.device:
    """Where the step runs: an offloaded DTensor parameter lives on the host, its mesh (and
    so the step) on the device."""
    p = next(model.parameters())
    return mesh_device(p.device_mesh) if isinstance(p, DTensor) else p.device


@contextlib.contextmanager
def record(model: torch.nn.Module, optimizer=None, extra_bytes: int = 0, *,
           device: Optional[torch.device] = None):
    """Record one step run inside the block. ``extra_bytes``: other live tensors to count in
    the baseline (the step's inputs). Memory is the step's ``device``'s (by default its mesh's
    for DTensor parameters, sharded by autoshard or FSDP2, else the first parameter's): on a
    GPU an offloaded model's host state is left out; on a CPU host and device are one
    memory."""
    device = device if device is not None else _step_device(model)
    cuda = device.type == "cuda"
    rec = Recording(baseline_bytes=state_bytes(model, optimizer, device) + extra_bytes)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        with _CommLog(rec):
            yield rec
        torch.cuda.synchronize()
        rec.peak_bytes = rec.baseline_bytes + torch.cuda.max_memory_allocated() - start
        return
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with _CommLog(rec):
            yield rec
    live = rec.baseline_bytes
    for _, delta in _compat.allocation_events(prof):
        live += delta
        rec.memory.append(live)
    rec.peak_bytes = max(rec.memory, default=live)

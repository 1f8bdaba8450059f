"""Record what a step actually did: the communication events in order and the bytes live on
this rank over the step, to hold against the plan's predictions.

Events come from a dispatch mode that sees every collective, wait and free the program runs.
Memory comes from the allocator, through torch.profiler's memory events (CPU) or the CUDA
caching allocator's counters, on top of the bytes the model state holds when the step starts.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from autoshard import _compat

_OPS = {
    torch.ops._c10d_functional.all_gather_into_tensor.default: "all_gather",
    torch.ops._c10d_functional.reduce_scatter_tensor.default: "reduce_scatter",
    torch.ops._c10d_functional.wait_tensor.default: "wait",
}


def _nbytes(t) -> int:
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return 0


@dataclasses.dataclass
class Recording:
    events: list = dataclasses.field(default_factory=list)  # (op, bytes) in order
    baseline_bytes: int = 0  # model state live when the step began
    memory: list = dataclasses.field(default_factory=list)  # live bytes after each alloc/free
    peak_bytes: int = 0


class _CommLog(TorchDispatchMode):
    def __init__(self, events: list):
        super().__init__()
        self.events = events

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = _OPS.get(func)
        if func is torch.ops.autoshard.free.default:
            self.events.append(("free", _nbytes(args[0])))
        out = func(*args, **kwargs)
        if kind is not None:
            self.events.append((kind, _nbytes(out)
                                if kind != "reduce_scatter" else _nbytes(args[0])))
        return out


def state_bytes(model: torch.nn.Module, optimizer=None) -> int:
    """Bytes this rank holds for the model: parameter shards, gradients, buffers, optimizer
    state (each storage once)."""
    seen, total = set(), 0

    def add(t):
        nonlocal total
        if isinstance(t, torch.Tensor):
            local = t.to_local() if hasattr(t, "to_local") else t
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


@contextlib.contextmanager
def record(model: torch.nn.Module, optimizer=None, extra_bytes: int = 0):
    """Record one step run inside the block. ``extra_bytes``: other live tensors to count in
    the baseline (the step's inputs)."""
    rec = Recording(baseline_bytes=state_bytes(model, optimizer) + extra_bytes)
    cuda = next(model.parameters()).device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        with _CommLog(rec.events):
            yield rec
        torch.cuda.synchronize()
        rec.peak_bytes = rec.baseline_bytes + torch.cuda.max_memory_allocated() - start
        return
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with _CommLog(rec.events):
            yield rec
    live = rec.baseline_bytes
    for _, delta in _compat.allocation_events(prof):
        live += delta
        rec.memory.append(live)
    rec.peak_bytes = max(rec.memory, default=live)

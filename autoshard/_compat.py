"""Version shims: every use of a private or moving torch API goes through here."""

from __future__ import annotations

import torch.fx.traceback as fx_traceback
from torch.fx.experimental.proxy_tensor import get_proxy_mode, make_fx  # noqa: F401
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: F401


def current_trace_graph():
    """The fx graph make_fx is recording into right now."""
    return get_proxy_mode().tracer.graph


def preserve_node_meta():
    return fx_traceback.preserve_node_meta()


def current_meta() -> dict:
    return fx_traceback.current_meta


def link_backward_to_forward(roots) -> None:
    """Make backward nodes recorded by make_fx carry the seq_nr of the forward op they
    differentiate (as AOTAutograd does), by hooking the autograd graph under ``roots``."""
    try:
        from torch._functorch._aot_autograd.logging_utils import (
            setup_stacktrace_preservation_hooks,
        )
    except ImportError:  # pragma: no cover - older/newer torch: no mapping, capture still works
        return
    setup_stacktrace_preservation_hooks([r for r in roots if r is not None])


def reparametrize(module, params_and_buffers):
    from torch.nn.utils.stateless import _reparametrize_module

    return _reparametrize_module(module, params_and_buffers, tie_weights=True, strict=False)


def boxed(gm):
    """Make ``gm`` take one list argument that it clears, so each input is released right
    after its last use (AOTAutograd's boxed calling convention)."""
    from torch.fx.graph import _BoxedCodeGen

    gm.graph.set_codegen(_BoxedCodeGen())
    gm.recompile()
    return gm


def allocation_events(prof) -> list:
    """(time ns, bytes) of every allocation (+) and release (-) a torch.profiler run with
    ``profile_memory=True`` saw, in time order."""
    from torch._C._profiler import _EventType

    out, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        if e.tag == _EventType.Allocation:
            out.append((e.start_time_ns, e.extra_fields.alloc_size))
        stack.extend(e.children)
    return sorted(out)


def capture_decompositions() -> dict:
    """Ops capture rewrites while tracing (make_fx ``decomposition_table``)."""
    return {}

"""``Config(compile=True)``: the forward and backward graphs through inductor, torch.compile's
compiler, with the collectives inside the compiled code and in the plan's order.

The graphs are already whole-step ATen graphs, so no Dynamo trace is needed: each goes to
``torch._inductor.compile_fx.compile_fx`` (AOT decomposition and functionalisation, then
inductor's kernels; C++ on CPU, Triton on CUDA) on its first call, with that call's tensors
as example inputs. Before that, two rewrites make the graph functional, as inductor wants it:

- each ``all_gather_into_tensor_out`` into a preallocated buffer becomes the functional
  ``all_gather_into_tensor`` (inductor allocates the buffer itself), and what else read the
  buffer (the forward returns it for the backward to free) reads the gathered tensor;
- the concatenation of a unit's gradients for its reduce-scatter becomes ``autoshard::pack``,
  which inductor leaves as one call (see ``autoshard.core.ops``);
- the ``autoshard::free`` nodes go: inductor releases every buffer after its last use, where
  the plan frees it, and the backward takes its inputs boxed, so saved activations and kept
  units still die at their last use.

Inductor may move an op towards its first user (``reorder_for_locality``) or reorder for its
own memory estimate (``reorder_for_peak_memory``); either would undo the planned prefetch (an
all-gather moved down onto its wait). Both are off while autoshard's graphs compile, and
``check_order`` reads the generated code's order of issues and waits back and compares it with
the graph's: a compiled step whose collectives do not come in the planned order is an error,
never a silent slowdown.
"""

from __future__ import annotations

import re

import torch
import torch.fx as fx

from autoshard.core import meta, progress
from autoshard.core.errors import AutoshardError
from autoshard.core.graph import clone_graph
from autoshard.core.ops import pack_op

_FUNCOL = torch.ops._c10d_functional
_AG_OUT = _FUNCOL.all_gather_into_tensor_out.default
_AG = _FUNCOL.all_gather_into_tensor.default

# the inductor settings every compiled graph of autoshard's is built under
INDUCTOR_CONFIG = {"reorder_for_locality": False, "reorder_for_peak_memory": False,
                   "reorder_for_compute_comm_overlap": False}


def functional(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` as inductor takes it: functional all-gathers, no free nodes, positional
    arguments (not boxed)."""
    g = clone_graph(gm)
    g.graph.set_codegen(fx.graph.CodeGen())
    for n in list(g.graph.nodes):
        if meta.is_free(n):
            g.graph.erase_node(n)
        elif n.target is torch.ops.aten.cat.default and meta.tag(n, meta.COMM) == meta.RS_PACK:
            n.target = pack_op
        elif n.target is _AG_OUT:
            buf = n.kwargs["out"]
            n.target, n.kwargs = _AG, {}
            # what else reads the buffer (the forward saves it, for the backward to free)
            # reads the gathered tensor: else it would be a second, empty buffer kept alive
            wait = next(u for u in n.users if meta.tag(u, meta.COMM) == meta.AG_WAIT)
            buf.replace_all_uses_with(wait)
            g.graph.erase_node(buf)
    g.graph.lint()
    g.recompile()
    return g


def planned_order(gm: fx.GraphModule) -> list:
    """The names of ``gm``'s collective issues and waits, in the graph's order."""
    return [n.name for n in gm.graph.nodes
            if meta.tag(n, meta.COMM) in _ISSUES_AND_WAITS]


_ISSUES_AND_WAITS = (meta.AG_ISSUE, meta.AG_WAIT, meta.RS_ISSUE, meta.RS_WAIT, meta.AR_ISSUE,
                     meta.AR_WAIT)
_COLLECTIVE_CALL = re.compile(r"torch\.ops\._c10d_functional\.(\w+)\.default\(")
_SOURCE = re.compile(r"#\s*Topologically Sorted Source Nodes:\s*\[([^\]]*)\]")


def compiled_order(source: str, names: set) -> list:
    """The collective nodes of the graph (``names``) in the order the generated code calls
    them: each call of a ``_c10d_functional`` op is preceded by inductor's comment naming the
    source nodes it was lowered from."""
    out, sources = [], []
    for line in source.splitlines():
        m = _SOURCE.search(line)
        if m:
            sources = [s.strip() for s in m.group(1).split(",")]
            continue
        if _COLLECTIVE_CALL.search(line):
            hits = [s for s in sources if s in names and s not in out]
            out.extend(hits)
    return out


def failing_sources(exc: BaseException) -> list:
    """The graph nodes named by inductor's comment over the collective call of generated code
    that raised ``exc`` (the innermost such frame), or []."""
    import linecache

    found, tb = [], exc.__traceback__
    while tb is not None:
        name, line = tb.tb_frame.f_code.co_filename, tb.tb_lineno
        if _COLLECTIVE_CALL.search(linecache.getline(name, line)):
            lines = linecache.getlines(name)[: line - 1]
            m = next((m for m in map(_SOURCE.search, reversed(lines)) if m), None)
            found = [s.strip() for s in m.group(1).split(",")] if m else found
        tb = tb.tb_next
    return found


def check_order(planned: list, source: str, what: str) -> None:
    got = compiled_order(source, set(planned))
    if got != planned:
        first = next((i for i, (a, b) in enumerate(zip(planned, got)) if a != b),
                     min(len(planned), len(got)))
        raise AutoshardError(
            f"the compiled {what} graph calls its collectives in another order than the plan "
            f"(first difference at position {first}: planned {planned[first:first + 3]}, "
            f"compiled {got[first:first + 3]}); the prefetch schedule would be lost. Run "
            "with Config(compile=False), and report the model.")


class CompiledGraph:
    """One of a program's graphs, compiled by inductor on its first call. ``boxed``: it is
    called with one list of inputs, which it empties (the backward's convention)."""

    def __init__(self, gm: fx.GraphModule, what: str, boxed: bool):
        self.gm, self.what, self.boxed = gm, what, boxed
        self.fn = None
        self.unused = []  # positions of the inputs the compiled code does not take
        self.source = None
        self.order = None  # the collectives' order, as checked against the plan's

    @property
    def graph(self) -> fx.Graph:
        """The graph it compiles (an error while compiling names one of its nodes)."""
        return self.gm.graph

    def __call__(self, *args):
        if self.boxed:
            (args,) = args
        else:
            args = list(args)
        if self.fn is None:  # inductor's first compile of a large step can take minutes

            with progress.phase(f"compiling the {self.what} graph with inductor"):
                g = functional(self.gm)
                self.unused = _drop_unused_inputs(g)
                _drop(args, self.unused)
                self.fn = self._compile(g, list(args))
        else:
            _drop(args, self.unused)
        return self.fn(args)

    def _compile(self, g: fx.GraphModule, example: list):
        from unittest import mock

        from autoshard.core._compat import GraphLowering, compile_fx, inductor_config

        sources = []
        with inductor_config.patch(INDUCTOR_CONFIG), torch.no_grad(), \
                mock.patch.object(GraphLowering, "save_output_code", sources.append):
            fn = compile_fx(g, example)
        self.source = "\n".join(sources)
        planned = planned_order(self.gm)
        if planned:
            check_order(planned, self.source, self.what)
        self.order = planned
        boxed = _boxed_entry(fn) if not any(True for _ in g.parameters()) else None
        if boxed is not None:
            return boxed

        def run(args: list):
            return fn(*args)

        return run


def _drop_unused_inputs(g: fx.GraphModule) -> list:
    """Removes the placeholders of ``g`` nothing reads; returns their positions. Inductor's
    code unpacks every input into a local that lives to the end of the call, so an input it
    never reads (a gathered buffer the backward only freed, before ``functional``) would be
    held through the whole backward; the caller drops it from the arguments instead."""
    unused = [i for i, n in enumerate(g.graph.find_nodes(op="placeholder")) if not n.users]
    for n in [n for n in g.graph.find_nodes(op="placeholder") if not n.users]:
        g.graph.erase_node(n)
    g.recompile()
    return unused


def _drop(args: list, positions: list) -> None:
    for i in reversed(positions):
        del args[i]


def _boxed_entry(fn):
    """AOTAutograd's runtime function under ``compile_fx``'s result: it takes one list and
    drops each input after its last use (the outer function unpacks the call's arguments and
    prepends the module's parameters, here none, and so keeps every input alive to the end).
    None if this torch wraps it otherwise."""
    import inspect

    f = getattr(fn, "__wrapped__", None)
    while f is not None:
        try:
            params = list(inspect.signature(f, follow_wrapped=False).parameters.values())
        except (TypeError, ValueError):
            return None
        if len(params) == 1 and params[0].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD:
            return f
        f = getattr(f, "__wrapped__", None)
    return None

"""Running a compiled program: the forward graph now, the backward graph on backward().

The graphs run as fx wrote them, node by node in the plan's order, on the caller's (compute)
stream: the c10d functional collectives issue and wait where their nodes are, and each
``autoshard::free`` releases storage where it stands. One exception, on a GPU: the copies
between host and device memory (nodes tagged with a kind in ``meta.COPIES``: offloaded shards
copied in, gradient shards copied out, activations copied out and in) run on a copy stream per
direction, ordered by events waited for just before each copy's first reader, before a free of
what it read, and by the host before the graph returns (``autoshard.runtime.streams``, which
rewrites a copy of each graph for that; ``AUTOSHARD_COPY_STREAMS=0`` turns it off). On a CPU,
under ``Config(compile=True)`` (inductor's code keeps the copies in order on the compute
stream) and in ``Program.run_instrumented`` the graphs run exactly as the passes wrote them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import warnings
from typing import Callable, Optional

import torch
import torch.fx as fx

from autoshard.core import _compat, carried, hooks, meta
from autoshard.core._compat import tree_unflatten
from autoshard.core.captured import NewState, StateOut, TENSOR
from autoshard.core.errors import AutoshardError
from autoshard.core.graph import alias_base, clone_graph
from autoshard.runtime import bindings, double, streams
from autoshard.runtime.inductor import CompiledGraph, failing_sources


class Program:
    """One compiled training step for one input signature."""

    def __init__(self, captured, split, plan, world_size: int, rank: int,
                 device_type: str = "cpu", agreement=None, compiled: bool = False):
        self.captured = captured
        self.split = split
        self.plan = plan
        self.compiled = compiled
        if compiled:  # Config.compile: inductor's code, built on the first call

            self.fwd = CompiledGraph(split.fwd, "forward", boxed=False)
            self.bwd = (CompiledGraph(split.bwd, "backward", boxed=True)
                        if split.bwd is not None else None)
        else:
            # on a GPU, host<->device copies run on copy streams (autoshard.runtime.streams);
            # ops call torch's public bindings, a microsecond each cheaper (runtime.bindings)
            fwd, bwd = streams.for_device(split.fwd, split.bwd, device_type)
            self.fwd = bindings.runnable(fwd)
            bwd = bindings.runnable(bwd) if bwd is not None else None
            # the backward takes its inputs boxed: saved activations die at their last use
            self.bwd = _compat.boxed(bwd) if bwd is not None else None
        self._bwd_retained = None
        # what a synchronised backward adds when nothing is pending for a parameter: a second
        # backward of the micro-batch (two forwards) after the first took what was pending
        accs = [n for n in split.bwd.graph.nodes if meta.is_grad_acc(n)] if split.bwd else []
        self.acc_like = {meta.tag(n, meta.FQN): n.meta["val"] for n in accs}
        # forward ops the backward recomputes ran, when traced, in the forward's grad mode,
        # and torch.utils.checkpoint recomputes them in it too: a backward holding any runs
        # in that mode (the backward's own ops read none, given inputs that require no grad)
        self.bwd_grad_enabled = captured.grad_enabled and split.bwd is not None and any(
            meta.tag(n, meta.RECOMPUTED) for n in split.bwd.graph.nodes)
        roles = split.fwd_roles
        self.n_user = sum(r[meta.ROLE] == meta.OUT_FWD for r in roles)
        self.mutated = [r[meta.FQN] for r in roles if r[meta.ROLE] == meta.OUT_BUFFER]
        slot = {f: i for i, f in enumerate(captured.buffer_fqns)}
        self.mutated_slots = [slot[f] for f in self.mutated]
        # a backward with create_graph replays the forward's random draws (runtime.double)
        self.draws_random = (captured.pristine is not None
                             and double.draws_random(captured.pristine))
        self.fqns = [p.fqn for p in captured.params]
        self.layouts = [p.layout for p in captured.params]
        # a layout over one rank (a replicated parameter) is all of it, on every rank
        at = [rank if lay.world_size > 1 else 0 for lay in self.layouts]
        # the rows of the full parameter this rank's shard holds; None: all (no dim 0)
        self.local_ranges = [lay.local_range(r) if lay.sharded else None
                             for lay, r in zip(self.layouts, at)]
        self.local_rows = [None if r is None else r[1] - r[0] for r in self.local_ranges]
        # the parameters read from a replica, and the shards padded to the layout's rows
        self.replica_slots = [i for i, p in enumerate(captured.params) if p.replica]
        self.padded_slots = [i for i, (p, lay, n) in enumerate(
            zip(captured.params, self.layouts, self.local_rows))
            if lay.sharded and n != lay.rows and not p.replica]
        slot = {f: i for i, f in enumerate(self.fqns)}
        kinds = {meta.OUT_GRAD: "param", meta.OUT_HOOK_GRAD: "hook"}
        self.grad_slots = [
            ("param", slot[r[meta.FQN]]) if r[meta.ROLE] == meta.OUT_GRAD
            else (kinds.get(r[meta.ROLE], "input"), r[meta.INDEX])
            for r in split.bwd_roles
        ]
        self.hook_owner = None  # the state whose traced_hooks a replacing hook joins
        self.grad_tangents = [
            captured.grad_tangents[(r[meta.ROLE], r.get(meta.FQN, r.get(meta.INDEX)))]
            for r in split.bwd_roles
        ]
        self.diff = list(captured.diff_outputs)
        self.device_type = device_type
        self.world_size, self.rank = world_size, rank
        self.agreement = agreement  # runtime.dist.Agreement, or None (no peers to agree with)

    # the padded shard the graph reads, from the DTensor's local rows
    def pad(self, i: int, local: torch.Tensor) -> torch.Tensor:
        lay = self.layouts[i]
        if not lay.sharded or local.shape[0] == lay.rows:
            return local
        extra = local.new_zeros((lay.rows - local.shape[0], *lay.inner))
        return torch.cat([local, extra])

    def feed(self, params: list, replicas: dict) -> list:
        """What each parameter placeholder reads: the padded local shard, or the parameter's
        replica (``ParamSpec.replica``, from ``replicas``)."""
        fed = list(map(_compat.local_tensor, params))
        for i in self.replica_slots:
            fed[i] = replicas[self.fqns[i]]
        for i in self.padded_slots:
            fed[i] = self.pad(i, fed[i])
        return fed

    def acc_zeros(self, fqn: str) -> torch.Tensor:
        """Nothing pending for ``fqn``: the forward saw gradients pending that an earlier
        backward of its micro-batch (a second forward's, or ``retain_graph=True``'s) took."""
        like = self.acc_like[fqn]
        return torch.zeros(like.shape, dtype=like.dtype, device=like.device)

    def run(self, params: list, buffers: list, inputs: list, replicas=None, pending=None):
        """Run the step on ``params`` (DTensor parameters, in capture order; ``replicas``:
        FQN -> full replica, for those that have one). Gradient shards are accumulated into
        ``param.grad`` by the backward, as AccumulateGrad would. ``pending``: FQN -> the
        full local gradients of steps run without gradient sync; a step without sync adds to
        it, a synchronised step reduces it with its own (``split.acc_fqns``) and empties
        it."""
        fed = self.feed(params, replicas or {})
        if self.bwd is not None and torch.is_grad_enabled():
            # the parameters are the step's inputs in autograd's graph too, so that
            # backward(inputs=...) and autograd.grad see them; without gradient sync not
            # those with post-accumulate-grad hooks, which wait for the synced backward (as
            # FSDP2's do), where autograd would run them at every one
            edges = params if self.plan.grad_sync else [
                _NO_EDGE if getattr(p, "_post_accumulate_grad_hooks", None) else p
                for p in params]
            outs = _Step.apply(self, params, pending, len(buffers), self.anchor(), len(edges),
                               *edges, *fed, *buffers, *inputs)
        else:
            with self.forward_mode():
                outs = self.call(self.fwd, *_detached(fed), *_detached(buffers),
                                 *_detached(inputs))
        user = list(outs[: self.n_user])
        return user, list(outs[self.n_user : self.n_user + len(self.mutated)])

    def backward_graph(self):
        """The backward to run now. Under ``backward(retain_graph=True)`` the saved tensors
        must outlive this call, so it runs a copy that frees none of them (a kept unit's
        gathered parameters, which the backward otherwise frees after their last use). A
        compiled backward frees nothing itself: it drops its references, and autograd's stay."""
        if self.compiled or not _compat.backward_keeps_graph():
            return self.bwd
        if self._bwd_retained is None:
            gm = clone_graph(self.bwd)
            for f in [n for n in gm.graph.nodes if meta.is_free(n)]:
                kept = [t for t in f.args[0] if alias_base(t).op != "placeholder"]
                if kept:
                    f.args = (kept,)
                else:
                    gm.graph.erase_node(f)
            self._bwd_retained = _compat.boxed(gm)
        return self._bwd_retained

    def call(self, gm, *args):
        """Run one of the graphs; a collective that fails becomes an error naming its unit,
        its op and the step: a timeout or a lost peer names the peers, any other failure
        (the backend refusing the op, say) keeps its own message."""
        start = time.monotonic()
        try:
            return gm(*args)
        except RuntimeError as e:
            node = _failing_node(gm, e)
            if node is None:
                raise
            raise self._comm_error(node, e, time.monotonic() - start) from e

    def _comm_error(self, node, exc, elapsed_s: float) -> AutoshardError:
        unit = meta.tag(node, meta.UNIT)
        names = {u.index: u.name for u in self.plan.units}
        kind = {meta.AG_ISSUE: "all-gather", meta.AG_WAIT: "wait for the all-gather",
                meta.RS_ISSUE: "reduce-scatter", meta.RS_WAIT: "wait for the reduce-scatter",
                meta.AR_ISSUE: "all-reduce", meta.AR_WAIT: "wait for the all-reduce"}
        op = kind.get(meta.tag(node, meta.COMM), meta.tag(node, meta.COMM))
        region = "forward" if meta.is_forward(node) else "backward"
        step = self.agreement.step if self.agreement is not None else "?"
        where = (f"rank {self.rank}, step {step}: the {op} of unit {unit} "
                 f"({names.get(unit, '?')}) in the {region} (graph node {node.name})")
        first = str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__
        if not is_lost_peer(exc):
            return AutoshardError(f"{where} failed: {first}")
        peers = [r for r in range(self.world_size) if r != self.rank]
        timeout = f" {self.agreement.waited(elapsed_s, mesh=True)}" if self.agreement else ""
        return AutoshardError(
            f"{where} got no answer from peer ranks {peers}{timeout}: a rank stopped, hangs, "
            f"or failed during the step.\n  {first}")

    @contextlib.contextmanager
    def forward_mode(self):
        """The forward graph runs in the grad mode capture traced it in (also inside the
        autograd.Function, which runs with grad off): a kernel may read the mode, as the CPU
        LSTM/GRU kernel does to decide whether to keep its backward's workspace. Its inputs
        are detached first, so grad on records no autograd history."""
        with torch.set_grad_enabled(self.captured.grad_enabled), self.no_autocast():
            yield

    def run_backward_hooks(self, res, given) -> None:
        """The module backward hooks kept out of the trace, on this backward's gradients,
        before any of them is accumulated (``autoshard.core.hooks``)."""
        grads = {}
        for (kind, i), g, deps in zip(self.grad_slots, res, self.grad_tangents):
            if kind == "hook":
                grads[i] = g if deps & given else None
        cap = self.captured
        try:
            hooks.replay_backward(cap.backward_taps, grads, cap.traced_hooks)
        except hooks.Replaces as r:
            if self.hook_owner is not None:
                self.hook_owner.traced_hooks = self.hook_owner.traced_hooks | {r.key}
            raise AutoshardError(
                "a module backward hook returned replacement gradients, which a backward "
                "already run cannot take: this backward's gradients were not accumulated. "
                "From the next call on the hook is traced into the step; run this step "
                "again.") from None

    def no_autocast(self):
        """The graphs hold autocast's casts already (capture traced them): run them as
        written, also when called inside ``torch.autocast``."""
        return torch.autocast(self.device_type, enabled=False)

    @staticmethod
    def anchor() -> torch.Tensor:
        # the parameters enter the step as plain local shards; this tensor makes the step's
        # outputs part of the autograd graph so that backward() reaches it
        return torch.empty(0, requires_grad=True)

    def unflatten(self, user: list, objects=(), written=()):
        """The forward's output from the graph's tensors: ``objects``, the call's input
        objects holding state, and ``written``, the tensors the forward left in objects
        (``autoshard.core.carried``), for the outputs that are such objects."""
        it = iter(user)
        leaves = [next(it) if c is TENSOR else objects[c.index] if isinstance(c, StateOut)
                  else carried.build(c.description, written) if isinstance(c, NewState) else c
                  for c in self.captured.out_consts]
        return tree_unflatten(leaves, self.captured.out_spec)

    # --- instrumented runs (autoshard.check) --------------------------------------------------

    def run_instrumented(self, params: dict, buffers: dict, inputs: list, tangents: dict,
                         on_node: Callable, *, graphs: str = "compiled",
                         replicas: Optional[dict] = None,
                         pending: Optional[dict] = None) -> "Traced":
        """Run the step once more, node by node, handing ``on_node(graph, node, value)`` each
        node's value as soon as it is computed (later in-place writes and frees do not change
        what it got; placeholders and outputs are not handed): ``graph`` is "joint", "fwd" or
        "bwd". Each node runs in the grad mode the executor runs it in, with autocast off as
        the graphs hold its casts. The arguments are copied first and never written, and no
        gradient is accumulated. Every rank runs it together: the graphs hold collectives.

        graphs: "compiled" runs the forward graph, then the backward graph on the values
            the forward saved, as fx runs them (also for a program inductor compiled);
            "joint" runs the joint graph as captured, before any pass.
        params: FQN -> the DTensor parameter ("compiled"), or its full value ("joint").
        buffers: FQN -> the buffer's value; inputs: the call's flat input tensors, as
            ``run`` takes them.
        tangents: index among the forward's tensor outputs -> the gradient of the loss with
            respect to that output, for every output that gets one (``diff_outputs``).
        replicas, pending: as ``run`` takes them (only "compiled" reads them).
        Returns a ``Traced``: the outputs and gradients by meaning, not by position."""
        bufs = [buffers[f].detach().clone() for f in self.captured.buffer_fqns]
        ins = [x.detach().clone() for x in inputs]
        tans = [tangents[i].detach().contiguous() for i in self.diff]
        with self.no_autocast():
            if graphs == "joint":
                return self._run_joint(params, bufs, ins, tans, on_node)
            if graphs != "compiled":
                raise ValueError(f"graphs is 'compiled' or 'joint', not {graphs!r}")
            return self._run_compiled(params, bufs, ins, tans, on_node, replicas or {},
                                      pending or {})

    def _run_joint(self, params: dict, bufs: list, ins: list, tans: list, on_node) -> "Traced":
        cap = self.captured
        if cap.pristine is None:
            raise ValueError("this program keeps no joint graph as captured")
        full = [params[p.fqn].detach().clone() for p in cap.params]
        # the joint graph's forward was traced in the step's grad mode, its backward (inside
        # autograd.grad) with grad off
        grad = cap.grad_enabled
        outs = _interpret(cap.pristine, full + bufs + ins + tans,
                          lambda n: grad and meta.is_forward(n),
                          lambda n, v: on_node("joint", n, v))
        traced = Traced(params=list(cap.params))
        nodes = meta.output_node(cap.pristine).args[0]
        for node, role, val in zip(nodes, meta.output_roles(cap.pristine), outs):
            if role[meta.ROLE] == meta.OUT_FWD:
                traced.outputs.append((node, val))
            elif role[meta.ROLE] == meta.OUT_GRAD:
                traced.grads[role[meta.FQN]] = (node, val)
        return traced

    def _run_compiled(self, params: dict, bufs: list, ins: list, tans: list, on_node,
                      replicas: dict, pending: dict) -> "Traced":
        fed = [t.detach().clone() for t in self.feed([params[f] for f in self.fqns], replicas)]
        fwd_mode, bwd_mode = self.captured.grad_enabled, self.bwd_grad_enabled
        fouts = _interpret(self.split.fwd, fed + bufs + ins, lambda n: fwd_mode,
                           lambda n, v: on_node("fwd", n, v))
        traced = Traced(params=list(self.captured.params))
        nodes = meta.output_node(self.split.fwd).args[0]
        traced.outputs = list(zip(nodes[: self.n_user], fouts[: self.n_user]))
        if self.split.bwd is None:
            return traced
        saved = fouts[self.n_user + len(self.mutated):]
        del fouts
        accs = [pending[f].clone() for f in self.split.acc_fqns]
        bouts = _interpret(self.split.bwd, saved + tans + accs, lambda n: bwd_mode,
                           lambda n, v: on_node("bwd", n, v))
        nodes = meta.output_node(self.split.bwd).args[0]
        for (kind, i), node, g in zip(self.grad_slots, nodes, bouts):
            if kind != "param":
                continue
            f, rows = self.fqns[i], self.local_rows[i]
            traced.grads[f] = (node, g if rows is None else g[:rows])
            if self.local_ranges[i] is not None:
                traced.rows[f] = self.local_ranges[i]
        return traced


@dataclasses.dataclass
class Traced:
    """What ``Program.run_instrumented`` computed, by meaning rather than by position.

    outputs: (output node, value) per forward output the caller gets, in order.
    grads: FQN -> (output node, value) per parameter gradient the backward computed: the
        full gradient from the joint graph; this rank's rows of it from the compiled graphs.
    rows: FQN -> (start, stop), the rows of the full gradient that ``grads`` holds, for the
        compiled graphs' gradients sharded by rows (any other holds every row).
    params: each parameter's ``ParamSpec``, in capture order.
    """

    params: list
    outputs: list = dataclasses.field(default_factory=list)
    grads: dict = dataclasses.field(default_factory=dict)
    rows: dict = dataclasses.field(default_factory=dict)


class _Instrumented(fx.Interpreter):
    """Runs a graph on real tensors, each node in the grad mode ``grad_mode(node)``, and hands
    each computed value to ``on_value(node, value)`` before anything else can touch it."""

    def __init__(self, gm: fx.GraphModule, grad_mode: Callable, on_value: Callable):
        super().__init__(gm, garbage_collect_values=True)
        self.grad_mode, self.on_value = grad_mode, on_value

    def run_node(self, n: fx.Node):
        with torch.set_grad_enabled(self.grad_mode(n)):
            out = super().run_node(n)
        if n.op not in ("placeholder", "output"):
            self.on_value(n, out)
        return out


def _interpret(gm: fx.GraphModule, args: list, grad_mode: Callable, on_value: Callable) -> list:
    return list(_Instrumented(gm, grad_mode, on_value).run(*args, enable_io_processing=False))


# how backends word a collective that a peer never completed: gloo's and NCCL's timeouts,
# a closed or reset connection, an aborted communicator
_LOST_PEER = ("timed out", "timeout", "connection closed", "connection reset",
              "connection refused", "broken pipe", "peer", "abort", "watchdog", "closed by",
              "socket")


def is_lost_peer(exc: BaseException) -> bool:
    """Whether a collective's ``exc`` says a peer did not answer (a timeout, a lost
    connection, an aborted communicator), rather than that the op itself failed (an
    unsupported dtype, a bad shape), which no peer has to do with."""
    import torch.distributed as dist

    lost = tuple(getattr(dist, n) for n in ("DistNetworkError", "DistStoreError")
                 if hasattr(dist, n))
    if lost and isinstance(exc, lost):
        return True
    text = str(exc).lower()
    return any(w in text for w in _LOST_PEER)


def _failing_node(gm, exc):
    """The collective node of ``gm`` (a GraphModule or a ``CompiledGraph``) whose line of
    generated code raised ``exc``, if any: fx's code names the node it runs, inductor's code
    the source nodes of each call in a comment above it."""
    import linecache
    import re

    if isinstance(gm, CompiledGraph):
        names = failing_sources(exc)
    else:
        tb, found = exc.__traceback__, None
        while tb is not None:
            code = tb.tb_frame.f_code
            if code.co_filename.startswith("<eval_with_key"):
                found = linecache.getline(code.co_filename, tb.tb_lineno)
            tb = tb.tb_next
        m = re.match(r"\s*(\w+)\s*=", found or "")
        names = [m.group(1)] if m else []
    return next((n for n in gm.graph.nodes if n.name in names and meta.is_comm(n)), None)


def _detached(tensors) -> list:
    return [t.detach() if isinstance(t, torch.Tensor) and t.requires_grad else t
            for t in tensors]


def _accumulate(param, grad_local: torch.Tensor) -> None:
    if param.grad is None:
        param.grad = _compat.dtensor_like(param, grad_local)
    else:
        _compat.local_tensor(param.grad).add_(grad_local)


_WARNED_REDUCED = []
_NO_EDGE = torch.empty(0)  # in a parameter's place among the step's inputs: no edge


def _returned(param, local: torch.Tensor, world_size: int):
    """A parameter's gradient as ``torch.autograd.grad`` returns it: the sharded DTensor
    ``.grad`` would hold (reduced over the data-parallel ranks as backward() reduces it)."""
    _say_reduced(world_size)
    return _compat.dtensor_like(param, local)


def _say_reduced(world_size: int) -> None:
    if world_size > 1 and not _WARNED_REDUCED:
        _WARNED_REDUCED.append(True)
        warnings.warn(
            "torch.autograd.grad with respect to parameters sharded by autoshard returns "
            "their gradients as .grad would hold them: sharded DTensors, reduced over the "
            "data-parallel ranks as backward() reduces them (the mean of every rank's loss's "
            "gradient), not this rank's own loss's alone (docs/api.md).", stacklevel=4)


def _check_nan(program, res: list, given: set) -> None:
    """Under ``torch.autograd.detect_anomaly()``: a gradient the backward graph computed
    holding NaN raises, naming it, as autograd raises for a function returning one."""
    for (kind, i), g, deps in zip(program.grad_slots, res, program.grad_tangents):
        if deps & given and kind != "hook" and g.isnan().any():
            what = program.fqns[i] if kind == "param" else f"input {i} of the call"
            raise RuntimeError(
                f"the backward of the step autoshard captured returned nan values in the "
                f"gradient of {what} (anomaly detection: the first NaN is in that gradient "
                "or before it in the step's backward; run the model unsharded under "
                "detect_anomaly to find the op)")


def _double_backward(ctx, tangents: list, given: set, accumulates: list) -> tuple:
    """``_Step.backward`` with ``create_graph=True`` (``autoshard.runtime.double``): every
    gradient with its graph. The engine accumulates a parameter's into ``.grad``, reduced and
    sharded as ever; ``autograd.grad`` gets this rank's own full gradient, as eager's."""
    program = ctx.program
    params, inputs = double.backward(program, ctx.kept, ctx.params, tangents, given)
    edge_grads = [None] * ctx.n_edges
    for i, g in enumerate(params):
        if g is None or accumulates[i] is False:
            continue
        if accumulates[i]:
            edge_grads[i] = double.reduced(ctx.params[i], g)
        else:
            double.say_own(program.world_size)
            edge_grads[i] = g
    return (None, None, None, None, None, None, *edge_grads,
            *([None] * (ctx.n_flat - ctx.n_inputs)), *inputs)


class _Step(torch.autograd.Function):
    """The step in autograd's graph. Its inputs: the anchor (every output depends on it),
    the ``n_edges`` DTensor parameters whose gradients a synchronised backward reduces (their
    gradient edges: which of them the engine accumulates decides what the backward hands
    them), then the graph's flat inputs."""

    @staticmethod
    def forward(ctx, program: Program, params: list, pending, n_buffers: int, anchor,
                n_edges: int, *rest):
        n_p = len(program.fqns)
        ctx.n_edges = n_edges
        flat = rest[n_edges:]
        ctx.kept = double.Kept(program, flat, n_buffers)  # for a backward with create_graph
        with program.forward_mode():
            res = program.call(program.fwd, *_detached(flat))
        n_out = program.n_user + len(program.mutated)
        ctx.save_for_backward(*res[n_out:])
        ctx.set_materialize_grads(False)  # an output no loss reads gets None, as in eager
        ctx.diff_like = [(res[i].shape, res[i].dtype, res[i].device) for i in program.diff]
        ctx.program, ctx.params, ctx.pending = program, params, pending
        ctx.step = program.agreement.step if program.agreement is not None else 0
        ctx.n_inputs = len(flat) - n_p - n_buffers
        ctx.n_flat = len(flat)
        outs = tuple(res[:n_out])
        diff = set(program.diff)
        ctx.mark_non_differentiable(*[o for i, o in enumerate(outs) if i not in diff])
        return outs

    @staticmethod
    def backward(ctx, *grads):
        program = ctx.program
        # per parameter edge: True, the engine accumulates it (backward(), or
        # backward(inputs=...) naming it); False, not asked for (its .grad is left as eager
        # leaves it); None, autograd.grad asks for it (and takes what is returned)
        edges = [node for node, _ in ctx.next_functions[1:1 + ctx.n_edges]]
        accumulates = [_compat.engine_accumulates(node) for node in edges]
        # autograd.grad asks for a parameter (one with an edge: a frozen one has none)
        asked = any(a is None for n, a in zip(edges, accumulates) if n is not None)
        # a parameter without an edge (a hooked one without gradient sync): the anchor says
        # whether this is a plain backward, which keeps its gradient for the synced one
        plain = _compat.engine_accumulates(ctx.next_functions[0][0]) is True
        keeps = [plain if node is None else a for node, a in zip(edges, accumulates)]
        if not program.plan.grad_sync and None in keeps:
            raise AutoshardError(
                "torch.autograd.grad with respect to parameters while gradient sync is off "
                "(no_sync(), set_requires_gradient_sync(False)): their gradients are kept "
                "whole on each rank for the synced backward, not returned. Call it with sync "
                "on, or use a plain backward() within no_sync().")
        given = {k for k, i in enumerate(program.diff) if grads[i] is not None}
        tangents = [grads[i].contiguous() if grads[i] is not None
                    else torch.zeros(shape, dtype=dtype, device=device)
                    for i, (shape, dtype, device) in zip(program.diff, ctx.diff_like)]
        create_graph = torch.is_grad_enabled()  # the engine runs backward in grad mode then
        if create_graph and (why := double.refusal(program, ctx.kept)) is not None:
            raise double.refuse(why)  # before anything is taken: a refusal keeps it all
        if (create_graph or asked) and torch.is_anomaly_enabled() \
                and torch.is_anomaly_check_nan_enabled():
            raise AutoshardError(
                "torch.autograd.detect_anomaly() checks every gradient a backward function "
                "returns for NaN, and cannot check the DTensor gradients of sharded parameters "
                "that a step's backward hands back to torch.autograd.grad or under "
                "create_graph=True (DTensor has no sharding rule for aten._is_any_true). Use "
                "detect_anomaly(check_nan=False) there, or make that call outside anomaly "
                "detection; backward() works under it.")
        if program.agreement is not None:  # before anything is taken: a refusal keeps it all
            program.agreement(f"step {ctx.step}: backward")
        if create_graph:
            ctx.maybe_clear_saved_tensors()
            return _double_backward(ctx, tangents, given, accumulates)
        pending = ctx.pending
        accs = [pending.pop(f) if f in pending else program.acc_zeros(f)
                for f in program.split.acc_fqns]
        # detached: a saved tensor that is also an output unpacks with the step's graph, and
        # a backward run in grad mode (recomputation) would leave that graph in the gradients
        args = [*_detached(ctx.saved_tensors), *tangents, *accs]
        del accs
        ctx.maybe_clear_saved_tensors()  # autograd's references go; the graph drops the rest
        with torch.set_grad_enabled(program.bwd_grad_enabled), program.no_autocast():
            res = program.call(program.backward_graph(), args)
        if torch.is_anomaly_enabled() and torch.is_anomaly_check_nan_enabled():
            _check_nan(program, res, given)  # as autograd checks each function's outputs
        input_grads, edge_grads = [None] * ctx.n_inputs, [None] * ctx.n_edges
        if program.captured.backward_taps:
            program.run_backward_hooks(res, given)
        for (kind, i), g, deps in zip(program.grad_slots, res, program.grad_tangents):
            if not deps & given or kind == "hook":
                continue  # it reads only outputs that got no gradient: None, as in eager
            if kind == "param" and not program.plan.grad_sync:  # full, local: kept
                if not keeps[i]:
                    continue  # not asked for (backward(inputs=...), autograd.grad), as eager
                f = program.fqns[i]
                if f in pending:
                    pending[f].add_(g)
                else:
                    pending[f] = g.clone()
            elif kind == "param":
                rows = program.local_rows[i]
                param, local = ctx.params[i], g if rows is None or rows == g.shape[0] else g[:rows]
                if accumulates[i]:  # the engine then runs its post-accumulate-grad hooks
                    _accumulate(param, local)
                elif accumulates[i] is None:
                    edge_grads[i] = _returned(param, local, program.world_size)
            else:
                input_grads[i] = g
        return (None, None, None, None, None, None, *edge_grads,
                *([None] * (ctx.n_flat - ctx.n_inputs)), *input_grads)

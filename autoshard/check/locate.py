"""Where a difference ``autoshard.check`` found first arises: ``locate_difference``.

The captured joint graph is run on the real values and compared with eager (capture to
blame?); then the compiled forward and backward graphs are run and compared with the
captured graph node by node, in the order they run (which pass to blame?). The values of
the graphs' nodes are recorded here, as few at a time as the search needs.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Optional

import torch
import torch.fx as fx

from autoshard.core import _compat, meta, progress
from autoshard.front.api import state_of
from autoshard.check.report import Difference, coarser_dtype, fmt_value, max_abs, max_delta
from autoshard.check.runs import (EagerRun, Ranks, fresh_inputs, group_device, split_inputs,
                                  tensor_leaves)


_aten = torch.ops.aten
# ops whose value is uninitialised memory: never compared
_UNINITIALISED = {
    _aten.empty.memory_format, _aten.empty_strided.default, _aten.new_empty.default,
    _aten.new_empty_strided.default, _aten.empty_like.default,
}


# --- values recorded from the graphs ---------------------------------------------------------


def _op_name(n: fx.Node) -> str:
    t = n.target
    if isinstance(t, _compat.OpOverload):
        return str(t)
    if t is operator.getitem:
        return "getitem"
    return getattr(t, "__name__", str(t))


def _comparable(n: fx.Node, value) -> bool:
    return (n.op == "call_function" and isinstance(value, torch.Tensor)
            and n.target not in _UNINITIALISED and not meta.is_comm(n)
            and not _opaque(n, value))


def _opaque(n: fx.Node, value: torch.Tensor) -> bool:
    """Whether ``value`` has another shape than the one traced for ``n``: a kernel's private
    buffer that the trace cannot describe (the CPU LSTM kernel's workspace is empty when
    traced and sized by oneDNN when run), whose bytes, padding included, mean nothing
    outside that kernel. Never compared."""
    traced = n.meta.get("val")
    return isinstance(traced, torch.Tensor) and tuple(traced.shape) != tuple(value.shape)


@dataclasses.dataclass
class _Recorded:
    value: torch.Tensor
    op: str
    module: str


class _NodeValues:
    """``on_node`` for the captured graph's run: each comparable node's value, by name."""

    def __init__(self):
        self.values = {}

    def __call__(self, graph: str, n: fx.Node, v) -> None:
        if _comparable(n, v):
            self.values[n.name] = _Recorded(v.detach().clone(), _op_name(n),
                                            meta.tag(n, meta.MODULE) or "")


class _Search:
    """``on_node`` for the compiled graphs' run: each node against the captured graph's node
    of the same name (a node the recompute pass copied, against the forward node it copies;
    communication nodes are skipped); keeps the first that differs beyond tolerance."""

    def __init__(self, recorded: dict, rk: "Ranks"):
        self.recorded, self.rk = recorded, rk
        self.first: Optional[Difference] = None
        self.compared = 0
        self.unmatched: list = []

    def __call__(self, graph: str, n: fx.Node, v) -> None:
        if not _comparable(n, v):
            return
        origin = meta.tag(n, meta.RECOMPUTED)
        rec = self.recorded.get(origin if isinstance(origin, str) else n.name)
        if rec is None:
            self.unmatched.append(n.name)
            return
        self.compared += 1
        if self.first is not None:
            return
        delta, mag = max_delta(rec.value, v), max_abs(rec.value)
        ok, _ = self.rk.within(delta, mag, rec.value.dtype)
        if not ok:
            self.first = _node_difference(n, graph, rec, v, delta, mag, origin, self.rk.rank,
                                          self.rk.world)


# --- localisation -----------------------------------------------------------------------------


def locate_difference(sharded, eager: EagerRun, example_inputs, step_ok: bool, rk: Ranks) -> tuple:
    """(first Difference or None, nodes compared, notes). Runs the sharded module's last
    program through its instrumented entry (collectives included: every rank calls it
    together): first its joint graph as captured, against eager; then its compiled graphs,
    node by node, against the joint graph; then its gradient shards, against the joint
    graph's gradients."""
    args, kwargs = split_inputs(fresh_inputs(example_inputs))
    state = state_of(sharded, "autoshard.check takes")
    with progress.phase("localising the first difference", unit="nodes") as p:
        def counted(on_node):
            def on(graph, n, v):
                on_node(graph, n, v)
                p.step()
            return on

        seen = _NodeValues()
        with rk.seeded():
            joint = state.run_instrumented(args, kwargs, eager.tangents, counted(seen),
                                           graphs="joint", params=eager.init_params,
                                           buffers=eager.init_buffers)
        capture_diff = _capture_difference(joint, eager, rk)
        search = _Search(seen.values, rk)
        with rk.seeded():
            traced = state.run_instrumented(args, kwargs, eager.tangents, counted(search),
                                            buffers=eager.init_buffers)
    pristine_grads = {f: v for f, (_, v) in joint.grads.items()}
    first, notes = search.first, []
    output_diff = None
    if rk.world > 1 or (first is None and capture_diff is None):  # collective: every rank
        output_diff = _compare_grad_outputs(traced, pristine_grads, rk)
    if first is not None and capture_diff is not None:
        notes.append(f"also, the compiled graphs differ from the captured one: {first}")
    result = capture_diff or first or output_diff
    if result is None and not step_ok:
        result = Difference(
            stage="runtime", rank=rk.rank,
            description=("every node of the compiled graphs computes the captured graph's "
                         "value, and the captured graph agrees with eager: the difference "
                         "arises outside the graphs, in the runtime (padding, gradient "
                         "accumulation into the DTensor .grad, or the collectives)"))
    if search.unmatched:
        notes.append(f"{len(search.unmatched)} compiled node(s) have no counterpart in the "
                     f"captured graph and were not compared (first: "
                     f"{', '.join(search.unmatched[:3])})")
    return result, search.compared, notes


def _capture_difference(joint, eager: EagerRun, rk: Ranks) -> Optional[Difference]:
    """The first output of the joint graph as captured (a forward output, then a gradient)
    that differs from eager's, if any: then capture, not a pass, is to blame."""
    pairs = [(node, val, ref, f"forward output {i}") for i, ((node, val), ref)
             in enumerate(zip(joint.outputs, tensor_leaves(eager.out)))]
    pairs += [(node, val, eager.local_grads.get(f), f"gradient of {f}")
              for f, (node, val) in joint.grads.items()]
    for node, val, ref, what in pairs:
        if ref is None or not isinstance(val, torch.Tensor):
            continue
        delta, mag = max_delta(ref, val), max_abs(ref)
        ok, _ = rk.within(delta, mag, coarser_dtype(ref.dtype, val.dtype))
        if ok:
            continue
        return Difference(
            stage="capture", node=node.name, graph="joint", op=_op_name(node),
            module=meta.tag(node, meta.MODULE) or "", max_delta=delta, max_abs=mag,
            rank=rk.rank,
            description=(
                f"the captured joint graph (as traced, before any pass) already differs "
                f"from eager at its {what} (node {node.name}, {_op_name(node)}; "
                f"max|Δ| {fmt_value(delta)}, max|eager| {fmt_value(mag)}"
                f"{_on_rank(rk.rank, rk.world)}): capture, not a pass, computes different "
                "values than eager"))
    return None


def _on_rank(rank: int, world: int) -> str:
    return f", on rank {rank}" if world > 1 else ""


def _node_difference(n, where, rec, v, delta, mag, origin, rank, world) -> Difference:
    op = _op_name(n)
    module = meta.tag(n, meta.MODULE) or ""
    parts = [f"node {n.name} ({op}) in the compiled {'forward' if where == 'fwd' else 'backward'}"
             f" graph, module {module or '<root>'}: max|Δ| {fmt_value(delta)} against the "
             f"captured graph's value (max {fmt_value(mag)}){_on_rank(rank, world)}"]
    if isinstance(origin, str):
        parts.append(f"it recomputes forward node {origin} in the backward, and its inputs "
                     "there no longer hold what they held in the forward (written in place "
                     "in between?)")
    elif rec.op != op:
        parts.append(f"its op differs from the captured graph's ({rec.op})")
    if isinstance(v, torch.Tensor) and tuple(v.shape) != tuple(rec.value.shape):
        parts.append(f"shape {tuple(v.shape)} where the captured graph has "
                     f"{tuple(rec.value.shape)}")
    return Difference(stage="graph", node=n.name, graph=where, op=op, module=module,
                      max_delta=delta, max_abs=mag,
                      recomputed_from=origin if isinstance(origin, str) else None, rank=rank,
                      description="; ".join(parts))


def _compare_grad_outputs(traced, pristine_grads: dict, rk: Ranks) -> Optional[Difference]:
    """The compiled backward's gradient shards (``traced``: what the instrumented run
    computed) against the captured graph's full gradients (averaged over the ranks), cut to
    this rank's rows."""
    import torch.distributed as dist

    full = {}
    for spec in traced.params:
        if not spec.requires_grad:
            continue
        g = pristine_grads.get(spec.fqn)
        if g is None:
            if rk.world == 1:
                continue
            g = torch.zeros(spec.shape, dtype=spec.dtype)  # every rank reduces every gradient
        g = g.clone()
        if rk.world > 1:
            home = g.device
            g = g.to(group_device(rk.group))
            dist.all_reduce(g, group=rk.group)
            g = (g / rk.world).to(home)
        full[spec.fqn] = g
    for f, (_, got) in traced.grads.items():
        ref = full.get(f)
        if ref is None:
            continue
        if f in traced.rows:
            a, b = traced.rows[f]
            ref = ref[a:b]
        delta, mag = max_delta(ref, got), max_abs(ref)
        ok, _ = rk.within(delta, mag, ref.dtype)
        if not ok:
            return Difference(
                stage="runtime", node=f, graph="bwd", max_delta=delta, max_abs=mag,
                rank=rk.rank,
                description=(f"every compared node agrees with the captured graph, but the "
                             f"backward's gradient shard of {f} differs from the captured "
                             f"gradient (max|Δ| {fmt_value(delta)}{_on_rank(rk.rank, rk.world)}): "
                             "look at the nodes the passes added (reduce-scatter packing, "
                             "new nodes with no counterpart in the captured graph)"))
    return None

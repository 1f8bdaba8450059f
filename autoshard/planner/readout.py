"""The Plan read off the chosen candidate's graphs: ``make_plan`` gathers its units, its
communication schedule (``read_schedule``: each collective where it runs, the op before it
and the module it serves), the prediction and the offloaded activations.

It reads the passes' node tags, so it lives beside them; ``autoshard.core.plans`` holds the
``Plan`` itself (plain data, its JSON and tables) and imports no pass.
"""

from __future__ import annotations

from typing import Optional

import torch.fx as fx

from autoshard.core import meta
from autoshard.passes.offload import offloaded_bytes
from autoshard.core.plans import TP_UNIT, Plan, ScheduleEntry, UnitInfo, module_label


_SHOWN = {
    meta.AG_ISSUE: "all_gather",
    meta.AG_WAIT: "wait",
    meta.RS_ISSUE: "reduce_scatter",
    meta.RS_WAIT: "wait",
    meta.AR_ISSUE: "all_reduce",
    meta.AR_WAIT: "wait",
    meta.FREE: "free",
}


def read_schedule(graphs) -> list:
    """ScheduleEntry per communication node of ``graphs`` (forward first, then backward):
    FSDP's, and tensor parallelism's over "tp" (``op`` "all_reduce (tp)", of no unit)."""
    entries = []
    for gm in graphs:
        if gm is None:
            continue
        where = node_modules(gm)
        serves, tp_serves = _served(gm, where), {}
        prev = None
        for n in gm.graph.nodes:
            kind = _comm(n)
            if kind in _SHOWN:
                if kind == meta.FREE:
                    size = sum(meta.val_bytes(t) for t in n.args[0])
                elif kind in (meta.RS_ISSUE, meta.AR_ISSUE):
                    size = meta.val_bytes(n.args[0])
                else:
                    size = meta.val_bytes(n)
                entries.append(
                    ScheduleEntry(
                        region=meta.tag(n, meta.REGION),
                        unit=meta.tag(n, meta.UNIT),
                        op=_SHOWN[kind],
                        bytes=size,
                        after=prev.name if prev is not None else "(start)",
                        module=where[prev] if prev is not None else "",
                        serves=serves.get(n, ""),
                        ranks=meta.tag(n, meta.GROUP, 0) if kind == meta.AG_ISSUE else 0,
                    )
                )
            elif kind is None and n.op == "call_function" and n.target in meta.TP_COLLECTIVES:
                # serves: the module whose output (or gradient) it carries
                tp_kind, src = meta.TP_COLLECTIVES[n.target], n.args[0]
                tp_serves[n] = tp_serves.get(src) or where.get(src, "")
                size = meta.val_bytes(src if tp_kind == "all_reduce" else n)
                entries.append(ScheduleEntry(
                    region=meta.tag(n, meta.REGION), unit=TP_UNIT, op=f"{tp_kind} (tp)",
                    bytes=size, after=prev.name if prev is not None else "(start)",
                    module=where[prev] if prev is not None else "", serves=tp_serves[n]))
            elif _is_compute(n):
                prev = n
    return entries


def _comm(n) -> Optional[str]:
    """``n``'s communication kind, None for a placeholder: a backward input saved from the
    forward keeps its maker's tags (a kept unit's gathered parameter, a wait's output) but
    runs nothing."""
    return None if n.op == "placeholder" else meta.tag(n, meta.COMM)


def _is_compute(n) -> bool:
    return n.op == "call_function" and not meta.is_comm(n)


_STEPS = (("ag_", "all-gather"), ("all_gather", "all-gather"), ("rs_", "reduce-scatter"),
          ("reduce_scatter", "reduce-scatter"), ("ar_", "all-reduce"),
          ("all_reduce", "all-reduce"), ("free", "free"), ("h2d", "copy to the device"),
          ("d2h", "copy to the host"))


def node_modules(gm, units=None) -> dict:
    """Per node of ``gm``, the module path the plan names it by: its module tag; for a
    communication node its step and unit (``"all-gather of blocks.1"``, ``units``: the unit
    names by index); for an op with no tag (made by a pass, or by autograd for no module) the
    op's before it."""
    out, last = {}, ""
    for n in gm.graph.nodes:
        kind, path = meta.tag(n, meta.COMM), meta.tag(n, meta.MODULE)
        if kind is not None:
            step = next((v for k, v in _STEPS if kind.startswith(k)), kind)
            unit = meta.tag(n, meta.UNIT)
            out[n] = f"{step} of {(units or {}).get(unit, f'unit {unit}')}"
        else:
            out[n] = last = path if path is not None else last
    return out


def _served(gm, where: dict) -> dict:
    """Per collective issue and wait of ``gm``, the module path of the op it serves
    (``ScheduleEntry.serves``); ``where``: ``node_modules``."""
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    readers = {}  # unit -> positions of the ops reading its gathered parameters
    for n in nodes:
        if _is_compute(n):
            for a in n.all_input_nodes:
                if meta.tag(a, meta.COMM) == meta.AG_UNPACK:
                    readers.setdefault(meta.tag(a, meta.UNIT), []).append(pos[n])
    out = {}
    for n in nodes:
        kind = _comm(n)
        if kind == meta.AG_WAIT:
            after = [p for p in readers.get(meta.tag(n, meta.UNIT), ()) if p > pos[n]]
            if after:
                out[n] = where[nodes[min(after)]]
        elif kind in (meta.RS_ISSUE, meta.AR_ISSUE):
            made = _makers(n.args[0])
            if made:
                out[n] = where[max(made, key=pos.__getitem__)]
    for n in nodes:  # an issue serves what its wait does, and the other way round
        if _comm(n) in meta.WAITS and isinstance(n.args[0], fx.Node):
            issue = n.args[0]
            if issue in out or n in out:
                out[issue] = out[n] = out.get(issue, out.get(n))
    return out


def _makers(node) -> list:
    """The compute ops whose values ``node`` is packed from (through communication nodes)."""
    seen, todo, out = set(), [node], []
    while todo:
        n = todo.pop()
        if n in seen or not isinstance(n, fx.Node):
            continue
        seen.add(n)
        if _is_compute(n):
            out.append(n)
        elif meta.is_comm(n) and not meta.is_collective_issue(n) and not meta.is_wait(n):
            todo.extend(n.all_input_nodes)
    return out


def make_plan(world_size: int, units, specs: dict, graphs, *, prediction=None, profile=None,
              budget: int = 0, policy: str = "", model_state_bytes: int = 0,
              host_state_bytes: int = 0, offload: float = 0.0,
              offload_params: Optional[float] = None, reshard: str = "",
              recompute=("", None), candidates=(), strategy: str = "zero3",
              mesh_shape=(), grad_sync: bool = True) -> Plan:
    infos = []
    for u in units:
        numel = sum(_numel(specs[f].shape) for f in u.fqns)
        nbytes = sum(specs[f].gathered_bytes() for f in u.fqns)
        host = sum(_numel(specs[f].shape) for f in u.fqns if specs[f].device == "host")
        infos.append(UnitInfo(u.index, u.name, list(u.fqns), numel, nbytes, u.stays_gathered,
                              u.held, host / numel if numel else 0.0, u.group))
    plan = Plan(world_size, infos, read_schedule(graphs), policy=policy, memory_budget=budget,
                recompute=recompute[0], recompute_blocks=recompute[1],
                offload=offload, offload_params=offload_params if offload else None,
                reshard=reshard, strategy=strategy, mesh_shape=list(mesh_shape),
                grad_sync=grad_sync, candidates=[dict(c) for c in candidates],
                reduction=_reduction(specs.values()))
    plan.offloaded_activations = _offloaded_activations(graphs[0], recompute[1])
    if profile is not None:
        plan.device = profile.to_dict()
    if prediction is not None:
        p = prediction
        plan.predicted = {
            "step_s": p.total, "compute_s": p.compute, "exposed_comm_s": p.exposed_comm,
            "peak_bytes": p.peak_bytes, "peak_at": p.peak_at, "comm_bytes": p.comm_bytes,
            "sent_bytes": p.sent_bytes, "model_state_bytes": model_state_bytes,
            "host_state_bytes": host_state_bytes, "host_peak_bytes": p.host_peak_bytes,
            "both_peak_bytes": p.both_peak_bytes,
        }
        names = {u.index: u.name for u in units}
        where = {(g, n.name): path for g, gm in zip((meta.FWD, meta.BWD), graphs)
                 if gm is not None for n, path in node_modules(gm, names).items()}
        graph, _, node = p.peak_at.partition(":")
        plan.predicted["peak_at"] = (module_label(where.get((graph, node), ""), graph)
                                     if node else p.peak_at)
        plan.memory_timeline = [[t, b, g, where.get((g, n), "")] for t, b, g, n in p.timeline]
        plan.events = p.events
    return plan


def _offloaded_activations(fwd, modes) -> dict:
    """``Plan.offloaded_activations`` of a forward graph: its copies to the host, by the
    block ``modes`` offloads that made them (else by module path)."""
    if fwd is None:
        return {}
    blocks = sorted((p for p, m in (modes or {}).items() if m == "offload"), key=len,
                    reverse=True)
    out: dict = {}
    for path, nbytes in offloaded_bytes(fwd).items():
        key = next((b for b in blocks if path == b or path.startswith(b + ".")), path)
        out[key] = out.get(key, 0) + nbytes
    return out


def _reduction(specs) -> str:
    """How the plan's gradients are reduced, as ``Plan.reduction`` says it."""
    s = next(iter(specs), None)
    if s is None or s.scaling[0] == "avg":
        return "mean"
    out = "mean" if s.grad_divide is None else f"sum / {s.grad_divide:g}"
    return out + (", sum collectives" if s.force_sum else "")


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n

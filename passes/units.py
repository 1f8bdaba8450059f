"""assign_units: which parameters are gathered together."""

from __future__ import annotations

import dataclasses
import math

import torch.fx as fx

from autoshard.core import meta
from autoshard.passes.auto import auto_units
from autoshard.passes.groupings import first_use_order, module_groups, size_groups, span_names


@dataclasses.dataclass
class Unit:
    """A wrapping unit: parameters gathered by one all-gather and reduced by one
    reduce-scatter (per dtype)."""

    index: int
    name: str  # the module paths covering its parameters (``span_names``), or "root"
    fqns: list
    stays_gathered: bool = False  # from forward to backward (not resharded after forward)
    # its shards, in host memory, are copied to the device once for the forward's all-gather
    # and held there for the backward's (set by insert_collectives from ctx.offload_params)
    held: bool = False
    # hpZ (Config.reshard_after_forward=k): resharded after the forward to groups of ``group``
    # ranks (this rank keeps 1/group of the gathered buffer; the backward all-gathers within
    # the group); 0: resharded to the whole shard dimension, or kept
    group: int = 0


def assign_units_pass(gm: fx.GraphModule, ctx, *,
                      options) -> tuple[fx.GraphModule, dict]:
    """Group parameters into units and tag each parameter placeholder with its unit.

    Needs: parameter placeholders tagged ``role=param`` with their ``fqn`` (capture).
    Options: ``units`` — explicit lists of FQNs (any tied alias accepted), or ``policy``:
    "auto" (see ``auto_units``), "module" (with ``classes`` and ``pattern``, as
    ``autoshard.Module``'s), "size" (with ``min_numel``, as ``autoshard.Size``'s),
    "per-parameter", "whole-model".
    Guarantees: every parameter is in exactly one unit; parameters no explicit unit or module
    names form the "root" unit; a unit is named by its block (module policy), else by the
    module paths covering its parameters (``span_names``); units are numbered in order of
    first use in the graph; ``Unit.stays_gathered`` follows ``ctx.reshard_after_forward``
    (True: none kept, False: all, "auto": the unit read last in forward, which the backward
    would gather again first; an int k: none kept, each resharded to groups of k,
    ``Unit.group``).
    Never changes the graph's nodes.
    """
    phs = first_use_order(gm)
    order = [meta.tag(n, meta.FQN) for n in phs]
    canonical = {f: f for f in order}
    canonical.update({k: v for k, v in ctx.fqn_aliases.items() if v in canonical})
    specs = {p.fqn: p for p in ctx.captured.params}

    groups = []  # (name, fqns)
    explicit = options.get("units")
    policy = options.get("policy", "module")
    if explicit is not None:
        seen = {}
        for i, unit in enumerate(explicit):
            fq = []
            for name in unit:
                if name not in canonical:
                    raise ValueError(
                        f"Config.units[{i}] names '{name}', which is not a parameter of the "
                        f"model; known parameters start with: {', '.join(order[:5])} ..."
                    )
                c = canonical[name]
                if c in seen:
                    raise ValueError(
                        f"parameter '{name}' is in Config.units[{seen[c]}] and "
                        f"Config.units[{i}]; each parameter belongs to one unit"
                    )
                seen[c] = i
                fq.append(c)
            groups.append(fq)
        groups = list(zip(span_names(groups, order), groups))
    elif policy == "module" and ctx.model is not None:
        groups = module_groups(ctx.model, order, options)
    elif policy == "size":
        numel = {f: math.prod(specs[f].shape) for f in order}
        groups = size_groups(order, numel, options.get("min_numel", 10**8))
    elif policy == "per-parameter":
        groups = [(f, [f]) for f in order]
    elif policy == "whole-model":
        groups = [("root", list(order))]
    elif policy == "auto":
        groups = auto_units(gm, ctx, order, options)
    assigned = {f for _, fq in groups for f in fq}
    rest = [f for f in order if f not in assigned]
    if rest:
        groups.append(("root", rest))

    rank = {f: i for i, f in enumerate(order)}
    groups.sort(key=lambda g: min(rank[f] for f in g[1]))
    by_fqn = {meta.tag(n, meta.FQN): n for n in phs}
    units = []
    for i, (name, fq) in enumerate(groups):
        fq = sorted(fq, key=rank.__getitem__)
        units.append(Unit(i, name, fq))
        for f in fq:
            meta.tags(by_fqn[f])[meta.UNIT] = i
    _choose_kept(gm, ctx.reshard_after_forward, units, by_fqn)
    return gm, {"units": units}


def _choose_kept(gm, mode, units: list, by_fqn) -> None:
    if mode is True:
        return
    if isinstance(mode, int) and not isinstance(mode, bool):
        for u in units:
            u.group = mode
        return
    if mode is False:
        for u in units:
            u.stays_gathered = True
        return
    pos = {n: i for i, n in enumerate(gm.graph.nodes)}
    end = {}  # unit -> position of its last forward read
    for u in units:
        reads = [pos[r] for f in u.fqns for r in by_fqn[f].users if meta.is_forward(r)]
        if reads:
            end[u.index] = max(reads)
    if end:  # the backward starts by gathering it again
        units[max(end, key=end.__getitem__)].stays_gathered = True

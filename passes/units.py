"""assign_units: which parameters are gathered together."""

from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from autoshard import meta


@dataclasses.dataclass
class Unit:
    """A wrapping unit: parameters gathered by one all-gather and reduced by one
    reduce-scatter (per dtype)."""

    index: int
    name: str  # module path of the block, or "root"
    fqns: list

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def repeated_blocks(model: torch.nn.Module) -> list:
    """Module paths of the repeated blocks of every outermost ModuleList/Sequential whose
    children with parameters all share one class."""
    found = []

    def visit(mod, prefix):
        if isinstance(mod, (torch.nn.ModuleList, torch.nn.Sequential)):
            kids = [
                (n, c) for n, c in mod.named_children() if next(c.parameters(), None) is not None
            ]
            if len(kids) >= 2 and len({type(c) for _, c in kids}) == 1:
                found.extend(prefix + n for n, _ in kids)
                return
        for n, c in mod.named_children():
            visit(c, prefix + n + ".")

    visit(model, "")
    return found


def assign_units_pass(gm: fx.GraphModule, ctx, *, options) -> fx.GraphModule:
    """Group parameters into units and tag each parameter placeholder with its unit.

    Needs: parameter placeholders tagged ``role=param`` with their ``fqn`` (capture).
    Options: ``units`` — explicit lists of FQNs (any tied alias accepted), or ``policy`` —
    "module": each repeated block of a ModuleList/Sequential is a unit.
    Guarantees: every parameter is in exactly one unit; parameters nobody named form the
    "root" unit; units are numbered in order of first use in the graph, ties by FQN order.
    Never changes the graph's nodes.
    """
    phs = [n for n in gm.graph.nodes if meta.is_param(n)]
    order = [meta.tag(n, meta.FQN) for n in phs]
    canonical = {f: f for f in order}
    canonical.update({k: v for k, v in ctx.fqn_aliases.items() if v in canonical})

    groups = []  # (name, fqns)
    explicit = options.get("units")
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
            groups.append((f"unit{i}", fq))
    elif ctx.model is not None:
        taken = set()
        for path in repeated_blocks(ctx.model):
            fq = [f for f in order if f.startswith(path + ".") and f not in taken]
            if fq:
                taken.update(fq)
                groups.append((path, fq))
    assigned = {f for _, fq in groups for f in fq}
    rest = [f for f in order if f not in assigned]
    if rest:
        groups.append(("root", rest))

    # number units by first use (graph order), so the schedule reads top to bottom
    pos = {n: i for i, n in enumerate(gm.graph.nodes)}
    by_fqn = dict(zip(order, phs))
    end = len(pos)

    def first_use(fq):
        return min((min((pos[u] for u in by_fqn[f].users), default=end) for f in fq), default=end)

    rank = {f: i for i, f in enumerate(order)}
    groups.sort(key=lambda g: (first_use(g[1]), min(rank[f] for f in g[1])))
    ctx.units = []
    for i, (name, fq) in enumerate(groups):
        fq = sorted(fq, key=rank.__getitem__)
        ctx.units.append(Unit(i, name, fq))
        for f in fq:
            meta.tags(by_fqn[f])[meta.UNIT] = i
    return gm

"""assign_units: which parameters are gathered together."""

from __future__ import annotations

import dataclasses
import math
import re

import torch
import torch.fx as fx

from autoshard import meta


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


def span_names(groups, order) -> list:
    """Each unit's name, for units of parameters ``groups`` (lists of FQNs) among all the
    parameters ``order``: the module paths that cover its parameters. A path covers a
    parameter when every parameter under it is in the unit (the parameter's own FQN covers it
    alone). One covering path is the name (``"layers.3"``, ``"layers.3.attn"``; the root
    module's: ``"root"``); consecutive numbered siblings are a range (``"layers.0-3"``); else
    the first and last paths, in the order of ``order``: ``"wte..layers.0"``,
    ``"layers.0.mlp..layers.1.attn"``. Names only: the units are as given."""
    under, pos = {}, {}  # module path -> its parameters; FQN -> position
    for i, f in enumerate(order):
        pos[f] = i
        parts = f.split(".")
        for k in range(len(parts) + 1):
            under.setdefault(".".join(parts[:k]), []).append(f)
    return [_span_name(sorted(fqns, key=lambda f: pos.get(f, -1)), under) for fqns in groups]


def _span_name(fqns, under: dict) -> str:
    mine, paths = set(fqns), {}
    for f in fqns:
        parts = f.split(".")
        paths.setdefault(next(p for p in (".".join(parts[:k]) for k in range(len(parts) + 1))
                              if all(g in mine for g in under.get(p, [f]))), None)
    paths = list(paths)
    if len(paths) == 1:
        return paths[0] or "root"
    parent = {p.rpartition(".")[0] for p in paths}
    tails = [p.rpartition(".")[2] for p in paths]
    if len(parent) == 1 and all(t.isdigit() for t in tails):
        nums = [int(t) for t in tails]
        if nums == list(range(nums[0], nums[0] + len(nums))):
            head = parent.pop()
            return f"{head + '.' if head else ''}{nums[0]}-{nums[-1]}"
    return f"{paths[0] or 'root'}..{paths[-1] or 'root'}"


def first_use_order(gm: fx.GraphModule) -> list:
    """Parameter placeholders in order of first use (unused ones last), ties by FQN order."""
    pos = {n: i for i, n in enumerate(gm.graph.nodes)}
    phs = [n for n in gm.graph.nodes if meta.is_param(n)]
    end = len(pos)
    return sorted(phs, key=lambda n: (min((pos[u] for u in n.users), default=end), pos[n]))


def module_groups(model, order, options) -> list:
    classes, pattern = options.get("classes"), options.get("pattern")
    if classes or pattern:
        rx = re.compile(pattern) if pattern else None
        paths = []
        for name, mod in model.named_modules():
            if not name or any(name.startswith(p + ".") for p in paths):
                continue
            if (classes and type(mod).__name__ in classes) or (rx and rx.fullmatch(name)):
                paths.append(name)
    else:
        paths = repeated_blocks(model)
    taken, groups = set(), []
    for path in paths:
        fq = [f for f in order if f.startswith(path + ".") and f not in taken]
        if fq:
            taken.update(fq)
            groups.append((path, fq))
    return groups


def size_groups(order, numel, min_numel) -> list:
    groups, cur, n = [], [], 0
    for f in order:
        cur.append(f)
        n += numel[f]
        if n >= min_numel:
            groups.append(cur)
            cur, n = [], 0
    if cur:
        if groups:
            groups[-1].extend(cur)
        else:
            groups.append(cur)
    return list(zip(span_names(groups, order), groups))


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
        from autoshard.passes.auto import auto_units

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

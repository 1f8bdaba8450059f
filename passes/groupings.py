"""Groupings of parameters into units, by module, by size, in first-use order, and their
names: the unit policies' raw material, which ``assign_units`` and the 'auto' policy's search
(``auto.py``) both read."""

from __future__ import annotations

import re

import torch
import torch.fx as fx

from autoshard.core import meta


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

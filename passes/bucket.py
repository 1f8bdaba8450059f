"""bucket: merge adjacent small units so their collectives go as one."""

from __future__ import annotations

import torch.fx as fx

from autoshard.core import meta
from autoshard.passes.auto import unit_bytes
from autoshard.core.spec import group_size
from autoshard.passes.units import Unit


def bucket_units_pass(gm: fx.GraphModule, ctx, *,
                      options) -> tuple[fx.GraphModule, dict]:
    """Merge runs of adjacent units (in first-use order) smaller than ``min_bytes`` into one
    unit of at most ``min_bytes``, so one all-gather and one reduce-scatter serve them all.

    Needs: ``ctx.units`` and the unit tags of parameter placeholders (assign_units).
    Options: ``min_bytes`` — units whose gathered bytes are below it are bucketed (default:
    the bytes a collective moves in the time of its latency, ``(N-1) alpha / beta``, from the
    cost model: below that a collective is latency-bound). Deterministic: units are walked in
    their order, never by hash. Does nothing when no two adjacent units are both small.
    """
    specs = {p.fqn: p for p in ctx.captured.params}
    world = group_size(specs.values())
    limit = options.get("min_bytes")
    if limit is None:
        p = ctx.profile
        limit = int((world - 1) * p.alpha / p.beta) if p is not None and p.beta else 0
    merged, run = [], []

    def close():
        if run:
            if len(run) == 1:
                merged.append(run[0])
            else:
                name = f"{run[0].name}+{len(run) - 1}"
                merged.append(Unit(0, name, [f for u in run for f in u.fqns],
                                   stays_gathered=any(u.stays_gathered for u in run)))
        run.clear()

    for u in ctx.units:
        size = unit_bytes(u.fqns, specs)
        if size >= limit:
            close()
            merged.append(u)
            continue
        if run and unit_bytes([f for r in run for f in r.fqns] + u.fqns, specs) > limit:
            close()
        run.append(u)
    close()
    by_fqn = {meta.tag(n, meta.FQN): n for n in gm.graph.nodes if meta.is_param(n)}
    units = []
    for i, u in enumerate(merged):
        units.append(Unit(i, u.name, list(u.fqns), stays_gathered=u.stays_gathered))
        for f in u.fqns:
            meta.tags(by_fqn[f])[meta.UNIT] = i
    return gm, {"units": units}

"""The "auto" unit policy: choose units that minimise predicted step time within the memory
budget.

Method: exact dynamic programming over contiguous groups of parameters in order of first use.
With every collective's wait right after its issue (no prefetch), a plan's step time is the
compute time (the same for every grouping) plus the sum of its collective times, so
``best[i] = min_j best[j] + cost(params j..i)`` is exact for contiguous groupings, where
``cost`` counts, per dtype, a forward and a backward all-gather and (for trainable
parameters) one reduce-scatter, each ``(N - 1) alpha + (N - 1) / N * bytes * beta``.
Memory: a group is allowed if ``3 * full bytes`` (gathered parameters, their unpacked copies
or full gradients, and the send buffer, at the backward's worst point) fits in what the budget
leaves after the model state and the activation peak. Groupings that are not contiguous in use
order (a module policy's root unit, for one) are also costed, and the cheapest allowed
grouping of all wins, so "auto" is never predicted slower than a fixed policy that fits.
Complexity: O(P * K) cost evaluations for P parameters and at most K parameters per allowed
group (O(P^2) in the worst case), each O(1) with prefix sums; networkx is not needed here
because the order is a line.
"""

from __future__ import annotations

import math

from autoshard.cost import collective_time
from autoshard.passes.collectives import ShardLayout


def unit_bytes(fqns, specs, world: int) -> int:
    """Full (padded) bytes of the units' parameters as gathered."""
    total = 0
    for f in fqns:
        lay = ShardLayout(specs[f].shape, world)
        total += (lay.local_numel * world if lay.sharded else 1) * specs[f].dtype.itemsize
    return total


def group_cost(fqns, specs, world: int, profile) -> float:
    """Predicted exposed seconds of one unit's collectives per step."""
    by_dtype = {}
    for f in fqns:
        by_dtype.setdefault(specs[f].dtype, []).append(f)
    total = 0.0
    for fs in by_dtype.values():
        sharded = [f for f in fs if specs[f].shape]
        if sharded:
            total += 2 * collective_time(unit_bytes(sharded, specs, world), world, profile)
        trainable = [f for f in fs if specs[f].requires_grad]
        if trainable:
            total += collective_time(
                sum(unit_bytes([f], specs, world) if specs[f].shape else
                    world * specs[f].dtype.itemsize for f in trainable), world, profile)
    return total


def _dp(order, specs, world, profile, cap):
    """Exact DP over contiguous groups; segment costs from per-dtype prefix sums."""
    n = len(order)
    dtypes = sorted({specs[f].dtype for f in order}, key=str)
    ag = {d: [0] * (n + 1) for d in dtypes}  # prefix sums of gathered bytes per dtype
    rs = {d: [0] * (n + 1) for d in dtypes}  # ... and of reduce-scattered bytes
    size = [0] * (n + 1)
    for k, f in enumerate(order):
        spec, b = specs[f], unit_bytes([f], specs, world)
        for d in dtypes:
            ag[d][k + 1], rs[d][k + 1] = ag[d][k], rs[d][k]
        if spec.shape:
            ag[spec.dtype][k + 1] += b
        if spec.requires_grad:
            rs[spec.dtype][k + 1] += b if spec.shape else world * spec.dtype.itemsize
        size[k + 1] = size[k] + b

    def seg(j, i):
        c = 0.0
        for d in dtypes:
            a, r = ag[d][i] - ag[d][j], rs[d][i] - rs[d][j]
            if a:
                c += 2 * collective_time(a, world, profile)
            if r:
                c += collective_time(r, world, profile)
        return c

    best = [0.0] + [math.inf] * n
    cut = [0] * (n + 1)
    for i in range(1, n + 1):
        for j in range(i - 1, -1, -1):
            if size[i] - size[j] > cap and j < i - 1:
                break
            c = best[j] + seg(j, i)
            if c < best[i]:
                best[i], cut[i] = c, j
    groups, i = [], n
    while i > 0:
        groups.append(order[cut[i]:i])
        i = cut[i]
    return groups[::-1]


def auto_units(gm, ctx, order, options) -> list:
    from autoshard.passes.units import _module_groups
    from autoshard.simulate import activation_peak

    specs = {p.fqn: p for p in ctx.captured.params}
    world, profile = ctx.world_size, ctx.profile
    cap = options.get("max_unit_bytes")
    if cap is None:
        free = ctx.memory_budget - ctx.static_bytes - activation_peak(gm)
        cap = max(free // 3, 0)
    ctx.auto_cap = cap
    candidates = [[(f"group{k}", g) for k, g in enumerate(_dp(order, specs, world, profile, cap))]]
    if ctx.model is not None:
        mod = _module_groups(ctx.model, order, options)
        rest = [f for f in order if f not in {x for _, g in mod for x in g}]
        candidates.append(mod + ([("root", rest)] if rest else []))
    candidates.append([("model", list(order))])

    def allowed(groups):
        return all(unit_bytes(g, specs, world) <= cap or len(g) == 1 for _, g in groups)

    def cost(groups):
        return sum(group_cost(g, specs, world, profile) for _, g in groups)

    fits = [c for c in candidates if allowed(c)]
    return min(fits, key=cost) if fits else candidates[0]

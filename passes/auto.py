"""The "auto" unit policy: choose units that minimise predicted step time within the memory
budget.

Method. With every collective's wait right after its issue (no prefetch), a plan's step time
is the compute time (the same for every grouping) plus the sum of its collective times; one
unit costs, per dtype, a forward and a backward all-gather and (for trainable parameters) one
reduce-scatter, each ``(N - 1) alpha + (N - 1) / N * bytes * beta``. So for a cap on unit size
an exact dynamic program over contiguous groups of parameters in order of first use,
``best[i] = min_j best[j] + cost(j..i)``, finds the fastest grouping whose units fit the cap.
The candidates are these DP groupings for a ladder of caps (half the model, a quarter, ...)
plus the fixed policies' groupings (module, size, per-parameter, whole-model: some are not
contiguous in use order, like a module policy's root unit). Candidates whose lower bound on
peak memory (model state plus the larger of the activation peak and the largest unit) exceeds
the budget are dropped; the rest are tried fastest first through the full pipeline and its
memory simulation (``autoshard.passes.plan``), and the fastest that fits wins. So "auto" is never
predicted slower than a fixed policy that fits, and what it picks is checked, not estimated.
Complexity: O(P * K) segment evaluations per cap for P parameters and at most K parameters per
unit (O(P^2) for the largest cap), each O(dtypes) with prefix sums; for graphs over
``BIG_GRAPH`` nodes at most ``MAX_TRIES`` full pipelines, then the smallest-memory candidate
(there the guarantee holds among the candidates tried).
"""

from __future__ import annotations

import math

from autoshard.cost import collective_time
from autoshard.spec import group_size

MAX_TRIES = 6  # full pipelines tried for graphs over BIG_GRAPH nodes; smaller ones try all
BIG_GRAPH = 5000


def unit_bytes(fqns, specs) -> int:
    """Full (padded) bytes of the parameters ``fqns`` as gathered, in their compute dtype."""
    return sum(specs[f].gathered_bytes() for f in fqns)


class _Segments:
    """Collective cost of any contiguous run of parameters, from per-dtype prefix sums."""

    def __init__(self, order, specs, profile):
        n = len(order)
        self.world, self.profile = group_size([specs[f] for f in order]), profile
        self.dtypes = sorted({d for f in order
                              for d in (specs[f].compute_dtype, specs[f].reduce_dtype)}, key=str)
        self.ag = {d: [0] * (n + 1) for d in self.dtypes}
        self.rs = {d: [0] * (n + 1) for d in self.dtypes}
        self.size = [0] * (n + 1)
        for k, f in enumerate(order):
            spec, b = specs[f], specs[f].gathered_bytes()
            for d in self.dtypes:
                self.ag[d][k + 1], self.rs[d][k + 1] = self.ag[d][k], self.rs[d][k]
            if spec.sharded:
                self.ag[spec.compute_dtype][k + 1] += b
            if spec.requires_grad:
                self.rs[spec.reduce_dtype][k + 1] += spec.reduced_bytes
            self.size[k + 1] = self.size[k] + b

    def cost(self, j: int, i: int) -> float:
        c = 0.0
        for d in self.dtypes:
            a, r = self.ag[d][i] - self.ag[d][j], self.rs[d][i] - self.rs[d][j]
            if a:
                c += 2 * collective_time(a, self.world, self.profile)
            if r:
                c += collective_time(r, self.world, self.profile)
        return c


def group_cost(fqns, specs, profile) -> float:
    """Predicted exposed seconds of one unit's collectives per step."""
    return _Segments(list(fqns), specs, profile).cost(0, len(fqns))


def _dp(order, seg: _Segments, cap: int) -> list:
    n = len(order)
    best = [0.0] + [math.inf] * n
    cut = [0] * (n + 1)
    for i in range(1, n + 1):
        for j in range(i - 1, -1, -1):
            if seg.size[i] - seg.size[j] > cap and j < i - 1:
                break
            c = best[j] + seg.cost(j, i)
            if c < best[i]:
                best[i], cut[i] = c, j
    groups, i = [], n
    while i > 0:
        groups.append(order[cut[i]:i])
        i = cut[i]
    return groups[::-1]


def auto_candidates(gm, ctx, order, options) -> list:
    """Candidate groupings, fastest first: ``[(seconds, lower bound bytes, groups)]``."""
    from autoshard.passes.units import _module_groups, _size_groups
    from autoshard.simulate import activation_peak

    specs = {p.fqn: p for p in ctx.captured.params}
    profile = ctx.profile
    seg = _Segments(order, specs, profile)
    total = seg.size[-1]
    groupings = [[("model", list(order))], [(f, [f]) for f in order]]
    mod = _module_groups(ctx.model, order, options) if ctx.model is not None else []
    if mod:
        rest = [f for f in order if f not in {x for _, g in mod for x in g}]
        groupings.append(mod + ([("root", rest)] if rest else []))
    numel = {f: math.prod(specs[f].shape) for f in order}
    groupings.append(_size_groups(order, numel, options.get("min_unit_numel", 10**8)))
    caps = {max(unit_bytes(g, specs) for _, g in c) for c in groupings[2:]}
    caps |= {total >> k for k in range(1, 7)}
    for cap in sorted(caps, reverse=True):
        groups = _dp(order, seg, cap)
        groupings.append([(f"group{k}", g) for k, g in enumerate(groups)])
    act = activation_peak(gm)
    out, seen = [], set()
    for groups in groupings:
        key = tuple(tuple(g) for _, g in groups)
        if key in seen:
            continue
        seen.add(key)
        t = sum(group_cost(g, specs, profile) for _, g in groups)
        biggest = max(unit_bytes(g, specs) for _, g in groups)
        out.append((t, ctx.static_bytes + max(act, biggest), groups))
    out.sort(key=lambda c: (c[0], -len(c[2])))
    return out


def auto_units(gm, ctx, order, options) -> list:
    """The grouping for this attempt: the ``options["candidate"]``-th candidate whose lower
    bound fits the budget (see the module docstring). ``options["auto_cache"]``, a dict, keeps
    the candidates between attempts on the same graph."""
    cache = options.get("auto_cache")  # the planner's, one per recomputation choice
    cands = cache.get("candidates") if cache is not None else None
    if cands is None:
        cands = auto_candidates(gm, ctx, order, options)
        if cache is not None:
            cache["candidates"] = cands
    finest = next(c for c in cands if len(c[2]) == len(order))  # one unit per parameter
    fitting = [c for c in cands if c[1] <= ctx.memory_budget and c is not finest]
    if len(gm.graph.nodes) > BIG_GRAPH:
        fitting = fitting[: MAX_TRIES - 1]
    fitting.append(finest)  # the least memory any plan needs: always tried last
    k = options.get("candidate", 0)
    ctx.auto_tries_left = len(fitting) - k - 1
    return fitting[k][2]

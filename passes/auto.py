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
the predicted peak exceeds the budget are dropped unbuilt: the state held all step plus, at
the worst point of the step, the activations live there and what the grouping surely holds
beside them, its gathered units, prefetched all-gathers, full gradients and the reductions'
buffers (``autoshard.passes.floor``). The rest are tried fastest first through the full
pipeline and its memory simulation (``autoshard.planner``), and the fastest that fits
wins. So "auto" is never predicted slower than a fixed policy that
fits, and what it picks is checked, not estimated. Complexity: O(P * K) segment evaluations
per cap for P parameters and at most K parameters per unit (O(P^2) for the largest cap), each
O(dtypes) with prefix sums, once per plan; for graphs over ``BIG_GRAPH`` nodes at most
``MAX_TRIES`` candidates, then the smallest-memory one, searched from the fastest
(``autoshard.planner.search``; there the guarantee holds among the candidates tried).
"""

from __future__ import annotations

import bisect
import math

import torch.fx as fx

from autoshard.core import meta
from autoshard.core.cost import collective_time, spans_nodes
from autoshard.passes.floor import MemoryFloor
from autoshard.passes.groupings import first_use_order, module_groups, size_groups, span_names
from autoshard.core.simulate import activations
from autoshard.core.spec import group_size

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
        return self.costs(i, (j,))[0]

    def costs(self, i: int, js) -> list:
        """``[cost(j, i) for j in js]``: per dtype, two all-gathers and a reduce-scatter of
        the segment's bytes, ``collective_time`` written out (the same floats) for the DP's
        inner loop."""
        n, p = self.world, self.profile
        fixed, slope = ((n - 1) * p.alpha, (n - 1) / n) if n > 1 else (p.alpha, 0.0)
        beta = (p.inter_beta or p.beta) if spans_nodes(n, 1, p) else p.beta
        terms = [(times, sums[i], sums) for d in self.dtypes
                 for times, sums in ((2, self.ag[d]), (1, self.rs[d])) if sums[-1]]
        out = []
        for j in js:
            c = 0.0
            for times, end, sums in terms:
                x = end - sums[j]
                if x:
                    c += times * (fixed + slope * x * beta)
            out.append(c)
        return out


def group_cost(fqns, specs, profile) -> float:
    """Predicted exposed seconds of one unit's collectives per step."""
    return _Segments(list(fqns), specs, profile).cost(0, len(fqns))


def _dp(order, seg: _Segments, cap: int) -> list:
    n = len(order)
    best = [0.0] + [math.inf] * n
    cut = [0] * (n + 1)
    for i in range(1, n + 1):
        # the groups ending at i within the cap, nearest start first (one parameter always)
        lo = min(bisect.bisect_left(seg.size, seg.size[i] - cap, 0, i), i - 1)
        js = range(i - 1, lo - 1, -1)
        for j, c in zip(js, seg.costs(i, js)):
            c = best[j] + c
            if c < best[i]:
                best[i], cut[i] = c, j
    groups, i = [], n
    while i > 0:
        groups.append(order[cut[i]:i])
        i = cut[i]
    return groups[::-1]


def auto_candidates(gm, ctx, order, options) -> list:
    """Candidate groupings, fastest first: ``[(seconds, lower bound bytes, groups)]``. The
    groupings are kept in ``options["auto_cache"]["groupings"]`` when given (they depend on
    the parameters' order of first use, not on the graph's activations); the graph's
    ``autoshard.core.simulate.activations`` are read from ``["activations"]`` when there. The
    bound (``autoshard.passes.floor``) is of the plans built with ``ctx``'s resharding and
    ``options["prefetch"]`` and ``["bucket"]`` (the Config's ``prefetch_options`` and
    whether it buckets)."""
    specs = {p.fqn: p for p in ctx.captured.params}
    known = options.get("auto_cache", {}).get("groupings", {})
    if tuple(order) not in known:  # with their collectives' time, the same for every graph
        known[tuple(order)] = [(sum(group_cost(g, specs, ctx.profile) for _, g in groups),
                                groups) for groups in _groupings(ctx, order, specs, options)]
    _, live = options.get("auto_cache", {}).get("activations") or activations(gm)
    floor = MemoryFloor(gm, live, specs, order, profile=ctx.profile,
                        reshard=ctx.reshard_after_forward, grad_sync=ctx.grad_sync,
                        prefetch=options.get("prefetch"), bucket=options.get("bucket", False))
    out = [(t, ctx.sim_static_bytes + floor.bound(groups), groups)
           for t, groups in known[tuple(order)]]
    out.sort(key=lambda c: (c[0], -len(c[2])))
    return out


def _groupings(ctx, order, specs, options) -> list:
    """Every candidate grouping of the parameters ``order`` (in first-use order), once each:
    the fixed policies' and the DP's for each cap."""
    profile = ctx.profile
    seg = _Segments(order, specs, profile)
    total = seg.size[-1]
    groupings = [[("root", list(order))], [(f, [f]) for f in order]]
    mod = module_groups(ctx.model, order, options) if ctx.model is not None else []
    if mod:
        rest = [f for f in order if f not in {x for _, g in mod for x in g}]
        groupings.append(mod + ([("root", rest)] if rest else []))
    numel = {f: math.prod(specs[f].shape) for f in order}
    groupings.append(size_groups(order, numel, options.get("min_numel", 10**8)))
    caps = {max(unit_bytes(g, specs) for _, g in c) for c in groupings[2:]}
    caps |= {total >> k for k in range(1, 7)}
    for cap in sorted(caps, reverse=True):
        groups = _dp(order, seg, cap)
        groupings.append(list(zip(span_names(groups, order), groups)))
    out, seen = [], set()
    for groups in groupings:
        key = tuple(tuple(g) for _, g in groups)
        if key not in seen:
            seen.add(key)
            out.append(groups)
    return out


def tries(gm, ctx, options, order=None) -> list:
    """The candidates the planner tries on this graph, in order: those whose lower bound fits
    the budget, fastest first (at most ``MAX_TRIES - 1`` for graphs over ``BIG_GRAPH`` nodes),
    then one unit per parameter, the least memory a plan needs. ``[(seconds, bound, groups)]``,
    kept in ``options["auto_cache"]`` (a dict, one per graph) when given."""
    cache = options.get("auto_cache")
    if cache is not None and "tries" in cache:
        return cache["tries"]
    if order is None:
        order = [meta.tag(n, meta.FQN) for n in first_use_order(gm)]
    cands = auto_candidates(gm, ctx, order, options)
    finest = next(c for c in cands if len(c[2]) == len(order))  # one unit per parameter
    fitting = [c for c in cands if c[1] <= ctx.memory_budget and c is not finest]
    if len(gm.graph.nodes) > BIG_GRAPH:
        fitting = fitting[: MAX_TRIES - 1]
    fitting.append(finest)
    if cache is not None:
        cache["tries"] = fitting
    return fitting


def copy_floor(groups, specs, profile, read, reshard) -> float:
    """Seconds a grouping surely adds to the step's compute: an all-gather of several
    parameters over several ranks is unpacked by copying each out of the buffer (in the
    forward, and again in the backward for a unit resharded after the forward: ``reshard`` as
    ``Config.reshard_after_forward``, "auto" keeping one unit), and a reduce-scatter of
    several gradients packs them by copying into one (each a read and a write at memory
    bandwidth, as ``autoshard.core.cost.node_time`` counts a copy). ``read``: the parameters the
    forward reads (the others are not gathered there)."""
    moved, unpacks = 0, []
    for _, fqns in groups:
        many = [specs[f] for f in fqns
                if f in read and specs[f].sharded and specs[f].shards > 1]
        gathers, reduces = {}, {}
        for s in many:
            gathers.setdefault(s.compute_dtype, []).append(s.gathered_bytes())
            if s.requires_grad:
                reduces.setdefault((s.reduce_dtype, s.dtype), []).append(s.reduced_bytes)
        unpacks.append(sum(2 * sum(b) for b in gathers.values() if len(b) > 1))
        moved += sum(2 * sum(b) for b in reduces.values() if len(b) > 1)
    moved += sum(unpacks)
    if reshard is not False:  # the backward's all-gathers
        moved += sum(unpacks) - (max(unpacks, default=0) if reshard == "auto" else 0)
    return moved / profile.mem_bandwidth


def gradient_copies(gm, specs, profile) -> float:
    """Seconds every plan spends copying gradients into reduce-scatter layout, whatever its
    units: a gradient that is not contiguous (a weight's, computed transposed) or whose rows
    are padded to a multiple of the ranks is copied before it is sent."""
    out = meta.output_node(gm)
    moved = 0
    for v, r in zip(out.args[0], meta.tags(out)[meta.OUTPUTS]):
        spec = specs.get(r.get(meta.FQN)) if r[meta.ROLE] == meta.OUT_GRAD else None
        val = v.meta.get("val") if isinstance(v, fx.Node) else None
        if spec is None or not spec.sharded or spec.shards == 1 or val is None:
            continue
        if not val.is_contiguous() or spec.layout.padded_rows != spec.shape[0]:
            moved += 2 * spec.reduced_bytes
    return moved / profile.mem_bandwidth


def auto_units(gm, ctx, order, options) -> list:
    """The grouping for this attempt: the ``options["candidate"]``-th of ``tries``."""
    return tries(gm, ctx, options, order)[options.get("candidate", 0)][2]

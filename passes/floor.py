"""A lower bound on the peak memory of any plan of a graph with given units, before building it.

The planner drops a unit candidate whose bound exceeds the memory budget without lowering it
(``autoshard.passes.auto.tries``), so the bound must never exceed the simulator's prediction
of the plan built from the candidate (``autoshard.core.simulate.simulate_joint`` after
``insert_collectives`` and ``prefetch``, with the resharding the bound is computed for,
whatever the placement of the state or the activations' offload): a bound above it would
drop a plan that fits.
``tests/passes/test_floor.py`` checks that on every candidate the search lowers.

``MemoryFloor`` is built once per graph (a recomputation choice: its nodes, the activations
live at each, ``autoshard.core.simulate.activations``) and bounds a grouping in one pass over its
parameters. At every node of the graph and every point between two nodes (in the order the
step runs them: the forward's nodes, then the backward's) the step holds at least the state
held all step plus:

- the activations live there, as ``activations`` counts them on the graph before any
  collective (less the tangents, which the step takes when its backward starts; between two
  nodes, what is live at the second less its own output);
- per unit and region, each parameter read there or later in the region, from the unit's
  first read in the region on (a unit's all-gather and unpacking come before the first read
  of any of its parameters, each unpacked parameter is freed after its last read), full and
  in its compute dtype; for the unit kept from the forward to the backward ("auto": the one
  read last in the forward), from its first read in the forward to each one's last in
  either. Reads by nodes computed from parameters alone count where ``insert_collectives``
  leaves them: in the forward where a forward node reads them, else copied into the
  backward;
- with prefetch (no byte bound), from the backward's first read of one unit to the next
  unit's, the next unit's gathered parameters and, where it is a copy, the send buffer of
  its all-gather: it is issued right after the wait of the one before it at the latest,
  and right after the wait of the one before that where the compute between cannot cover
  it (``prefetch_pass`` issues it two ahead then);
- each full gradient from where the activations stop counting its storage (the last read
  other than the output's) to its reduction, which reads all of its unit's gradients (per
  reduce dtype, storage dtype and scaling) right after the last of them is made; there, the
  gradients cast to the reduce dtype, or the uncast ones, for several the buffer they are
  concatenated into, and until the packing's last free the previous reduction's send
  buffer (``prefetch_pass`` defers its wait); after it, the reduced shards, as the
  prediction counts them.

The bound is the largest of these sums. They change only at points that do not depend on
the grouping (the parameters' reads, the gradients' nodes), so the activations' maximum
between two such points is computed once per graph. A graph whose forward nodes are not all
before its backward ones gets no bound above the state (0 here): its activations are not
counted in the order the step runs them.
"""

from __future__ import annotations

import itertools
import math
import operator
from typing import NamedTuple, Optional

import torch
import torch.fx as fx

from autoshard.core import meta
from autoshard.core.cost import collective_time, node_time
from autoshard.core.graph import aliased_arg, alias_closure, param_derived


class MemoryFloor:
    """The lower bound of one graph (module docstring) for the parameters ``specs``
    (``{fqn: ParamSpec}``). ``live``: per node name, the activation bytes live while it runs
    (``autoshard.core.simulate.activations``); ``order``: the parameters in order of first use
    (``autoshard.passes.units.first_use_order``, which numbers the units); ``profile``: the
    device profile the plans are priced on; ``reshard``: which units free their gathered
    parameters after the forward (``PassContext.reshard_after_forward``); ``grad_sync``:
    whether the step reduces gradients (``PassContext.grad_sync``); ``prefetch``: the
    plans' ``Prefetch`` (``Config.prefetch_options``; None: no prefetch); ``bucket``: whether
    they bucket units (``Config.bucket_options``: merged units gather together, so no
    all-gather is known to be two ahead)."""

    def __init__(self, gm: fx.GraphModule, live: dict, specs: dict, order, *, profile=None,
                 reshard="auto", grad_sync: bool = True, prefetch=None, bucket: bool = False):
        self.profile, self.reshard, self.grad_sync = profile, reshard, grad_sync
        # how many all-gathers ahead prefetch surely issues each (a byte bound may stop it)
        depth = prefetch.depth if prefetch is not None and prefetch.bytes is None else 0
        self.depth = min(depth, 1) if bucket or profile is None else depth
        self.waits = prefetch is not None  # prefetch defers each reduction's wait
        self.rank = {f: i for i, f in enumerate(order)}
        self.params = {f: _Param.of(s) for f, s in specs.items()}
        nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
        pos = {n: i for i, n in enumerate(nodes)}
        regions = [meta.tag(n, meta.REGION) for n in nodes]
        first_bwd = regions.index(meta.BWD) if meta.BWD in regions else len(nodes)
        self.ordered = meta.FWD not in regions[first_bwd:]
        self.reads, self.last_fwd, copied = _param_reads(gm, pos)
        self.copied = sum(node_time(n, profile) for n in copied) if self.depth >= 2 else 0.0
        self.grads, self.roots, self.unknown = _gradients(gm, pos, self.params)
        # the activations at each node; between two nodes they are computed where needed
        tangents = sum(meta.val_bytes(n) for n in gm.graph.nodes if meta.is_tangent(n))
        self.acts = [live.get(n.name, 0) for n in nodes]
        for i in range(first_bwd):
            self.acts[i] -= tangents
        self.nodes, self.cum = nodes, None
        # per kinds of reads, each parameter's first and last
        self.spans = {kinds: {} for kinds in (_KEPT, *_RESHARDED)}
        for (f, kind), (first, last) in self.reads.items():
            for kinds, spans in self.spans.items():
                if kind in kinds:
                    a, b = spans.get(f, (first, last))
                    spans[f] = (min(a, first), max(b, last))
        points = self._points(len(nodes))
        self.segment = [0] * (2 * len(nodes) + 2)  # a point -> its segment's index
        for k, p in enumerate(points):
            self.segment[p] = k
        self.peak = [self._most(a, b) for a, b in zip(points, points[1:])]

    def _points(self, n: int) -> list:
        """Where any grouping's sum may change, as half positions: 2i is node i, 2i + 1 the
        point between node i and node i + 1."""
        points = {0, 2 * n}
        for first, last in self.reads.values():
            points.update((first, last + 1))
        for g in self.grads.values():
            points.update((2 * g.made + 1, 2 * g.made + 2))
        points.update(2 * counted + 1 for counted, *_ in self.roots.values())
        return sorted(points)

    def _most(self, a: int, b: int) -> int:
        """The most activation bytes live over half positions ``a`` to ``b`` (excluded): the
        nodes', or at a point between two nodes alone, the second's less its own output."""
        lo, hi = (a + 1) // 2, (b + 1) // 2
        if lo < hi:
            return max(self.acts[lo:hi])
        i = a // 2
        if i + 1 >= len(self.nodes):
            return 0
        return max(0, self.acts[i + 1] - meta.val_bytes(self.nodes[i + 1]))

    def bound(self, groups) -> int:
        """The bound for units ``groups`` (``[(name, fqns)]``), less the state held all
        step."""
        if not self.ordered:
            return 0
        diff = [0] * (len(self.peak) + 1)
        kept = self.kept(groups)
        self._gathered(diff, groups, kept)
        self._prefetched(diff, groups, kept)
        self._reduced(diff, groups)
        # the activations' most plus what the grouping holds, per segment
        return max(map(operator.add, self.peak, itertools.accumulate(diff)), default=0)

    def _add(self, diff: list, start: int, end: int, nbytes: int) -> None:
        """``nbytes`` held over half positions ``start`` to ``end`` (excluded)."""
        if start < end and nbytes:
            diff[self.segment[start]] += nbytes
            diff[self.segment[end]] -= nbytes

    def kept(self, groups) -> list:
        """Whether each unit of ``groups`` keeps its gathered parameters from the forward to
        the backward, as ``autoshard.passes.units`` decides it for ``reshard``: "auto" keeps
        the unit read last in the forward (the first of those, in order of first use)."""
        if self.reshard is False:
            return [True] * len(groups)
        out = [False] * len(groups)
        if self.reshard != "auto":
            return out
        last, rank = self.last_fwd, self.rank
        ends = [(max((last[f] for f in fqns if f in last), default=-1),
                 -min((rank.get(f, len(rank)) for f in fqns), default=0), k)
                for k, (_, fqns) in enumerate(groups)]
        end = max(ends, default=(-1, 0, 0))
        if end[0] >= 0:
            out[end[2]] = True
        return out

    def _gathers(self, fqns) -> list:
        """The parameters of one unit that one all-gather moves together: those gathered,
        by compute dtype."""
        out = {}
        for f in fqns:
            key = self.params[f].gather
            if key is not None:
                out.setdefault(key, []).append(f)
        return list(out.values())

    def _spans(self, group: list, kinds) -> dict:
        """Per parameter of ``group``, the first and last of its reads of ``kinds``."""
        spans = self.spans[kinds]
        return {f: spans[f] for f in group if f in spans}

    def _gathered(self, diff: list, groups, kept: list) -> None:
        """Add each unit's gathered parameters, from the unit's first read in a region to
        each one's last there, or for a unit kept from the forward to the backward, in
        either (``_param_reads``). Over one rank, the parameters of a unit of several are
        views of pieces ``split`` out of the buffer, which the prediction does not count
        (``autoshard.core.simulate`` follows no storage through a list of views): none then."""
        params, segment = self.params, self.segment
        for (_, fqns), keep in zip(groups, kept):
            for group in self._gathers(fqns):
                if len(group) > 1 and not params[group[0]].several:
                    continue
                for kinds in (_KEPT,) if keep else _RESHARDED:
                    spans = self._spans(group, kinds)
                    if spans:  # (``_add``, written out: the bound's inner loop)
                        start = segment[min(first for first, _ in spans.values())]
                        for f, (_, last) in spans.items():
                            diff[start] += params[f].full
                            diff[segment[last + 1]] -= params[f].full

    def _prefetched(self, diff: list, groups, kept: list) -> None:
        """Add what the backward's all-gathers hold before their unit is read: each unit's
        parameters the backward reads (in its all-gather's buffer) from the first read of
        the unit gathered before it (``prefetch_pass`` issues each all-gather right after the
        wait of the one ``depth`` before it, ``depth`` >= 1), and from the first read of the
        one before that where the compute between the two before it cannot cover it
        (``depth`` >= 2 then; the compute counted at most: every node between, and every node
        ``insert_collectives`` copies into the backward). With them, the send buffer the
        all-gather holds until its wait, where it is a copy of the shards (cast to the
        compute dtype, or several concatenated; not for a unit in host memory, whose
        shards may be held from the forward, nor for hpZ's, which sends a chunk)."""
        gathers, params = [], self.params
        for (_, fqns), keep in zip(groups, kept):
            for group in self._gathers(fqns) if not keep else ():
                spans = self._spans(group, _RESHARDED[1])
                if spans:
                    copied = (not _is_group(self.reshard)
                              and not any(params[f].hosted for f in group)
                              and (len(group) > 1 or params[group[0]].cast))
                    sent = sum(params[f].sent for f in group) if copied else 0
                    gathers.append((min(first for first, _ in spans.values()),
                                    sum(params[f].full for f in spans) + sent, group))
        gathers.sort(key=lambda g: g[0])
        for j in range(1, len(gathers) if self.depth >= 1 else 0):
            first, nbytes, group = gathers[j]
            self._add(diff, gathers[j - 1][0], first, nbytes)
            if j >= 2 and self.depth >= 2 and self._uncovered(gathers[j - 1][0], first, group):
                self._add(diff, gathers[j - 2][0], gathers[j - 1][0], nbytes)

    def _uncovered(self, start: int, end: int, group: list) -> bool:
        """Whether the compute between half positions ``start`` and ``end`` (at most) takes
        less than the all-gather of ``group`` (as ``prefetch_pass`` prices it)."""
        p = self.params[group[0]]
        ranks = self.reshard if _is_group(self.reshard) else p.shards
        need = collective_time(sum(self.params[f].gathered for f in group), ranks, self.profile)
        cum = self._compute()
        return cum[(end + 1) // 2] - cum[(start + 1) // 2] + self.copied < need

    def _compute(self) -> list:
        """Seconds of compute before each node (``prefetch_pass``'s count: communication
        nodes take none), computed once."""
        if self.cum is None:
            self.cum = [0.0]
            for n in self.nodes:
                t = 0.0 if meta.is_comm(n) else node_time(n, self.profile)
                self.cum.append(self.cum[-1] + t)
        return self.cum

    def _reduced(self, diff: list, groups) -> None:
        """Add the full gradients until their reduction, what the reduction packs, and the
        reduced shards after it. One reduction reads the gradients of one unit's parameters
        of one reduction, reduce dtype, storage dtype and scaling, as
        ``autoshard.passes.collectives`` groups them, right after the last is made."""
        reduced, at = {}, {}  # gradient storage -> its last reduction; position -> those there
        grads, params = self.grads, self.params
        for _, fqns in groups:
            by_key = {}
            for f in fqns:
                if f in grads or f in self.unknown:
                    by_key.setdefault(params[f].reduce, []).append(grads.get(f))
            for group in by_key.values():
                known = [g for g in group if g is not None]
                if not known:
                    continue
                last = max(g.made for g in known)
                for g in known:
                    if g.root is not None and reduced.get(g.root, -1) < last:
                        reduced[g.root] = last
                if self.grad_sync:  # (None: a gradient not known here, read there too)
                    at.setdefault(last, []).append(group)
        for root, last in reduced.items():
            counted, nbytes, _ = self.roots[root]
            self._add(diff, 2 * counted + 1, 2 * last + 1, nbytes)
        self._reductions(diff, at, reduced)

    def _reductions(self, diff: list, at: dict, reduced: dict) -> None:
        """Add, per reduction (``at``: the position of the last gradient each reads -> the
        gradients), what its packing holds, and its reduced shards from its issue on: in the
        smaller of the reduce and storage dtypes until its wait, which comes at the latest
        in the next reduction's packing (``prefetch_pass`` defers it there), then cast to
        the storage dtype, or as views of its output: to the step's end, or for several
        parameters until the output is ``split`` into them after the wait, which the
        prediction counts no further."""
        end, before, points = 2 * len(self.nodes), None, sorted(at)
        for k, last in enumerate(points):
            # with several after one gradient, which goes first is not known
            one, packs = len(at[last]) == 1, []
            for group in at[last]:
                if None in group:  # its reduction reads a gradient not known here
                    packs = None
                    continue
                # the next reduction's packing: this one's wait comes before its issue
                after = 2 * points[k + 1] + 1 if k + 1 < len(points) else 2 * last + 1
                if not group[0].reduces:
                    self._add(diff, 2 * last + 2, end, sum(g.shard for g in group))
                elif group[0].recast:  # cast to the storage dtype after the wait
                    self._add(diff, 2 * last + 2, after + 1, sum(g.shard for g in group))
                    self._add(diff, after + 1, end, sum(g.stored for g in group))
                else:  # split (several) or viewed (one) out of the reduction's output
                    self._add(diff, 2 * last + 2, after if len(group) > 1 else end,
                              sum(g.shard for g in group))
                if group[0].reduces and packs is not None:
                    packs.append(self._pack(group, last, reduced, before if one else None))
            if packs:
                self._add(diff, 2 * last + 1, 2 * last + 2, max(p[0] for p in packs))
            before = packs[0][1] if self.waits and one and packs else None

    def _pack(self, group: list, last: int, reduced: dict, before) -> tuple:
        """``(bytes, send buffer)``: what one reduction holds while it packs the gradients
        ``group`` (``_Grad``, the last made by ``last``), and its send buffer (None where it
        may be a gradient's storage). It holds each gradient cast to the reduce dtype (a
        copy), or, uncast, its storage where the activations no longer count it and no later
        reduction reads it; for several, the buffer they are concatenated into. With
        ``before``, the send buffer of the reduction before it, it holds that too until the
        packing's last free (``prefetch_pass`` defers a reduction's wait to the contiguous
        packing before the next one's issue, which starts after a free): the
        concatenation's, where an uncast contiguous gradient whose storage no other reduction
        reads is freed after it, else, all cast, the last cast's."""
        item = group[0].rdtype.itemsize
        grads = list({g.node: g for g in group}.values())
        alone = {g.root for g in grads if g.root is not None
                 and self.roots[g.root][0] <= last and reduced[g.root] == last}
        cast = sum(g.numel for g in grads if g.cast) * item
        uncast = {}
        for g in grads:
            if not g.cast and g.root in alone:
                uncast[g.root] = uncast.get(g.root, 0) + g.numel * item
        held = sum(min(nbytes, self.roots[root][2]) for root, nbytes in uncast.items())
        flat = sum(g.numel for g in grads) * item
        sent = flat if len(grads) > 1 or cast else None
        flat = flat if len(grads) > 1 else 0
        if before is None:
            return cast + held + flat, sent
        if len(grads) > 1 and any(not g.cast and g.root in alone and g.plain for g in grads):
            return cast + held + flat + before, sent
        if all(g.cast and g.root in alone for g in grads):
            return cast + max(flat, before), sent
        return cast + held + flat, sent


def _is_group(reshard) -> bool:
    """Whether ``reshard`` is an hpZ group size (an int, not a bool)."""
    return isinstance(reshard, int) and not isinstance(reshard, bool)


class _Param(NamedTuple):
    """What the bound reads of one parameter's ``ParamSpec``."""

    full: int  # bytes as the step reads it: full (unpadded), in its compute dtype
    gathered: int  # bytes of its all-gather's buffer: full and padded, in its compute dtype
    gather: Optional[torch.dtype]  # the compute dtype it is gathered in; None: not gathered
    shards: int  # the ranks of its all-gather
    several: bool  # sharded over several ranks: each copied out of its unit's buffer
    padded: bool  # its rows are padded to a multiple of the ranks (packed by a copy)
    reduce: tuple  # its reduction's key (reduction, reduce dtype, storage dtype, scaling)
    reduces: bool  # its gradient is reduced (a reduce-scatter or all-reduce)
    # bytes its reduced gradient surely takes on the device after its reduction (until the
    # step's end, or ``MemoryFloor._reductions``): its shard in the smaller of the reduce and
    # storage dtypes (the reduction's output, then the shard cast to the storage dtype); none
    # in host memory
    shard_grad: int
    shard_stored: int  # that shard in the storage dtype; none in host memory
    sent: int  # its shard in the compute dtype, as an all-gather sends it
    cast: bool  # its compute dtype is not its storage dtype
    hosted: bool  # its shard is in host memory

    @classmethod
    def of(cls, spec) -> "_Param":
        least = min(spec.reduce_dtype.itemsize, spec.dtype.itemsize)
        padded = spec.sharded and spec.layout.padded_rows != spec.shape[0]
        device = spec.device != "host"
        return cls(math.prod(spec.shape) * spec.compute_dtype.itemsize, spec.gathered_bytes(),
                   spec.compute_dtype if spec.gathers else None, spec.shards, spec.shards > 1,
                   padded,
                   (spec.reduction, spec.reduce_dtype, spec.dtype, spec.scaling),
                   bool(spec.reduction), device * spec.shard_numel * least,
                   device * spec.shard_bytes, spec.shard_numel * spec.compute_dtype.itemsize,
                   spec.compute_dtype != spec.dtype, not device)


class _Grad(NamedTuple):
    """A full gradient the backward makes, and what its reduction reads of its parameter."""

    made: int  # the position of its node: its reduction comes after it
    root: Optional[fx.Node]  # the node owning its storage, where the prediction follows it
    node: fx.Node
    numel: int
    # contiguous and its parameter's rows not padded: packed without a copy, by views
    plain: bool
    key: tuple  # its reduction's (``_Param.reduce``)
    rdtype: torch.dtype  # the reduce dtype
    cast: bool  # cast to it (a copy) for the reduction
    reduces: bool
    shard: int  # ``_Param.shard_grad``, where the prediction counts it
    stored: int  # its shard's bytes in the storage dtype on the device
    recast: bool  # the reduced shard is cast to the storage dtype (a copy)


# the kinds of reads of a parameter (``_param_reads``) its gathered copy is alive for: of a
# unit kept from the forward to the backward, and per region of a unit resharded after it
_KEPT = ("fwd", "bwd")
_RESHARDED = (("fwd",), ("bwd", "copy"))


def _param_reads(gm: fx.GraphModule, pos: dict) -> tuple:
    """``({(fqn, kind): (first, last)}, {fqn: last}, copied)``: the first and last half position
    (``MemoryFloor._points``) at which the step reads each parameter's gathered storage, by
    kind, and the last forward node reading the parameter (any), which decides the unit
    "auto" keeps (``autoshard.passes.units``). Kinds: "fwd", a forward node (not a
    communication node: no all-gather serves those) reads it or a view of it; "bwd", a
    backward node does; "copy", the backward's copy of a node computed from parameters
    alone reads it, right before that node's first backward reader
    (``autoshard.passes.collectives`` copies those there, ``copy_into_backward``, unless all
    of their parameters are kept from the forward). Such a node stays in the forward (and
    reads it there) only where a forward node reads it. ``copied``: the nodes copied into
    the backward."""
    derived = param_derived(gm)
    place, stays = {}, set()  # the backward node each copy goes before; the nodes staying
    for d in reversed(list(derived)):
        cands = [pos[u] for u in d.users if meta.is_backward(u)]
        cands += [place[u] for u in d.users if u in place]
        if cands:
            place[d] = min(cands)
        if any(u in stays or (u not in derived and meta.is_forward(u)) for u in d.users):
            stays.add(d)
    reads, last_fwd = {}, {}

    def read(f, kind, at):
        first, last = reads.get((f, kind), (at, at))
        reads[f, kind] = (min(first, at), max(last, at))

    for p in gm.graph.nodes:
        if not meta.is_param(p):
            continue
        f = meta.tag(p, meta.FQN)
        last_fwd[f] = max((pos[u] for u in p.users if meta.is_forward(u)), default=None)
        if last_fwd[f] is None:
            del last_fwd[f]
        views = [p]  # the parameter and the nodes computed from it alone that view it
        while views:
            v = views.pop()
            for u in v.users:
                if u.op == "output" or meta.is_comm(u):
                    continue
                if u not in derived:
                    if meta.is_forward(u) or meta.is_backward(u):
                        read(f, "fwd" if meta.is_forward(u) else "bwd", 2 * pos[u])
                else:
                    if u in stays:
                        read(f, "fwd", 2 * pos[u])
                    if u in place:
                        read(f, "copy", 2 * place[u] - 1)
                if aliased_arg(u) is v and isinstance(u.meta.get("val"), torch.Tensor):
                    views.append(u)  # (the prediction follows no storage through a list)
    return reads, last_fwd, list(place)


def _gradients(gm: fx.GraphModule, pos: dict, params: dict) -> tuple:
    """The gradients the backward returns for the parameters, ``{fqn: _Grad}``; per storage
    the backward makes for them ``(counted, bytes, storage bytes)``: the last position at
    which ``autoshard.core.simulate.activations`` counts it (its last read other than the
    output's) and the bytes surely held from there to the reduction: the least of the
    storage's and the sum of its gradients' (each may be summed into a storage of its own
    first, ``PassContext.accumulated``); and the parameters whose gradient is no node here.
    A gradient of a storage the backward does not make (an input's), or viewing its storage
    through a list of views (``split``, which the prediction does not follow), has no
    storage (``_Grad.root`` None)."""
    out_node = meta.output_node(gm)
    grads, views, unknown = {}, {}, set()
    for v, r in zip(out_node.args[0], meta.tags(out_node)[meta.OUTPUTS]):
        if r[meta.ROLE] != meta.OUT_GRAD or r.get(meta.FQN) not in params:
            continue
        f, val = r[meta.FQN], v.meta.get("val") if isinstance(v, fx.Node) else None
        if not isinstance(val, torch.Tensor):
            unknown.add(f)
            continue
        root, tracked = v, True
        while aliased_arg(root) is not None:
            root = aliased_arg(root)
            tracked = tracked and isinstance(root.meta.get("val"), torch.Tensor)
        tracked = tracked and root.op != "placeholder" and meta.is_backward(root)
        if tracked:
            views.setdefault(root, set()).add(v)
        p = params[f]
        grads[f] = _Grad(pos[v], root if tracked else None, v, val.numel(),
                         val.is_contiguous() and not p.padded, p.reduce, p.reduce[1],
                         val.dtype != p.reduce[1], p.reduces,
                         p.shard_grad if tracked or p.reduces else 0, p.shard_stored,
                         p.reduce[1] != p.reduce[2])
    roots = {}
    for root, vs in views.items():
        counted = max(pos[a] if u.op == "output" else pos[u]
                      for a in alias_closure(root) for u in (a, *a.users))
        nbytes = meta.val_bytes(root)
        roots[root] = (counted, min(nbytes, sum(meta.val_bytes(v) for v in vs)), nbytes)
    return grads, roots, unknown

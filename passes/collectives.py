"""insert_collectives: explicit all-gather, reduce-scatter and free nodes for every unit."""

from __future__ import annotations

import torch
import torch.fx as fx

from autoshard import meta
from autoshard._compat import fake_empty
from autoshard.spec import ShardLayout, group_size  # noqa: F401 (re-exported)
from autoshard.graph import (
    alias_base,
    alias_closure,
    copy_into_backward,
    insert_free,
    param_derived,
    positions,
    splice,
    storage_roots,
)

# the out= form: it reaches the backend's plain all-gather (``_allgather_base``, what FSDP2
# calls); the allocating form goes through the coalesced all-gather, which in gloo corrupts
# memory when two of them are in flight at once
_AG = torch.ops._c10d_functional.all_gather_into_tensor_out.default
_EMPTY = torch.ops.aten.empty.memory_format
_RS = torch.ops._c10d_functional.reduce_scatter_tensor.default
_WAIT = torch.ops._c10d_functional.wait_tensor.default
_TO_COPY = torch.ops.aten._to_copy.default
HOST = torch.device("cpu")


def _by_dtype(fqns, key):
    """``fqns`` grouped by ``key(fqn)`` (a dtype or a tuple of them), in first-seen order:
    one collective moves one dtype."""
    groups = {}
    for f in fqns:
        groups.setdefault(key(f), []).append(f)
    return list(groups.items())


def _comm_tags(unit: int, region: str, kinds: dict, other_kind: str, copy_kind=None):
    """Tags for a traced issue: ``kinds`` maps an op to its kind, a copy to another device is
    ``copy_kind`` (H2D or D2H), every other node is ``other_kind`` (packing)."""

    def tag(n):
        kind = kinds.get(n.target, other_kind)
        if copy_kind is not None and n.target is _TO_COPY and "device" in n.kwargs:
            kind = copy_kind
        return {meta.COMM: kind, meta.UNIT: unit, meta.REGION: region}

    return tag


def _plain_tags(kind, unit, region):
    return {meta.COMM: kind, meta.UNIT: unit, meta.REGION: region}


def _recompute_param_derived(gm: fx.GraphModule, kept: set) -> None:
    """Copy forward nodes computed from parameters alone (``t(w)``, casts, views) into the
    backward that reads them, so no gathered parameter or view of one is saved across; those
    computed from ``kept`` parameters (gathered across anyway) alone stay."""
    graph = gm.graph
    derived = param_derived(gm, kept)
    if not derived:
        return
    copy_into_backward(gm, list(derived))
    for n in reversed(list(derived)):
        if not n.users:
            graph.erase_node(n)


def insert_collectives_pass(gm: fx.GraphModule, ctx, *, options) -> fx.GraphModule:
    """Make every parameter read go through its unit's all-gather, and every gradient
    through its unit's reduce-scatter.

    Needs: ``ctx.units`` and parameter placeholders tagged with ``unit`` (assign_units),
    regions and output roles (capture).
    Guarantees, per unit and dtype: one all_gather+wait before the unit's first forward use
    and one before its first backward use (unless ``Unit.keep``: then the forward's serves;
    the backward all-gather of a ``Unit.held`` unit sends the forward's send buffer again,
    with no copy from the host and no packing; ``ctx.offload_params`` chooses those among
    ``offloaded_units``),
    one reduce_scatter+wait after the last of its gradients is complete; an
    ``autoshard::free`` after the last read of every gathered buffer, full parameter, full
    gradient and send buffer; a collective's input is freed after its wait, not its issue.
    Freed explicitly rather than left to its last reference, a send buffer goes at a fixed
    point of the step: gloo drops its work objects (and their references) on a worker thread
    whenever that thread next runs. Parameter placeholders now hold the local padded shard
    (``ParamSpec.layout.local_shape``); gradient outputs are local padded shards. Each
    collective runs over its parameters' ``ParamSpec.group_size`` ranks.
    Does nothing to units whose parameters are never read.
    """
    graph = gm.graph
    group = ctx.group_name
    specs = {p.fqn: p for p in ctx.captured.params}
    phs = {meta.tag(n, meta.FQN): n for n in graph.nodes if meta.is_param(n)}
    _recompute_param_derived(gm, {f for u in ctx.units if u.keep for f in u.fqns})
    # where the step computes: capture traced every parameter there, full size
    device = next((n.meta["val"].device for n in phs.values()), HOST)

    for f, n in phs.items():
        v, lay = n.meta["val"], specs[f].layout
        if lay.sharded:  # the placeholder now holds the local shard, in its storage dtype,
            # on the host when it is offloaded
            home = HOST if specs[f].device == "host" else v.device
            n.meta["val"] = fake_empty(v.fake_mode, lay.local_shape, specs[f].dtype, home)
        elif specs[f].dtype != v.dtype:  # read unsharded, in the compute dtype
            _cast_unsharded(gm, n, specs[f].dtype)

    _choose_held(ctx.units, specs, ctx.offload_params)
    roots = {}  # storage root -> unit index
    pos = positions(graph)  # original nodes keep their relative order through the splices
    for unit in ctx.units:
        fqns = [f for f in unit.fqns if specs[f].sharded]
        for dtype, group_fqns in _by_dtype(fqns, lambda f: specs[f].compute_dtype):
            held = None  # the forward's send buffer, when the unit holds it for the backward
            for region in (meta.FWD,) if unit.keep else (meta.FWD, meta.BWD):
                new, sent = _gather(gm, pos, unit.index, region,
                                    [specs[f] for f in group_fqns], phs, group, unit.keep,
                                    dtype, device, held)
                held = sent if unit.held else None
                roots.update((r, unit.index) for r in _freed_roots(new))

    out = meta.output_node(gm)
    outs = list(out.args[0])
    grad_at = {r[meta.FQN]: i for i, r in enumerate(meta.tags(out)[meta.OUTPUTS])
               if r[meta.ROLE] == meta.OUT_GRAD}
    for unit in ctx.units:
        fqns = [f for f in unit.fqns if f in grad_at]
        key = lambda f: (specs[f].reduce_dtype, specs[f].dtype)  # noqa: E731
        for dtypes, group_fqns in _by_dtype(fqns, key):
            grads = [outs[grad_at[f]] for f in group_fqns]
            locals_, new = _reduce(gm, pos, unit.index, grads, [specs[f] for f in group_fqns],
                                   group, *dtypes)
            for f, loc in zip(group_fqns, locals_):
                outs[grad_at[f]] = loc
            roots.update((r, unit.index) for r in _freed_roots(new))
            for g in grads:
                base = alias_base(g)
                if base.op != "placeholder" and meta.is_backward(base):
                    roots.setdefault(base, unit.index)
    out.args = (outs,)

    insert_free(
        gm,
        list(roots),
        lambda root, last: _plain_tags(meta.FREE, roots[root], meta.tag(last, meta.REGION)),
    )
    ctx.collectives_inserted = True
    gm.recompile()
    return gm


def _freed_roots(new) -> list:
    """The fresh storages among a collective's new nodes that get an explicit free: all but
    packing temporaries (a shard cast to the compute dtype before the send buffer is
    concatenated), which only other packing nodes read and which go with their last
    reference, so a pack stays one contiguous block for prefetch to move."""
    packs = (meta.H2D, meta.AG_PACK, meta.RS_PACK)

    def temporary(r):  # read, through any view, by packing nodes only
        return meta.tag(r, meta.COMM) in packs and all(
            meta.tag(u, meta.COMM) in packs for a in alias_closure(r) for u in a.users)

    return [r for r in storage_roots(new) if not temporary(r)]


def _cast_unsharded(gm, ph, storage_dtype):
    """An unsharded (0-d) parameter is read without a gather: its placeholder now holds the
    stored value, and one cast gives every reader the compute dtype they were traced with."""
    v = ph.meta["val"]
    ph.meta["val"] = fake_empty(v.fake_mode, (), storage_dtype, v.device)
    users = list(ph.users)
    with gm.graph.inserting_after(ph):
        cast = gm.graph.call_function(torch.ops.aten._to_copy.default, (ph,), {"dtype": v.dtype})
    cast.meta["val"] = v
    meta.tags(cast)[meta.REGION] = meta.FWD
    for u in users:
        u.replace_input_with(ph, cast)


def offloaded_units(units, specs: dict) -> list:
    """The units resharded after the forward whose shards are in host memory: each copies
    them in again for the backward's all-gather or holds the forward's copy."""
    return [u for u in units if not u.keep and any(
        specs[f].sharded and specs[f].device == "host" for f in u.fqns)]


def _choose_held(units, specs, fraction: float) -> None:
    """Mark the units that hold their shards' device copy from the forward to the backward:
    of ``offloaded_units``, all but the first ``fraction``."""
    hosted = offloaded_units(units, specs)
    again = round(fraction * len(hosted))
    for i, u in enumerate(hosted):
        u.held = i >= again


def _gather(gm, pos, unit, region, specs, phs, group, keep, dtype, device, held=None):
    """all-gather the parameters ``specs`` describe (shards cast to ``dtype``, their compute
    dtype; an offloaded shard first copied from the host to ``device``) before their first
    use in ``region``; ``held``: the send buffer an earlier gather packed, sent again as it is
    (no copy, no packing). Returns (new nodes, the send buffer)."""
    fqns, N = [s.fqn for s in specs], group_size(specs)
    hosted = [s.device == "host" for s in specs]
    users = {
        u
        for f in fqns
        for u in phs[f].users
        if not meta.is_comm(u) and (keep or meta.tag(u, meta.REGION) == region)
    }
    if not users:
        return [], held
    first = min(users, key=pos.__getitem__)
    lays = [s.layout for s in specs]

    def issue(*shards):
        if held is None:
            # non_blocking: the step's gradient copies back are blocking, so every copy in
            # has completed before the backward returns and the optimizer writes the host
            # shards
            shards = [_TO_COPY(s, device=device, non_blocking=True) if h else s
                      for s, h in zip(shards, hosted)]
            flat = [s.reshape(-1).to(dtype) for s in shards]
            flat = torch.cat(flat) if len(flat) > 1 else flat[0]
        else:
            flat = shards[0]
        buf = torch.empty((N * flat.numel(),), dtype=flat.dtype, device=flat.device)
        return _AG(flat, N, group, out=buf), flat

    def unpack(buf):
        cols, off, fulls = buf.view(N, -1), 0, []
        for lay in lays:
            full = cols[:, off : off + lay.local_numel].reshape(lay.padded_rows, *lay.inner)
            fulls.append(full[: lay.shape[0]] if lay.padded_rows != lay.shape[0] else full)
            off += lay.local_numel
        return fulls

    key = ("ag", N, group, dtype, str(device), tuple(hosted), tuple(lay.shape for lay in lays))
    tag = _comm_tags(unit, region, {_AG: meta.AG_ISSUE, _EMPTY: meta.AG_BUFFER}, meta.AG_PACK,
                     copy_kind=meta.H2D)
    sources = [phs[f] for f in fqns] if held is None else [held]
    (handle, sent), n1 = splice(gm, issue, sources, first, tag,
                                key=key + ("issue", held is None))
    waited, n2 = splice(gm, _WAIT, [handle], first, _plain_tags(meta.AG_WAIT, unit, region),
                        key=("wait",))
    fulls, n3 = splice(gm, unpack, [waited], first, _plain_tags(meta.AG_UNPACK, unit, region),
                       key=key + ("unpack",))
    for f, full in zip(fqns, fulls):
        for u in users:
            u.replace_input_with(phs[f], full)
    return n1 + n2 + n3, sent


def _reduce(gm, pos, unit, grads, specs, group, reduce_dtype, storage_dtype):
    """reduce-scatter (average) full gradients ``grads`` of the parameters ``specs`` describe,
    in ``reduce_dtype``, right after the last of them; the local gradient shards come out in
    ``storage_dtype``, an offloaded parameter's copied to the host (a blocking copy: the
    optimizer step on the host reads it)."""
    lays, N = [s.layout for s in specs], group_size(specs)
    hosted = [s.device == "host" for s in specs]
    before = max(grads, key=pos.__getitem__).next

    def issue(*gs):
        cols = []
        for g, lay in zip(gs, lays):
            g = g.to(reduce_dtype)
            if not lay.sharded:
                cols.append(g.reshape(1, 1).expand(N, 1))
                continue
            if lay.padded_rows != lay.shape[0]:
                pad = [0, 0] * len(lay.inner) + [0, lay.padded_rows - lay.shape[0]]
                g = torch.nn.functional.pad(g, pad)
            cols.append(g.reshape(N, -1))
        flat = (torch.cat(cols, dim=1) if len(cols) > 1 else cols[0]).reshape(-1)
        return _RS(flat, "avg", N, group)

    def unpack(buf):
        off, outs = 0, []
        for lay in lays:
            if lay.sharded:
                outs.append(buf[off : off + lay.local_numel].view(lay.local_shape))
                off += lay.local_numel
            else:
                outs.append(buf[off])
                off += 1
        return [_TO_COPY(o, dtype=storage_dtype, device=HOST) if h else o.to(storage_dtype)
                for o, h in zip(outs, hosted)]

    key = ("rs", N, group, reduce_dtype, storage_dtype, tuple(hosted),
           tuple(lay.shape for lay in lays))
    tag = _comm_tags(unit, meta.BWD, {_RS: meta.RS_ISSUE}, meta.RS_PACK)
    handle, n1 = splice(gm, issue, grads, before, tag, key=key + ("issue",))
    waited, n2 = splice(gm, _WAIT, [handle], before, _plain_tags(meta.RS_WAIT, unit, meta.BWD),
                        key=("wait",))
    locals_, n3 = splice(gm, unpack, [waited], before,
                         _comm_tags(unit, meta.BWD, {}, meta.RS_UNPACK, copy_kind=meta.D2H),
                         key=key + ("unpack",))
    return locals_, n1 + n2 + n3

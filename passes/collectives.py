"""insert_collectives: explicit all-gather, reduce-scatter and free nodes for every unit."""

from __future__ import annotations

import math

import torch
import torch.fx as fx

from autoshard.core import meta
from autoshard.core._compat import fake_empty
from autoshard.core.spec import ShardLayout, group_size  # noqa: F401 (re-exported)
from autoshard.core.graph import (
    alias_base,
    alias_closure,
    copy_into_backward,
    insert_free,
    param_derived,
    positions,
    splice,
    storage_roots,
)
from autoshard.core.ops import chunk_op

# the out= form: it reaches the backend's plain all-gather (``_allgather_base``, what FSDP2
# calls); the allocating form goes through the coalesced all-gather, which in gloo corrupts
# memory when two of them are in flight at once
_AG = torch.ops._c10d_functional.all_gather_into_tensor_out.default
_EMPTY = torch.ops.aten.empty.memory_format
_RS = torch.ops._c10d_functional.reduce_scatter_tensor.default
_AR = torch.ops._c10d_functional.all_reduce.default
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


def _real(t):
    """What a collective moves for ``t``: a complex tensor as its real view (its last dim the
    real and imaginary parts), flat; gloo has no complex collectives, and summing or
    averaging the parts is summing or averaging the numbers. Other tensors as they are."""
    return torch.view_as_real(t).reshape(-1) if t.is_complex() else t


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


def insert_collectives_pass(gm: fx.GraphModule, ctx, *,
                            options) -> tuple[fx.GraphModule, dict]:
    """Make every parameter read go through its unit's all-gather, and every gradient
    through its unit's reduce-scatter.

    Needs: ``ctx.units`` and parameter placeholders tagged with ``unit`` (assign_units),
    regions and output roles (capture).
    Guarantees, per unit and dtype: one all_gather+wait before the unit's first forward use
    and one before its first backward use (unless ``Unit.stays_gathered``: then the forward's
    serves; the backward all-gather of a ``Unit.held`` unit sends the forward's send buffer again,
    with no copy from the host and no packing, ``ctx.offload_params`` choosing those among
    ``offloaded_units``; that of a unit resharded to groups of k (``Unit.group``, hpZ) sends
    the ``autoshard::chunk`` (tagged ``meta.AG_CHUNK``) that copied this rank's 1/k of the
    forward's gathered buffer after its last forward read, over this rank's group of k
    (``reshard_group``), and the chunk is freed after its wait),
    its gradients reduced after the last of them is complete, as ``ParamSpec.reduction``
    says (a reduce_scatter+wait over the shard dimension, an all_reduce+wait over each
    replicated one; none with ``ctx.grad_sync`` off: full local gradients are returned),
    with the reduce op and divisions of ``ParamSpec.scaling``; an
    ``autoshard::free`` after the last read of every gathered buffer, full parameter, full
    gradient and send buffer; a collective's input is freed after its wait, not its issue.
    Freed explicitly rather than left to its last reference, a send buffer goes at a fixed
    point of the step: gloo drops its work objects (and their references) on a worker thread
    whenever that thread next runs. Placeholders of gathered parameters
    (``ParamSpec.gathers``) now hold the local padded shard (``ParamSpec.layout.local_shape``);
    the others hold the full parameter (stored replicated, or its ``replica``) and are read
    directly. Gradient outputs are local padded shards (full gradients for replicated
    parameters). Each collective runs over its mesh dimension's group
    (``group_names(ctx)``).
    Does nothing to units whose parameters are never read.
    """
    graph = gm.graph
    groups = group_names(ctx)
    specs = {p.fqn: p for p in ctx.captured.params}
    phs = {meta.tag(n, meta.FQN): n for n in graph.nodes if meta.is_param(n)}
    _recompute_param_derived(gm, {f for u in ctx.units if u.stays_gathered for f in u.fqns})
    # where the step computes: capture traced every parameter there, full size
    device = next((n.meta["val"].device for n in phs.values()), HOST)
    _store_placeholders(gm, phs, specs)
    _choose_held(ctx.units, specs, ctx.offload_params)
    roots = {}  # storage root -> unit index
    pos = positions(graph)  # original nodes keep their relative order through the splices
    _insert_gathers(gm, ctx, pos, roots, specs, phs, groups[-1], device)
    _insert_reductions(gm, ctx, pos, roots, specs, groups)
    insert_free(
        gm,
        list(roots),
        lambda root, last: _plain_tags(meta.FREE, roots[root], meta.tag(last, meta.REGION)),
    )
    gm.recompile()
    return gm, {"collectives_inserted": True}


def _store_placeholders(gm: fx.GraphModule, phs: dict, specs: dict) -> None:
    """Each parameter placeholder as stored: a gathered one holds its local shard, an
    unsharded one stored in another dtype is cast once to its compute dtype."""
    for f, n in phs.items():
        v, spec = n.meta["val"], specs[f]
        if spec.gathers:  # the placeholder now holds the local shard, in its storage dtype,
            # on the host when it is offloaded
            home = HOST if spec.device == "host" else v.device
            n.meta["val"] = fake_empty(v.fake_mode, spec.layout.local_shape, spec.dtype, home)
        elif spec.dtype != v.dtype and not spec.replica:  # read as stored (a replica is kept
            # in the compute dtype), cast once to the compute dtype
            _cast_unsharded(gm, n, spec.dtype)


def _insert_gathers(gm, ctx, pos, roots: dict, specs: dict, phs: dict, group: str,
                    device) -> None:
    """Per unit and compute dtype, the all-gathers of its gathered parameters (forward, and
    backward unless ``Unit.stays_gathered``); what they allocate joins ``roots``, to be freed."""
    for unit in ctx.units:
        fqns = [f for f in unit.fqns if specs[f].gathers]
        k = unit.group if not unit.stays_gathered else 0
        sub = reshard_group(ctx, k) if k else None
        for dtype, group_fqns in _by_dtype(fqns, lambda f: specs[f].compute_dtype):
            held = None  # the forward's send buffer, when the unit holds it for the backward
            for region in (meta.FWD,) if unit.stays_gathered else (meta.FWD, meta.BWD):
                hpz = k and region == meta.BWD and held is not None
                new, sent = _gather(gm, pos, unit.index, region,
                                    [specs[f] for f in group_fqns], phs,
                                    sub if hpz else group, unit.stays_gathered, dtype, device, held,
                                    ranks=k if hpz else None)
                held = sent if unit.held else None
                if k and region == meta.FWD and new and _read_in_backward(group_fqns, phs):
                    held = _insert_chunk(gm, unit.index, new, k, sub)
                    new = new + [held]
                roots.update((r, unit.index) for r in _freed_roots(new))


def _read_in_backward(fqns, phs: dict) -> bool:
    """Whether the backward reads any of the parameters ``fqns`` (through no gather yet)."""
    return any(meta.is_backward(u) and not meta.is_comm(u) for f in fqns for u in phs[f].users)


def reshard_group(ctx, k: int) -> str:
    """The process group name of this rank's group of ``k`` consecutive ranks of the shard
    dimension (``PassContext.reshard_groups``); for planning without one, a name derived
    from the shard dimension's."""
    names = ctx.reshard_groups or {}
    if k in names:
        return names[k]
    return f"{group_names(ctx)[-1]}:groups_of_{k}"


def _insert_chunk(gm, unit: int, new: list, k: int, sub: str) -> fx.Node:
    """hpZ: after the last forward read of the gathered buffer a forward gather made
    (``new``), a copy of this rank's 1/k of it (``autoshard::chunk``) for the backward's
    all-gather within its group of ``k``; the buffer is freed after it as before."""

    waited = next(n for n in new if meta.tag(n, meta.COMM) == meta.AG_WAIT)
    pos = positions(gm.graph)
    last = waited
    for a in alias_closure(alias_base(waited)):
        for u in a.users:
            if meta.is_forward(u) and not meta.is_free(u) and pos[u] > pos[last]:
                last = u
    with gm.graph.inserting_after(last):
        chunk = gm.graph.call_function(chunk_op, (waited, k, sub))
    v = waited.meta["val"]
    chunk.meta["val"] = fake_empty(v.fake_mode, (v.numel() // k,), v.dtype, v.device)
    meta.tags(chunk).update(_plain_tags(meta.AG_CHUNK, unit, meta.FWD))
    return chunk


def _insert_reductions(gm, ctx, pos, roots: dict, specs: dict, groups: list) -> None:
    """Per unit and (reduction, dtypes, scaling), its gradient outputs reduced (or, on one
    rank, cast) to local shards; the full gradients and what the reductions allocate join
    ``roots``, to be freed."""
    out = meta.output_node(gm)
    outs = list(out.args[0])
    grad_at = {r[meta.FQN]: i for i, r in enumerate(meta.tags(out)[meta.OUTPUTS])
               if r[meta.ROLE] == meta.OUT_GRAD}
    for unit in ctx.units:
        fqns = [f for f in unit.fqns if f in grad_at]
        if not ctx.grad_sync:
            fqns = []  # gradients stay full and local (ctx.grad_sync)
        key = lambda f: (specs[f].reduction, specs[f].reduce_dtype, specs[f].dtype,  # noqa
                         specs[f].scaling)
        for (steps, *dtypes, scaling), group_fqns in _by_dtype(fqns, key):
            grads = [outs[grad_at[f]] for f in group_fqns]
            # what steps without gradient sync kept is added before any reduction, and also
            # where there is none (one rank): else it would be dropped
            sums = (_add_accumulated(gm, pos, unit.index, grads, group_fqns)
                    if ctx.accumulated else [])
            if not steps:  # one rank, nothing to reduce over: cast to the storage dtype
                locals_ = _cast_local(gm, pos, unit.index, sums or grads, dtypes, scaling)
                for f, loc in zip(group_fqns, locals_):
                    outs[grad_at[f]] = loc
                kept = set(locals_)
                for g in grads + sums:
                    base = alias_base(g)
                    if (sums and base not in kept and base.op != "placeholder"
                            and meta.is_backward(base)):
                        roots.setdefault(base, unit.index)
                continue
            locals_, new = _reduce(gm, pos, unit.index, sums or grads,
                                   [specs[f] for f in group_fqns], steps, groups, *dtypes,
                                   scaling)
            for f, loc in zip(group_fqns, locals_):
                outs[grad_at[f]] = loc
            roots.update((r, unit.index) for r in _freed_roots(new))
            for g in grads + sums:
                base = alias_base(g)
                if base.op != "placeholder" and meta.is_backward(base):
                    roots.setdefault(base, unit.index)
    out.args = (outs,)


def _cast_local(gm, pos, unit: int, grads: list, dtypes: list, scaling) -> list:
    """On one rank: the full gradients ``grads`` cast to the storage dtype ``dtypes[1]``,
    divided by the scaling factor if one is set (as FSDP2 divides on one rank); ``grads``
    themselves when nothing changes."""
    div = math.prod(d for d in scaling[1:] if d is not None)
    if div == 1 and all(g.meta["val"].dtype == dtypes[1] for g in grads):
        return grads
    before = max(grads, key=pos.__getitem__).next
    locals_, _ = splice(
        gm, lambda *gs: [g.to(dtypes[1]) if div == 1
                         else (g.to(dtypes[0]) / div).to(dtypes[1]) for g in gs],
        grads, before, _plain_tags(meta.RS_UNPACK, unit, meta.BWD),
        key=("cast", *dtypes, div, len(grads)))
    return locals_


def _add_accumulated(gm, pos, unit, grads, fqns) -> list:
    """Each full gradient plus a new backward input (``meta.ROLE_GRAD_ACC``) holding what
    steps without gradient sync accumulated for that parameter, in the gradient's shape and
    dtype; the sums, which the reduction reads instead."""
    graph = gm.graph
    first = next(n for n in graph.nodes if n.op != "placeholder")
    out = []
    for f, g in zip(fqns, grads):
        v = g.meta["val"]
        with graph.inserting_before(first):
            acc = graph.placeholder("acc_" + f.replace(".", "_"))
        acc.meta["val"] = fake_empty(v.fake_mode, v.shape, v.dtype, v.device)
        meta.tags(acc).update({meta.ROLE: meta.ROLE_GRAD_ACC, meta.FQN: f,
                               meta.REGION: meta.BWD})
        before = g.next
        (total,), _ = splice(gm, lambda a, b: [a + b], [g, acc], before,
                             _plain_tags(meta.RS_PACK, unit, meta.BWD), key=("acc",))
        pos[total] = pos[g] + 0.5
        out.append(total)
    return out


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
    return [u for u in units if not u.stays_gathered and not u.group and any(
        specs[f].sharded and specs[f].device == "host" for f in u.fqns)]


def _choose_held(units, specs, fraction: float) -> None:
    """Mark the units that hold their shards' device copy from the forward to the backward:
    of ``offloaded_units``, all but the first ``fraction``."""
    hosted = offloaded_units(units, specs)
    again = round(fraction * len(hosted))
    for i, u in enumerate(hosted):
        u.held = i >= again


def _gather(gm, pos, unit, region, specs, phs, group, keep, dtype, device, held=None,
            ranks=None):
    """all-gather the parameters ``specs`` describe (shards cast to ``dtype``, their compute
    dtype; an offloaded shard first copied from the host to ``device``) before their first
    use in ``region``; ``held``: the send buffer an earlier gather packed, sent again as it is
    (no copy, no packing), or with ``ranks`` (hpZ) the chunk an ``autoshard::chunk`` copied,
    all-gathered over the ``ranks`` of ``group``. Returns (new nodes, the send buffer)."""
    fqns, N = [s.fqn for s in specs], group_size(specs)
    sent_over = ranks or N
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
            flat = [_flat(s).to(dtype) for s in shards]
            flat = torch.cat(flat) if len(flat) > 1 else flat[0]
        else:
            flat = shards[0]
        wire = _real(flat)
        buf = torch.empty((sent_over * wire.numel(),), dtype=wire.dtype, device=wire.device)
        return _AG(wire, sent_over, group, out=buf), flat

    def unpack(buf):
        # each rank's shards sit side by side in its slice of the buffer, so a parameter's
        # rows are strided by the slice's length. A parameter with one row per rank (no more
        # rows than ranks) reshapes to a strided view of the buffer; one with more is copied
        # by the reshape. Ops must see what eager gives them, a contiguous nn.Parameter
        # (CPU BatchNorm, for one, rounds otherwise on a strided weight), so the view is
        # copied too: ``contiguous`` copies only a view that is not contiguous already.
        # One split gives every parameter's piece; over one rank the buffer is the pieces
        # end to end, and a 1-D piece is its parameter as it is (no node per parameter).
        if dtype.is_complex and not buf.is_complex():  # sent as its real view (_real)
            buf = torch.view_as_complex(buf.view(-1, 2))
        sizes = [lay.local_numel for lay in lays]
        pieces = _split(buf, sizes) if N == 1 else _split(buf.view(N, -1), sizes, dim=1)
        fulls = []
        for piece, lay in zip(pieces, lays):
            full = _shaped(piece, (lay.padded_rows, *lay.inner))
            full = full[: lay.shape[0]] if lay.padded_rows != lay.shape[0] else full
            fulls.append(full.contiguous())
        return fulls

    key = ("ag", N, sent_over, group, dtype, str(device), tuple(hosted),
           tuple(lay.shape for lay in lays))
    tag = _comm_tags(unit, region, {_AG: meta.AG_ISSUE, _EMPTY: meta.AG_BUFFER}, meta.AG_PACK,
                     copy_kind=meta.H2D)
    if ranks:  # hpZ: the group differs from the shard dimension's; the plan shows its size
        tag = _grouped(tag, ("ag", 0, ranks))
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


def group_names(ctx) -> tuple:
    """The process group name of each mesh dimension (``PassContext.group_name``: one name
    for a 1-D mesh, or one per dimension)."""
    g = ctx.group_name
    return (g,) if isinstance(g, str) else tuple(g)


def _reduce(gm, pos, unit, grads, specs, steps, groups, reduce_dtype, storage_dtype,
            scaling=("avg", None, None)):
    """Reduce full gradients ``grads`` of the parameters ``specs`` describe over the mesh, as
    ``steps`` (``ParamSpec.reduction``) says, in ``reduce_dtype``, right after the last of
    them: a reduce-scatter over the dimension they are sharded over, then an all-reduce over
    each they are replicated over, each with the reduce op of ``scaling``
    (``ParamSpec.scaling``: averaged, or summed and divided before the first and after the
    last); the local gradients (shards, or full gradients where nothing is sharded) come out
    in ``storage_dtype``, an offloaded parameter's copied to the host (a blocking copy: the
    optimizer step on the host reads it)."""
    lays = [s.layout for s in specs]
    hosted = [s.device == "host" for s in specs]
    before = max(grads, key=pos.__getitem__).next
    scatter = steps[0][0] == "rs"
    ranks = steps[0][2]
    mesh = tuple(specs[0].mesh_shape)

    def issue(*gs):
        cols = []
        for g, lay in zip(gs, lays):
            g = g.to(reduce_dtype)
            if not scatter:
                cols.append(_flat(_real(g)))
                continue
            if lay.padded_rows != lay.shape[0]:
                pad = [0, 0] * len(lay.inner) + [0, lay.padded_rows - lay.shape[0]]
                g = torch.nn.functional.pad(g, pad)
            # over one rank the shards are the gradients end to end: no column view each
            cols.append(_flat(_real(g)) if ranks == 1 else _real(g).reshape(ranks, -1))
        dim = int(scatter and ranks > 1)
        flat = _flat(torch.cat(cols, dim=dim) if len(cols) > 1 else cols[0])
        if scaling[1] is not None:
            flat = flat / scaling[1]
        return _collective(flat, steps[0], groups, scaling[0])

    def unpack(buf):
        if scaling[2] is not None:
            buf = buf / scaling[2]
        if reduce_dtype.is_complex and not buf.is_complex():  # reduced as its real view
            buf = torch.view_as_complex(buf.view(-1, 2))
        shapes = [tuple(lay.local_shape if scatter else lay.shape) for lay in lays]
        outs = [_shaped(piece, shape)
                for piece, shape in zip(_split(buf, [math.prod(s) for s in shapes]), shapes)]
        return [_TO_COPY(o, dtype=storage_dtype, device=HOST) if h else o.to(storage_dtype)
                for o, h in zip(outs, hosted)]

    key = ("rs", steps, groups, reduce_dtype, storage_dtype, scaling, tuple(hosted),
           tuple(lay.shape for lay in lays))
    kinds = {_RS: meta.RS_ISSUE, _AR: meta.AR_ISSUE}
    new, waited = [], None
    for k, step in enumerate(steps):
        wait_kind = meta.RS_WAIT if step[0] == "rs" else meta.AR_WAIT
        if k == 0:
            tag = _comm_tags(unit, meta.BWD, kinds, meta.RS_PACK)
            handle, n1 = splice(gm, issue, grads, before, _grouped(tag, step, mesh),
                                 key=key + (0,))
        else:
            handle, n1 = splice(gm, lambda x, s=step: _collective(x, s, groups, scaling[0]),
                                [waited],
                                before,
                                _grouped(_comm_tags(unit, meta.BWD, kinds, None), step, mesh),
                                key=key + (k,))
        waited, n2 = splice(gm, _WAIT, [handle], before, _plain_tags(wait_kind, unit, meta.BWD),
                            key=("wait",))
        new += n1 + n2
    locals_, n3 = splice(gm, unpack, [waited], before,
                         _comm_tags(unit, meta.BWD, {}, meta.RS_UNPACK, copy_kind=meta.D2H),
                         key=key + ("unpack",))
    return locals_, new + n3


def _flat(t):
    """``t`` as one dimension, with no node where it is one already."""
    return t if t.dim() == 1 else t.reshape(-1)


def _shaped(t, shape):
    """``t`` reshaped to ``shape``, with no node where it has that shape already."""
    return t if tuple(t.shape) == tuple(shape) else t.reshape(shape)


def _split(t, sizes, dim=0):
    """``t``'s consecutive pieces of ``sizes`` along ``dim``: one node for them all."""
    return [t] if len(sizes) == 1 else list(torch.split(t, sizes, dim=dim))


def _collective(flat, step, groups, op="avg"):
    """One reduction step (``ParamSpec.reduction``) over its mesh dimension's group, with the
    reduce op ``op`` (``ParamSpec.scaling``)."""
    kind, dim, n = step
    if kind == "rs":
        return _RS(flat, op, n, groups[dim])
    return _AR(flat, op, groups[dim])


def _grouped(tag, step, mesh_shape=()):
    """``tag`` plus, on an all-reduce issue (or an hpZ all-gather's), its group size
    (``meta.GROUP``) and, over a dimension before the mesh's last, the distance between its
    ranks (``meta.STRIDE``: the product of the later dimensions' sizes)."""
    stride = math.prod(mesh_shape[step[1] + 1:]) if mesh_shape else 1

    def out(n):
        t = tag(n)
        if t[meta.COMM] in (meta.AR_ISSUE, meta.AG_ISSUE):
            t[meta.GROUP] = step[2]
            if stride > 1:
                t[meta.STRIDE] = stride
        return t

    return out

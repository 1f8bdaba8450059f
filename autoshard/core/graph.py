"""Graph analyses shared by the passes: aliasing, liveness, splicing traced rewrites.

networkx holds the graph for order and reachability questions (``to_nx``); answers are always
mapped back in original node order so that every rank makes the same decisions.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Callable, Iterable, Optional, Sequence

import networkx as nx
import torch
import torch.fx as fx

from autoshard.core import _compat, meta
from autoshard.core._compat import tree_flatten, tree_map, tree_unflatten
from autoshard.core.ops import free_op


def to_nx(graph: fx.Graph) -> nx.DiGraph:
    """The data-flow graph as a networkx DiGraph; nodes carry ``order`` (position)."""
    g = nx.DiGraph()
    for i, n in enumerate(graph.nodes):
        g.add_node(n, order=i)
        for a in n.all_input_nodes:
            g.add_edge(a, n)
    return g


def positions(graph: fx.Graph) -> dict:
    return {n: i for i, n in enumerate(graph.nodes)}


# --- aliasing ---------------------------------------------------------------------------------


def fold_alias_pairs(graph: fx.Graph) -> int:
    """Drop what two views in a row undo or repeat: ``t(t(x))`` is ``x`` and
    ``detach(detach(x))`` is ``detach(x)``. Autograd's backward writes both (a weight
    transposed for its forward, transposed back for the gradient; a saved value detached
    as it is saved and again as it is read). Both are aliases with ``x``'s metadata, so
    nothing reads a difference, and a node less is a dispatch less each step. Returns how
    many nodes went."""
    t, detach = torch.ops.aten.t.default, torch.ops.aten.detach.default
    gone = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in (t, detach):
            continue
        inner = node.args[0]
        if not isinstance(inner, fx.Node) or inner.target is not node.target:
            continue
        node.replace_all_uses_with(inner.args[0] if node.target is t else inner)
        graph.erase_node(node)
        gone += 1
        if not inner.users:
            graph.erase_node(inner)
            gone += 1
    return gone


def aliased_arg(node: fx.Node) -> Optional[fx.Node]:
    """The input whose storage ``node``'s output shares (a view or an in-place result)."""
    if node.op != "call_function":
        return None
    target = node.target
    if target is operator.getitem:
        src = node.args[0]
        return src if isinstance(src, fx.Node) and aliased_arg(src) is not None else None
    for i, name in _op_facts(target)[1]:
        val = node.args[i] if i < len(node.args) else node.kwargs.get(name)
        if isinstance(val, fx.Node):
            return val
    return None


# id(op) -> (op, its alias slots, its write slots, its undeclared writes); keyed by id: an
# OpOverload hashes in Python, and the passes ask for every node many times over
_OP_FACTS: dict = {}


def _op_facts(target) -> tuple:
    facts = _OP_FACTS.get(id(target))
    if facts is None or facts[0] is not target:
        writes = ()
        # detach_ changes a tensor's autograd metadata, never its values (DTensor.from_local
        # traced under inference mode emits one on a parameter's view)
        if isinstance(target, _compat.OpOverload) and target is not torch.ops.aten.detach_.default:
            writes = tuple((i, a.name) for i, a in enumerate(target._schema.arguments)
                           if a.alias_info is not None and a.alias_info.is_write)
        facts = _OP_FACTS[id(target)] = (target, _alias_slots(target), writes,
                                         _UNDECLARED_WRITES.get(target))
    return facts


def _alias_slots(target) -> tuple:
    """``((position, name), ...)`` of the arguments whose storage ``target``'s output
    shares, in schema order (the first one given as a node is the one)."""
    if not isinstance(target, _compat.OpOverload):
        return ()
    schema = target._schema
    if target is torch.ops._c10d_functional.wait_tensor.default:
        return ((0, schema.arguments[0].name),)  # the very tensor the collective writes
    if not schema.returns:
        return ()
    ret_alias = schema.returns[0].alias_info
    if target is torch.ops.aten._unsafe_view.default:
        ret_alias = True  # shares storage in practice though the schema says it does not
    if ret_alias is None:
        return ()
    return tuple((i, a.name) for i, a in enumerate(schema.arguments)
                 if a.alias_info is not None or (ret_alias is True and i == 0))


# ops that update some inputs in place although their schema does not say so (BatchNorm's
# running statistics in training): op -> (positions of the written inputs, "training" position)
_UNDECLARED_WRITES = {
    torch.ops.aten.native_batch_norm.default: ((3, 4), 5),
    torch.ops.aten.cudnn_batch_norm.default: ((3, 4), 5),
    torch.ops.aten.miopen_batch_norm.default: ((3, 4), 5),
}


def written_inputs(n: fx.Node) -> list:
    """The input nodes ``n`` writes into (in-place ops, out= ops, BatchNorm statistics)."""
    if n.op != "call_function":
        return []
    _, _, writes, hidden = _op_facts(n.target)
    out = []
    for i, name in writes:
        v = n.args[i] if i < len(n.args) else n.kwargs.get(name)
        out.extend(x for x in (v if isinstance(v, (list, tuple)) else [v])
                   if isinstance(x, fx.Node))
    if hidden is not None and len(n.args) > hidden[1] and n.args[hidden[1]]:
        out.extend(n.args[i] for i in hidden[0] if isinstance(n.args[i], fx.Node))
    return out


def mutated_storages(nodes: Iterable[fx.Node]) -> set:
    """The storages (as ``alias_base`` nodes) that some node among ``nodes`` writes into,
    through any view. Communication nodes are left out: an all-gather's write into its
    buffer is how that buffer gets its value, and a free ends a storage (the verifier checks
    that nothing reads it after)."""
    return {alias_base(w) for n in nodes if not meta.is_comm(n) for w in written_inputs(n)}


def reads_mutated(n: fx.Node, mutated: set) -> bool:
    """Whether ``n`` reads, or is, a storage in ``mutated``: its value may then differ at
    another point of the step, so ``n`` must not be computed again elsewhere."""
    return any(alias_base(a) in mutated for a in (n, *n.all_input_nodes))


def writes_input(n: fx.Node) -> bool:
    """Whether ``n`` writes into one of its inputs."""
    return bool(written_inputs(n))


def param_derived(gm: fx.GraphModule, kept=frozenset()) -> dict:
    """Forward nodes computed from parameters (and buffers) alone, at least one of them not in
    ``kept`` (``t(w)``, casts, views), in graph order: as dict keys."""
    derived = {}
    for n in gm.graph.nodes:
        if n.op != "call_function" or not meta.is_forward(n):
            continue
        ins = n.all_input_nodes
        if not ins or writes_input(n):
            continue
        if all(meta.is_param(a) or meta.is_buffer(a) or a in derived for a in ins) and any(
            (meta.is_param(a) and meta.tag(a, meta.FQN) not in kept) or a in derived
            for a in ins
        ):
            derived[n] = True
    return derived


def alias_base(node: fx.Node) -> fx.Node:
    """The node that owns the storage ``node`` reads (itself unless it is a view)."""
    seen = set()
    while True:
        src = aliased_arg(node)
        if src is None or src in seen:
            return node
        seen.add(node)
        node = src


def alias_bases(nodes: Iterable[fx.Node]) -> dict:
    """``alias_base`` of every node of ``nodes`` (in graph order), in one pass."""
    bases = {}
    for n in nodes:
        src = aliased_arg(n)
        bases[n] = n if src is None else bases.get(src) or alias_base(src)
    return bases


def alias_closure(root: fx.Node) -> list:
    """``root`` and every node that views its storage, transitively."""
    out, stack, seen = [], [root], {root}
    while stack:
        n = stack.pop()
        out.append(n)
        for u in n.users:
            if u not in seen and aliased_arg(u) is n:
                seen.add(u)
                stack.append(u)
    return out


def last_use(root: fx.Node, pos: dict) -> tuple:
    """(last node reading ``root``'s storage, whether the storage escapes via the output).

    A collective issue keeps reading its input until its wait, so the wait counts as the use.
    Free nodes are not uses.
    """
    last, escapes = root, False
    for a in alias_closure(root):
        for u in a.users:
            if u.op == "output":
                escapes = True
                continue
            if meta.is_free(u):
                continue
            if meta.is_collective_issue(u):
                u = next(w for w in u.users if meta.is_wait(w))
            if pos[u] > pos[last]:
                last = u
    return last, escapes


# --- splicing traced rewrites -----------------------------------------------------------------


_TRACES: dict = {}


def _val_key(v):
    if isinstance(v, torch.Tensor):
        return ("T", tuple(v.shape), v.dtype, tuple(v.stride()), str(v.device))
    return ("C", repr(v))


class _Recorder(_compat.TorchDispatchMode):
    """Appends every aten op run under it to ``graph``, mapping tensors to nodes by identity
    (``env``), as make_fx records them."""

    def __init__(self, graph: fx.Graph, env: dict, fake_mode):
        super().__init__()
        self.graph, self.env, self.fake_mode = graph, env, fake_mode

    def node_of(self, x):
        if isinstance(x, torch.Tensor):
            if id(x) not in self.env:
                raise AssertionError("a traced function read a tensor it was not given")
            return self.env[id(x)]
        return x

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = _compat.fake_run(self.fake_mode, func, args, kwargs)
        if out is None:
            out = func(*args, **kwargs)
        if not isinstance(out, (torch.Tensor, tuple, list)):  # prim.device and the like
            return out
        if func is torch.ops.aten.detach.default:  # autograd's, around an out= argument
            self.env[id(out)] = self.node_of(args[0])
            return out
        nargs, nkwargs = tree_map(self.node_of, (tuple(args), dict(kwargs)))
        node = _compat.new_node(self.graph, func, nargs, nkwargs,
                                func.overloadpacket.__name__)
        node.meta["val"] = out
        if isinstance(out, (tuple, list)):
            for i, o in enumerate(out):
                item = _compat.new_node(self.graph, operator.getitem, (node, i), {},
                                        "getitem")
                item.meta["val"] = o
                self.env[id(o)] = item
        else:
            self.env[id(out)] = node
        return out


def record(fn: Callable, vals: Sequence) -> fx.GraphModule:
    """``make_fx(fn, tracing_mode="fake")(*vals)`` for a function of fake tensors made of
    aten ops alone, recorded by a dispatch mode: the same graph (the same ops, seen at the
    same dispatch level, with the same values and names; tested against make_fx) at half the
    cost, most of which is the fake tensors' own. Ops that return no tensor (``prim.device``)
    and autograd's ``detach`` of an ``out=`` argument are not recorded, as make_fx does not
    record them.

    Each argument is traced as a tensor of its own: one fake tensor given twice (two nodes
    that share a ``meta["val"]``, as nodes spliced from one cached trace do) is traced the
    second time as a new fake tensor of the same metadata, so the graph reads each of its
    placeholders where ``fn`` reads that argument. Tensors are mapped to nodes by identity
    (as make_fx maps them): without this, every read of the shared value would read the last
    placeholder given it, and the trace, cached by metadata (``splice``), would do so for
    any later arguments too."""
    graph, env = fx.Graph(), {}
    vals = list(vals)
    for i, v in enumerate(vals):
        if isinstance(v, torch.Tensor) and id(v) in env:
            vals[i] = v = _compat.fake_empty(v.fake_mode, tuple(v.shape), v.dtype, v.device,
                                             stride=tuple(v.stride()))
        ph = graph.placeholder(f"arg{i}")
        ph.meta["val"] = v
        env[id(v)] = ph
    recorder = _Recorder(graph, env, vals[0].fake_mode)
    with vals[0].fake_mode, recorder:
        out = fn(*vals)
    graph.output(tree_map(recorder.node_of, out))
    return fx.GraphModule(torch.nn.Module(), graph)


def splice(
    gm: fx.GraphModule,
    fn: Callable,
    args: Sequence,
    before: fx.Node,
    tag: Callable[[fx.Node], dict] | dict,
    key=None,
):
    """Trace ``fn`` (``record``) on the fake values of ``args`` and insert its nodes before
    ``before``. Every new node keeps its ``meta["val"]`` and gets the tags ``tag`` gives it.
    Returns ``(outputs, new_nodes)``: ``fn``'s outputs mapped to the new nodes (same
    structure), and every node inserted, in order.

    ``key``: a hashable naming everything ``fn`` closes over; with it, the trace is reused for
    any later call with the same key and input metadata (repeated blocks trace once)."""
    if not all(isinstance(a, fx.Node) for a in args):
        raise TypeError("splice takes graph nodes as arguments")
    vals = [a.meta["val"] for a in args]
    node_args = list(args)
    cache_key = None if key is None else (key, tuple(_val_key(v) for v in vals))
    sub = _TRACES.get(cache_key) if cache_key is not None else None
    if sub is None:
        sub = record(fn, vals)
        if cache_key is not None:
            if len(_TRACES) > 4096:
                _TRACES.clear()
            _TRACES[cache_key] = sub
    env = {}
    ph = iter(node_args)
    new_nodes = []
    with gm.graph.inserting_before(before):
        for n in sub.graph.nodes:
            if n.op == "placeholder":
                env[n] = next(ph)
            elif n.op == "output":
                flat, spec = tree_flatten(n.args[0])
                mapped = [env[x] if isinstance(x, fx.Node) else x for x in flat]
                out = tree_unflatten(mapped, spec)
            else:
                new = _compat.node_copy(gm.graph, n, lambda x: env[x],
                                        meta={"val": n.meta.get("val")})
                t = tag(n) if callable(tag) else tag
                if t:
                    meta.tags(new).update(t)
                env[n] = new
                new_nodes.append(new)
    return out, new_nodes


def insert_free(gm: fx.GraphModule, roots: Iterable[fx.Node], tags_of: Callable) -> list:
    """Insert ``autoshard::free`` after the last read of each root's storage; roots whose
    last reads coincide and whose ``tags_of(root, last)`` agree share one free node.

    Roots whose storage escapes through the graph output, or that are placeholders, are left
    alone. Returns the free nodes."""

    pos = positions(gm.graph)
    groups: dict = {}
    for root in roots:
        if root.op == "placeholder":
            continue
        last, escapes = last_use(root, pos)
        if not escapes:
            t = tags_of(root, last)
            groups.setdefault((last, tuple(sorted(t.items()))), (t, []))[1].append(root)
    frees = []
    for (last, _), (t, group) in sorted(groups.items(), key=lambda kv: pos[kv[0][0]]):
        with gm.graph.inserting_after(last):  # as call_function makes it, at less cost
            f = _compat.new_node(gm.graph, free_op, (sorted(group, key=pos.__getitem__),), {})
        f.meta["val"] = None
        meta.tags(f).update(t)
        frees.append(f)
    return frees


def storage_roots(nodes: Iterable[fx.Node]) -> list:
    """The nodes among ``nodes`` that own a fresh tensor storage (not views, not lists)."""
    return [
        n
        for n in nodes
        if n.op == "call_function"
        and aliased_arg(n) is None
        and isinstance(n.meta.get("val"), torch.Tensor)
    ]


def clone_graph(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` whose nodes carry copies of the autoshard tags (vals are shared)."""
    graph = fx.Graph()
    env = {}
    for n in gm.graph.nodes:
        new = _compat.node_copy(graph, n, lambda a: env[a])
        if meta.KEY in n.meta:
            new.meta[meta.KEY] = dict(n.meta[meta.KEY])
        env[n] = new
    return _compat.graph_module(gm, graph)


def copy_into_backward(gm: fx.GraphModule, nodes: Sequence) -> dict:
    """Copy forward ``nodes`` (in graph order, closed under what the copies read among them)
    into the backward, each right before its first backward reader or copy that reads it;
    backward readers then read the copies (tagged ``recomputed`` with the original's name,
    region bwd). Nodes no
    backward node reaches are not copied. Returns {original: copy}."""
    graph = gm.graph
    order = positions(graph)
    place = {}
    for n in reversed(nodes):
        cands = [u for u in n.users if meta.is_backward(u)]
        cands += [place[u] for u in n.users if u in place]
        if cands:
            place[n] = min(cands, key=order.__getitem__)
    copies = {}
    for n in nodes:
        if n not in place:
            continue
        with graph.inserting_before(place[n]):
            c = _compat.node_copy(graph, n, lambda a: copies.get(a, a))
        c.meta[meta.KEY] = {**meta.tags(n), meta.REGION: meta.BWD,
                            meta.RECOMPUTED: n.name}
        copies[n] = c
    made = set(copies.values())
    for n, c in copies.items():
        for u in list(n.users):
            if meta.is_backward(u) and u not in made:
                u.replace_input_with(n, c)
    return copies


@dataclasses.dataclass
class Partition:
    """The joint graph's nodes as the split runs them: ``fwd`` and ``bwd`` (in joint order,
    placeholders included, the output node not), ``saved`` (forward nodes a backward node
    reads, in joint order), the output ``values`` and their ``roles``, and which of them the
    forward returns (``fwd_idx``: user outputs and mutated buffers) and the backward
    (``bwd_idx``)."""

    fwd: list
    bwd: list
    saved: list
    values: list
    roles: list
    fwd_idx: list
    bwd_idx: list

    def fwd_outputs(self) -> list:
        return [self.values[i] for i in self.fwd_idx] + self.saved

    def bwd_outputs(self) -> list:
        return [self.values[i] for i in self.bwd_idx]


def partition(gm: fx.GraphModule) -> Partition:
    out = meta.output_node(gm)
    roles = meta.tags(out)[meta.OUTPUTS]
    fwd = [n for n in gm.graph.nodes if n.op != "output" and meta.is_forward(n)]
    bwd = [n for n in gm.graph.nodes if n.op != "output" and meta.is_backward(n)]
    bwd_set = set(bwd)
    fwd_idx = [i for i, r in enumerate(roles) if r[meta.ROLE] in (meta.OUT_FWD, meta.OUT_BUFFER)]
    return Partition(fwd, bwd, [n for n in fwd if any(u in bwd_set for u in n.users)],
                     list(out.args[0]), roles, fwd_idx,
                     [i for i in range(len(roles)) if i not in set(fwd_idx)])

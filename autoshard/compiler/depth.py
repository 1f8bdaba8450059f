"""Capture a deep stack of identical blocks from a shallow one.

Tracing costs about a millisecond per graph node, so GPT-175B's 96 blocks take 15-30 s to
trace although 94 of them trace to the very same nodes. ``capture_deep`` traces the model with
its block list cut to ``SHALLOW`` blocks and builds the full graph from that: a middle block's
forward and backward nodes are repeated, each copy reading its own parameters, its
predecessor's forward values and its successor's gradients; the blocks after it are renamed to
the last ones.

It checks itself first: the graph it builds for ``SHALLOW + 1`` blocks must equal, node for
node (op, arguments, shapes, dtypes, strides, tags, output roles), the graph traced with
``SHALLOW + 1`` blocks. A model that fails this, or whose blocks are not one class with the
same parameters, is traced whole. The planner (``autoshard.plan``) uses it; a sharded model
traces its own step whole.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
from typing import Callable, Optional

import torch
import torch.fx as fx

from autoshard.core import _compat, meta

SHALLOW = 5  # blocks traced: the first two, the middle one repeated, the last two
TEMPLATE = 2  # the block repeated
MIN_DEPTH = 12  # shallower stacks are traced whole (it takes a few seconds at most)


class NotRegular(Exception):
    """The traced graph does not repeat the way ``unroll`` builds it; says why."""


def block_stack(model: torch.nn.Module) -> Optional[tuple]:
    """``(path, depth)`` of the model's one ModuleList of at least ``MIN_DEPTH`` blocks of one
    class with the same parameters and buffers (names, shapes, dtypes), none shared with
    anything else; None when there is none."""
    owners = collections.Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    for path, mod in model.named_modules():
        if not isinstance(mod, torch.nn.ModuleList) or len(mod) < MIN_DEPTH:
            continue
        kids = list(mod._modules.items())
        if [k for k, _ in kids] != [str(i) for i in range(len(kids))]:
            continue
        sig = {_signature(c) for _, c in kids}
        if len({type(c) for _, c in kids}) == 1 and len(sig) == 1 and all(
                owners[id(p)] == 1 for _, c in kids for p in c.parameters()):
            return path, len(kids)
    return None


def _signature(mod: torch.nn.Module) -> tuple:
    return (tuple((n, tuple(p.shape), p.dtype, p.requires_grad)
                  for n, p in mod.named_parameters()),
            tuple((n, tuple(b.shape), b.dtype) for n, b in mod.named_buffers()))


@contextlib.contextmanager
def cut(model: torch.nn.Module, path: str, depth: int):
    """``model`` with its block list ``path`` holding only its first ``depth`` blocks."""
    stack = model.get_submodule(path)
    kept = stack._modules
    stack._modules = collections.OrderedDict(list(kept.items())[:depth])
    try:
        yield
    finally:
        stack._modules = kept


def capture_deep(model, path: str, depth: int, specs: list, capture_cut: Callable, say=None):
    """The Captured of ``model``, whose block list ``path`` holds ``depth`` blocks and whose
    parameters ``specs`` describes, built from traces of ``SHALLOW`` and ``SHALLOW + 1``
    blocks (``capture_cut(specs)`` traces the model as it is when called, with those of
    ``specs`` it has); None, with the reason given to ``say``, if they do not repeat."""
    def traced(k):
        with cut(model, path, k):
            names = {fqn for fqn, _ in model.named_parameters()}
            return capture_cut([s for s in specs if s.fqn in names])

    small, check = traced(SHALLOW), traced(SHALLOW + 1)
    try:
        diff = difference(unroll(small, path, SHALLOW + 1, check.params), check)
        if diff:
            raise NotRegular(diff)
        return unroll(small, path, depth, specs)
    except NotRegular as e:
        if say is not None:
            say(f"tracing all {depth} blocks: the graph built from {SHALLOW} blocks for "
                f"{SHALLOW + 1} differs from their trace ({e})")
        return None


def unroll(small, path: str, depth: int, specs: list):
    """A copy of Captured ``small`` (``SHALLOW`` blocks at ``path``) with ``depth`` blocks;
    ``specs`` are the deep model's ParamSpecs in order. Raises NotRegular."""
    u = _Unroll(small.gm.graph, path, depth)
    u.emit_nodes()
    u.emit_output()
    deep_gm = _compat.graph_module(small.gm, u.new)
    new = u.new
    vals = [id(n.meta["val"]) for n in new.nodes
            if isinstance(n.meta.get("val"), torch.Tensor)]
    if len(vals) != len(set(vals)):
        raise NotRegular("two built nodes share one value")
    phs = [n for n in new.nodes if meta.is_param(n)]
    if [meta.tag(n, meta.FQN) for n in phs] != [p.fqn for p in specs]:
        raise NotRegular("the built parameters are not the model's, in its order")
    grad_tangents = {}
    for (kind, key), deps in small.grad_tangents.items():
        for k in u.deepen([key]) if isinstance(key, str) else [key]:
            grad_tangents[kind, k] = deps
    return dataclasses.replace(
        small, gm=deep_gm, params=list(specs),
        buffer_fqns=[meta.tag(n, meta.FQN) for n in new.nodes if meta.is_buffer(n)],
        mutated_buffers=u.deepen(small.mutated_buffers), grad_tangents=grad_tangents)


class _Unroll:
    """Building the deep graph ``new`` of a shallow one with ``SHALLOW`` blocks at ``path``.

    Shallow block ``TEMPLATE`` becomes the deep blocks ``copies``; every other shallow block
    b becomes deep block ``where[b]``. ``segs[b, region]`` are the nodes of middle block b
    in a region (forward from its first node to the next block's first, backward from its
    first to the previous block's first: the glue between blocks included) and ``seg`` maps
    each of them to (block, region, index in its segment). Raises NotRegular.
    """

    def __init__(self, graph: fx.Graph, path: str, depth: int):
        self.path, self.prefix = path, path + "."
        self.nodes = list(graph.nodes)
        fs, bs = self._starts()
        self.seg, self.segs = self._segments(fs, bs)
        self._check_segments(bool(bs))
        a, t = SHALLOW, TEMPLATE
        self.copies = list(range(t, depth - (a - t) + 1))
        if not self.copies:
            raise NotRegular(f"{depth} blocks is too few to build")
        self.where = {b: b if b < t else depth - (a - b) for b in range(a) if b != t}
        self.new = fx.Graph()
        self.env: dict = {}  # (shallow node, copy or None) -> deep node
        self.names: dict = {}  # (shallow node name, copy) -> deep node name, for FWD_NODE

    def block(self, name: str):
        """The block index of an FQN or module path under ``path``; None outside it."""
        if name and name.startswith(self.prefix):
            head = name[len(self.prefix):].split(".", 1)[0]
            return int(head) if head.isdigit() else None
        return None

    def block_of(self, n: fx.Node):
        if n.op == "placeholder":
            return self.block(meta.tag(n, meta.FQN) or "")
        return self.block(meta.tag(n, meta.MODULE) or "")

    def _starts(self) -> tuple:
        """Per region, block -> the position of its first node; checked to run in order."""
        a = SHALLOW
        starts: dict = {meta.FWD: {}, meta.BWD: {}}
        for i, n in enumerate(self.nodes):
            b = self.block_of(n)
            if b is not None and n.op != "placeholder":
                starts[meta.tag(n, meta.REGION)].setdefault(b, i)
        fs, bs = starts[meta.FWD], starts[meta.BWD]
        if sorted(fs) != list(range(a)) or (bs and sorted(bs) != list(range(a))):
            raise NotRegular("not every block has forward (and backward) nodes")
        if any(fs[i] >= fs[i + 1] for i in range(a - 1)) or bs and (any(
                bs[i] <= bs[i + 1] for i in range(a - 1)) or bs[a - 1] <= fs[a - 1]):
            raise NotRegular("the blocks do not run one after another")
        return fs, bs

    def _segments(self, fs: dict, bs: dict) -> tuple:
        """``seg`` and ``segs`` of the middle blocks 1 .. SHALLOW - 2."""
        seg, segs = {}, {}
        for b in range(1, SHALLOW - 1):
            ranges = [(meta.FWD, fs[b], fs[b + 1])]
            ranges += [(meta.BWD, bs[b], bs[b - 1])] if bs else []
            for region, lo, hi in ranges:
                segs[b, region] = self.nodes[lo:hi]
                for k, n in enumerate(self.nodes[lo:hi]):
                    seg[n] = (b, region, k)
        return seg, segs

    def _check_segments(self, backward: bool) -> None:
        """Every middle block's nodes lie in its own span, the template is not checkpointed,
        and the middle blocks' spans are of one length."""
        seg, t = self.seg, TEMPLATE
        for n in self.nodes:
            b = self.block_of(n)
            if n.op != "placeholder" and b in range(1, SHALLOW - 1) and seg.get(n, (b,))[0] != b:
                raise NotRegular(f"{n.name} of block {b} runs outside its block's span")
            if n in seg and b not in (None, seg[n][0]):
                raise NotRegular(f"{n.name} of block {b} runs inside block {seg[n][0]}'s span")
            if n in seg and seg[n][0] == t and meta.tag(n, meta.CHECKPOINT) is not None:
                raise NotRegular("the blocks are checkpointed")
        for region in (meta.FWD, meta.BWD) if backward else (meta.FWD,):
            if len({len(self.segs[b, region]) for b in range(1, SHALLOW - 1)}) != 1:
                raise NotRegular(f"the middle blocks' {region} spans differ in length")

    def copy_of(self, n: fx.Node, j):
        """The deep node of shallow node ``n`` as read by copy ``j`` of the template (j None:
        by a node that is not in the template)."""
        t, env, copies = TEMPLATE, self.env, self.copies
        info = self.seg.get(n)
        if info is None and n.op == "placeholder" and self.block_of(n) == t:
            if j is None:
                raise NotRegular(f"{n.name} of the repeated block is read outside it")
            return env[n, j]
        if info is None or (info[0] != t and j is None):
            return env[n, None]
        b, region, k = info
        twin = self.segs[t, region][k] if b != t else n
        if b == t:
            if j is None:  # read after the copies: the one run last
                j = copies[-1] if region == meta.FWD else copies[0]
            return env[twin, j]
        if b == t - 1 and region == meta.FWD:
            return env[n, None] if j == copies[0] else env[twin, j - 1]
        if b == t + 1 and region == meta.BWD:
            return env[n, None] if j == copies[-1] else env[twin, j + 1]
        raise NotRegular(f"the repeated block reads {n.name} of block {b} ({region})")

    def emit(self, n: fx.Node, j) -> None:
        """Copy ``n`` into ``new``, as copy ``j`` of the template (j None: as itself)."""
        out = _compat.node_copy(self.new, n, lambda x: self.copy_of(x, j))
        if j is not None and j != self.copies[0]:  # a value of its own: make_fx (splice)
            out.meta["val"] = _fresh(n.meta.get("val"))  # traces one tensor given twice as one
        tags = dict(meta.tags(n))
        b = TEMPLATE if j is not None else self.block_of(n)
        deep = j if j is not None else self.where.get(b, b)
        for key in (meta.FQN, meta.MODULE):
            if b is not None and self.block(tags.get(key) or "") == b:
                tags[key] = _at(tags[key], self.path, b, deep)
        if meta.FWD_NODE in tags:
            fwd = tags[meta.FWD_NODE]
            tags[meta.FWD_NODE] = self.names.get((fwd, j), self.names.get((fwd, None), fwd))
        out.meta[meta.KEY] = tags
        self.env[n, j] = out
        self.names[n.name, j] = out.name

    def emit_nodes(self) -> None:
        """Every node but the output, the template's placeholders and segments once per copy
        (its backward segments in reverse order), where the template's first ones stood."""
        t, seg, segs, copies = TEMPLATE, self.seg, self.segs, self.copies
        template_phs = [n for n in self.nodes if n.op == "placeholder" and self.block_of(n) == t]
        first_seg = {segs[t, r][0]: r for r in (meta.FWD, meta.BWD) if (t, r) in segs}
        for n in self.nodes:
            if n.op == "output":
                break
            if n.op == "placeholder" and self.block_of(n) == t:
                if n is template_phs[0]:
                    for j in copies:
                        for p in template_phs:
                            self.emit(p, j)
                continue
            if n in seg and seg[n][0] == t:
                region = first_seg.get(n)
                if region is not None:
                    order = copies if region == meta.FWD else copies[::-1]
                    for j in order:
                        for m in segs[t, region]:
                            self.emit(m, j)
                continue
            self.emit(n, None)

    def emit_output(self) -> None:
        """The output node: the template's outputs (its gradients) once per copy, the others
        read from their deep nodes, each with its role's FQN renamed."""
        t, path = TEMPLATE, self.path
        out = self.nodes[-1]
        roles = meta.tags(out)[meta.OUTPUTS]
        values, new_roles = [], []
        template_outs = [(v, r) for v, r in zip(out.args[0], roles)
                         if isinstance(v, fx.Node) and self.seg.get(v, (None,))[0] == t]
        for v, r in zip(out.args[0], roles):
            if (v, r) in template_outs:
                if (v, r) == template_outs[0]:
                    for j in self.copies:
                        for tv, tr in template_outs:
                            fqn = tr.get(meta.FQN)
                            if fqn is None or self.block(fqn) != t:
                                raise NotRegular("the repeated block returns a value of its own")
                            values.append(self.env[tv, j])
                            new_roles.append({**tr, meta.FQN: _at(fqn, path, t, j)})
                continue
            values.append(self.copy_of(v, None) if isinstance(v, fx.Node) else v)
            fqn = r.get(meta.FQN)
            b = self.block(fqn or "")
            new_roles.append({**r, meta.FQN: _at(fqn, path, b, self.where[b])}
                             if b is not None else r)
        o = self.new.output(values)
        o.meta = dict(out.meta)
        o.meta[meta.KEY] = {**meta.tags(out), meta.OUTPUTS: new_roles}

    def deepen(self, fqns) -> list:
        """Shallow FQNs -> deep ones: a template block's once per copy, the rest renamed."""
        out = []
        for f in fqns:
            b = self.block(f)
            if b is None:
                out.append(f)
            elif b == TEMPLATE:
                out.extend(_at(f, self.path, TEMPLATE, j) for j in self.copies)
            else:
                out.append(_at(f, self.path, b, self.where[b]))
        return out


def _fresh(v):
    """A fake tensor like ``v`` (shape, strides, dtype, device) that is not ``v``."""
    if isinstance(v, (list, tuple)):
        return type(v)(_fresh(x) for x in v)
    return _compat.fake_like(v) if isinstance(v, torch.Tensor) else v


def _at(fqn: str, path: str, b: int, deep: int) -> str:
    return f"{path}.{deep}" + fqn[len(f"{path}.{b}"):]


def difference(built, traced) -> str:
    """The first way two Captured graphs differ ("" when they are the same)."""
    a, b = list(built.gm.graph.nodes), list(traced.gm.graph.nodes)
    if len(a) != len(b):
        return f"{len(a)} nodes built, {len(b)} traced"
    ia, ib = {n: i for i, n in enumerate(a)}, {n: i for i, n in enumerate(b)}
    names_a = {n.name: i for i, n in enumerate(a)}
    names_b = {n.name: i for i, n in enumerate(b)}

    def shape(x, index):
        if isinstance(x, fx.Node):
            return ("node", index[x])
        if isinstance(x, (list, tuple)):
            return (type(x).__name__, tuple(shape(y, index) for y in x))
        if isinstance(x, dict):
            return ("dict", tuple((k, shape(v, index)) for k, v in x.items()))
        return ("const", repr(x))

    def val(v):
        if isinstance(v, torch.Tensor):
            return (tuple(v.shape), v.dtype, tuple(v.stride()), v.device.type)
        if isinstance(v, (list, tuple)):
            return tuple(val(x) for x in v)
        return repr(v) if v is None or isinstance(v, (int, float, bool)) else type(v).__name__

    def tags(n, names):
        t = dict(meta.tags(n))
        if meta.FWD_NODE in t:
            t[meta.FWD_NODE] = names.get(t[meta.FWD_NODE])
        return t

    for x, y in zip(a, b):
        if x.op != y.op or (x.op != "placeholder" and x.target != y.target):
            return f"node {ia[x]}: {x.format_node()} against {y.format_node()}"
        if shape((x.args, x.kwargs), ia) != shape((y.args, y.kwargs), ib):
            return f"node {ia[x]} ({x.name}): arguments differ"
        if val(x.meta.get("val")) != val(y.meta.get("val")):
            return f"node {ia[x]} ({x.name}): values differ"
        if tags(x, names_a) != tags(y, names_b):
            return f"node {ia[x]} ({x.name}): tags {meta.tags(x)} against {meta.tags(y)}"
    for field in ("buffer_fqns", "mutated_buffers", "grad_tangents", "diff_outputs",
                  "input_grads", "in_consts", "out_consts", "has_backward"):
        if getattr(built, field) != getattr(traced, field):
            return f"{field} differ"
    return ""

"""Capture: one joint forward+backward fx graph of a model's training step.

``make_fx`` traces ``functional_call(model) + torch.autograd.grad`` over fake tensors holding
the FULL parameter shapes (with tensor parallelism, each rank's piece, as a DTensor on "tp"),
so capture costs no parameter memory and works for any model size.
Every placeholder and output is tagged with its role (see ``autoshard.core.meta``); forward nodes
carry the module path that produced them and backward nodes the forward node they
differentiate, wherever autograd records it. A trace that takes a while shows as the progress
phase "capturing the training step" (``autoshard.core.progress``).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Optional

import torch
import torch.fx as fx

from autoshard.core._compat import (keystr, tree_flatten, tree_flatten_with_path, tree_map,
                                    tree_unflatten)
from autoshard.core import _compat, carried, guards, hooks, meta, progress, writes
from autoshard.core.errors import AutoshardError
from autoshard.core.graph import alias_closure, fold_alias_pairs, written_inputs
from autoshard.core.ops import capture_decompositions
from autoshard.core.captured import Captured, NewState, StateIn, StateOut, TENSOR
from autoshard.runtime import tensor_parallel
from autoshard.compiler.capture_errors import (CheckDtypes, assert_value_checks, check_source,
                                              explain)


_PLAIN = (type(None), bool, int, float, str, torch.dtype, torch.device)


_tracing_depth = [0]


def tracing() -> bool:
    """Whether a capture is tracing a forward now (a submodule's or method's entry then
    runs the original code, to be traced; see ``calls.install_entry``)."""
    return _tracing_depth[0] > 0


@contextlib.contextmanager
def _traced():
    _tracing_depth[0] += 1
    try:
        yield
    finally:
        _tracing_depth[0] -= 1


def _fake_like(fake_mode, t: torch.Tensor, device: torch.device):
    if t.device.type == "meta":  # planning a meta-device model: buffers live on ``device``
        with fake_mode:
            return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
    return fake_mode.from_tensor(t)


def _module_names(model: torch.nn.Module) -> dict:
    names = {}
    for name, mod in model.named_modules(remove_duplicate=False):
        names.setdefault(id(mod), name)
    return names


@contextlib.contextmanager
def _track_modules(model: torch.nn.Module, stack: list):
    """Record the module path of every traced op in ``node.meta['nn_module_stack']``."""
    names = _module_names(model)

    def publish():
        cur = _compat.current_meta()
        if stack:
            cur["nn_module_stack"] = {p: (p, c) for p, c in stack}
        else:
            cur.pop("nn_module_stack", None)

    def pre(mod, args):
        name = names.get(id(mod))
        if name is not None:
            stack.append((name, guards.user_class_name(mod)))
            publish()

    def post(mod, args, out):
        name = names.get(id(mod))
        if name is not None and stack and stack[-1][0] == name:
            stack.pop()
            publish()

    h1 = torch.nn.modules.module.register_module_forward_pre_hook(pre)
    h2 = torch.nn.modules.module.register_module_forward_hook(post)
    stack.append(("", guards.user_class_name(model)))
    publish()
    try:
        yield
    finally:
        h1.remove()
        h2.remove()


def _track_checkpoints():
    """Trace ``torch.utils.checkpoint`` regions as plain calls and mark their nodes with the
    region (``node.meta["ac_graph_id"]``, the field torch's own checkpointing uses)."""
    regions: list = []
    count = [0]

    def enter():
        count[0] += 1
        regions.append(count[0])
        _compat.current_meta()["ac_graph_id"] = regions[-1]

    def leave():
        regions.pop()
        cur = _compat.current_meta()
        if regions:
            cur["ac_graph_id"] = regions[-1]
        else:
            cur.pop("ac_graph_id", None)

    return _compat.transparent_checkpoint(enter, leave)


def _is_mutated(node: fx.Node) -> bool:
    """Whether any op writes into ``node``'s storage (directly or through a view)."""
    aliases = alias_closure(node)
    return any(a in written_inputs(u) for a in aliases for u in a.users)


def input_names(args, kwargs) -> list:
    """(name, leaf) of each leaf of a call's inputs, named as a person writes them:
    ``args[0]``, ``args[1]['mask']``, ``labels``."""
    out = []
    for path, x in tree_flatten_with_path((args, kwargs))[0]:
        rest = keystr(path[1:])  # path[0] says args or kwargs
        out.append((f"args{rest}" if path[0].idx == 0 else rest[2:].replace("']", "", 1), x))
    return out


def capture(
    model: torch.nn.Module, forward: Callable, params: list, buffers: dict, args: tuple,
    kwargs: dict, *,
    device: torch.device,
    with_grad: bool,
    input_dtype: Optional[torch.dtype] = None,
    output_dtype: Optional[torch.dtype] = None,
    traced_hooks: frozenset = frozenset(),
    lifted: tuple = (),
) -> Captured:
    """Trace ``forward(model, *args, **kwargs)`` and, if ``with_grad``, its backward.

    params: ParamSpec per (deduplicated) parameter, traced in its compute dtype; buffers:
    FQN -> tensor (real or meta). ``input_dtype`` / ``output_dtype``: floating tensor inputs
    and outputs are cast to it inside the graph (a mixed precision policy's
    ``cast_forward_inputs`` and ``output_dtype``). ``traced_hooks``: forward hooks traced
    into the graph, the others run after it (``autoshard.core.hooks``); ``lifted``: (module,
    attribute) of float attributes the graph reads as inputs instead of constants, fed from
    the attribute on each call.

    What the forward reads of the Python world is guarded (``Captured.guards``); a call the
    graph cannot repeat (Python random, the clock) is refused, naming it.
    """
    names = _module_names(model)
    hooks.refuse_backward_hooks(model, names)
    leaves, in_spec = tree_flatten((args, kwargs))
    objects = [x for x in leaves if carried.is_carried(x)]
    fparams, fbufs, finputs = _fake_inputs(params, buffers, flat_inputs(leaves), lifted,
                                           device)
    joint = _Joint(model=model, forward=forward, params=list(params), bnames=list(buffers),
                   in_spec=in_spec, in_consts=_input_consts(leaves), objects=objects,
                   device=device, with_grad=with_grad, input_dtype=input_dtype,
                   output_dtype=output_dtype, traced_hooks=traced_hooks, lifted=lifted,
                   tp=tensor_parallel.trace_layouts(model, params))
    grad_mode = torch.is_grad_enabled()
    gm = _trace(joint, [*fparams, *fbufs, *finputs], args, kwargs)
    _refuse_outputs(model, joint.rec)
    return _captured(joint, gm, finputs, grad_mode, names)


def _input_consts(leaves) -> list:
    """Per input leaf: ``TENSOR``, a ``StateIn`` for an object holding state, else the leaf."""
    count = iter(range(sum(1 for x in leaves if carried.is_carried(x))))
    return [TENSOR if isinstance(x, torch.Tensor) else
            StateIn(next(count), len(carried.tensors(x))) if carried.is_carried(x) else x
            for x in leaves]


def _fake_inputs(params: list, buffers: dict, tensors_in: list, lifted, device) -> tuple:
    """Fake tensors to trace with: the parameters (full shape, compute dtype), the buffers,
    the call's input tensors, and a 0-dim float64 tensor per lifted float attribute."""
    # real tensors the forward reads that are neither parameters nor buffers (a module-level
    # constant, a plain tensor attribute) are traced as graph constants, as eager reads them
    fake_mode = _compat.capture_fake_mode()
    with fake_mode:
        fparams = [
            torch.empty(p.shape, dtype=p.compute_dtype, device=device)
            .requires_grad_(p.requires_grad)
            for p in params
        ]
    fbufs = [_fake_like(fake_mode, b, device) for b in buffers.values()]
    finputs = []
    for x in tensors_in:
        f = fake_mode.from_tensor(x.detach())
        finputs.append(f.requires_grad_(x.requires_grad) if x.is_floating_point() else f)
    for mod, name in lifted:  # a 0-dim float64 tensor stands for the Python float
        finputs.append(fake_mode.from_tensor(torch.tensor(mod.__dict__[name],
                                                          dtype=torch.float64)))
    return fparams, fbufs, finputs


def _new_record() -> dict:
    return {"taps": [], "tapped": [], "btaps": [], "hgrads": [], "installed": set(),
            "writes": [], "written": []}


@dataclasses.dataclass
class _Joint:
    """The function ``make_fx`` traces: given the parameters, buffers, input tensors and
    lifted floats flat, the call's forward and, ``with_grad``, its backward. ``rec`` keeps
    what building ``Captured`` and tagging its graph need of the trace; ``stack`` is the
    module path being traced, for a capture error."""

    model: torch.nn.Module
    forward: Callable
    params: list  # ParamSpec per parameter
    bnames: list  # buffer FQNs
    in_spec: Any
    in_consts: list
    objects: list  # the input leaves that are objects holding state
    device: torch.device
    with_grad: bool
    input_dtype: Optional[torch.dtype]
    output_dtype: Optional[torch.dtype]
    traced_hooks: frozenset
    lifted: tuple
    tp: dict  # tensor parallelism's layouts (tensor_parallel.trace_layouts)
    rec: dict = dataclasses.field(default_factory=_new_record)
    stack: list = dataclasses.field(default_factory=list)

    def __call__(self, *flat):
        rec, n_p, n_b, n_lifted = self.rec, len(self.params), len(self.bnames), len(self.lifted)
        p, b, xs = flat[:n_p], flat[n_p : n_p + n_b], list(flat[n_p + n_b :])
        if n_lifted:
            xs, lifts = xs[:-n_lifted], xs[-n_lifted:]
        else:
            lifts = []
        bclones = [t.clone() for t in b]
        rec["clones"] = list(_compat.current_trace_graph().nodes)[-n_b:] if n_b else []
        a, kw, shadows = self._call_inputs(xs)
        values = tensor_parallel.traced_values(self.tp, self.params, p)
        values.update(zip(self.bnames, bclones))
        out = self._run_forward(a, kw, values, lifts)
        touts, n_user = self._outputs(out, shadows)
        wrt = [t for t in p if t.requires_grad] + [x for x in xs if x.requires_grad]
        grads = self._backward(touts, n_user, wrt)
        rec["grad_mask"] = [g is not None for g in grads]
        return touts, [g for g in grads if g is not None], bclones, list(rec["hgrads"])

    def _call_inputs(self, xs: list) -> tuple:
        """The call's (args, kwargs) around the traced tensors ``xs``, each object holding
        state standing as a shadow holding its tensors of ``xs``; and per object, (its
        shadow, {id(tensor): its place among the object's tensors})."""
        it = iter(xs)
        full, shadows = [], []
        for c in self.in_consts:
            if isinstance(c, StateIn):
                fakes = [next(it) for _ in range(c.n)]
                shadows.append((carried.shadow(self.objects[c.index], iter(fakes)),
                                {id(f): i for i, f in enumerate(fakes)}))
                full.append(shadows[-1][0])
            else:
                full.append(next(it) if c is TENSOR else c)
        a, kw = _cast_floating(tree_unflatten(full, self.in_spec), self.input_dtype)
        return a, kw, shadows

    def _run_forward(self, a, kw, values: dict, lifts: list):
        """The model's forward on ``values`` (FQN -> tensor), hooks tapped, module paths,
        checkpoint regions and the reads of the Python world recorded."""
        rec, model = self.rec, self.model
        with _lifting(self.lifted, lifts), _compat.reparametrize(model, values),\
                hooks.tapping(model, self.traced_hooks, rec["taps"], rec["tapped"],
                              rec["btaps"], rec["hgrads"], rec["installed"]),\
                _track_modules(model, self.stack), _track_checkpoints(),\
                _cumulative_batch_norms(model),\
                guards.recording(model) as reads, _traced(), CheckDtypes():
            rec["reads"] = reads
            watch = writes.Watch(writes.owners(model))
            try:  # what the forward wrote is replayed after each run, never left fake
                out = _cast_floating(self.forward(model, *a, **kw), self.output_dtype)
                rec["writes"], rec["written"] = watch.finish(reads, guards.MODULE_INTERNALS)
            finally:
                watch.undo()
        _compat.current_meta().pop("nn_module_stack", None)
        return out

    def _outputs(self, out, shadows: list) -> tuple:
        """The forward's tensor outputs: the user's, those it wrote to modules (``writes``),
        the taps', then the state the forward left in objects; and how many are the user's and
        written (differentiable). Objects among the outputs become ``StateOut``/``NewState``."""
        rec = self.rec
        _compat.register_dataclasses(out)  # its tensors are outputs, as a tuple's are
        out_leaves, rec["out_spec"] = tree_flatten(out)
        touts = [o for o in out_leaves if isinstance(o, torch.Tensor)]
        n_user = len(touts)
        souts: list = []  # what the forward left in objects, after the taps
        rec["state_in"] = [(k, carried.describe(sh, ins, souts)) for k, (sh, ins) in
                           enumerate(shadows)]
        whose = {id(sh): k for k, (sh, _) in enumerate(shadows)}
        for i, o in enumerate(out_leaves):
            if id(o) in whose:
                out_leaves[i] = StateOut(whose[id(o)])
            elif carried.is_carried(o):
                out_leaves[i] = NewState(carried.describe(o, {}, souts))
        rec["n_state"] = len(souts)
        touts = touts + rec["written"] + rec["tapped"] + [t.detach() for t in souts]
        rec["out_consts"] = [TENSOR if isinstance(o, torch.Tensor) else o for o in out_leaves]
        rec["fwd_last"] = list(_compat.current_trace_graph().nodes)[-1]
        return touts, n_user + len(rec["written"])

    def _backward(self, touts: list, n_user: int, wrt: list):
        """The gradients of ``wrt`` from the user's differentiable outputs, each given a
        fresh tangent; ``()`` when there is no backward to trace."""
        rec = self.rec
        diff = [i for i, o in enumerate(touts[:n_user]) if o.requires_grad]
        rec["diff"], rec["tangents"] = diff, []
        if not (self.with_grad and diff and wrt):
            return ()
        outs = [touts[i] for i in diff]
        _compat.link_backward_to_forward([o.grad_fn for o in outs])
        tangents = []
        for o in outs:
            tangents.append(torch.empty(o.shape, dtype=o.dtype, device=o.device))
            rec["tangents"].append(list(_compat.current_trace_graph().nodes)[-1])
        # eager runs backward() outside the autocast region: trace it so, whatever the
        # forward's autocast state (the forward's casts are in the graph already)
        with torch.autocast(self.device.type, enabled=False):
            return torch.autograd.grad(outs, wrt, tangents, allow_unused=True)


_BATCH_NORMS = (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.BatchNorm3d)


@contextlib.contextmanager
def _cumulative_batch_norms(model: torch.nn.Module):
    """Within it, each batch norm in training with ``momentum=None`` (a cumulative moving
    average) updates its running statistics with the factor ``1 / num_batches_tracked`` as a
    tensor: torch's module takes it as a Python float of the counter, a read of a value
    capture does not know. The normalisation itself is ``F.batch_norm``'s, as eager's."""
    patched = [m for m in model.modules()
               if isinstance(m, _BATCH_NORMS) and m.momentum is None
               and m.training and m.track_running_stats and m.running_mean is not None]
    for m in patched:
        m.forward = _cumulative_forward(m)
    try:
        yield
    finally:
        for m in patched:
            del m.forward


def _cumulative_forward(m) -> Callable:
    def forward(x):
        with torch.no_grad():
            m.num_batches_tracked.add_(1)
        # on copies (the backward saves them; the statistics are updated below)
        out = torch.nn.functional.batch_norm(x, m.running_mean.clone(), m.running_var.clone(),
                                             m.weight, m.bias, True, 0.0, m.eps)
        with torch.no_grad():
            dims = [d for d in range(x.dim()) if d != 1]
            factor = 1.0 / m.num_batches_tracked
            xd = x.detach().to(m.running_mean.dtype)
            mean, var = xd.mean(dims), xd.var(dims, correction=1)  # unbiased, as eager's
            m.running_mean.mul_(1 - factor).add_(mean * factor)
            m.running_var.mul_(1 - factor).add_(var * factor)
        return out
    return forward


class _LayoutAsRun:
    """An op whose fake kernel gives its first output another layout than its kernels do:
    traced as is, then made contiguous, as it runs. torch's meta ``native_batch_norm`` (and
    its backward) keeps the input's strides, the CPU kernels return a contiguous output
    (channels-last kept, the input's suggested memory format); a later op
    traced on the fake strides (``transpose`` then ``view``, as ``linear`` of a transposed
    batch-norm output does) would fail when run. Inside the call the op is traced as usual
    (``NotImplemented``: make_fx's own tracing)."""

    def __init__(self, op, input_at: int):
        self.op, self.input_at, self.inside = op, input_at, False

    def __call__(self, *args, **kwargs):
        if self.inside:
            return NotImplemented
        self.inside = True
        try:
            out = self.op(*args, **kwargs)
        finally:
            self.inside = False
        first, x = out[0], args[self.input_at]
        kept = {4: torch.channels_last, 5: torch.channels_last_3d}.get(x.dim())
        if first.is_contiguous() or kept is not None and x.is_contiguous(memory_format=kept):
            return out  # contiguous, or channels-last kept (the input's suggested format)
        return (first.contiguous(), *out[1:])


_AS_RUN = {op: _LayoutAsRun(op, at) for op, at in (
    (torch.ops.aten.native_batch_norm.default, 0),
    (torch.ops.aten.native_batch_norm_backward.default, 1))}


def _trace(joint: _Joint, flat: list, args: tuple, kwargs: dict) -> fx.GraphModule:
    """``joint`` traced on the fake tensors ``flat``; a failure is explained (``explain``)
    naming the module, the op and the input of the call (``args``, ``kwargs``) at fault."""
    fake_mode = next((t.fake_mode for t in flat if _compat.is_fake(t)), None)
    checks = (_compat.recording_value_checks(fake_mode, check_source)
              if fake_mode is not None and fake_mode.shape_env is not None
              else contextlib.nullcontext([]))
    with progress.phase("capturing the training step"):
        try:
            with _compat.preserve_node_meta(), checks as found, \
                    torch.autograd.set_detect_anomaly(False):  # its checks read values
                table = {**capture_decompositions(), **_AS_RUN}
                gm = _compat.make_fx(joint, tracing_mode="fake", decomposition_table=table)(*flat)
            assert_value_checks(gm, found, joint.stack)
            return _compat.graph_module(gm, gm.graph)
        except AutoshardError:
            raise
        except Exception as exc:  # noqa: BLE001 - every capture failure gets the same explanation
            raise explain(exc, joint.stack, input_names(args, kwargs),
                           {p.compute_dtype for p in joint.params}) from exc


def _refuse_outputs(model: torch.nn.Module, rec: dict) -> None:
    """Refuse a forward that reads what the graph cannot follow, or returns what a captured
    step cannot (a function, a class, a module)."""
    guards.refuse_unfollowable(rec["reads"], guards.user_class_name(model))
    for leaf in rec["out_consts"]:
        if leaf is not TENSOR and not isinstance(leaf, _PLAIN + (StateOut, NewState)):
            raise AutoshardError(
                f"{guards.user_class_name(model)}.forward returned a {type(leaf).__name__} "
                "among its outputs; a captured step returns tensors, plain Python values and "
                "objects holding them (a KV cache), not functions, classes or modules."
            )


def _captured(joint: _Joint, gm: fx.GraphModule, finputs: list, grad_mode: bool,
              names: dict) -> Captured:
    """The ``Captured`` of the traced ``gm``: which gradients it returns, its guards, taps
    and state, and its nodes tagged (``_tag``)."""
    rec, params = joint.rec, joint.params
    wrt_specs = [p for p in params if p.requires_grad]
    input_rg = [i for i, x in enumerate(finputs) if x.requires_grad]
    grad_mask = rec["grad_mask"] or [False] * (len(wrt_specs) + len(input_rg))
    grads_for = [p.fqn for p, m in zip(wrt_specs, grad_mask) if m]
    input_grads = [i for i, m in zip(input_rg, grad_mask[len(wrt_specs) :]) if m]
    has_backward = bool(rec["tangents"])

    cap = Captured(
        gm=gm,
        params=list(params),
        buffer_fqns=joint.bnames,
        in_spec=joint.in_spec,
        in_consts=joint.in_consts,
        out_spec=rec["out_spec"],
        out_consts=rec["out_consts"],
        diff_outputs=rec["diff"] if has_backward else [],
        input_grads=input_grads,
        mutated_buffers=[],
        has_backward=has_backward,
        grad_enabled=grad_mode,
    )
    cap.guards = guards.build(joint.model, rec["reads"], names, hooks.hook_dicts, joint.lifted)
    cap.taps, cap.n_taps = rec["taps"], len(rec["tapped"])
    # hooks the forward registered ran in the trace; later captures trace them too
    cap.lifted = list(joint.lifted)
    cap.traced_hooks = joint.traced_hooks | frozenset(rec["installed"])
    cap.state_in, cap.n_state = rec["state_in"], rec["n_state"]
    cap.writes, cap.n_written = rec["writes"], len(rec["written"])
    cap.backward_taps = rec["btaps"] if has_backward else []
    _tag(cap, rec, grads_for)
    if fold_alias_pairs(cap.gm.graph):  # autograd's t(t(w)) and detach(detach(x))
        cap.gm.recompile()
    return cap


@contextlib.contextmanager
def _lifting(lifted, values):
    """The lifted float attributes read as the graph's inputs ``values`` while tracing."""
    old = [mod.__dict__[name] for mod, name in lifted]
    for (mod, name), v in zip(lifted, values):
        mod.__dict__[name] = v
    try:
        yield
    finally:
        for (mod, name), v in zip(lifted, old):
            mod.__dict__[name] = v


def flat_inputs(leaves) -> list:
    """The graph's input tensors of a call's leaves: each tensor, and the tensors each object
    holding state holds (``autoshard.core.carried``), in order."""
    out = []
    for x in leaves:
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif carried.is_carried(x):
            out.extend(t.detach() for t in carried.tensors(x))
    return out


def _cast_floating(tree, dtype):
    if dtype is None:
        return tree
    return tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor)
                    and t.is_floating_point() else t, tree)


def _tag(cap: Captured, rec: dict, grads_for: list) -> None:
    gm, graph = cap.gm, cap.gm.graph
    phs = [n for n in graph.nodes if n.op == "placeholder"]
    n_p, n_b = len(cap.params), len(cap.buffer_fqns)
    for i, n in enumerate(phs):
        t = meta.tags(n)
        t[meta.REGION] = meta.FWD
        if i < n_p:
            t.update({meta.ROLE: meta.ROLE_PARAM, meta.FQN: cap.params[i].fqn})
        elif i < n_p + n_b:
            t.update({meta.ROLE: meta.ROLE_BUFFER, meta.FQN: cap.buffer_fqns[i - n_p]})
        else:
            t.update({meta.ROLE: meta.ROLE_INPUT, meta.INDEX: i - n_p - n_b})

    # tangents were traced as fresh tensors; they become placeholders after the inputs
    for k, node in enumerate(rec["tangents"]):
        with graph.inserting_after(phs[-1] if phs else next(iter(graph.nodes))):
            ph = graph.placeholder(f"tangent_{k}")
        ph.meta["val"] = node.meta["val"]
        meta.tags(ph).update({meta.ROLE: meta.ROLE_TANGENT, meta.INDEX: k, meta.REGION: meta.BWD})
        node.replace_all_uses_with(ph)
        graph.erase_node(node)
        phs.append(ph)

    out = meta.output_node(gm)
    touts, grads, bclones, hook_grads = out.args[0]
    roles = [{meta.ROLE: meta.OUT_FWD, meta.INDEX: i} for i in range(len(touts))]
    n_param_grads = len(grads_for)
    for k, g in enumerate(grads):
        if k < n_param_grads:
            roles.append({meta.ROLE: meta.OUT_GRAD, meta.FQN: grads_for[k]})
        else:
            index = cap.input_grads[k - n_param_grads]
            roles.append({meta.ROLE: meta.OUT_INPUT_GRAD, meta.INDEX: index})
    kept = []
    for fqn, clone in zip(cap.buffer_fqns, rec["clones"]):
        if _is_mutated(clone):
            kept.append(clone)
            roles.append({meta.ROLE: meta.OUT_BUFFER, meta.FQN: fqn})
            cap.mutated_buffers.append(fqn)
        else:
            clone.replace_all_uses_with(clone.args[0])
            graph.erase_node(clone)
    roles += [{meta.ROLE: meta.OUT_HOOK_GRAD, meta.INDEX: k} for k in range(len(hook_grads))]
    out.args = (list(touts) + list(grads) + kept + list(hook_grads),)
    meta.tags(out)[meta.OUTPUTS] = roles
    deps: dict = {}
    for n in graph.nodes:
        deps[n] = ({meta.tag(n, meta.INDEX)} if meta.is_tangent(n)
                   else set().union(*(deps[a] for a in n.all_input_nodes)))
    for v, r in zip(out.args[0], roles):
        if r[meta.ROLE] in (meta.OUT_GRAD, meta.OUT_INPUT_GRAD, meta.OUT_HOOK_GRAD):
            key = r.get(meta.FQN, r.get(meta.INDEX))
            cap.grad_tangents[(r[meta.ROLE], key)] = frozenset(deps[v])

    # regions, module paths, and backward -> forward links
    region = meta.FWD
    by_seq = {}
    for n in graph.nodes:
        if n.op in ("placeholder", "output"):
            continue
        t = meta.tags(n)
        t[meta.REGION] = region
        stack = n.meta.get("nn_module_stack")
        seq = n.meta.get("seq_nr")
        if region == meta.FWD:
            t[meta.MODULE] = next(reversed(stack)) if stack else ""
            if n.meta.get("ac_graph_id") is not None:
                t[meta.CHECKPOINT] = n.meta["ac_graph_id"]
            if seq is not None:  # the op that made autograd node seq; ops after it that
                by_seq.setdefault(seq, n)  # make none (no_grad, integer) repeat its number
        else:
            src = by_seq.get(seq)
            if src is not None:
                t[meta.FWD_NODE] = src.name
                t[meta.MODULE] = meta.tag(src, meta.MODULE)
        if n is rec["fwd_last"]:
            region = meta.BWD
    gm.graph.lint()
    gm.recompile()

"""``autoshard.check``: one training step eagerly and compiled, compared value by value.

Users run it on a model they are about to shard. It takes one step of the unsharded model
eagerly (on a deep copy) and one step of ``autoshard()`` of another deep copy, with the same
inputs and the same output gradients (tangents), and compares every trainable parameter's
gradient and every forward output. When something differs beyond tolerance it finds where:

1. the captured joint graph, as traced and before any pass, is run on the real values with
   ``torch.fx.Interpreter``; if its outputs already differ from eager, capture is to blame;
2. otherwise the compiled forward and backward graphs (what the passes made of it) are run the
   same way and compared with the captured graph node by node, in the order they run,
   matching nodes by name (a node the recompute pass copied into the backward is compared
   with the forward node it copies; communication nodes are skipped). The first node whose
   value differs is reported with its op and module path;
3. if every node agrees, the difference lies outside the graphs (the runtime).

With a process group of N > 1 ranks, every rank calls ``check`` with its own inputs; the
compiled gradients are compared with the eager gradients averaged over the ranks (what data
parallel training computes), and the node-level search runs on every rank on that rank's
inputs.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import operator
from typing import Callable, Optional

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten, tree_unflatten

from autoshard import meta

# (atol, rtol) per dtype: a value passes when max|Δ| <= atol + rtol * max|reference|
DEFAULT_TOLERANCES = {
    torch.float64: (1e-10, 1e-7),
    torch.float32: (1e-5, 1e-4),
    torch.bfloat16: (1e-3, 2e-2),
    torch.float16: (1e-4, 2e-3),
}
PROJECTION_SEED = 0

_aten = torch.ops.aten
# ops whose value is uninitialised memory: never compared
_UNINITIALISED = {
    _aten.empty.memory_format, _aten.empty_strided.default, _aten.new_empty.default,
    _aten.new_empty_strided.default, _aten.empty_like.default,
}


# --- the report -------------------------------------------------------------------------------


@dataclasses.dataclass
class ParamRow:
    """One trainable parameter: eager's gradient against the compiled step's."""

    fqn: str
    dtype: str
    shape: tuple
    max_grad: float  # max |grad| of eager's gradient (averaged over ranks)
    max_delta: float  # max |Δgrad|; inf when one side has no gradient
    tolerance: float  # atol + rtol * max_grad
    status: str  # "ok", "differs", "no grad in compiled", "no grad in eager", "no grad"

    @property
    def ok(self) -> bool:
        return self.status in ("ok", "no grad")


@dataclasses.dataclass
class OutputRow:
    """One tensor leaf of the forward's output."""

    path: str  # e.g. "[0]", "['logits']", ".logits"
    dtype: str
    shape: tuple
    max_abs: float
    max_delta: float
    tolerance: float
    ok: bool


@dataclasses.dataclass
class Difference:
    """Where values first differ.

    stage: "capture" (the traced joint graph already differs from eager), "graph" (a node of
        the compiled graphs differs from the traced graph's same node), "runtime" (every
        graph node agrees; the difference arises outside the graphs).
    node, graph, op, module: the node (its name in the compiled ``graph``, "fwd" or "bwd"; or
        the captured output for stage "capture"), its op and the module path that produced it.
    """

    stage: str
    description: str
    node: Optional[str] = None
    graph: Optional[str] = None
    op: Optional[str] = None
    module: Optional[str] = None
    max_delta: float = 0.0
    max_abs: float = 0.0
    recomputed_from: Optional[str] = None
    rank: int = 0

    def __str__(self) -> str:
        return self.description


@dataclasses.dataclass
class CheckReport:
    """The result of ``autoshard.check``; ``str(report)`` renders it as tables."""

    ok: bool
    params: list  # ParamRow per trainable parameter, in the model's order
    outputs: list  # OutputRow per tensor output leaf
    outputs_delta: float  # max |Δ| over the forward outputs
    worst: Optional[tuple]  # (fqn, max |Δgrad|) of the parameter furthest out of tolerance
    first_difference: Optional[Difference]
    tolerances: dict  # dtype name -> (atol, rtol)
    world_size: int = 1
    rank: int = 0
    loss: str = ""
    nodes_compared: int = 0
    notes: list = dataclasses.field(default_factory=list)

    def __bool__(self) -> bool:
        return self.ok

    def __str__(self) -> str:
        from tabulate import tabulate

        n_bad = sum(not r.ok for r in self.params)
        head = (f"autoshard check: {'OK' if self.ok else 'DIFFERS'} — one training step, "
                f"eager vs compiled, world size {self.world_size}")
        tol = "; ".join(f"{d}: atol {a:g}, rtol {r:g}" for d, (a, r) in self.tolerances.items())
        lines = [head, f"tolerance: max|Δ| <= atol + rtol * max|eager|  ({tol})",
                 f"loss: {self.loss}"]
        if self.world_size > 1:
            lines.append(f"gradients: eager averaged over {self.world_size} ranks "
                         f"(this is rank {self.rank})")
        lines.append("")
        out_rows = [(o.path, o.dtype, "x".join(map(str, o.shape)) or "()", _f(o.max_abs),
                     _f(o.max_delta), _f(o.tolerance), "ok" if o.ok else "DIFFERS")
                    for o in self.outputs]
        lines.append(tabulate(out_rows, headers=["output", "dtype", "shape", "max|out|",
                                                 "max|Δ|", "tol", ""]))
        lines.append("")
        rows = [(r.fqn, r.dtype, "x".join(map(str, r.shape)) or "()",
                 *((_f(r.max_grad), _f(r.max_delta), _f(r.tolerance)) if r.status != "no grad"
                   else ("-", "-", "-")),
                 r.status if r.ok else r.status.upper())
                for r in self.params]
        lines.append(tabulate(rows, headers=["parameter", "dtype", "shape", "max|grad|",
                                             "max|Δgrad|", "tol", ""]))
        lines.append("")
        lines.append(f"{len(self.params)} parameters, {n_bad} differ; "
                     f"outputs max|Δ| {_f(self.outputs_delta)}")
        if self.worst is not None:
            row = next(r for r in self.params if r.fqn == self.worst[0])
            lines.append(f"worst parameter: {self.worst[0]} (max|Δgrad| {_f(self.worst[1])}, "
                         f"{'within' if row.ok else 'beyond'} tolerance)")
        if self.first_difference is not None:
            lines.append(f"first difference: {self.first_difference}")
        elif not self.ok:
            lines.append("first difference: not localised")
        for note in self.notes:
            lines.append(f"note: {note}")
        return "\n".join(lines)


def _f(x: float) -> str:
    if x is None:
        return "-"
    if math.isinf(x):
        return "inf"
    return f"{x:.3g}"


# --- comparisons ------------------------------------------------------------------------------


def _tolerance(dtype: torch.dtype, atol, rtol) -> tuple:
    da, dr = DEFAULT_TOLERANCES.get(dtype, DEFAULT_TOLERANCES[torch.float32])
    return (da if atol is None else atol), (dr if rtol is None else rtol)


def _max_abs(t: torch.Tensor) -> float:
    if t.numel() == 0:
        return 0.0
    t = t.detach()
    if t.is_complex():
        t = t.abs()
    v = t.double().abs()
    v = torch.where(torch.isnan(v), torch.zeros_like(v), v)
    return float(v.max())


def _max_delta(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b|; NaN against NaN and inf against the same inf count as equal."""
    if a.shape != b.shape:
        return math.inf
    if a.numel() == 0:
        return 0.0
    a, b = a.detach(), b.detach()
    if a.is_complex() or b.is_complex():
        return float((a.to(torch.complex128) - b.to(torch.complex128)).abs().max())
    a64, b64 = a.double(), b.double()
    same = (a64 == b64) | (torch.isnan(a64) & torch.isnan(b64))
    d = (a64 - b64).abs()
    d = torch.where(same, torch.zeros_like(d), d)
    d = torch.where(torch.isnan(d), torch.full_like(d, math.inf), d)
    return float(d.max())


def _within(delta: float, ref: float, dtype: torch.dtype, atol, rtol) -> tuple:
    """(ok, tolerance); integer and bool values must match exactly."""
    if not (dtype.is_floating_point or dtype.is_complex):
        return delta == 0, 0.0
    a, r = _tolerance(dtype, atol, rtol)
    tol = a + r * ref
    return delta <= tol, tol


def _coarser(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    """Of two dtypes, the one whose tolerance applies: the less precise floating one (a value
    computed in bf16 and reduced in fp32 is as good as bf16)."""
    if not (a.is_floating_point and b.is_floating_point):
        return a
    return max(a, b, key=lambda d: torch.finfo(d).eps)


def _cast_floating(tree, dtype: torch.dtype):
    """``tree`` with its floating tensors cast to ``dtype`` (differentiably)."""
    from torch.utils._pytree import tree_map_only

    return tree_map_only(torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t,
                         tree)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


# --- the loss and the tangents ----------------------------------------------------------------


def projection_loss(outputs, seed: int = PROJECTION_SEED) -> torch.Tensor:
    """The default loss: a fixed random projection of every floating-point output leaf that
    requires grad, ``sum_k (out_k * w_k).sum()`` with ``w_k`` drawn from a generator seeded
    with ``seed``. Unlike a plain sum it gives every output element its own gradient (a sum's
    gradient through a softmax is zero, which would hide any error behind it)."""
    gen = torch.Generator().manual_seed(seed)
    total = None
    for leaf in tree_flatten(outputs)[0]:
        if not (isinstance(leaf, torch.Tensor) and leaf.is_floating_point()
                and leaf.requires_grad):
            continue
        w = torch.randn(tuple(leaf.shape), generator=gen, dtype=torch.float32)
        term = (leaf * w.to(device=leaf.device, dtype=leaf.dtype)).sum()
        total = term if total is None else total + term
    if total is None:
        raise ValueError("the model's outputs hold no floating-point tensor that requires "
                         "grad: there is no backward to check")
    return total


def _leaf_paths(outputs) -> list:
    """A readable path per pytree leaf of ``outputs``."""
    try:
        from torch.utils._pytree import keystr, tree_flatten_with_path

        return [keystr(p) or "out" for p, _ in tree_flatten_with_path(outputs)[0]]
    except Exception:  # noqa: BLE001 - a container without key paths: number the leaves
        return [f"[{i}]" for i in range(len(tree_flatten(outputs)[0]))]


def _tangents(outputs, loss_fn: Callable) -> dict:
    """{index among tensor output leaves: d loss / d leaf} for every leaf that requires
    grad, computed once so that eager and compiled get the very same tangents."""
    leaves, spec = tree_flatten(outputs)
    detached, wrt = [], {}
    k = 0
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            d = leaf.detach()
            if leaf.requires_grad:
                d = d.clone().requires_grad_(True)
                wrt[k] = d
            detached.append(d)
            k += 1
        else:
            detached.append(leaf)
    if not wrt:
        raise ValueError("no output of the model requires grad: there is no backward to "
                         "check (is every parameter frozen, or the forward under no_grad?)")
    with torch.enable_grad():
        loss = loss_fn(tree_unflatten(detached, spec))
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError("loss_fn(outputs) must return a scalar tensor")
        if not loss.requires_grad:
            raise ValueError("loss_fn(outputs) does not depend on any output that requires "
                             "grad")
        grads = torch.autograd.grad(loss.reshape(()), list(wrt.values()), allow_unused=True)
    return {i: (g if g is not None else torch.zeros_like(wrt[i])).detach()
            for i, g in zip(wrt, grads)}


def _backward(outputs, tangents: dict) -> None:
    touts = [x for x in tree_flatten(outputs)[0] if isinstance(x, torch.Tensor)]
    pairs = [(touts[i], g) for i, g in tangents.items() if touts[i].requires_grad]
    if pairs:
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])


# --- inputs -----------------------------------------------------------------------------------


def _fresh(example_inputs):
    """A copy of the inputs whose tensors are new leaves (the user's stay untouched)."""
    def one(x):
        if isinstance(x, torch.Tensor):
            y = x.detach().clone()
            return y.requires_grad_(x.requires_grad) if y.is_floating_point() else y
        return x

    leaves, spec = tree_flatten(example_inputs)
    return tree_unflatten([one(x) for x in leaves], spec)


def _split(example_inputs):
    from autoshard.api import _split_inputs

    return _split_inputs(example_inputs)


# --- recording interpreters -------------------------------------------------------------------


class _Recorder(fx.Interpreter):
    """Runs a graph on real tensors and hands each node's value to ``on_value`` as soon as
    it is computed (later in-place writes and frees must not change what is compared).
    Each node runs in the grad mode ``grad_mode(node)``: the one the executor runs it in."""

    def __init__(self, gm: fx.GraphModule, on_value: Callable, grad_mode: Callable):
        super().__init__(gm, garbage_collect_values=True)
        self.on_value = on_value
        self.grad_mode = grad_mode

    def run_node(self, n: fx.Node):
        with torch.set_grad_enabled(self.grad_mode(n)):
            out = super().run_node(n)
        if n.op not in ("placeholder", "output"):
            self.on_value(n, out)
        return out


def _run(gm: fx.GraphModule, args: list, on_value: Callable, grad_mode: Callable):
    """``grad_mode(node)``: the grad mode to run ``node`` in, that of its trace (kernels may
    read it: see ``Captured.grad_enabled``); the arguments require no grad, so none is
    recorded."""
    # the graphs hold autocast's casts already (capture traced them): run them as written
    device_type = next((a.device.type for a in args if isinstance(a, torch.Tensor)), "cpu")
    with torch.autocast(device_type, enabled=False):
        return _Recorder(gm, on_value, grad_mode).run(*args, enable_io_processing=False)


def _op_name(n: fx.Node) -> str:
    t = n.target
    if isinstance(t, torch._ops.OpOverload):
        return str(t)
    if t is operator.getitem:
        return "getitem"
    return getattr(t, "__name__", str(t))


def _comparable(n: fx.Node, value) -> bool:
    return (n.op == "call_function" and isinstance(value, torch.Tensor)
            and n.target not in _UNINITIALISED and not meta.is_comm(n)
            and not _opaque(n, value))


def _opaque(n: fx.Node, value: torch.Tensor) -> bool:
    """Whether ``value`` has another shape than the one traced for ``n``: a kernel's private
    buffer that the trace cannot describe (the CPU LSTM kernel's workspace is empty when
    traced and sized by oneDNN when run), whose bytes, padding included, mean nothing
    outside that kernel. Never compared."""
    traced = n.meta.get("val")
    return isinstance(traced, torch.Tensor) and tuple(traced.shape) != tuple(value.shape)


@dataclasses.dataclass
class _Recorded:
    value: torch.Tensor
    op: str
    module: str


def _record_pristine(gm, args, grad_enabled: bool) -> tuple:
    values = {}

    def keep(n, v):
        if _comparable(n, v):
            values[n.name] = _Recorded(v.detach().clone(), _op_name(n),
                                       meta.tag(n, meta.MODULE) or "")

    # the joint graph's forward was traced in the step's grad mode, its backward (inside
    # autograd.grad) with grad off
    out = _run(gm, args, keep, lambda n: grad_enabled and meta.is_forward(n))
    return values, list(out)


# --- the check --------------------------------------------------------------------------------


def check(model: torch.nn.Module, example_inputs, *, loss_fn: Optional[Callable] = None,
          mesh=None, config=None, atol: Optional[float] = None, rtol: Optional[float] = None,
          localise: Optional[bool] = None, seed: int = 0) -> CheckReport:
    """Run one training step of ``model`` eagerly and compiled by autoshard, and compare.

    model: the unsharded ``nn.Module`` (real, not meta, parameters); it is left untouched:
        both steps run on deep copies.
    example_inputs: a tuple of positional inputs, a dict of keyword inputs, or one tensor.
    loss_fn: ``loss_fn(outputs) -> scalar``; by default a fixed random projection of every
        floating-point output that requires grad (``projection_loss``). Its gradients with
        respect to the outputs (computed once, from eager's outputs) are the tangents both
        steps' backwards use.
    mesh, config: as for ``autoshard()``.
    atol, rtol: a value passes when ``max|Δ| <= atol + rtol * max|eager value|``; by default
        per dtype (``DEFAULT_TOLERANCES``: fp32 1e-5 and 1e-4, bf16 1e-3 and 2e-2, fp16 1e-4
        and 2e-3, fp64 1e-10 and 1e-7).
    localise: search for the first differing graph node: None (default) when something
        differs, True always, False never.
    seed: the random generator state each step starts from (random ops in the model draw the
        same numbers in both).

    With a process group of N > 1 ranks, all ranks call ``check`` together, each with its own
    inputs; compiled gradients are compared with eager gradients averaged over the ranks.
    Returns a ``CheckReport``.
    """
    from torch.distributed.tensor import DTensor

    from autoshard.api import ShardedModule
    from autoshard.runtime import dist as _dist

    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"check() takes an nn.Module, got {type(model).__name__}")
    if isinstance(model, ShardedModule):
        raise ValueError(
            f"check() takes the unsharded model, but this {type(model).__name__} is already "
            "sharded by autoshard; pass the model as it was before autoshard() (for example "
            "build it again and load sharded.full_state_dict() into it)")
    if example_inputs is None:
        raise ValueError("check() needs example_inputs: the inputs of one training step, as a "
                         "tuple of positional inputs or a dict of keyword inputs")
    for fqn, p in model.named_parameters():
        if isinstance(p, DTensor):
            raise ValueError(f"parameter {fqn} is a DTensor: the model is already sharded; "
                             "pass the unsharded model to check()")
        if p.device.type == "meta":
            raise ValueError(f"parameter {fqn} is on the meta device: check() runs a real "
                             "step and needs real parameter values")
    mesh = mesh if mesh is not None else _dist.default_mesh()
    with torch.enable_grad():  # a training step, whatever the caller's grad mode
        return _check(model, example_inputs, loss_fn, mesh, config, atol, rtol, localise, seed)


def _check(model, example_inputs, loss_fn, mesh, config, atol, rtol, localise, seed):
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from autoshard.api import autoshard
    from autoshard.runtime import dist as _dist

    loss_desc = ("loss_fn(outputs)" if loss_fn is not None
                 else f"random projection of the outputs (seed {PROJECTION_SEED})")
    loss_fn = loss_fn if loss_fn is not None else projection_loss

    device = _dist.mesh_device(mesh)
    world, rank = mesh.size(), mesh.get_local_rank()
    group = mesh.get_group()
    notes = []
    if world > 1:
        _same_model_on_all_ranks(model, group)

    # --- eager -----------------------------------------------------------------------------
    mp = config.mp_policy if config is not None else None
    eager = copy.deepcopy(model).to(device)
    for p in eager.parameters():
        p.grad = None  # gradients the user's model holds are not this step's
        if mp is not None and mp.param_dtype is not None and p.is_floating_point():
            p.data = p.data.to(mp.param_dtype)  # FSDP2's mixed precision, unsharded
    init_params = {f: p.detach().clone() for f, p in eager.named_parameters()}
    init_buffers = {f: b.detach().clone() for f, b in eager.named_buffers()}
    e_in = _fresh(example_inputs)
    if mp is not None and mp.cast_forward_inputs and mp.param_dtype is not None:
        e_in = _cast_floating(e_in, mp.param_dtype)
    args, kwargs = _split(e_in)
    with torch.random.fork_rng(devices=_rng_devices(device)):
        torch.manual_seed(seed)
        e_out = eager(*args, **kwargs)
    if mp is not None and mp.output_dtype is not None:
        e_out = _cast_floating(e_out, mp.output_dtype)
    tangents = _tangents(e_out, loss_fn)
    _backward(e_out, tangents)
    trainable = [(f, p) for f, p in eager.named_parameters() if p.requires_grad]
    # gradients are reduced in the reduce dtype, as the compiled step reduces them
    reduce = mp.reduce_dtype or mp.param_dtype if mp is not None else None
    local_grads = {f: (p.grad.detach().to(reduce or p.grad.dtype, copy=True)
                       if p.grad is not None else None)
                   for f, p in trainable}
    eager_grads = _average(local_grads, dict(trainable), group, world)

    # --- compiled ---------------------------------------------------------------------------
    twin = copy.deepcopy(model)
    for p in twin.parameters():
        p.grad = None
    sharded = autoshard(twin, mesh=mesh, config=config, example_inputs=_fresh(example_inputs))
    c_in = _fresh(example_inputs)
    cargs, ckwargs = _split(c_in)
    with torch.random.fork_rng(devices=_rng_devices(device)):
        torch.manual_seed(seed)
        c_out = sharded(*cargs, **ckwargs)
    e_touts = [x for x in tree_flatten(e_out)[0] if isinstance(x, torch.Tensor)]
    c_touts = [x for x in tree_flatten(c_out)[0] if isinstance(x, torch.Tensor)]
    if len(e_touts) != len(c_touts):
        raise AssertionError(f"the compiled step returned {len(c_touts)} tensors, eager "
                             f"{len(e_touts)}")
    _backward(c_out, tangents)
    compiled_grads = {}
    cparams = dict(sharded.named_parameters())
    for f, _ in trainable:
        g = cparams[f].grad
        if g is not None and isinstance(g, DTensor):
            g = g.full_tensor()
        compiled_grads[f] = None if g is None else g.detach()

    # --- compare ------------------------------------------------------------------------------
    tolerances = {}
    outputs = []
    paths = [p for p, leaf in zip(_leaf_paths(e_out), tree_flatten(e_out)[0])
             if isinstance(leaf, torch.Tensor)]
    for path, e, c in zip(paths, e_touts, c_touts):
        ref = _max_abs(e)
        delta = _max_delta(e, c)
        ok, tol = _within(delta, ref, e.dtype, atol, rtol)
        if e.dtype.is_floating_point:
            tolerances[_dtype_name(e.dtype)] = _tolerance(e.dtype, atol, rtol)
        outputs.append(OutputRow(path, _dtype_name(e.dtype), tuple(e.shape), ref, delta, tol,
                                 ok))
    # buffers the step updates (BatchNorm statistics)
    cbufs = dict(sharded.named_buffers())
    for f, b in eager.named_buffers():
        c, b0 = cbufs.get(f), init_buffers[f]
        if c is None or not b.is_floating_point():
            continue
        if torch.equal(b, b0) and torch.equal(c, b0):
            continue
        ref, delta = _max_abs(b), _max_delta(b, c)
        ok, tol = _within(delta, ref, b.dtype, atol, rtol)
        outputs.append(OutputRow(f"buffer {f}", _dtype_name(b.dtype), tuple(b.shape), ref,
                                 delta, tol, ok))
    rows = []
    for f, p in trainable:
        e, c = eager_grads[f], compiled_grads[f]
        tolerances[_dtype_name(p.dtype)] = _tolerance(p.dtype, atol, rtol)
        if e is None and c is None:
            rows.append(ParamRow(f, _dtype_name(p.dtype), tuple(p.shape), 0.0, 0.0, 0.0,
                                 "no grad"))
            continue
        if e is None or c is None:
            ref = _max_abs(c if e is None else e)
            rows.append(ParamRow(f, _dtype_name(p.dtype), tuple(p.shape), ref, math.inf, 0.0,
                                 "no grad in eager" if e is None else "no grad in compiled"))
            continue
        ref = _max_abs(e)
        delta = _max_delta(e, c)
        ok, tol = _within(delta, ref, p.dtype, atol, rtol)
        rows.append(ParamRow(f, _dtype_name(p.dtype), tuple(p.shape), ref, delta, tol,
                             "ok" if ok else "differs"))
    if world > 1:
        _agree_outputs(outputs, group)
    ok = all(r.ok for r in rows) and all(o.ok for o in outputs)
    if world > 1:
        flag = torch.tensor([0.0 if ok else 1.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        ok = flag.item() == 0.0
    worst = _worst(rows)

    # --- localise -------------------------------------------------------------------------
    first, compared = None, 0
    if localise or (localise is None and not ok):
        first, compared, more = _localise(
            eager, sharded, init_params, init_buffers, example_inputs, tangents, e_out,
            local_grads, ok, group, world, rank, device, seed, atol, rtol)
        notes.extend(more)
    return CheckReport(
        ok=ok, params=rows, outputs=outputs,
        outputs_delta=max((o.max_delta for o in outputs), default=0.0), worst=worst,
        first_difference=first, tolerances=tolerances, world_size=world, rank=rank,
        loss=loss_desc, nodes_compared=compared, notes=notes,
    )


def _rng_devices(device: torch.device) -> list:
    return [device] if device.type == "cuda" else []


def _worst(rows: list) -> Optional[tuple]:
    def badness(r: ParamRow) -> float:
        if r.status == "no grad":
            return -1.0
        if math.isinf(r.max_delta):
            return math.inf
        return r.max_delta / r.tolerance if r.tolerance > 0 else (math.inf if r.max_delta
                                                                     else 0.0)

    scored = [r for r in rows if r.status != "no grad"]
    if not scored:
        return None
    r = max(scored, key=badness)
    return (r.fqn, r.max_delta)


def _group_device(group) -> torch.device:
    """Where ``group``'s collectives take their tensors (NCCL: this rank's GPU)."""
    import torch.distributed as dist

    if "nccl" in str(dist.get_backend(group)):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _average(grads: dict, params: dict, group, world: int) -> dict:
    """Eager's gradients averaged over the ranks (what data parallel training applies)."""
    if world == 1:
        return dict(grads)
    import torch.distributed as dist

    present = torch.tensor([0.0 if g is None else 1.0 for g in grads.values()],
                           device=_group_device(group))
    dist.all_reduce(present, group=group)
    out = {}
    for (f, g), n in zip(grads.items(), present.tolist()):
        if n == 0:
            out[f] = None
            continue
        # a rank where the parameter got no gradient contributes zeros, as in DDP
        t = g.clone() if g is not None else torch.zeros_like(params[f])
        t = t.to(_group_device(group))
        dist.all_reduce(t, group=group)
        out[f] = (t / world).to(params[f].device)
    return out


def _agree_outputs(outputs: list, group) -> None:
    """Every rank reports the worst output delta over the ranks."""
    import torch.distributed as dist

    if not outputs:
        return
    vals = torch.tensor([[o.max_delta - o.tolerance, o.max_delta] for o in outputs],
                        dtype=torch.float64, device=_group_device(group))
    dist.all_reduce(vals, op=dist.ReduceOp.MAX, group=group)
    for o, (excess, delta) in zip(outputs, vals.tolist()):
        o.max_delta = max(o.max_delta, delta)
        o.ok = o.ok and excess <= 0


def _same_model_on_all_ranks(model, group) -> None:
    import torch.distributed as dist

    sums = torch.tensor([float(p.detach().double().sum()) for p in model.parameters()]
                        or [0.0], dtype=torch.float64, device=_group_device(group))
    hi, lo = sums.clone(), sums.clone()
    dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
    if not torch.equal(hi, lo):
        raise ValueError("the ranks hold different parameter values: build the model the same "
                         "way on every rank (seed before building it) before check()")


# --- localisation -----------------------------------------------------------------------------


def _pristine_graph(eager_model, sharded, args, kwargs, device):
    """The joint graph as captured, before any pass: the Program's own copy where it keeps
    one, else captured again from the eager model (capture is deterministic, so node names
    agree with the compiled graphs')."""
    prog = sharded._autoshard.last
    kept = getattr(prog.captured, "pristine", None)
    if kept is not None:
        return kept, prog.captured
    from autoshard.capture import capture, param_specs

    specs = param_specs(eager_model, sharded._autoshard.config.mp_policy)
    with torch.enable_grad():
        cap = capture(eager_model, type(eager_model).forward, specs,
                      dict(eager_model.named_buffers()), args, kwargs, device=device,
                      with_grad=True)
    return cap.gm, cap


def _localise(eager_model, sharded, init_params, init_buffers, example_inputs, tangents,
              e_out, local_grads, step_ok, group, world, rank, device, seed, atol, rtol):
    """(first Difference or None, nodes compared, notes). Runs collectives in the compiled
    graphs: every rank calls it together."""
    notes = []
    args, kwargs = _split(_fresh(example_inputs))
    gm, cap = _pristine_graph(eager_model, sharded, args, kwargs, device)
    prog = sharded._autoshard.last
    inputs = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]
    graph_tangents = [tangents[i].contiguous() for i in cap.diff_outputs]

    # 1. the captured graph on the real values, against eager
    pargs = ([init_params[p.fqn].clone() for p in cap.params]
             + [init_buffers[f].clone() for f in cap.buffer_fqns]
             + [x.detach().clone() for x in inputs] + graph_tangents)
    with torch.random.fork_rng(devices=_rng_devices(device)):
        torch.manual_seed(seed)
        recorded, pouts = _record_pristine(gm, pargs, cap.grad_enabled)
    roles = meta.output_roles(gm)
    out_nodes = list(meta.output_node(gm).args[0])
    e_touts = [x for x in tree_flatten(e_out)[0] if isinstance(x, torch.Tensor)]
    pristine_grads = {}
    capture_diff = None
    for node, role, val in zip(out_nodes, roles, pouts):
        kind = role[meta.ROLE]
        if kind == meta.OUT_FWD:
            ref, what = e_touts[role[meta.INDEX]], f"forward output {role[meta.INDEX]}"
        elif kind == meta.OUT_GRAD:
            pristine_grads[role[meta.FQN]] = val
            ref, what = local_grads.get(role[meta.FQN]), f"gradient of {role[meta.FQN]}"
        else:
            continue
        if ref is None or not isinstance(val, torch.Tensor):
            continue
        delta, mag = _max_delta(ref, val), _max_abs(ref)
        ok, _ = _within(delta, mag, _coarser(ref.dtype, val.dtype), atol, rtol)
        if not ok and capture_diff is None:
            capture_diff = Difference(
                stage="capture", node=node.name, graph="joint", op=_op_name(node),
                module=meta.tag(node, meta.MODULE) or "", max_delta=delta, max_abs=mag,
                rank=rank,
                description=(
                    f"the captured joint graph (as traced, before any pass) already differs "
                    f"from eager at its {what} (node {node.name}, {_op_name(node)}; "
                    f"max|Δ| {_f(delta)}, max|eager| {_f(mag)}"
                    f"{_on_rank(rank, world)}): capture, not a pass, computes different "
                    "values than eager"))

    # 2. the compiled graphs on the same values, node by node against the captured graph
    first = None
    compared = 0
    unmatched = []

    def compare(where):
        def on_value(n, v):
            nonlocal first, compared
            if not _comparable(n, v):
                return
            origin = meta.tag(n, meta.RECOMPUTED)
            name = origin if isinstance(origin, str) else n.name
            rec = recorded.get(name)
            if rec is None:
                unmatched.append(n.name)
                return
            compared += 1
            if first is not None:
                return
            delta, mag = _max_delta(rec.value, v), _max_abs(rec.value)
            ok, _ = _within(delta, mag, rec.value.dtype, atol, rtol)
            if ok:
                return
            first = _node_difference(n, where, rec, v, delta, mag, origin, rank, world)
        return on_value

    n_p = len(prog.fqns)
    locals_ = [mod._parameters[name]._local_tensor for mod, name in sharded._autoshard.param_refs]
    fargs = ([prog.pad(i, t.detach().clone()) for i, t in enumerate(locals_[:n_p])]
             + [init_buffers[f].clone() for f in prog.captured.buffer_fqns]
             + [x.detach().clone() for x in inputs])
    with torch.random.fork_rng(devices=_rng_devices(device)):
        torch.manual_seed(seed)
        # in the grad modes the executor runs them in
        fwd_mode, bwd_mode = prog.captured.grad_enabled, prog.bwd_grad_enabled
        fouts = list(_run(prog.split.fwd, fargs, compare("fwd"), lambda n: fwd_mode))
        bouts = []
        if prog.split.bwd is not None:
            saved = fouts[prog.n_user + len(prog.mutated):]
            bouts = list(_run(prog.split.bwd, saved + graph_tangents, compare("bwd"),
                              lambda n: bwd_mode))

    # 3. the graphs' gradient shards against the captured graph's gradients
    output_diff = None
    if world > 1 or (first is None and capture_diff is None):  # collective: every rank runs it
        output_diff = _compare_grad_outputs(prog, bouts, pristine_grads, group, world, rank,
                                            atol, rtol)
    if first is not None and capture_diff is not None:
        notes.append(f"also, the compiled graphs differ from the captured one: {first}")
    result = capture_diff or first or output_diff
    if result is None and not step_ok:
        result = Difference(
            stage="runtime", rank=rank,
            description=("every node of the compiled graphs computes the captured graph's "
                         "value, and the captured graph agrees with eager: the difference "
                         "arises outside the graphs, in the runtime (padding, gradient "
                         "accumulation into the DTensor .grad, or the collectives)"))
    if unmatched:
        notes.append(f"{len(unmatched)} compiled node(s) have no counterpart in the captured "
                     f"graph and were not compared (first: {', '.join(unmatched[:3])})")
    return result, compared, notes


def _on_rank(rank: int, world: int) -> str:
    return f", on rank {rank}" if world > 1 else ""


def _node_difference(n, where, rec, v, delta, mag, origin, rank, world) -> Difference:
    op = _op_name(n)
    module = meta.tag(n, meta.MODULE) or ""
    parts = [f"node {n.name} ({op}) in the compiled {'forward' if where == 'fwd' else 'backward'}"
             f" graph, module {module or '<root>'}: max|Δ| {_f(delta)} against the captured "
             f"graph's value (max {_f(mag)}){_on_rank(rank, world)}"]
    if isinstance(origin, str):
        parts.append(f"it recomputes forward node {origin} in the backward, and its inputs "
                     "there no longer hold what they held in the forward (written in place "
                     "in between?)")
    elif rec.op != op:
        parts.append(f"its op differs from the captured graph's ({rec.op})")
    if isinstance(v, torch.Tensor) and tuple(v.shape) != tuple(rec.value.shape):
        parts.append(f"shape {tuple(v.shape)} where the captured graph has "
                     f"{tuple(rec.value.shape)}")
    return Difference(stage="graph", node=n.name, graph=where, op=op, module=module,
                      max_delta=delta, max_abs=mag,
                      recomputed_from=origin if isinstance(origin, str) else None, rank=rank,
                      description="; ".join(parts))


def _compare_grad_outputs(prog, bouts, pristine_grads, group, world, rank, atol, rtol):
    """The compiled backward's gradient shards against the captured graph's full gradients
    (averaged over the ranks), cut to this rank's rows."""
    import torch.distributed as dist

    full = {}
    for f, spec in zip(prog.fqns, prog.captured.params):
        if not spec.requires_grad:
            continue
        g = pristine_grads.get(f)
        if g is None:
            if world == 1:
                continue
            g = torch.zeros(spec.shape, dtype=spec.dtype)  # every rank reduces every gradient
        g = g.clone()
        if world > 1:
            home = g.device
            g = g.to(_group_device(group))
            dist.all_reduce(g, group=group)
            g = (g / world).to(home)
        full[f] = g
    for (kind, i), got in zip(prog.grad_slots, bouts):
        if kind != "param":
            continue
        f, lay = prog.fqns[i], prog.layouts[i]
        ref = full.get(f)
        if ref is None:
            continue
        if lay.sharded:
            a, b = lay.local_range(rank)
            ref = ref[a:b]
            got = got[: b - a]
        delta, mag = _max_delta(ref, got), _max_abs(ref)
        ok, _ = _within(delta, mag, ref.dtype, atol, rtol)
        if not ok:
            return Difference(
                stage="runtime", node=f, graph="bwd", max_delta=delta, max_abs=mag,
                rank=rank,
                description=(f"every compared node agrees with the captured graph, but the "
                             f"backward's gradient shard of {f} differs from the captured "
                             f"gradient (max|Δ| {_f(delta)}{_on_rank(rank, world)}): look at "
                             "the nodes the passes added (reduce-scatter packing, new nodes "
                             "with no counterpart in the captured graph)"))
    return None


# --- the command line -------------------------------------------------------------------------


def default_inputs(model: torch.nn.Module, factory, batch: int, seq: int):
    """``factory.example_inputs(batch, seq)`` where the factory has it, else integer tokens
    (batch, seq) below the smallest embedding table's size (zeros with no embedding)."""
    make = getattr(factory, "example_inputs", None)
    if make is not None:
        return make(batch, seq)
    sizes = [m.num_embeddings for m in model.modules() if isinstance(m, torch.nn.Embedding)]
    if sizes:
        return (torch.randint(0, min(sizes), (batch, seq)),)
    return (torch.zeros(batch, seq, dtype=torch.long),)


def _check_factory(spec: str, opts: dict, rank: int) -> CheckReport:
    from autoshard.factory import load_factory
    from autoshard.config import Config

    factory = load_factory(spec)
    torch.manual_seed(0)  # the same model on every rank
    model = factory()
    torch.manual_seed(1 + rank)  # each rank its own batch
    inputs = default_inputs(model, factory, opts["batch"], opts["seq"])
    config = Config(policy=opts["policy"]) if opts.get("policy") else None
    return check(model, inputs, config=config, atol=opts.get("atol"), rtol=opts.get("rtol"))


def _cli_rank(rank: int, world: int, spec: str, opts: dict, tmp: str) -> None:
    import os

    report = _check_factory(spec, opts, rank)
    if rank == 0:
        with open(os.path.join(tmp, "report.txt"), "w") as f:
            f.write(("ok\n" if report.ok else "differs\n") + str(report))


def run_factory(spec: str, *, batch: int, seq: int, world_size: int = 1, policy=None,
                atol=None, rtol=None) -> tuple:
    """``check`` a model built by the factory ``MODULE:FACTORY`` on ``world_size`` gloo
    ranks (spawned processes when more than one). Returns (report text, ok)."""
    opts = {"batch": batch, "seq": seq, "policy": policy, "atol": atol, "rtol": rtol}
    if world_size == 1:
        report = _check_factory(spec, opts, 0)
        return str(report), report.ok
    import os
    import tempfile

    from autoshard.runtime.dist import spawn_ranks

    with tempfile.TemporaryDirectory() as tmp:
        spawn_ranks(world_size, _cli_rank, spec, opts, tmp)
        with open(os.path.join(tmp, "report.txt")) as f:
            status, _, text = f.read().partition("\n")
    return text, status == "ok"

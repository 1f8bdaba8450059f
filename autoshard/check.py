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

import contextlib
import copy
import dataclasses
import functools
import math
import operator
from typing import Any, Callable, Optional

import torch
import torch.fx as fx

from autoshard import _compat, meta, progress
from autoshard._compat import tree_flatten, tree_unflatten

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
    return _compat.tree_map_only(
        torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, tree)


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
        return [_compat.keystr(p) or "out"
                for p, _ in _compat.tree_flatten_with_path(outputs)[0]]
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


# --- values recorded from the graphs ---------------------------------------------------------


def _op_name(n: fx.Node) -> str:
    t = n.target
    if isinstance(t, _compat.OpOverload):
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


class _Keep:
    """``on_node`` for the captured graph's run: each comparable node's value, by name."""

    def __init__(self):
        self.values = {}

    def __call__(self, graph: str, n: fx.Node, v) -> None:
        if _comparable(n, v):
            self.values[n.name] = _Recorded(v.detach().clone(), _op_name(n),
                                            meta.tag(n, meta.MODULE) or "")


class _Search:
    """``on_node`` for the compiled graphs' run: each node against the captured graph's node
    of the same name (a node the recompute pass copied, against the forward node it copies;
    communication nodes are skipped); keeps the first that differs beyond tolerance."""

    def __init__(self, recorded: dict, rk: "_Ranks"):
        self.recorded, self.rk = recorded, rk
        self.first: Optional[Difference] = None
        self.compared = 0
        self.unmatched: list = []

    def __call__(self, graph: str, n: fx.Node, v) -> None:
        if not _comparable(n, v):
            return
        origin = meta.tag(n, meta.RECOMPUTED)
        rec = self.recorded.get(origin if isinstance(origin, str) else n.name)
        if rec is None:
            self.unmatched.append(n.name)
            return
        self.compared += 1
        if self.first is not None:
            return
        delta, mag = _max_delta(rec.value, v), _max_abs(rec.value)
        ok, _ = self.rk.within(delta, mag, rec.value.dtype)
        if not ok:
            self.first = _node_difference(n, graph, rec, v, delta, mag, origin, self.rk.rank,
                                          self.rk.world)


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


@dataclasses.dataclass
class _Ranks:
    """Where the check runs (its process group, this rank, the device), the random state
    each step starts from, and the tolerances values are judged by."""

    group: Any
    world: int
    rank: int
    device: torch.device
    seed: int
    atol: Optional[float]
    rtol: Optional[float]

    def within(self, delta: float, ref: float, dtype: torch.dtype) -> tuple:
        return _within(delta, ref, dtype, self.atol, self.rtol)

    @contextlib.contextmanager
    def seeded(self):
        """The generators as ``seed`` leaves them, and as they were afterwards."""
        with torch.random.fork_rng(devices=_rng_devices(self.device)):
            torch.manual_seed(self.seed)
            yield


@dataclasses.dataclass
class _Eager:
    """Eager's step: its copy of the model, the values it started from, what it computed."""

    model: torch.nn.Module
    init_params: dict  # FQN -> value before the step (in param_dtype under mixed precision)
    init_buffers: dict  # FQN -> value before the step
    out: Any  # the forward's output
    tangents: dict  # index among tensor output leaves -> d loss / d output
    trainable: list  # (FQN, parameter) of each parameter that requires grad
    local_grads: dict  # FQN -> this rank's gradient (in the reduce dtype), or None
    grads: dict  # FQN -> the gradient averaged over the ranks, or None


def _check(model, example_inputs, loss_fn, mesh, config, atol, rtol, localise, seed):
    import torch.distributed as dist

    from autoshard.runtime import dist as _dist

    loss_desc = ("loss_fn(outputs)" if loss_fn is not None
                 else f"random projection of the outputs (seed {PROJECTION_SEED})")
    rk = _Ranks(mesh.get_group(), mesh.size(), mesh.get_local_rank(), _dist.mesh_device(mesh),
                seed, atol, rtol)
    if rk.world > 1:
        _same_model_on_all_ranks(model, rk.group)
    loss_fn = loss_fn if loss_fn is not None else projection_loss
    with progress.phase("checking against eager", total=3, unit="steps") as p:
        eager = _eager_step(model, example_inputs, loss_fn, config, rk)
        p.step(note="the compiled step")
        sharded, c_out, compiled_grads = _compiled_step(model, example_inputs, mesh, config,
                                                        eager, rk)
        p.step(note="comparing")
        tolerances: dict = {}
        outputs = _compare_outputs(eager, sharded, c_out, rk, tolerances)
        rows = _compare_grads(eager, compiled_grads, rk, tolerances)
        if rk.world > 1:
            _agree_outputs(outputs, rk.group)
        ok = all(r.ok for r in rows) and all(o.ok for o in outputs)
        if rk.world > 1:
            flag = torch.tensor([0.0 if ok else 1.0], device=rk.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=rk.group)
            ok = flag.item() == 0.0
        p.step()
    first, compared, notes = None, 0, []
    if localise or (localise is None and not ok):
        first, compared, notes = _localise(sharded, eager, example_inputs, ok, rk)
    return CheckReport(
        ok=ok, params=rows, outputs=outputs,
        outputs_delta=max((o.max_delta for o in outputs), default=0.0), worst=_worst(rows),
        first_difference=first, tolerances=tolerances, world_size=rk.world, rank=rk.rank,
        loss=loss_desc, nodes_compared=compared, notes=notes,
    )


def _eager_step(model, example_inputs, loss_fn, config, rk: _Ranks) -> _Eager:
    """One step of a deep copy of ``model``, eagerly, as FSDP2 would compute it under
    ``config``'s mixed precision: parameters in param_dtype, outputs cast to output_dtype,
    gradients taken in the reduce dtype and averaged over the ranks."""
    mp = config.mp_policy if config is not None else None
    eager = copy.deepcopy(model).to(rk.device)
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
    with rk.seeded():
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
    grads = _average(local_grads, dict(trainable), rk.group, rk.world)
    return _Eager(eager, init_params, init_buffers, e_out, tangents, trainable, local_grads,
                  grads)


def _compiled_step(model, example_inputs, mesh, config, eager: _Eager, rk: _Ranks) -> tuple:
    """One step of ``autoshard()`` of another deep copy, with eager's tangents. Returns
    (the sharded module, its output, FQN -> full gradient or None)."""
    from torch.distributed.tensor import DTensor

    from autoshard.api import autoshard

    twin = copy.deepcopy(model)
    for p in twin.parameters():
        p.grad = None
    sharded = autoshard(twin, mesh=mesh, config=config, example_inputs=_fresh(example_inputs))
    cargs, ckwargs = _split(_fresh(example_inputs))
    with rk.seeded():
        c_out = sharded(*cargs, **ckwargs)
    n_eager, n_compiled = len(_tensor_leaves(eager.out)), len(_tensor_leaves(c_out))
    if n_eager != n_compiled:
        raise AssertionError(f"the compiled step returned {n_compiled} tensors, eager "
                             f"{n_eager}")
    _backward(c_out, eager.tangents)
    grads = {}
    cparams = dict(sharded.named_parameters())
    for f, _ in eager.trainable:
        g = cparams[f].grad
        if g is not None and isinstance(g, DTensor):
            g = g.full_tensor()
        grads[f] = None if g is None else g.detach()
    return sharded, c_out, grads


def _tensor_leaves(tree) -> list:
    return [x for x in tree_flatten(tree)[0] if isinstance(x, torch.Tensor)]


def _compare_outputs(eager: _Eager, sharded, c_out, rk: _Ranks, tolerances: dict) -> list:
    """An OutputRow per tensor output leaf, and per buffer the step updates (BatchNorm's
    statistics); ``tolerances`` gets each floating dtype's."""
    outputs = []
    paths = [p for p, leaf in zip(_leaf_paths(eager.out), tree_flatten(eager.out)[0])
             if isinstance(leaf, torch.Tensor)]
    for path, e, c in zip(paths, _tensor_leaves(eager.out), _tensor_leaves(c_out)):
        ref, delta = _max_abs(e), _max_delta(e, c)
        ok, tol = rk.within(delta, ref, e.dtype)
        if e.dtype.is_floating_point:
            tolerances[_dtype_name(e.dtype)] = _tolerance(e.dtype, rk.atol, rk.rtol)
        outputs.append(OutputRow(path, _dtype_name(e.dtype), tuple(e.shape), ref, delta, tol,
                                 ok))
    cbufs = dict(sharded.named_buffers())
    for f, b in eager.model.named_buffers():
        c, b0 = cbufs.get(f), eager.init_buffers[f]
        if c is None or not b.is_floating_point():
            continue
        if torch.equal(b, b0) and torch.equal(c, b0):
            continue
        ref, delta = _max_abs(b), _max_delta(b, c)
        ok, tol = rk.within(delta, ref, b.dtype)
        outputs.append(OutputRow(f"buffer {f}", _dtype_name(b.dtype), tuple(b.shape), ref,
                                 delta, tol, ok))
    return outputs


def _compare_grads(eager: _Eager, compiled_grads: dict, rk: _Ranks, tolerances: dict) -> list:
    """A ParamRow per trainable parameter, in the model's order."""
    rows = []
    for f, p in eager.trainable:
        e, c = eager.grads[f], compiled_grads[f]
        tolerances[_dtype_name(p.dtype)] = _tolerance(p.dtype, rk.atol, rk.rtol)
        row = functools.partial(ParamRow, f, _dtype_name(p.dtype), tuple(p.shape))
        if e is None and c is None:
            rows.append(row(0.0, 0.0, 0.0, "no grad"))
        elif e is None or c is None:
            rows.append(row(_max_abs(c if e is None else e), math.inf, 0.0,
                            "no grad in eager" if e is None else "no grad in compiled"))
        else:
            ref, delta = _max_abs(e), _max_delta(e, c)
            ok, tol = rk.within(delta, ref, p.dtype)
            rows.append(row(ref, delta, tol, "ok" if ok else "differs"))
    return rows


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


def _localise(sharded, eager: _Eager, example_inputs, step_ok: bool, rk: _Ranks) -> tuple:
    """(first Difference or None, nodes compared, notes). Runs the sharded module's last
    program through its instrumented entry (collectives included: every rank calls it
    together): first its joint graph as captured, against eager; then its compiled graphs,
    node by node, against the joint graph; then its gradient shards, against the joint
    graph's gradients."""
    args, kwargs = _split(_fresh(example_inputs))
    state = sharded._autoshard
    with progress.phase("localising the first difference", unit="nodes") as p:
        def counted(on_node):
            def on(graph, n, v):
                on_node(graph, n, v)
                p.step()
            return on

        keep = _Keep()
        with rk.seeded():
            joint = state.run_instrumented(args, kwargs, eager.tangents, counted(keep),
                                           graphs="joint", params=eager.init_params,
                                           buffers=eager.init_buffers)
        capture_diff = _capture_difference(joint, eager, rk)
        search = _Search(keep.values, rk)
        with rk.seeded():
            traced = state.run_instrumented(args, kwargs, eager.tangents, counted(search),
                                            buffers=eager.init_buffers)
    pristine_grads = {f: v for f, (_, v) in joint.grads.items()}
    first, notes = search.first, []
    output_diff = None
    if rk.world > 1 or (first is None and capture_diff is None):  # collective: every rank
        output_diff = _compare_grad_outputs(traced, pristine_grads, rk)
    if first is not None and capture_diff is not None:
        notes.append(f"also, the compiled graphs differ from the captured one: {first}")
    result = capture_diff or first or output_diff
    if result is None and not step_ok:
        result = Difference(
            stage="runtime", rank=rk.rank,
            description=("every node of the compiled graphs computes the captured graph's "
                         "value, and the captured graph agrees with eager: the difference "
                         "arises outside the graphs, in the runtime (padding, gradient "
                         "accumulation into the DTensor .grad, or the collectives)"))
    if search.unmatched:
        notes.append(f"{len(search.unmatched)} compiled node(s) have no counterpart in the "
                     f"captured graph and were not compared (first: "
                     f"{', '.join(search.unmatched[:3])})")
    return result, search.compared, notes


def _capture_difference(joint, eager: _Eager, rk: _Ranks) -> Optional[Difference]:
    """The first output of the joint graph as captured (a forward output, then a gradient)
    that differs from eager's, if any: then capture, not a pass, is to blame."""
    pairs = [(node, val, ref, f"forward output {i}") for i, ((node, val), ref)
             in enumerate(zip(joint.outputs, _tensor_leaves(eager.out)))]
    pairs += [(node, val, eager.local_grads.get(f), f"gradient of {f}")
              for f, (node, val) in joint.grads.items()]
    for node, val, ref, what in pairs:
        if ref is None or not isinstance(val, torch.Tensor):
            continue
        delta, mag = _max_delta(ref, val), _max_abs(ref)
        ok, _ = rk.within(delta, mag, _coarser(ref.dtype, val.dtype))
        if ok:
            continue
        return Difference(
            stage="capture", node=node.name, graph="joint", op=_op_name(node),
            module=meta.tag(node, meta.MODULE) or "", max_delta=delta, max_abs=mag,
            rank=rk.rank,
            description=(
                f"the captured joint graph (as traced, before any pass) already differs "
                f"from eager at its {what} (node {node.name}, {_op_name(node)}; "
                f"max|Δ| {_f(delta)}, max|eager| {_f(mag)}"
                f"{_on_rank(rk.rank, rk.world)}): capture, not a pass, computes different "
                "values than eager"))
    return None


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


def _compare_grad_outputs(traced, pristine_grads: dict, rk: _Ranks) -> Optional[Difference]:
    """The compiled backward's gradient shards (``traced``: what the instrumented run
    computed) against the captured graph's full gradients (averaged over the ranks), cut to
    this rank's rows."""
    import torch.distributed as dist

    full = {}
    for spec in traced.params:
        if not spec.requires_grad:
            continue
        g = pristine_grads.get(spec.fqn)
        if g is None:
            if rk.world == 1:
                continue
            g = torch.zeros(spec.shape, dtype=spec.dtype)  # every rank reduces every gradient
        g = g.clone()
        if rk.world > 1:
            home = g.device
            g = g.to(_group_device(rk.group))
            dist.all_reduce(g, group=rk.group)
            g = (g / rk.world).to(home)
        full[spec.fqn] = g
    for f, (_, got) in traced.grads.items():
        ref = full.get(f)
        if ref is None:
            continue
        if f in traced.rows:
            a, b = traced.rows[f]
            ref = ref[a:b]
        delta, mag = _max_delta(ref, got), _max_abs(ref)
        ok, _ = rk.within(delta, mag, ref.dtype)
        if not ok:
            return Difference(
                stage="runtime", node=f, graph="bwd", max_delta=delta, max_abs=mag,
                rank=rk.rank,
                description=(f"every compared node agrees with the captured graph, but the "
                             f"backward's gradient shard of {f} differs from the captured "
                             f"gradient (max|Δ| {_f(delta)}{_on_rank(rk.rank, rk.world)}): "
                             "look at the nodes the passes added (reduce-scatter packing, "
                             "new nodes with no counterpart in the captured graph)"))
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

"""The two steps ``autoshard.check`` compares: one eager step of the unsharded model
(``eager_step``) and one of ``autoshard()`` (``compiled_step``), from the same inputs,
seed and output gradients (the projection loss's tangents).

Also where the check runs (``Ranks``: group, rank, device, tolerances) and the collectives
that make eager's values those data parallel training computes (gradients averaged over
the ranks).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from typing import Any, Callable, Optional

import torch

from autoshard.core import _compat
from autoshard.core._compat import tree_flatten, tree_unflatten
from autoshard.front.api import autoshard
from autoshard.front.calls import split_inputs
from autoshard.check.report import cast_floating, within_tolerance


PROJECTION_SEED = 0


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


def leaf_paths(outputs) -> list:
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


def fresh_inputs(example_inputs):
    """A copy of the inputs whose tensors are new leaves (the user's stay untouched)."""
    def one(x):
        if isinstance(x, torch.Tensor):
            y = x.detach().clone()
            return y.requires_grad_(x.requires_grad) if y.is_floating_point() else y
        return x

    leaves, spec = tree_flatten(example_inputs)
    return tree_unflatten([one(x) for x in leaves], spec)


@dataclasses.dataclass
class Ranks:
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
        return within_tolerance(delta, ref, dtype, self.atol, self.rtol)

    @contextlib.contextmanager
    def seeded(self):
        """The generators as ``seed`` leaves them, and as they were afterwards."""
        with torch.random.fork_rng(devices=_rng_devices(self.device)):
            torch.manual_seed(self.seed)
            yield


@dataclasses.dataclass
class EagerRun:
    """Eager's step: its copy of the model, the values it started from, what it computed."""

    model: torch.nn.Module
    init_params: dict  # FQN -> value before the step (in param_dtype under mixed precision)
    init_buffers: dict  # FQN -> value before the step
    out: Any  # the forward's output
    tangents: dict  # index among tensor output leaves -> d loss / d output
    trainable: list  # (FQN, parameter) of each parameter that requires grad
    local_grads: dict  # FQN -> this rank's gradient (in the reduce dtype), or None
    grads: dict  # FQN -> the gradient averaged over the ranks, or None


def eager_step(model, example_inputs, loss_fn, config, rk: Ranks) -> EagerRun:
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
    e_in = fresh_inputs(example_inputs)
    if mp is not None and mp.cast_forward_inputs and mp.param_dtype is not None:
        e_in = cast_floating(e_in, mp.param_dtype)
    args, kwargs = split_inputs(e_in)
    with rk.seeded():
        e_out = eager(*args, **kwargs)
    if mp is not None and mp.output_dtype is not None:
        e_out = cast_floating(e_out, mp.output_dtype)
    tangents = _tangents(e_out, loss_fn)
    _backward(e_out, tangents)
    trainable = [(f, p) for f, p in eager.named_parameters() if p.requires_grad]
    # gradients are reduced in the reduce dtype, as the compiled step reduces them
    reduce = mp.reduce_dtype or mp.param_dtype if mp is not None else None
    local_grads = {f: (p.grad.detach().to(reduce or p.grad.dtype, copy=True)
                       if p.grad is not None else None)
                   for f, p in trainable}
    grads = _average(local_grads, dict(trainable), rk.group, rk.world)
    return EagerRun(eager, init_params, init_buffers, e_out, tangents, trainable, local_grads,
                  grads)


def compiled_step(model, example_inputs, mesh, config, eager: EagerRun, rk: Ranks) -> tuple:
    """One step of ``autoshard()`` of another deep copy, with eager's tangents. Returns
    (the sharded module, its output, FQN -> full gradient or None)."""
    from torch.distributed.tensor import DTensor

    twin = copy.deepcopy(model)
    for p in twin.parameters():
        p.grad = None
    sharded = autoshard(twin, mesh=mesh, config=config, example_inputs=fresh_inputs(example_inputs))
    cargs, ckwargs = split_inputs(fresh_inputs(example_inputs))
    with rk.seeded():
        c_out = sharded(*cargs, **ckwargs)
    n_eager, n_compiled = len(tensor_leaves(eager.out)), len(tensor_leaves(c_out))
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


def tensor_leaves(tree) -> list:
    return [x for x in tree_flatten(tree)[0] if isinstance(x, torch.Tensor)]


def _rng_devices(device: torch.device) -> list:
    return [device] if device.type == "cuda" else []


def group_device(group) -> torch.device:
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
                           device=group_device(group))
    dist.all_reduce(present, group=group)
    out = {}
    for (f, g), n in zip(grads.items(), present.tolist()):
        if n == 0:
            out[f] = None
            continue
        # a rank where the parameter got no gradient contributes zeros, as in DDP
        t = g.clone() if g is not None else torch.zeros_like(params[f])
        t = t.to(group_device(group))
        dist.all_reduce(t, group=group)
        out[f] = (t / world).to(params[f].device)
    return out


def agree_outputs(outputs: list, group) -> None:
    """Every rank reports the worst output delta over the ranks."""
    import torch.distributed as dist

    if not outputs:
        return
    vals = torch.tensor([[o.max_delta - o.tolerance, o.max_delta] for o in outputs],
                        dtype=torch.float64, device=group_device(group))
    dist.all_reduce(vals, op=dist.ReduceOp.MAX, group=group)
    for o, (excess, delta) in zip(outputs, vals.tolist()):
        o.max_delta = max(o.max_delta, delta)
        o.ok = o.ok and excess <= 0


def same_model_on_all_ranks(model, group) -> None:
    import torch.distributed as dist

    sums = torch.tensor([float(p.detach().double().sum()) for p in model.parameters()]
                        or [0.0], dtype=torch.float64, device=group_device(group))
    hi, lo = sums.clone(), sums.clone()
    dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
    if not torch.equal(hi, lo):
        raise ValueError("the ranks hold different parameter values: build the model the same "
                         "way on every rank (seed before building it) before check()")

"""A backward with ``create_graph=True`` through the step: gradient penalties (with respect to
the inputs or to the parameters), Hessian-vector products, double backward.

The step's backward graph computes gradients outside autograd, so its results carry no graph.
Such a backward instead runs the joint graph as captured (``Captured.pristine``: the forward
and the aten backward formulas eager's autograd would run) in grad mode, on

- each parameter gathered differentiably: DTensor's redistribute to ``Replicate``, whose
  backward sums every rank's gradient back onto the shard, scaled to the mean of the ranks
  (the step's own reduction, ``Plan.reduction`` "mean");
- the call's own input tensors, with their graph, and the gradients given, with theirs;
- the buffers as the forward read them, and the random state the forward started from, so
  that dropout draws the masks the forward drew;

so that autograd records what eager's ``create_graph`` records. The parameters' gradients it
returns are the step's (reduced to each rank's shard, the mean over the ranks), with a graph.
What it cannot match it refuses before anything is taken (``refusal``)."""

from __future__ import annotations

import warnings
import weakref
from typing import Optional

import torch
import torch.fx as fx
from torch.distributed.tensor import DTensor, Partial, Replicate

from autoshard.core import _compat, meta
from autoshard.core.errors import AutoshardError
from autoshard.core.graph import clone_graph


def draws_random(gm: fx.GraphModule) -> bool:
    """Whether the forward of the joint graph ``gm`` draws random numbers (dropout)."""
    return any(meta.is_forward(n) and isinstance(n.target, _compat.OpOverload)
               and torch.Tag.nondeterministic_seeded in n.target.tags for n in gm.graph.nodes)


_JOINTS = weakref.WeakKeyDictionary()  # pristine joint graph -> its differentiable copy


def differentiable(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` with the forward values its backward formulas read kept in the graph: autograd
    saves an op's output detached (traced as a forward ``detach`` only backward nodes read),
    where ``create_graph`` unpacks it with its history. A detach the user wrote is read by the
    forward and stays."""
    if gm not in _JOINTS:
        copy = clone_graph(gm)
        for n in list(copy.graph.nodes):
            if (n.op == "call_function" and n.target is torch.ops.aten.detach.default
                    and meta.is_forward(n) and n.users
                    and all(meta.is_backward(u) for u in n.users)):
                n.replace_all_uses_with(n.args[0])
                copy.graph.erase_node(n)
        copy.recompile()
        _JOINTS[gm] = copy
    return _JOINTS[gm]


class Kept:
    """What a differentiable forward keeps for a backward with ``create_graph=True``: the
    call's input tensors as given (with their graph) and their versions, the buffers' values
    before the forward's writes, the random state the forward started from."""

    __slots__ = ("inputs", "versions", "buffers", "rng")

    def __init__(self, program, flat: tuple, n_buffers: int):
        n_p = len(program.fqns)
        self.inputs = list(flat[n_p + n_buffers:])
        self.versions = [t._version if isinstance(t, torch.Tensor) else None
                         for t in self.inputs]
        self.buffers = list(flat[n_p:n_p + n_buffers])
        for s in program.mutated_slots:  # the forward writes these after it ran
            self.buffers[s] = self.buffers[s].detach().clone()
        self.rng = _rng_state(program.device_type) if program.draws_random else None


def _rng_state(device_type: str) -> tuple:
    cpu = torch.get_rng_state()
    if device_type == "cuda":
        return cpu, torch.cuda.get_rng_state()
    return cpu, None


def refusal(program, kept: Kept) -> Optional[str]:
    """Why this step's backward cannot build its own graph, or None."""
    specs = program.captured.params
    if not program.plan.grad_sync:
        return ("within no_sync() (gradient sync off), where gradients stay whole on each rank "
                "for the synced backward")
    if program.captured.backward_taps:
        return "with module backward hooks run after the backward graph"
    if program.captured.pristine is None:
        return "for this program, which keeps no joint graph"
    mixed = [p.fqn for p in specs if p.compute_dtype != p.dtype or p.reduce_dtype != p.dtype]
    if mixed:
        return (f"under mixed precision ({mixed[0]} is computed in another dtype than it is "
                "stored in; the joint graph holds no casts)")
    placed = [p.fqn for p in specs if p.tp is not None]
    if placed:
        return (f"with tensor parallelism ({placed[0]}: the step's tensor-parallel "
                "collectives have no derivative of their own to differentiate again)")
    hosted = [p.fqn for p in specs if p.device == "host"]
    if hosted:
        return f"with parameters offloaded to host memory ({hosted[0]})"
    if program.plan.reduction != "mean":
        return (f"with the gradient reduction {program.plan.reduction!r} (only the mean over the "
                "ranks is built)")
    changed = [i for i, (t, v) in enumerate(zip(kept.inputs, kept.versions))
               if v is not None and t._version != v]
    if changed:
        return (f"after input tensor {changed[0]} of the call was changed in place since the "
                "forward")
    return None


def refuse(why: str) -> AutoshardError:
    return AutoshardError(
        f"a backward with create_graph=True (a gradient penalty, a Hessian-vector product) "
        f"through a model sharded by autoshard is not built {why}. Run that step without it "
        "(Config or context), or compute the penalty on an unsharded copy.")


class _MeanOverRanks(torch.autograd.Function):
    """The identity, whose backward divides by the number of ranks: a gathered parameter's
    gradient, summed over the ranks by the gather's backward, becomes their mean."""

    @staticmethod
    def forward(ctx, t, n: int):
        ctx.n = n
        return t.view_as(t)

    @staticmethod
    def backward(ctx, g):
        return g / ctx.n, None


def _gathered(param) -> torch.Tensor:
    """The full parameter, whose gradient reaches ``param`` as the step's reduction makes
    it: summed over every mesh dimension onto this rank's shard, divided by the ranks."""
    if not isinstance(param, DTensor):
        return param
    mesh = param.device_mesh
    full = param.redistribute(mesh, [Replicate()] * mesh.ndim)
    if not param.requires_grad:
        return full.to_local()
    full = full.to_local(grad_placements=[Partial()] * mesh.ndim)
    return _MeanOverRanks.apply(full, mesh.size())


def reduced(param, full_grad: torch.Tensor):
    """The gradient of ``param`` as its ``.grad`` holds it: the ranks' mean, on this rank's
    shard, differentiable."""
    if not isinstance(param, DTensor):
        return full_grad
    mesh = param.device_mesh
    part = DTensor.from_local(full_grad / mesh.size(), mesh, [Partial()] * mesh.ndim,
                              run_check=False)
    return part.redistribute(mesh, param.placements)


def backward(program, kept: Kept, params: list, tangents: list, given: set):
    """The gradients of a backward with ``create_graph=True`` given ``tangents`` (per
    differentiable output; ``given``: the positions of those the engine passed): per
    parameter (capture order) this rank's full gradient with its graph (``reduced`` makes
    it ``.grad``'s form), or None; per input of the call its gradient, or None. Every rank
    runs it together (the gathers are collectives)."""
    cap = program.captured
    devices = [torch.cuda.current_device()] if kept.rng and kept.rng[1] is not None else []
    with torch.random.fork_rng(devices=devices, enabled=kept.rng is not None), \
            torch.enable_grad(), program.no_autocast():
        if kept.rng is not None:
            torch.set_rng_state(kept.rng[0])
            if kept.rng[1] is not None:
                torch.cuda.set_rng_state(kept.rng[1])
        full = [_gathered(p) for p in params]
        outs = fx.Interpreter(differentiable(cap.pristine), garbage_collect_values=True).run(
            *full, *kept.buffers, *kept.inputs, *tangents, enable_io_processing=False)
    slot = {f: i for i, f in enumerate(program.fqns)}
    param_grads, input_grads = [None] * len(params), [None] * len(kept.inputs)
    for role, g in zip(meta.output_roles(cap.pristine), outs):
        kind = role[meta.ROLE]
        if kind not in (meta.OUT_GRAD, meta.OUT_INPUT_GRAD) or g is None:
            continue
        key = role[meta.FQN] if kind == meta.OUT_GRAD else role[meta.INDEX]
        if not cap.grad_tangents.get((kind, key), set()) & given:
            continue  # it reads only outputs that got no gradient: None, as in eager
        if kind == meta.OUT_GRAD:
            param_grads[slot[key]] = g
        else:
            input_grads[key] = g
    return param_grads, input_grads


_SAID = []


def say_own(world_size: int) -> None:
    """Say once what ``autograd.grad(..., create_graph=True)`` returns for a parameter."""
    if world_size > 1 and not _SAID:
        _SAID.append(True)
        warnings.warn(
            "torch.autograd.grad(..., create_graph=True) with respect to parameters sharded by "
            "autoshard returns, as eager does for this rank's loss, this rank's own full "
            "gradient of each (a plain tensor with its graph), not reduced over the ranks; a "
            "penalty built on it reaches .grad reduced as backward() reduces every gradient "
            "(docs/api.md).", stacklevel=4)

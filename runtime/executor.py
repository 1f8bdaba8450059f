"""Running a compiled program: the forward graph now, the backward graph on backward()."""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_unflatten

from autoshard import _compat, meta
from autoshard.capture import TENSOR
from autoshard.passes.collectives import ShardLayout


class Program:
    """One compiled training step for one input signature."""

    def __init__(self, captured, split, units, plan, world_size: int, rank: int):
        self.captured = captured
        self.split = split
        self.units = units
        self.plan = plan
        self.fwd = split.fwd
        # the backward takes its inputs boxed: saved activations die at their last use
        self.bwd = _compat.boxed(split.bwd) if split.bwd is not None else None
        roles = split.fwd_roles
        self.n_user = sum(r[meta.ROLE] == meta.OUT_FWD for r in roles)
        self.mutated = [r[meta.FQN] for r in roles if r[meta.ROLE] == meta.OUT_BUFFER]
        slot = {f: i for i, f in enumerate(captured.buffer_fqns)}
        self.mutated_slots = [slot[f] for f in self.mutated]
        self.fqns = [p.fqn for p in captured.params]
        self.layouts = [ShardLayout(p.shape, world_size) for p in captured.params]
        self.local_rows = [
            (lay.local_range(rank)[1] - lay.local_range(rank)[0]) if lay.sharded else None
            for lay in self.layouts
        ]
        slot = {f: i for i, f in enumerate(self.fqns)}
        self.grad_slots = [
            ("param", slot[r[meta.FQN]]) if r[meta.ROLE] == meta.OUT_GRAD
            else ("input", r[meta.INDEX])
            for r in split.bwd_roles
        ]
        self.diff = list(captured.diff_outputs)

    # the padded shard the graph reads, from the DTensor's local rows
    def pad(self, i: int, local: torch.Tensor) -> torch.Tensor:
        lay = self.layouts[i]
        if not lay.sharded or local.shape[0] == lay.rows:
            return local
        extra = local.new_zeros((lay.rows - local.shape[0], *lay.inner))
        return torch.cat([local, extra])

    def run(self, params: list, buffers: list, inputs: list):
        """Run the step on ``params`` (DTensor parameters, in capture order). Gradient shards
        are accumulated into ``param.grad`` by the backward, as AccumulateGrad would."""
        locals_ = [p._local_tensor for p in params]
        if self.bwd is not None and torch.is_grad_enabled():
            outs = _Step.apply(self, params, len(buffers), self.anchor(), *locals_, *buffers,
                               *inputs)
        else:
            with torch.no_grad():
                padded = [self.pad(i, t) for i, t in enumerate(locals_)]
                outs = self.fwd(*padded, *buffers, *inputs)
        user = list(outs[: self.n_user])
        return user, list(outs[self.n_user : self.n_user + len(self.mutated)])

    @staticmethod
    def anchor() -> torch.Tensor:
        # the parameters enter the step as plain local shards; this tensor makes the step's
        # outputs part of the autograd graph so that backward() reaches it
        return torch.empty(0, requires_grad=True)

    def unflatten(self, user: list):
        it = iter(user)
        leaves = [next(it) if c is TENSOR else c for c in self.captured.out_consts]
        return tree_unflatten(leaves, self.captured.out_spec)


def _accumulate(param, grad_local: torch.Tensor) -> None:
    from torch.distributed.tensor import DTensor

    if param.grad is None:
        param.grad = DTensor(grad_local, param._spec, requires_grad=False)
    else:
        param.grad._local_tensor.add_(grad_local)


class _Step(torch.autograd.Function):
    @staticmethod
    def forward(ctx, program: Program, params: list, n_buffers: int, anchor, *flat):
        n_p = len(program.fqns)
        padded = [program.pad(i, t) for i, t in enumerate(flat[:n_p])]
        res = program.fwd(*padded, *flat[n_p:])
        n_out = program.n_user + len(program.mutated)
        ctx.save_for_backward(*res[n_out:])
        ctx.program, ctx.params = program, params
        ctx.n_inputs = len(flat) - n_p - n_buffers
        ctx.n_flat = len(flat)
        outs = tuple(res[:n_out])
        diff = set(program.diff)
        ctx.mark_non_differentiable(*[o for i, o in enumerate(outs) if i not in diff])
        return outs

    @staticmethod
    def backward(ctx, *grads):
        program = ctx.program
        tangents = [grads[i].contiguous() for i in program.diff]
        args = [*ctx.saved_tensors, *tangents]
        ctx.maybe_clear_saved_tensors()  # autograd's references go; the graph drops the rest
        res = program.bwd(args)
        input_grads = [None] * ctx.n_inputs
        for (kind, i), g in zip(program.grad_slots, res):
            if kind == "param":
                rows = program.local_rows[i]
                _accumulate(ctx.params[i], g if rows is None or rows == g.shape[0] else g[:rows])
            else:
                input_grads[i] = g
        return (None, None, None, None, *([None] * (ctx.n_flat - ctx.n_inputs)), *input_grads)

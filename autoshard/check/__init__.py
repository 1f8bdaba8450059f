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

import functools
import math
from typing import Callable, Optional

import torch

from autoshard.core import progress
from autoshard.core._compat import tree_flatten
from autoshard.front.api import ShardedModule
from autoshard.check.locate import locate_difference
from autoshard.check.report import (CheckReport, OutputRow, ParamRow, dtype_name, max_abs,
                                    max_delta, tolerance_for)
from autoshard.check.runs import (EagerRun, PROJECTION_SEED, Ranks, agree_outputs, compiled_step,
                                  eager_step, leaf_paths, projection_loss, same_model_on_all_ranks,
                                  tensor_leaves)
from autoshard.core.config import Config
from autoshard.front.factory import default_inputs, load_factory
from autoshard.runtime import dist as _dist
from autoshard.runtime.dist import spawn_ranks


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
    if mesh.ndim > 1:
        raise ValueError(
            f"check() compares on a 1-D mesh, and this one is {mesh.ndim}-D "
            f"{dict(zip(mesh.mesh_dim_names or (), mesh.shape))}: pass a 1-D mesh over the "
            "same ranks (init_device_mesh(device, (world,))): check() does not take hybrid "
            "or tensor-parallel meshes in this version")
    with torch.enable_grad():  # a training step, whatever the caller's grad mode
        return _check(model, example_inputs, loss_fn, mesh, config, atol, rtol, localise, seed)


def _check(model, example_inputs, loss_fn, mesh, config, atol, rtol, localise, seed):
    import torch.distributed as dist

    loss_desc = ("loss_fn(outputs)" if loss_fn is not None
                 else f"random projection of the outputs (seed {PROJECTION_SEED})")
    rk = Ranks(mesh.get_group(), mesh.size(), mesh.get_local_rank(), _dist.mesh_device(mesh),
                seed, atol, rtol)
    if rk.world > 1:
        same_model_on_all_ranks(model, rk.group)
    loss_fn = loss_fn if loss_fn is not None else projection_loss
    with progress.phase("checking against eager", total=3, unit="steps") as p:
        eager = eager_step(model, example_inputs, loss_fn, config, rk)
        p.step(note="the compiled step")
        sharded, c_out, compiled_grads = compiled_step(model, example_inputs, mesh, config,
                                                        eager, rk)
        p.step(note="comparing")
        tolerances: dict = {}
        outputs = _compare_outputs(eager, sharded, c_out, rk, tolerances)
        rows = _compare_grads(eager, compiled_grads, rk, tolerances)
        if rk.world > 1:
            agree_outputs(outputs, rk.group)
        ok = all(r.ok for r in rows) and all(o.ok for o in outputs)
        if rk.world > 1:
            flag = torch.tensor([0.0 if ok else 1.0], device=rk.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=rk.group)
            ok = flag.item() == 0.0
        p.step()
    first, compared, notes = None, 0, []
    if localise or (localise is None and not ok):
        first, compared, notes = locate_difference(sharded, eager, example_inputs, ok, rk)
    return CheckReport(
        ok=ok, params=rows, outputs=outputs,
        outputs_delta=max((o.max_delta for o in outputs), default=0.0), worst=_worst(rows),
        first_difference=first, tolerances=tolerances, world_size=rk.world, rank=rk.rank,
        loss=loss_desc, nodes_compared=compared, notes=notes,
    )


def _compare_outputs(eager: EagerRun, sharded, c_out, rk: Ranks, tolerances: dict) -> list:
    """An OutputRow per tensor output leaf, and per buffer the step updates (BatchNorm's
    statistics); ``tolerances`` gets each floating dtype's."""
    outputs = []
    paths = [p for p, leaf in zip(leaf_paths(eager.out), tree_flatten(eager.out)[0])
             if isinstance(leaf, torch.Tensor)]
    for path, e, c in zip(paths, tensor_leaves(eager.out), tensor_leaves(c_out)):
        ref, delta = max_abs(e), max_delta(e, c)
        ok, tol = rk.within(delta, ref, e.dtype)
        if e.dtype.is_floating_point:
            tolerances[dtype_name(e.dtype)] = tolerance_for(e.dtype, rk.atol, rk.rtol)
        outputs.append(OutputRow(path, dtype_name(e.dtype), tuple(e.shape), ref, delta, tol,
                                 ok))
    cbufs = dict(sharded.named_buffers())
    for f, b in eager.model.named_buffers():
        c, b0 = cbufs.get(f), eager.init_buffers[f]
        if c is None or not b.is_floating_point():
            continue
        if torch.equal(b, b0) and torch.equal(c, b0):
            continue
        ref, delta = max_abs(b), max_delta(b, c)
        ok, tol = rk.within(delta, ref, b.dtype)
        outputs.append(OutputRow(f"buffer {f}", dtype_name(b.dtype), tuple(b.shape), ref,
                                 delta, tol, ok))
    return outputs


def _compare_grads(eager: EagerRun, compiled_grads: dict, rk: Ranks, tolerances: dict) -> list:
    """A ParamRow per trainable parameter, in the model's order."""
    rows = []
    for f, p in eager.trainable:
        e, c = eager.grads[f], compiled_grads[f]
        tolerances[dtype_name(p.dtype)] = tolerance_for(p.dtype, rk.atol, rk.rtol)
        row = functools.partial(ParamRow, f, dtype_name(p.dtype), tuple(p.shape))
        if e is None and c is None:
            rows.append(row(0.0, 0.0, 0.0, "no grad"))
        elif e is None or c is None:
            rows.append(row(max_abs(c if e is None else e), math.inf, 0.0,
                            "no grad in eager" if e is None else "no grad in compiled"))
        else:
            ref, delta = max_abs(e), max_delta(e, c)
            ok, tol = rk.within(delta, ref, p.dtype)
            rows.append(row(ref, delta, tol, "ok" if ok else "differs"))
    return rows


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


# --- the command line -------------------------------------------------------------------------


def _check_factory(spec: str, opts: dict, rank: int) -> CheckReport:
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

    with tempfile.TemporaryDirectory() as tmp:
        spawn_ranks(world_size, _cli_rank, spec, opts, tmp)
        with open(os.path.join(tmp, "report.txt")) as f:
            status, _, text = f.read().partition("\n")
    return text, status == "ok"

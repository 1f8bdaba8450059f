"""The compiler: a model's training step captured, planned and lowered, in one place.

``compile_step`` captures a step (``autoshard.compiler.capture``, or
``autoshard.compiler.depth`` for deep stacks of identical blocks) and hands it to
``plan_captured``, which runs the planner (``autoshard.planner``, above the passes: it runs
them once per candidate) and
returns the chosen program's graphs, the placements of every parameter (``cap.params``) and
the finished Plan.
``autoshard()``, ``autoshard.plan()`` and a loaded export all plan through here.

    model, inputs -capture-> Captured(joint graph, ParamSpecs)
      -plan_captured-> PassContext(units, split graphs) + Plan (candidates, schedule, memory)
"""

from __future__ import annotations

import torch

from autoshard.compiler import capture, depth
from autoshard.core import meta
from autoshard.core.config import offloads
from autoshard.core.config import reshard_group_size, reshard_group_sizes
from autoshard.core.cost import device_profile
from autoshard.core.errors import AutoshardError
from autoshard.passes import PassContext
from autoshard.planner import choose as choose_plan
from autoshard.core.plans import Plan
from autoshard.core.progress import timed
from autoshard.runtime.storage import fqn_aliases
from autoshard.core.spec import param_specs


def compile_step(model, forward, args, kwargs, *, world_size, group_name, device, config,
                 reshard_groups=None, aliases=None, progress=None, from_shallow=False,
                 grad_sync=True, accumulated=False, traced_hooks=frozenset(), lifted=(),
                 offload_stored=None):
    """Capture ``model``'s step, run the passes and predict the result; no process group is
    touched. Returns ``(captured, ctx, plan)``; ``ctx.split`` holds the two graphs.
    ``world_size``: the ranks, or the mesh's shape (``(replicate, shard)`` for hybrid
    sharding). ``grad_sync`` False: gradients come out full and unreduced
    (``ShardedModule.set_requires_gradient_sync``); ``accumulated``: the backward takes what
    such steps accumulated and reduces it with its own gradients.
    ``traced_hooks``, ``lifted``: see ``autoshard.compiler.capture.capture``. ``reshard_groups``:
    the process group names of this rank's hpZ groups by size
    (``autoshard.runtime.dist.reshard_groups``); None when planning only.
    ``from_shallow``: build a deep stack of identical blocks from a few traced ones
    (``autoshard.compiler.depth``) instead of tracing them all. ``offload_stored``: the
    fraction of the state an earlier plan put in host memory (the parameters are stored so
    already, marked ``autoshard.core.spec.ON_HOST``), which this plan keeps; None: the plan
    chooses.

    The planner (``autoshard.planner``) tries candidate units (policy "auto") and
    recomputation (recompute "auto") and keeps the fastest that fits the budget; with no
    ``Config.offload_policy``, it then tries the model state in host memory. If none fits,
    AutoshardError says the smallest budget that would.
    """
    say = progress or (lambda msg: None)
    mp = config.mp_policy
    mesh_shape = tuple(world_size) if isinstance(world_size, (tuple, list)) else (world_size,)
    if isinstance(group_name, str) and len(mesh_shape) > 1:  # planning only: a name per dim
        group_name = tuple(f"{group_name}:{d}" for d in range(len(mesh_shape)))
    reshard_group_size(config.reshard_after_forward, mesh_shape[-1])  # refuses a bad k early
    strategy = "zero3" if config.strategy == "auto" else config.strategy
    specs = param_specs(model, mp, mesh_shape=mesh_shape, offload=offloads(config),
                        strategy=strategy, grad_divide=config.gradient_divide_factor,
                        force_sum=config.force_sum_reduction_for_comms)

    def trace(specs):
        return capture.capture(
            model, forward, specs, dict(model.named_buffers()), args, kwargs,
            device=device, with_grad=torch.is_grad_enabled(),
            input_dtype=mp.param_dtype if mp is not None and mp.cast_forward_inputs else None,
            output_dtype=mp.output_dtype if mp is not None else None,
            traced_hooks=traced_hooks, lifted=lifted,
        )

    with timed("capture"):
        cap = _capture(model, specs, trace, from_shallow, say)
    say(f"captured {len(cap.gm.graph.nodes)} nodes")
    cap.pristine = cap.gm  # as traced (the planner works on copies), for autoshard.check
    ctx, plan = plan_captured(cap, model, group_name=group_name, device=device,
                              config=config, reshard_groups=reshard_groups, aliases=aliases,
                              progress=progress, grad_sync=grad_sync,
                              accumulated=accumulated, offload_stored=offload_stored)
    return cap, ctx, plan


def _capture(model, specs, trace, from_shallow: bool, say):
    """The captured step: traced whole, or with ``from_shallow`` built from a few traced
    blocks where the model has a stack of identical ones (``autoshard.compiler.depth``)."""
    stack = depth.block_stack(model) if from_shallow else None
    cap = None
    if stack is not None:
        say(f"capturing the training step with {depth.SHALLOW} and {depth.SHALLOW + 1} of "
            f"the {stack[1]} blocks of {stack[0]}, to build all {stack[1]} from")
        cap = depth.capture_deep(model, *stack, specs, trace, say)
    if cap is None:
        say(f"capturing the training step ({len(specs)} parameters)")
        cap = trace(specs)
    return cap


def reshard_sizes(config, mesh_shape, device) -> tuple:
    """The hpZ group sizes a plan of ``config`` may use on a mesh of ``mesh_shape``
    (``autoshard.core.config.reshard_group_sizes``; "search" under strategy "auto"), for the
    runtime to make their groups before planning (``runtime.dist.reshard_groups``)."""
    if config.strategy not in ("zero3", "auto"):
        return ()
    profile = device_profile(config.device_profile, device)
    setting = "search" if config.strategy == "auto" else config.reshard_after_forward
    return reshard_group_sizes(setting, tuple(mesh_shape)[-1], profile.ranks_per_node)


def plan_captured(cap, model, *, group_name, device, config, aliases=None, progress=None,
                  grad_sync=True, accumulated=False, offload_stored=None, reshard_groups=None):
    """The planner on a captured step (``compile_step`` after capture; also what a loaded
    export runs on its stored joint graph at another world size), over the mesh its
    ``ParamSpec``s name. ``model`` gives the module structure and the buffers. The planner
    searches every choice the Config leaves open, ``Config.strategy="auto"`` included, and
    the chosen plan's graph and placement (``ParamSpec.replica`` of its strategy) are stored
    in ``cap``. Returns ``(ctx, plan)``; ``AutoshardError`` when the search finds nothing
    that fits (``plan.unfit`` says what would)."""
    say = progress or (lambda msg: None)
    profile = device_profile(config.device_profile, device)
    inputs = sum(meta.val_bytes(n) for n in cap.gm.graph.nodes
                 if n.op == "placeholder" and meta.role(n) == meta.ROLE_INPUT)
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    # without sync (and the step that reduces what it kept), one full local gradient per
    # parameter, held all step
    local_grads = (sum(p.gathered_bytes() for p in cap.params if p.requires_grad)
                   if not grad_sync or accumulated else 0)
    ctx = PassContext(
        captured=cap, group_name=group_name, model=model, reshard_groups=reshard_groups,
        fqn_aliases=aliases if aliases is not None else fqn_aliases(model),
        profile=profile, memory_budget=config.memory_budget or profile.memory,
        grad_sync=grad_sync, accumulated=accumulated)
    say("planning units, recomputation and collectives; predicting time and memory")
    gm, ctx, plan = choose_plan(cap.gm, ctx, {
        "config": config, "verify": config.verify, "local_grad_bytes": local_grads,
        "offload_stored": offload_stored, "other_static_bytes": buffers + local_grads + inputs})
    if plan.unfit is not None:
        raise AutoshardError(plan.unfit)
    cap.gm, cap.params = gm, ctx.captured.params
    return ctx, plan


def fit_symbolic(p1: Plan, p2: Plan, p3: Plan, batch: int, seq: int) -> dict:
    """Memory and time as sympy expressions in batch and seq, from plans traced at
    (batch, seq), (2 batch, seq) and (batch, 2 seq) with the same units
    (``autoshard.plan(make_inputs=...)``)."""
    import sympy

    b, s = sympy.symbols("batch seq", positive=True)
    out = {"batch_at": batch, "seq_at": seq,
           "method": "fit a + batch*(b*seq + c*seq**2) to traces at (B,S), (2B,S), (B,2S)"}
    for key, field in (("memory", "peak_bytes"), ("time", "step_s")):
        m1, m2, m3 = (float(p.predicted[field]) for p in (p1, p2, p3))
        k1, k2 = (m2 - m1) / batch, (m3 - m1) / batch
        c = (k2 - k1) / (2 * seq**2)
        lin = (k1 - c * seq**2) / seq
        a = m1 - batch * k1
        out[key] = str(sympy.Float(a, 8) + b * (sympy.Float(lin, 6) * s
                                                 + sympy.Float(c, 6) * s**2))
    return out



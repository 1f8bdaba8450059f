"""The pass pipeline: what passes share (``PassContext``), their declared order, and the
one runner that applies a list of them (``run_passes``). The planner (``planner/__init__.py``)
lowers each candidate plan with this runner, so the runner knows no planner: it imports the
passes it lists, never the planner (``autoshard.passes`` re-exports both)."""


from __future__ import annotations

import collections
import dataclasses
import os
import sys
from typing import Any, Optional

import torch.fx as fx

from autoshard.core import progress
from autoshard.passes.units import assign_units_pass
from autoshard.passes.collectives import insert_collectives_pass
from autoshard.passes.bucket import bucket_units_pass
from autoshard.passes.prefetch import prefetch_pass
from autoshard.passes.remat import recompute_activations_pass
from autoshard.passes.split import split_pass
from autoshard.passes.verify import verify


@dataclasses.dataclass(frozen=True)
class PassContext:
    """What passes share: the captured signature (its ``params`` say how each parameter is
    sharded, over how many ranks, in which dtypes), and what earlier passes decided (units,
    the split program)."""

    captured: Any  # autoshard.compiler.capture.Captured
    # the process group of the mesh (a 1-D mesh), or one group name per mesh dimension
    group_name: Any
    model: Any = None  # the nn.Module, for module-structure policies
    fqn_aliases: dict = dataclasses.field(default_factory=dict)  # any name -> canonical FQN
    reshard_after_forward: Any = "auto"  # True, False, "auto" or an int k (Config's)
    # hpZ: group size k -> the process group name of this rank's group of k consecutive
    # ranks of the shard dimension (runtime.dist.reshard_groups); empty when planning only
    reshard_groups: Any = None
    # whether gradients are reduced over the mesh this step; False: they come out full and
    # local, for the runtime to accumulate (ShardedModule.set_requires_gradient_sync)
    grad_sync: bool = True
    # whether the backward takes, per reduced gradient, what earlier steps without sync
    # accumulated (a ``grad_acc`` input added before the reduction)
    accumulated: bool = False
    # with the sharded state on the host: the fraction of resharded units (the first in
    # forward order) whose shards are copied in from the host again for the backward; the
    # others hold the forward's copy on the device until their backward all-gather (1.0:
    # every gather copies, as FSDP2's CPUOffloadPolicy; 0.0: each shard is copied in once per
    # step and only the optimizer state and its step stay on the host)
    offload_params: float = 1.0
    profile: Any = None  # autoshard.core.cost.DeviceProfile, for cost-based decisions
    memory_budget: int = 0  # bytes per rank
    static_bytes: int = 0  # bytes per rank held all step: model state, buffers, inputs
    sim_static_bytes: int = 0  # of those, what the simulator holds from the step's start
    sim_host_bytes: int = 0  # what it holds in host memory from the start (the state there)
    units: Optional[list] = None  # list[Unit], set by assign_units
    prefetch_cap: Optional[int] = None  # bound on in-flight gathered bytes (prefetch)
    collectives_inserted: bool = False
    split: Any = None  # autoshard.core.captured.SplitProgram, set by split


def debug_level() -> int:
    try:
        return int(os.environ.get("AUTOSHARD_DEBUG", "0"))
    except ValueError:
        return 1


def _op_counts(gm: fx.GraphModule) -> collections.Counter:
    return collections.Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function")


# The pipeline's order: a list given to the runner keeps it (passes not named here, such as
# the planner, run anywhere). Recomputation first: it decides the activation memory the unit
# choice works with; offload next: it moves what recomputation leaves saved; the split last:
# it partitions what the others built.
ORDER = ("recompute_activations_pass", "offload_activations_pass", "assign_units_pass",
         "bucket_units_pass", "insert_collectives_pass", "prefetch_pass", "split_pass")
# what a pass reads from the context, and the pass that provides it: checked before it runs
NEEDS = {"bucket_units_pass": ("units",), "insert_collectives_pass": ("units",),
         "prefetch_pass": ("collectives_inserted",)}
PROVIDER = {"units": "assign_units_pass", "collectives_inserted": "insert_collectives_pass"}


def check_order(passes: list, ctx: PassContext) -> None:
    """``ValueError`` naming the two passes when ``passes`` breaks ``ORDER``, or a pass
    whose input (``NEEDS``) neither the context holds nor an earlier pass provides."""
    names = [fn.__name__ for fn, _ in passes]
    ranks = [(ORDER.index(n), n) for n in names if n in ORDER]
    for (a, na), (b, nb) in zip(ranks, ranks[1:]):
        if b < a:
            raise ValueError(f"pass {nb} must run before {na} (autoshard.passes.ORDER), "
                             f"but the list is {names}")
    for i, name in enumerate(names):
        for need in NEEDS.get(name, ()):
            if not getattr(ctx, need) and PROVIDER[need] not in names[:i]:
                raise ValueError(f"pass {name} needs ctx.{need}, which {PROVIDER[need]} "
                                 f"provides; it has not run (passes before it: "
                                 f"{names[:i] or 'none'})")


def run_passes(gm: fx.GraphModule, ctx: PassContext, passes: list, *, verify_each: bool = False,
               lint: bool = True):
    """Apply ``passes`` (a list of ``(fn, options)``) in order and return the final graph and
    context (``ctx`` with what the passes decided; ``ctx`` itself is not changed);
    ``lint``: check the graph's wiring after each (the planner's candidates skip it unless
    verifying: the plan it returns is checked by the pass that chose it). The order is
    checked first (``check_order``); a pass that fails says which passes ran before it."""
    check_order(passes, ctx)
    level = debug_level()
    verify_each = verify_each or level > 0 or os.environ.get("AUTOSHARD_VERIFY") == "1"
    for i, (fn, options) in enumerate(passes):
        before = _op_counts(gm) if level else None
        spent = progress.TIMES[fn.__name__]
        try:
            with progress.timed(fn.__name__):
                gm, ctx = _run_one(fn, gm, ctx, options, lint or verify_each, verify_each)
        except Exception as e:
            if hasattr(e, "add_note"):  # Python 3.11+
                ran = [f.__name__ for f, _ in passes[:i]]
                e.add_note(f"in pass {fn.__name__}, after {ran or 'no other pass'} in this run")
            raise
        if level:
            _debug(fn, gm, i, before, progress.TIMES[fn.__name__] - spent, level)
    return gm, ctx


def _run_one(fn, gm, ctx, options, lint: bool, verify_each: bool):
    n_before = len(gm.graph.nodes)
    out = fn(gm, ctx, options=options or {})
    gm, ctx = (out[0], dataclasses.replace(ctx, **out[1])) if isinstance(out, tuple) else (
        out, ctx)
    if lint:
        gm.graph.lint()
    if getattr(fn, "reorder_only", False) and len(gm.graph.nodes) != n_before:
        raise AssertionError(f"{fn.__name__} is reorder-only but changed the node count")
    if verify_each:
        verify(gm, ctx)
    return gm, ctx


def _debug(fn, gm, i: int, before, seconds: float, level: int) -> None:
    dt = seconds * 1e3
    after = _op_counts(gm)
    diff = {k: after[k] - before[k] for k in sorted(set(after) | set(before))
            if after[k] != before[k]}
    print(f"[autoshard] pass {i} {fn.__name__}: {dt:.1f} ms, ops {diff}", file=sys.stderr)
    if level >= 2:
        print(f"[autoshard] graph after {fn.__name__}:", file=sys.stderr)
        for k, n in enumerate(gm.graph.nodes):
            print(f"  {k:5d} {n.format_node()}", file=sys.stderr)


def unit_options(config) -> dict:
    """``assign_units_pass``'s options from a Config: the policy's name and its options."""
    options = {"units": config.units, "policy": config.policy_name}
    policy = config.policy_options
    if policy is not None:
        options.update(dataclasses.asdict(policy))
    return options


def default_passes(config, **unit_extra) -> list:
    units = {**unit_options(config), **unit_extra}
    # recomputation first: it decides the activation memory the unit choice works with
    passes = [(recompute_activations_pass, {})] if config.recompute else []
    passes.append((assign_units_pass, units))
    bucket, prefetch = config.bucket_options, config.prefetch_options
    if bucket is not None:
        passes.append((bucket_units_pass, {"min_bytes": bucket.bytes}))
    passes.append((insert_collectives_pass, {}))
    if prefetch is not None:
        passes.append((prefetch_pass, {"max_inflight_bytes": prefetch.bytes,
                                       "max_depth": prefetch.depth}))
    return passes + [(split_pass, {})]

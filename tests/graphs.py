"""Capture tiny models and run chosen passes on them, in process, with no process group."""

from __future__ import annotations

import torch

from autoshard import Config
from autoshard.compiler.capture import capture
from autoshard.core.spec import param_specs
from autoshard.passes import PassContext, run_passes
from autoshard.runtime.storage import fqn_aliases


def captured(model, *inputs, world_size=2, reshard_after_forward=True, with_grad=True,
             strategy="zero3"):
    """``world_size``: ranks, or a (replicate, shard) mesh shape."""
    shape = world_size if isinstance(world_size, tuple) else (world_size,)
    specs = param_specs(model, mesh_shape=shape, strategy=strategy)
    with torch.set_grad_enabled(with_grad):
        cap = capture(model, type(model).forward, specs, dict(model.named_buffers()), inputs, {},
                      device=torch.device("cpu"), with_grad=with_grad)
    group = "test" if len(shape) == 1 else ("test_replicate", "test_shard")
    ctx = PassContext(captured=cap, group_name=group, model=model,
                      fqn_aliases=fqn_aliases(model),
                      reshard_after_forward=reshard_after_forward)
    return cap.gm, ctx


def run(gm, ctx, *passes, **options):
    """``(graph, context)`` after ``passes``; ``options`` go to assign_units."""
    return run_passes(gm, ctx, [(p, options if p.__name__ == "assign_units_pass" else {})
                                for p in passes])


def default_config():
    return Config()

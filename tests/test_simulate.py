"""The planner predicts each candidate on the joint graph (``simulate_joint``); the plan it
returns is split. Both must predict the same."""

import pytest
import torch
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

from autoshard.core import meta
from autoshard.compiler import compile_step
from autoshard.core.config import Config
from autoshard.core.models import GPT, tiny_hf
from autoshard.core.simulate import simulate, simulate_joint

CONFIGS = {
    "gpt": (lambda: GPT(layers=3), Config()),
    "gpt_bf16_offload": (lambda: GPT(layers=3), Config(
        mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        offload_policy=CPUOffloadPolicy(), device_profile="h100")),
    "hf_llama_blocks": (lambda: tiny_hf("llama", layers=3), Config(recompute="blocks")),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_joint_prediction_is_the_split_prediction(name):
    make, cfg = CONFIGS[name]
    model = make()
    x = torch.zeros(2, 16, dtype=torch.long)
    args, kwargs = ((x,), {}) if name.startswith("gpt") else ((), {"input_ids": x})
    cap, ctx, plan = compile_step(model, type(model).forward, args, kwargs, world_size=4,
                                  group_name="plan", device=torch.device("cpu"), config=cfg)
    host = ctx.sim_host_bytes
    n_user = sum(r[meta.ROLE] == meta.OUT_FWD for r in ctx.split.fwd_roles)
    split = simulate(ctx.split.fwd, ctx.split.bwd, ctx.profile, ctx.sim_static_bytes, n_user,
                     host)
    joint = simulate_joint(cap.gm, ctx.profile, ctx.sim_static_bytes, host)
    for field in ("total", "compute", "exposed_comm", "peak_bytes", "peak_at",
                  "host_peak_bytes", "both_peak_bytes", "comm_bytes"):
        assert getattr(joint, field) == getattr(split, field), field
    assert [t[1] for t in joint.timeline] == [t[1] for t in split.timeline]
    assert plan.predicted["peak_bytes"] == split.peak_bytes

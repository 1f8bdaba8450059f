"""splice records the collectives' packing with a dispatch mode (``autoshard.graph.record``)
instead of make_fx; the programs must be the same node for node."""

import types

import pytest
import torch
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

from autoshard import depth, graph
from autoshard._compat import make_fx
from autoshard.api import compile_step
from autoshard.config import Config
from autoshard.models import GPT, tiny_hf

CONFIGS = {
    "gpt_ws4": (lambda: GPT(layers=2), 4, Config(policy="module")),
    "gpt_ws3_per_parameter": (lambda: GPT(layers=1), 3, Config(policy="per-parameter")),
    "gpt_bf16_offload": (lambda: GPT(layers=2), 4, Config(
        mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        offload_policy=CPUOffloadPolicy(), device_profile="h100")),
    "hf_llama_ws1": (lambda: tiny_hf("llama", layers=2), 1, Config()),
}


def _program(make, world, cfg):
    model = make()
    x = torch.zeros(2, 16, dtype=torch.long)
    args, kwargs = ((x,), {}) if isinstance(model, GPT) else ((), {"input_ids": x})
    graph._TRACES.clear()
    _, ctx, _ = compile_step(model, type(model).forward, args, kwargs, world_size=world,
                             group_name="g", device=torch.device("cpu"), config=cfg)
    return ctx.split


def _as_captured(gm):
    fields = ("buffer_fqns", "mutated_buffers", "grad_tangents", "diff_outputs",
              "input_grads", "in_consts", "out_consts", "has_backward")
    return types.SimpleNamespace(gm=gm, **{f: None for f in fields})


@pytest.mark.parametrize("name", list(CONFIGS))
def test_recorded_packing_is_make_fx_packing(name, monkeypatch):
    recorded = _program(*CONFIGS[name])
    monkeypatch.setattr(graph, "record",
                        lambda fn, vals: make_fx(fn, tracing_mode="fake")(*vals))
    traced = _program(*CONFIGS[name])
    for a, b in ((recorded.fwd, traced.fwd), (recorded.bwd, traced.bwd)):
        assert depth.difference(_as_captured(a), _as_captured(b)) == ""

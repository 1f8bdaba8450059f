"""Building a deep stack of identical blocks from a shallow trace (autoshard.compiler.depth)."""

import pytest
import torch

from autoshard.compiler import depth
from autoshard.compiler import compile_step
from autoshard.compiler.capture import capture
from autoshard.core.config import Config
from autoshard.core.models import GPT, tiny_hf
from autoshard.core.spec import param_specs
from tests.models import CheckpointedGPT


def _capturer(model, args, kwargs):
    def trace(specs):
        return capture(model, type(model).forward, specs, dict(model.named_buffers()), args,
                       kwargs, device=torch.device("cpu"), with_grad=True)
    return trace


CASES = {
    "gpt": (lambda: GPT(layers=13), ((torch.zeros(2, 16, dtype=torch.long),), {})),
    "gpt_fused": (lambda: GPT(layers=12, fused_attention=True),
                  ((torch.zeros(2, 16, dtype=torch.long),), {})),
    "hf_llama": (lambda: tiny_hf("llama", layers=12),
                 ((), {"input_ids": torch.zeros(2, 16, dtype=torch.long)})),
}


@pytest.mark.parametrize("name", list(CASES))
def test_built_graph_is_the_traced_graph(name):
    make, (args, kwargs) = CASES[name]
    model = make()
    path, n = depth.block_stack(model)
    specs = param_specs(model, None, mesh_shape=(4,))
    trace = _capturer(model, args, kwargs)
    built = depth.capture_deep(model, path, n, specs, trace)
    assert built is not None
    traced = trace(specs)
    assert depth.difference(built, traced) == ""
    assert [p.fqn for p in built.params] == [p.fqn for p in traced.params]
    vals = [id(v.meta["val"]) for v in built.gm.graph.nodes
            if isinstance(v.meta.get("val"), torch.Tensor)]
    assert len(vals) == len(set(vals))  # make_fx would merge two inputs that are one tensor


def test_the_plan_is_the_same_built_or_traced():
    """Every candidate the planner tries predicts the same time and peak on both graphs (a
    tight budget, so the unit and recomputation search runs)."""
    with torch.device("meta"):
        model = GPT(vocab=512, dim=256, heads=4, layers=12, seq=128, fused_attention=True)
    x = torch.zeros(2, 128, dtype=torch.long)
    cfg = Config(memory_budget=48 * 2**20, device_profile="h100")
    got = []
    for shallow in (True, False):
        _, ctx, plan = compile_step(model, type(model).forward, (x,), {}, world_size=8,
                                    group_name="plan", device=torch.device("cpu"),
                                    config=cfg, from_shallow=shallow)
        got.append([(c["recompute"], c["units"], c["step_s"], c["peak_bytes"])
                    for c in plan.candidates])
    assert len(got[0]) > 3
    assert got[0] == got[1]


def test_blocks_that_differ_are_traced_whole():
    model = GPT(layers=12)
    model.blocks[7].fc = torch.nn.Linear(32, 128, bias=False)
    assert depth.block_stack(model) is None
    assert depth.block_stack(GPT(layers=depth.MIN_DEPTH - 1)) is None


def test_checkpointed_blocks_are_traced_whole():
    model = CheckpointedGPT(layers=12)
    said = []
    trace = _capturer(model, (torch.zeros(2, 16, dtype=torch.long),), {})
    specs = param_specs(model, None, mesh_shape=(2,))
    assert depth.capture_deep(model, "blocks", 12, specs, trace, said.append) is None
    assert "checkpointed" in said[0]


def test_a_step_without_gradients_is_built_too():
    model = GPT(layers=12)
    x = torch.zeros(2, 16, dtype=torch.long)
    specs = param_specs(model, None, mesh_shape=(2,))
    with torch.no_grad():
        trace = _capturer(model, (x,), {})
        built = depth.capture_deep(model, "blocks", 12, specs, trace)
        assert built is not None and not built.has_backward
        assert depth.difference(built, trace(specs)) == ""

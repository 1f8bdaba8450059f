"""The "auto" unit policy against the fixed ones, on the cost model's own predictions."""

import pytest
import torch

import autoshard
from autoshard import AutoshardError, Config, Module, Offload, Size
from autoshard.core.models import GPT
from models import build

SMALL = Size(min_numel=20000)  # several units of these small models
FIXED = ["module", SMALL, "per-parameter", "whole-model"]


def _plan(model, inputs, **cfg):
    return autoshard.plan(model, inputs, world_size=8, config=Config(device_profile="h100",
                                                                      **cfg))


def _models():
    return {
        "gpt": (GPT(layers=4), (torch.randint(0, 96, (4, 16)),)),
        "hf_llama": (build("hf_llama"), {"input_ids": torch.randint(0, 96, (4, 16))}),
    }


@pytest.mark.parametrize("name", ["gpt", "hf_llama"])
def test_auto_is_never_predicted_slower_than_a_fixed_policy_that_fits(name):
    model, inputs = _models()[name]
    fixed = {p: _plan(model, inputs, policy=p) for p in FIXED}
    peaks = sorted(p.predicted["peak_bytes"] for p in fixed.values())
    # a roomy budget, and budgets between the fixed policies' peaks
    budgets = [10 * peaks[-1]] + [(a + b) // 2 for a, b in zip(peaks, peaks[1:]) if a != b]
    for budget in budgets:
        # for speed: the default (prefer="memory") may take a slower plan lighter than
        # FSDP2's by its target (tests/passes/test_prefer.py)
        auto = _plan(model, inputs, memory_budget=budget, prefer="speed")
        assert auto.predicted["peak_bytes"] <= budget
        for policy, plan in fixed.items():
            if plan.predicted["peak_bytes"] <= budget:
                assert auto.predicted["step_s"] <= plan.predicted["step_s"] * (1 + 1e-9), (
                    f"budget {budget}: auto {auto.predicted['step_s']} > {policy} "
                    f"{plan.predicted['step_s']}")


def test_units_shrink_with_the_budget():
    """Under the speed search (the default may recompute blocks instead of splitting units
    to meet its target against FSDP2's plan: tests/passes/test_prefer.py)."""
    model, inputs = _models()["gpt"]
    roomy = _plan(model, inputs, prefer="speed")
    finest = _plan(model, inputs, policy="per-parameter", bucket=False)
    last_count, last_max = 0, float("inf")
    top, low = roomy.predicted["peak_bytes"], finest.predicted["peak_bytes"]
    for frac in (1.0, 0.5, 0.2):
        plan = _plan(model, inputs, memory_budget=int(low + (top - low) * frac),
                     prefer="speed")
        biggest = max(u.bytes for u in plan.units)
        assert len(plan.units) >= last_count and biggest <= last_max
        last_count, last_max = len(plan.units), biggest
    assert last_count > len(roomy.units)


@pytest.mark.slow  # about 60 s: in the whole suite, not in CI's tier
def test_no_plan_fits_names_the_smallest_budget_that_would():
    from torch.distributed.fsdp import OffloadPolicy

    model, inputs = _models()["gpt"]
    # on the device only, and (the default) with offload as the last resort
    for offload, smallest in ((OffloadPolicy(), "units)"), (None, "state + params)")):
        with pytest.raises(AutoshardError, match=r"needs ([\d.]+ \w+)") as e:
            _plan(model, inputs, memory_budget=100_000, offload_policy=offload)
        assert smallest in str(e.value)
        # every block recomputed whole, what crosses then in host memory (activation
        # offload), and, the state offloaded, every shard copied in for each all-gather: the
        # least device memory
        whole = {**{f"blocks.{i}": "block" for i in range(4)}, "*": "offload"}
        finest = _plan(model, inputs, policy="per-parameter", bucket=False, recompute=whole,
                       offload_policy=Offload(params=1.0) if offload is None else offload)
        assert autoshard.core.plans.fmt_bytes(finest.predicted["peak_bytes"]) in str(e.value)
        # and that budget is enough
        _plan(model, inputs, memory_budget=finest.predicted["peak_bytes"],
              offload_policy=offload)


def test_pinned_units_round_trip_through_json():
    model, inputs = _models()["gpt"]
    plan = _plan(model, inputs, policy="module")
    again = autoshard.Plan.from_json(plan.to_json())
    pinned = _plan(model, inputs, units=again.pinned_units())
    assert [u.fqns for u in pinned.units] == [u.fqns for u in plan.units]
    assert pinned.policy == "pinned"


def test_module_policy_by_class_name_and_pattern():
    model, inputs = _models()["gpt"]
    by_class = _plan(model, inputs, policy=Module(classes=["Block"]))
    by_pattern = _plan(model, inputs, policy=Module(pattern=r"blocks\.[0-9]+"))
    names = [u.name for u in by_class.units]
    assert names == ["root", "blocks.0", "blocks.1", "blocks.2", "blocks.3"]
    assert [u.name for u in by_pattern.units] == names


def test_size_policy_makes_units_of_at_least_the_minimum():
    model, inputs = _models()["gpt"]
    plan = _plan(model, inputs, policy=SMALL)
    assert all(u.numel >= 20000 for u in plan.units)
    assert len(plan.units) > 1


@pytest.mark.parametrize("world", [1, 3, 512])
def test_segment_costs_are_the_cost_models(world):
    """The DP's segment costs equal the cost model's collective times float for float (its
    choices follow them, ties included): mixed dtypes, a frozen and an unsharded parameter."""
    from autoshard.core.cost import collective_time, get_profile
    from autoshard.passes.auto import _Segments
    from autoshard.core.spec import ParamSpec

    shapes = [(96, 64), (64,), (), (7, 5), (300, 8), (1,)]
    dtypes = [torch.float32, torch.bfloat16, torch.float32, torch.bfloat16, torch.float32,
              torch.float32]
    specs = {f"p{k}": ParamSpec(f"p{k}", shape, torch.float32, k != 3, compute_dtype=dtype,
                                reduce_dtype=torch.float32, mesh_shape=(world,))
             for k, (shape, dtype) in enumerate(zip(shapes, dtypes))}
    profile = get_profile("h100")
    seg = _Segments(list(specs), specs, profile)

    def cost(j, i):  # collective_time per dtype, as the cost model prices one unit
        c = 0.0
        for d in seg.dtypes:
            a, r = seg.ag[d][i] - seg.ag[d][j], seg.rs[d][i] - seg.rs[d][j]
            if a:
                c += 2 * collective_time(a, world, profile)
            if r:
                c += collective_time(r, world, profile)
        return c

    for i in range(1, len(specs) + 1):
        js = range(i - 1, -1, -1)
        assert seg.costs(i, js) == [cost(j, i) for j in js]
    assert seg.cost(0, len(specs)) == cost(0, len(specs)) > 0

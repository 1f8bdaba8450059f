"""Config.prefer: on a CPU the default plan trades speed for memory against FSDP2's plan and
says why; on a GPU profile it is never predicted slower or heavier than FSDP2's plan and
takes the lightest within 2% of the fastest; prefer="speed" takes the fastest plan that
fits."""

import pytest
import torch

import autoshard
from autoshard import Config, Prefetch
from autoshard.core.models import GPT
from autoshard.planner import IMMATERIAL, NEAR, PEAK_TARGET, STEP_CAP

# a GPT whose fastest plan (one unit) peaks just above PEAK_TARGET of FSDP2's plan's
# predicted peak
MODEL = dict(vocab=96, dim=64, heads=4, layers=4, seq=32)
INPUTS = (torch.randint(0, 96, (4, 32), generator=torch.Generator().manual_seed(0)),)


def _plan(**config):
    return autoshard.plan(GPT(**MODEL), INPUTS, world_size=2, config=Config(**config))


@pytest.fixture(scope="module")
def plans():
    return {prefer: _plan(prefer=prefer) for prefer in ("memory", "speed")}


def _chosen(plan):
    (row,) = [c for c in plan.candidates if c["chosen"]]
    return row


def test_the_default_takes_the_fastest_plan_within_the_target_and_says_why(plans):
    plan = plans["memory"]
    ref_peak, ref_step = plan.predicted["fsdp2_peak_bytes"], plan.predicted["fsdp2_step_s"]
    fits = [c for c in plan.candidates if c["fits"]]
    fastest = min(fits, key=lambda c: c["step_s"])
    assert fastest["peak_bytes"] > PEAK_TARGET * ref_peak  # the fastest misses the target
    meeting = [c for c in fits if c["peak_bytes"] <= PEAK_TARGET * ref_peak
               and c["step_s"] <= STEP_CAP * ref_step]
    assert _chosen(plan) is min(meeting, key=lambda c: c["step_s"])
    # the fastest misses the target: recomputing whole blocks is tried too (with
    # Config(recompute=True) only a fallback otherwise), against smaller units
    labels = {c["recompute"] for c in plan.candidates}
    assert "min-cut" in labels and any(label.startswith("blocks") for label in labels)
    speed = {c["recompute"] for c in plans["speed"].candidates}
    assert not any(label.startswith("blocks") for label in speed)
    assert _chosen(plan) is not fastest
    assert plan.predicted["peak_bytes"] <= PEAK_TARGET * ref_peak
    slower = round(100 * (plan.predicted["step_s"] / fastest["step_s"] - 1))
    assert plan.choice == (
        f"the fastest plan peaks at {fastest['peak_bytes'] / ref_peak:.2f}x FSDP2's plan's "
        f"predicted peak ({autoshard.core.plans.fmt_bytes(ref_peak)}); chose the fastest within "
        f"{PEAK_TARGET}x ({plan.predicted['peak_bytes'] / ref_peak:.2f}x), {slower}% slower; "
        "Config(prefer='speed') takes the fastest")
    text = " ".join(str(plan).split())
    assert f"chosen: {plan.choice}" in text and "FSDP2's plan (predicted)" in text
    again = autoshard.Plan.from_json(plan.to_json())
    assert again == plan and again.choice == plan.choice


def test_prefer_speed_takes_the_fastest(plans):
    memory, speed = plans["memory"], plans["speed"]
    fastest = min((c for c in speed.candidates if c["fits"]), key=lambda c: c["step_s"])
    assert _chosen(speed) is fastest
    assert speed.predicted["step_s"] < memory.predicted["step_s"]
    assert speed.predicted["peak_bytes"] > memory.predicted["peak_bytes"]
    assert speed.choice is None and "fsdp2_peak_bytes" not in speed.predicted
    # the same candidates were predicted either way
    assert {(c["units"], c["step_s"]) for c in speed.candidates} <= {
        (c["units"], c["step_s"]) for c in memory.candidates}


def test_the_reference_is_fsdp2s_plan(plans):
    """One unit per block plus the root, resharded but the root, nothing recomputed, a
    prefetch of one: the plan the module policy makes so, predicted alike."""
    fsdp2 = _plan(policy="module", recompute=False, prefetch=Prefetch(depth=1), prefer="speed")
    assert len(fsdp2.units) == MODEL["layers"] + 1 and fsdp2.reshard == "all but the last"
    assert fsdp2.predicted["peak_bytes"] == plans["memory"].predicted["fsdp2_peak_bytes"]
    assert fsdp2.predicted["step_s"] == pytest.approx(plans["memory"].predicted["fsdp2_step_s"])


def test_prefer_is_checked():
    with pytest.raises(ValueError, match="Config.prefer='fast' is not accepted.*'speed'"):
        Config(prefer="fast")


def test_offload_activations_plans_with_the_reference_and_symbolically():
    """``offload_activations=True`` with the default ``prefer``: FSDP2's reference plan
    offloads nothing, and ``plan(make_inputs=...)`` refits with the blocks' choices pinned
    (each block's offload named by the pinned recomputation)."""
    def make(batch, seq):
        return (torch.zeros(batch, seq, dtype=torch.long),)

    plan = autoshard.plan(GPT(layers=2), world_size=2, config=Config(offload_activations=True),
                          make_inputs=make, batch=2, seq=16)
    assert plan.predicted["fsdp2_peak_bytes"] is not None
    assert set(plan.recompute_blocks.values()) == {"offload"}
    assert plan.symbolic is not None


# --- on a GPU profile: "balanced" -----------------------------------------------------------


def test_auto_is_memory_on_a_cpu_and_balanced_on_a_gpu_profile(plans):
    from autoshard.core.cost import PROFILES
    from autoshard.planner import preference

    assert Config().prefer == "auto"
    assert preference(Config(), PROFILES["cpu"]) == "memory"
    for name in ("h100", "a100", "h200"):
        assert preference(Config(), PROFILES[name]) == "balanced"
    assert preference(Config(prefer="speed"), PROFILES["h100"]) == "speed"
    assert _plan() == plans["memory"]  # the cpu profile, this machine's default


@pytest.mark.parametrize("profile", ["h100", "a100", "h200"])
def test_balanced_is_never_slower_or_heavier_than_fsdp2s_plan(profile):
    """The default on a GPU profile: no slower and no heavier than FSDP2's plan (a peak above
    it by under IMMATERIAL of the budget counts as no higher); of the plans that are, those
    within 2% of the fastest's step, the lightest."""
    plan = _plan(device_profile=profile)
    ref_step = plan.predicted["fsdp2_step_s"]
    ref_peak = plan.predicted["fsdp2_peak_bytes"] + IMMATERIAL * plan.memory_budget
    assert plan.predicted["step_s"] <= ref_step and plan.predicted["peak_bytes"] <= ref_peak
    fits = [c for c in plan.candidates if c["fits"] and c["step_s"] is not None
            and c["step_s"] <= ref_step and c["peak_bytes"] <= ref_peak]
    fastest = min(c["step_s"] for c in fits)
    near = [c for c in fits if c["step_s"] <= fastest * (1 + NEAR)]
    assert _chosen(plan)["peak_bytes"] == min(c["peak_bytes"] for c in near)
    speed = _plan(device_profile=profile, prefer="speed")
    assert plan.predicted["step_s"] <= speed.predicted["step_s"] * (1 + NEAR)


def _mlp_plan(**config):
    """A stack of 48 Linear(8, 8) blocks at world size 1 on the h200 profile: the
    launch-bound regime, where the fastest plan (one unit) peaks some KiB above FSDP2's
    plan (one unit per block) and is predicted many times faster."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
                                  for _ in range(48)])
    return autoshard.plan(model, (torch.randn(4, 8),), world_size=1,
                          config=Config(device_profile="h200", **config))


def test_balanced_takes_the_fastest_where_it_is_heavier_by_bytes_that_buy_nothing():
    plan = _mlp_plan()
    ref_peak, ref_step = plan.predicted["fsdp2_peak_bytes"], plan.predicted["fsdp2_step_s"]
    assert len(plan.units) == 1 and ref_peak < plan.predicted["peak_bytes"]
    assert plan.predicted["peak_bytes"] <= ref_peak + IMMATERIAL * plan.memory_budget
    assert plan.predicted["step_s"] < ref_step / 10
    assert plan.choice.startswith("the plan peaks ") and "which buys nothing" in plan.choice
    # where the same bytes are material (a budget a few times the plan's peak), the default
    # stays within FSDP2's plan's peak, slower
    tight = _mlp_plan(memory_budget=int(4 * ref_peak))
    assert tight.predicted["peak_bytes"] <= tight.predicted["fsdp2_peak_bytes"]
    assert tight.predicted["step_s"] > plan.predicted["step_s"]
    assert "chose the fastest within FSDP2's plan's predicted step and peak" in tight.choice


def test_balanced_builds_fsdp2s_plan_on_a_graph_too_big_to_search_whole(monkeypatch):
    """Past BIG_GRAPH nodes the search bisects for the first grouping that fits, which need
    not be as fast as FSDP2's plan: that plan is built as a candidate, and taken when the
    search finds nothing faster."""
    from autoshard import planner as plan_mod

    monkeypatch.setattr(plan_mod, "BIG_GRAPH", 10)
    monkeypatch.setattr("autoshard.planner.search.BIG_GRAPH", 10)
    monkeypatch.setattr("autoshard.passes.auto.BIG_GRAPH", 10)
    plan = _plan(device_profile="h100")
    fsdp2 = _plan(device_profile="h100", policy="module", recompute=False,
                  prefetch=Prefetch(depth=1), bucket=False, offload_activations=False,
                  prefer="speed")
    assert plan.predicted["fsdp2_step_s"] == pytest.approx(fsdp2.predicted["step_s"])
    assert plan.predicted["step_s"] <= fsdp2.predicted["step_s"]
    assert plan.predicted["peak_bytes"] <= fsdp2.predicted["peak_bytes"]
    assert any(c["note"].startswith("FSDP2's plan") for c in plan.candidates)

"""The default plan of torchtitan's llama3 debug model (width 64, 2 layers, vocabulary 256),
planned only, against FSDP2's plan (Config.prefer="memory"). At 2 sequences of 32 tokens per
rank the parameters and their full gradients outweigh the activations: the one-unit plan
peaks at FSDP2's plan's peak, and every lighter grouping pays a collective's latency per unit
(predicted over 1.25x FSDP2's plan's step), so the fastest is kept and the plan says why. At
8 sequences the activations the min cut does not save make the difference. Skipped where
torchtitan is not installed (``.ci/run`` installs it)."""

import torch

import autoshard
from autoshard.planner import PEAK_TARGET, STEP_CAP
from torchtitan_workers import SEQ, VOCAB, build_model, import_torchtitan, torchtitan_or_skip

torchtitan_or_skip()


def _plan(batch):
    tokens = torch.randint(0, VOCAB, (batch, SEQ), generator=torch.Generator().manual_seed(0))
    return autoshard.plan(build_model(import_torchtitan()), (tokens,), world_size=2)


def test_where_parameters_outweigh_activations_the_plan_says_why_it_keeps_the_fastest():
    plan = _plan(2)
    ratio = plan.predicted["peak_bytes"] / plan.predicted["fsdp2_peak_bytes"]
    assert ratio > PEAK_TARGET
    fastest = min((c for c in plan.candidates if c["fits"]), key=lambda c: c["step_s"])
    assert fastest["chosen"] and fastest["units"] == 1
    assert plan.choice.startswith(f"the fastest plan peaks at {ratio:.2f}x FSDP2's plan's")
    assert (f"no plan within {PEAK_TARGET}x is predicted within {STEP_CAP}x of its step"
            in plan.choice)


def test_with_more_activations_the_default_plan_peaks_within_the_target():
    plan = _plan(8)
    assert plan.predicted["peak_bytes"] <= PEAK_TARGET * plan.predicted["fsdp2_peak_bytes"]
    assert plan.choice is None

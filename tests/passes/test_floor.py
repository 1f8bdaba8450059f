"""The planner's memory lower bound (``autoshard.passes.floor``): never above the predicted
peak of a candidate the search lowers.

A bound above the peak would drop a plan that fits, unbuilt. Each case plans a small model
with the "auto" unit policy (several groupings), watching every candidate the search lowers
with the resharding its bound was computed for, and compares the bound with the prediction;
together they cover each term of the bound: recomputation and activation offload (every
choice of ``recompute="auto"``), gradients cast for their reduction or not, every strategy
and resharding (kept, resharded, hpZ), prefetch one or two ahead, bounded by bytes or off,
padded and unsharded parameters, a profile whose host is the device, the sharded state in
host memory, and a big graph's search."""

import dataclasses

import pytest
import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

import autoshard
import autoshard.planner as plan_mod
import autoshard.planner.search as search_mod
from autoshard import Config, Offload, Prefetch
from autoshard.core.cost import PROFILES
from autoshard.core.models import GPT
from models import CheckpointedGPT, build

BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16)  # gradients reduced in bf16
BF16_FP32 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
# links so fast that the compute between two all-gathers covers each: prefetch goes one ahead
FAST = dataclasses.replace(PROFILES["h100"], name="fast links", alpha=0.0, beta=1e-15,
                           inter_beta=1e-15)


def _tokens(batch=4, seq=16):
    return (torch.randint(0, 96, (batch, seq)),)


CASES = {
    # every recomputation choice; gradients cast to fp32 for their reduction
    "gpt-auto-cast": (lambda: GPT(layers=4), _tokens, 8,
                      dict(recompute="auto", mp_policy=BF16_FP32)),
    # as GPT-175B on 512 ranks, smaller: parameters outweigh activations, communication
    # outlasts compute (prefetch two ahead), gradients reduced in bf16
    "gpt-wide": (lambda: GPT(layers=4, dim=512, heads=8, seq=64, fused_attention=True),
                 lambda: _tokens(1, 64), 64, dict(recompute="auto", mp_policy=BF16)),
    # zero1, zero2 (every unit kept) and zero3, reduced in the compute dtype
    "gpt-strategies": (lambda: GPT(layers=4), _tokens, 8,
                       dict(strategy="auto", mp_policy=BF16)),
    "gpt-hpz": (lambda: GPT(layers=4), _tokens, 8, dict(reshard_after_forward=2)),
    "gpt-fast-links": (lambda: GPT(layers=4, dim=256), lambda: _tokens(1, 8), 8,
                       dict(device_profile=FAST, mp_policy=BF16)),
    "llama-resharded": (lambda: build("hf_llama"), lambda: {"input_ids": _tokens()[0]}, 8,
                        dict(reshard_after_forward=True, prefetch=Prefetch(depth=1))),
    # gradients and reduced shards split out of one tensor (which the prediction does not
    # follow), over two ranks
    "bert-cast": (lambda: build("hf_bert"), lambda: {"input_ids": _tokens()[0]}, 2,
                  dict(recompute="auto", mp_policy=BF16_FP32)),
    # dim-0 sizes no rank count divides, a scalar, a frozen parameter; the host is the device
    "odd-cpu": (lambda: build("odd"), lambda: (torch.randn(4, 6),), 4,
                dict(device_profile="cpu", prefetch=Prefetch(bytes=1024))),
    "checkpointed": (lambda: CheckpointedGPT(layers=2), _tokens, 2,
                     dict(prefetch=False, recompute="auto")),
    "gpt-state-on-host": (lambda: GPT(layers=2), _tokens, 4,
                          dict(offload_policy=Offload(state=0.5), mp_policy=BF16_FP32)),
}


def _bounds(monkeypatch) -> list:
    """Record, for every candidate the search lowers with the resharding its unit candidates
    were bounded for, ``(bound, predicted peak, candidate)``."""
    rows, lower = [], search_mod.lower

    def spy(base, hosting, cand, config, cache, **kw):
        low = lower(base, hosting, cand, config, cache, **kw)
        if "tries" in cache and cand.reshard == hosting.ctx.reshard_after_forward:
            rows.append((cache["tries"][cand.units][1], low.prediction.peak_bytes, cand))
        return low

    monkeypatch.setattr(search_mod, "lower", spy)
    return rows


def _check(rows) -> None:
    assert rows, "no unit candidate was lowered"
    over = [(b, peak, cand) for b, peak, cand in rows if b > peak]
    assert not over, f"bounds above the predicted peak: {over}"
    # and it is no trivial bound: at least the half of every peak
    assert all(b >= peak // 2 for b, peak, _ in rows), rows


@pytest.mark.parametrize("name", list(CASES))
def test_the_bound_never_exceeds_a_lowered_candidates_predicted_peak(monkeypatch, name):
    factory, inputs, world, config = CASES[name]
    rows = _bounds(monkeypatch)
    autoshard.plan(factory(), inputs(), world_size=world,
                   config=Config(**{"device_profile": "h100", **config}))
    _check(rows)


def test_the_bound_holds_on_a_big_graphs_search(monkeypatch):
    """Over ``BIG_GRAPH`` nodes the first candidate that fits is searched for (the first,
    second, fourth ... then bisected), under a budget that leaves some candidates out."""
    rows = _bounds(monkeypatch)
    model, inputs = GPT(layers=4), _tokens()
    roomy = autoshard.plan(model, inputs, world_size=8, config=Config(device_profile="h100"))
    monkeypatch.setattr(plan_mod, "BIG_GRAPH", 0)
    monkeypatch.setattr(search_mod, "BIG_GRAPH", 0)
    budget = roomy.predicted["peak_bytes"] * 3 // 4
    plan = autoshard.plan(model, inputs, world_size=8,
                          config=Config(device_profile="h100", recompute="auto",
                                        memory_budget=budget))
    assert plan.predicted["peak_bytes"] <= budget
    _check(rows)

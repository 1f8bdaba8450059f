"""What the plan predicts against what the runtime measures (gloo, world size 2).

The event order is the sequence of all-gathers, reduce-scatters, waits and frees seen by a
dispatch mode while the step runs; the memory is the allocator's live bytes (torch.profiler's
allocation events) on top of the model state held when the step starts.

Prefetch is off here: with gathers in flight across compute, gloo's scratch copy of each
buffer lives until its worker thread finishes, so the measured peak moves by several percent
from run to run with thread timing. Even without prefetch, gloo's clone of a reduce-scatter's
input goes when its worker thread gets to it, and an all-gather's staging copy, which the
calling thread frees as it hands the work over, lives on beside the worker's own buffer of the
same size when the worker starts first (on a busy machine Llama's blocks variant measured one
gathered buffer, 148 kB, more at its peak: 1.21 MB for the 1.07 predicted and otherwise
measured). That only ever adds, so the measured peak is the least of five identical steps."""

import pytest
import torch

from harness import run_ranks
from models import CASES, build, call

STEPS = 5  # recorded steps of which the least peak counts (gloo's thread timing only adds)


def _measure(rank, world, payload):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from autoshard import Config, Offload, autoshard

    name, variant = payload
    mp = None
    if variant == "bf16":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    recompute = {"keep": False, "blocks": "blocks"}.get(variant, True)
    offloaded = variant.startswith("offload")
    model = autoshard(build(name), config=Config(
        policy="module", prefetch=False, mp_policy=mp, recompute=recompute,
        offload_policy=Offload(state=0.5 if variant == "offload 1/2" else None, params=0.5,
                               pin_memory=False) if offloaded else None))
    _, data, _, loss_fn = CASES[name]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = data(torch.Generator().manual_seed(0), 8)
    x, y = x.chunk(world)[rank], y.chunk(world)[rank]
    for _ in range(2):  # the optimizer state exists, as in any later step
        loss_fn(call(name, model, x), y).backward()
        opt.step()
        opt.zero_grad()
    recs = []
    for _ in range(STEPS):
        with model.record(opt, x, y) as rec:
            loss_fn(call(name, model, x), y).backward()
        recs.append(rec)
        opt.zero_grad()  # each step starts without gradients, as the plan assumes
    plan = model.plan
    return {
        "planned": [(e.op, e.bytes) for e in plan.schedule],
        "measured": recs[0].events,
        # on this machine the host is the device: device and host bytes at once
        "predicted_peak": plan.predicted["both_peak_bytes"],
        "measured_peak": min(r.peak_bytes for r in recs),
    }


# fp32 with the min cut (the default), bf16 parameters and compute (fp32 reduce), fp32 with
# each other recomputation choice (nothing recomputed, every block recomputed whole), and fp32
# offloaded (CPUOffloadPolicy; half the units copy their shards in again for the backward, the
# others hold the forward's copy): all of the state for the GPT, the last half for Llama
@pytest.mark.parametrize("name,variant", [
    (name, variant) for name in ("gpt", "hf_llama")
    for variant in ("fp32", "bf16", "keep", "blocks",
                    "offload" if name == "gpt" else "offload 1/2")])
def test_measured_step_matches_the_plan(name, variant):
    for r in run_ranks(2, _measure, (name, variant)):
        assert r["measured"] == r["planned"]
        ratio = r["predicted_peak"] / r["measured_peak"]
        assert 0.9 <= ratio <= 1.1, f"predicted {r['predicted_peak']} measured {r['measured_peak']}"


def _measure_at(rank, world, payload):
    from autoshard import Config, autoshard
    from autoshard.core.models import GPT, gpt_loss

    units, batch = payload
    torch.manual_seed(0)
    model = autoshard(GPT(seq=32), config=Config(units=units, prefetch=False))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 96, (batch, 17), generator=torch.Generator().manual_seed(rank))
    x, y = x[:, :-1], x[:, 1:]
    for _ in range(2):
        gpt_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    peaks = []
    for _ in range(3):
        with model.record(opt, x, y) as rec:
            gpt_loss(model(x), y).backward()
        peaks.append(rec.peak_bytes)
        opt.zero_grad()
    return min(peaks)


def test_symbolic_memory_predicts_a_larger_batch_and_the_largest_that_fits():
    import sympy

    import autoshard
    from autoshard.core.models import GPT

    def make(b, s):
        return (torch.randint(0, 96, (b, s)),)

    plan = autoshard.plan(GPT(seq=32), world_size=2, make_inputs=make, batch=4, seq=16,
                          config=autoshard.Config(policy="module", prefetch=False))
    batch, seq = sympy.symbols("batch seq", positive=True)
    memory = sympy.sympify(plan.symbolic["memory"], locals={"batch": batch, "seq": seq})
    predicted_12 = float(memory.subs({batch: 12, seq: 16}))
    measured_12 = run_ranks(2, _measure_at, (plan.pinned_units(), 12))[0]
    assert 0.9 <= predicted_12 / measured_12 <= 1.1, (predicted_12, measured_12)
    budget = int(float(memory.subs({batch: 10, seq: 16}))) + 1
    assert plan.max_batch_size(budget) == 10
    measured_10 = run_ranks(2, _measure_at, (plan.pinned_units(), 10))[0]
    assert measured_10 <= budget * 1.1

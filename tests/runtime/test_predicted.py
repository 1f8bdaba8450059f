"""What the plan predicts against what the runtime measures (gloo, world size 2).

The event order is the sequence of all-gathers, reduce-scatters, waits and frees seen by a
dispatch mode while the step runs; the memory is the allocator's live bytes (torch.profiler's
allocation events) on top of the model state held when the step starts."""

import pytest
import torch

from harness import run_ranks
from models import CASES, build


def _measure(rank, world, name):
    from autoshard import Config, autoshard

    model = autoshard(build(name), config=Config(policy="module"))
    _, data, call, loss_fn = CASES[name]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = data(torch.Generator().manual_seed(0), 8)
    x, y = x.chunk(world)[rank], y.chunk(world)[rank]
    for _ in range(2):  # the optimizer state exists, as in any later step
        loss_fn(call(model, x), y).backward()
        opt.step()
        opt.zero_grad()
    with model.record(opt, x, y) as rec:
        loss_fn(call(model, x), y).backward()
    plan = model.plan
    return {
        "planned": [(e.op, e.bytes) for e in plan.schedule],
        "measured": rec.events,
        "predicted_peak": plan.predicted["peak_bytes"],
        "measured_peak": rec.peak_bytes,
    }


@pytest.mark.parametrize("name", ["gpt", "hf_llama"])
def test_measured_step_matches_the_plan(name):
    for r in run_ranks(2, _measure, name):
        assert r["measured"] == r["planned"]
        ratio = r["predicted_peak"] / r["measured_peak"]
        assert 0.9 <= ratio <= 1.1, f"predicted {r['predicted_peak']} measured {r['measured_peak']}"

"""With prefetch, gloo's collectives run while the rank computes: the recorded timeline of a
real two-rank step shows gathers issued ahead of their use and time in flight not waited."""

import json

import torch

from harness import run_ranks


def _record(rank, world, path):
    from autoshard import Config, autoshard
    from autoshard.core.models import GPT, gpt_loss

    torch.manual_seed(0)
    model = autoshard(GPT(layers=4), config=Config(policy="module"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 96, (4, 17), generator=torch.Generator().manual_seed(rank))
    for _ in range(2):
        gpt_loss(model(x[:, :-1]), x[:, 1:]).backward()
        opt.step()
        opt.zero_grad()
    with model.record(opt, x) as rec:
        gpt_loss(model(x[:, :-1]), x[:, 1:]).backward()
    if rank == 0:
        rec.to_chrome_trace(path)
    return {"events": rec.events, "overlap": rec.overlap(), "n": len(rec.collectives)}


def test_prefetched_gathers_are_in_flight_while_the_rank_computes(tmp_path):
    path = str(tmp_path / "trace.json")
    for r in run_ranks(2, _record, path):
        # some all-gather is issued while an earlier one is not yet waited for
        pending, ahead = 0, 0
        for op, _ in r["events"]:
            if op == "all_gather":
                ahead += pending > 0
                pending += 1
            elif op == "wait" and pending:
                pending -= 1
        assert ahead >= 1
        ov = r["overlap"]
        assert ov["in_flight_s"] > 0 and ov["hidden_s"] > 0
        assert ov["hidden_s"] + ov["exposed_s"] <= ov["in_flight_s"] * (1 + 1e-9)
    trace = json.load(open(path))["traceEvents"]
    lanes = {e["args"]["name"] for e in trace if e["ph"] == "M"}
    assert lanes == {"compute", "collective in flight", "waiting"}
    assert sum(e.get("name") == "all_gather" for e in trace) >= 4


class _Mark:
    """A stand-in for a CUDA event: when the stream reached it, in ms."""

    def __init__(self, ms):
        self.ms = ms

    def synchronize(self):
        pass

    def elapsed_time(self, later):
        return later.ms - self.ms


def test_on_a_gpu_exposed_time_is_the_stream_stalled_between_its_events():
    """On a GPU the host does not wait for NCCL (its wait returns at once), so each
    collective is timed by events on the step's stream: issued at 0 and 10 ms; the first
    waited from 4 to 6 ms (2 exposed), the second from 12 to 15 (3): in flight 0-6 and
    10-15 (11 ms), exposed 5, hidden 6. The trace shows the same."""
    from autoshard.runtime.record import Recording

    rec = Recording(collectives=[
        ["all_gather", 8, _Mark(0), _Mark(4), _Mark(6)],
        ["reduce_scatter", 8, _Mark(10), _Mark(12), _Mark(15)],
    ])
    got = rec.overlap()
    assert {k: round(v * 1e3, 6) for k, v in got.items()} == {
        "in_flight_s": 11.0, "exposed_s": 5.0, "hidden_s": 6.0}
    assert rec.timings()[1] == ["reduce_scatter", 8, 0.01, 0.012, 0.015]

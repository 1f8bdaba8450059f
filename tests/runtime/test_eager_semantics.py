"""What a training loop may do around the model behaves as eager (world size 1, this
process): activation checkpointing inside the model, retain_graph, autocast, outputs no loss
reads, and record() on the compiling call."""

import copy

import pytest
import torch
import torch.nn as nn

from autoshard import Config, autoshard, plan
from autoshard.core.models import GPT, gpt_loss
from models import CheckpointedGPT


def _data(batch=2):
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 96, (batch, 16), generator=g)
    return x, torch.roll(x, -1, 1)


def _grads(model):
    return {n: None if p.grad is None else
            (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
            for n, p in model.named_parameters()}


def _assert_same_grads(sharded, ref, atol=1e-6):
    got, want = _grads(sharded), _grads(ref)
    for name, g in want.items():
        assert (g is None) == (got[name] is None), name
        if g is not None:
            torch.testing.assert_close(got[name], g, rtol=1e-5, atol=atol, msg=name)


def test_activation_checkpointing_inside_the_model_matches_eager_and_saves_memory():
    torch.manual_seed(0)
    model = CheckpointedGPT(layers=4)
    ref = copy.deepcopy(model)
    sharded = autoshard(model, config=Config(policy="module"))
    x, y = _data()
    for _ in range(2):
        gpt_loss(sharded(x), y).backward()
        gpt_loss(ref(x), y).backward()
    _assert_same_grads(sharded, ref)
    # the regions become recomputation: each block recomputes from its saved input
    x, _ = _data(64)
    peaks = {}
    for cls in (GPT, CheckpointedGPT):
        torch.manual_seed(0)
        peaks[cls] = plan(cls(layers=4), (x,), world_size=2,
                          config=Config(policy="module")).predicted["peak_bytes"]
    assert peaks[CheckpointedGPT] < 0.7 * peaks[GPT], peaks


def test_retain_graph_then_backward_again_accumulates_twice():
    torch.manual_seed(0)
    model = GPT()
    ref = copy.deepcopy(model)
    sharded = autoshard(model, config=Config(policy="module"))
    x, y = _data()
    for m in (sharded, ref):
        loss = gpt_loss(m(x), y)
        loss.backward(retain_graph=True)
        loss.backward()
    _assert_same_grads(sharded, ref)
    for m in (sharded, ref):  # and the next plain step still runs
        gpt_loss(m(x), y).backward()
    _assert_same_grads(sharded, ref)


@pytest.mark.parametrize("first", ["plain", "autocast"])
def test_autocast_is_part_of_the_signature(first):
    torch.manual_seed(0)
    model = GPT()
    ref = copy.deepcopy(model)
    sharded = autoshard(model)
    x, y = _data()
    order = [first, "autocast" if first == "plain" else "plain", first]
    for mode in order:
        outs = []
        for m in (sharded, ref):
            m.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "autocast"):
                out = m(x)
            gpt_loss(out.float(), y).backward()
            outs.append(out)
        assert outs[0].dtype == outs[1].dtype == (
            torch.bfloat16 if mode == "autocast" else torch.float32)
        torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
        _assert_same_grads(sharded, ref, atol=0)
    assert len(sharded._autoshard.programs) == 2


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 3), nn.Linear(8, 3)

    def forward(self, x):
        h = torch.relu(self.body(x))
        return self.a(h), self.b(h)


def test_parameters_only_an_unread_output_uses_keep_a_none_gradient():
    torch.manual_seed(0)
    model = TwoHeads()
    ref = copy.deepcopy(model)
    sharded = autoshard(model, config=Config(policy="per-parameter"))
    x = torch.randn(4, 8)
    for m in (sharded, ref):
        a, _ = m(x)
        a.pow(2).sum().backward()
    _assert_same_grads(sharded, ref)
    assert sharded.b.weight.grad is None and sharded.a.weight.grad is not None
    # AdamW's weight decay then leaves b alone, as in eager
    before = sharded.b.weight.full_tensor().clone()
    for m in (sharded, ref):
        torch.optim.AdamW(m.parameters(), lr=0.1).step()
    assert torch.equal(sharded.b.weight.full_tensor(), before)
    for m in (sharded, ref):  # both outputs read: both get gradients
        m.zero_grad(set_to_none=True)
        a, b = m(x)
        (a.sum() + b.pow(2).sum()).backward()
    _assert_same_grads(sharded, ref)


def test_record_on_the_compiling_call_counts_only_what_ran():
    torch.manual_seed(0)
    x, y = _data()
    first = autoshard(GPT(), config=Config(policy="module"))
    with first.record(None, x, y) as rec_first:
        gpt_loss(first(x), y).backward()
    with first.record(None, x, y) as rec_again:
        gpt_loss(first(x), y).backward()
    assert rec_first.events == rec_again.events
    ops = [op for op, _ in rec_again.events]
    assert ops.count("all_gather") == sum(e.op == "all_gather" for e in first.plan.schedule)

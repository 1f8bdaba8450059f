"""Single-rank runtime behaviour (world size 1 in this process)."""

import copy

import torch
from torch.distributed.tensor import DTensor, Shard

from autoshard import autoshard
from autoshard.core import meta
from autoshard.core.models import GPT, gpt_loss
from autoshard.core.ops import free_op


def _pair():
    torch.manual_seed(0)
    model = GPT()
    return autoshard(copy.deepcopy(model)), model


def _data():
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 96, (2, 16), generator=g)
    return x, torch.roll(x, -1, 1)


def test_parameters_are_dtensor_shards_under_the_original_keys():
    sharded, ref = _pair()
    assert list(sharded.state_dict()) == list(ref.state_dict())
    for v in sharded.state_dict().values():
        assert isinstance(v, DTensor) and v.placements == (Shard(0),)
    assert sharded.head.weight is sharded.wte.weight  # tied stays tied
    assert len(list(sharded.parameters())) == len(list(ref.parameters()))


def test_two_backwards_without_zero_grad_accumulate():
    sharded, ref = _pair()
    x, y = _data()
    for _ in range(2):
        gpt_loss(sharded(x), y).backward()
        gpt_loss(ref(x), y).backward()
    for (name, p), q in zip(sharded.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_input_gradients_flow_back():
    torch.manual_seed(0)
    lin = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    ref = copy.deepcopy(lin)
    sharded = autoshard(lin)
    x = torch.randn(3, 4, requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    sharded(x).sum().backward()
    ref(xr).sum().backward()
    torch.testing.assert_close(x.grad, xr.grad)


def test_no_grad_call_runs_the_forward_graph_only():
    sharded, ref = _pair()
    x, _ = _data()
    with torch.no_grad():
        torch.testing.assert_close(sharded(x), ref(x))
        assert sharded._autoshard.last.bwd is None


def test_free_releases_storage_at_once():
    t = torch.ones(1024)
    view = t[:10]
    free_op([view])
    assert t.untyped_storage().nbytes() == 0


def test_forward_graph_frees_every_gathered_buffer_of_units_not_kept():
    sharded, _ = _pair()
    x, y = _data()
    gpt_loss(sharded(x), y).backward()
    program = sharded._autoshard.last
    kept = {u.index for u in program.plan.units if u.kept}
    assert len(kept) == 1  # reshard_after_forward="auto": the unit read last in forward
    buffers = [n for n in program.fwd.graph.nodes if meta.tag(n, meta.COMM) == meta.AG_BUFFER]
    freed = {a for n in program.fwd.graph.nodes if meta.is_free(n) for a in n.args[0]}
    assert {meta.tag(b, meta.UNIT) for b in buffers if b not in freed} <= kept
    assert all(b in freed for b in buffers if meta.tag(b, meta.UNIT) not in kept)


def test_schedule_table_lists_collectives_in_order():
    sharded, _ = _pair()
    x, y = _data()
    gpt_loss(sharded(x), y).backward()
    text = sharded.schedule()
    header = text.splitlines()[0]
    for col in ("unit", "op", "bytes", "placed after"):
        assert col in header
    ops = [e.op for e in sharded.plan.schedule]
    kept = sum(u.kept for u in sharded.units)  # gathered once: kept from forward to backward
    assert ops.count("all_gather") == 2 * len(sharded.units) - kept
    assert ops.count("reduce_scatter") == len(sharded.units)
    assert text.count("all_gather") == ops.count("all_gather")

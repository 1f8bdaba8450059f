import torch

from autoshard.core import meta
from autoshard.core.models import GPT
from autoshard.passes import assign_units_pass, insert_collectives_pass, split_pass
from graphs import captured, run
from models import CNN


def test_split_saves_no_gathered_parameter():
    gm, ctx = captured(GPT(), torch.randint(0, 96, (2, 16)))
    gm, ctx = run(gm, ctx, assign_units_pass, insert_collectives_pass, split_pass)
    sp = ctx.split
    fwd_out = list(sp.fwd.graph.nodes)[-1].args[0]
    saved = fwd_out[len(sp.fwd_roles):]
    assert len(saved) == len(sp.saved) > 0
    for n in saved:
        assert meta.tag(n, meta.COMM) not in (meta.AG_ISSUE, meta.AG_WAIT, meta.AG_UNPACK)
    assert [r[meta.ROLE] for r in sp.fwd_roles] == [meta.OUT_FWD]
    assert all(r[meta.ROLE] == meta.OUT_GRAD for r in sp.bwd_roles)
    assert len(sp.bwd_roles) == len(list(GPT().parameters()))
    bwd_inputs = [n for n in sp.bwd.graph.nodes if n.op == "placeholder"]
    assert len(bwd_inputs) == len(saved) + sp.n_tangents


def test_split_returns_mutated_buffers_from_forward():
    gm, ctx = captured(CNN(), torch.randn(2, 3, 8, 8))
    gm, ctx = run(gm, ctx, assign_units_pass, insert_collectives_pass, split_pass)
    roles = [r[meta.ROLE] for r in ctx.split.fwd_roles]
    assert roles.count(meta.OUT_BUFFER) == 6  # running mean, var, count of two BatchNorms


def test_forward_only_capture_has_no_backward():
    gm, ctx = captured(GPT(), torch.randint(0, 96, (2, 16)), with_grad=False)
    gm, ctx = run(gm, ctx, assign_units_pass, insert_collectives_pass, split_pass)
    assert ctx.split.bwd is None and ctx.split.saved == []

import collections

import pytest
import torch

from autoshard.core import meta
from autoshard.core.graph import alias_base
from autoshard.core.models import GPT
from autoshard.passes import assign_units_pass, insert_collectives_pass, verify
from autoshard.passes.verify import VerificationError
from graphs import captured, run
from models import Odd, TinyNorm


def _comm(gm):
    return collections.Counter(
        (meta.tag(n, meta.REGION), meta.tag(n, meta.UNIT), meta.tag(n, meta.COMM))
        for n in gm.graph.nodes if meta.is_comm(n)
    )


def _gpt(world=2, **kw):
    gm, ctx = captured(GPT(), torch.randint(0, 96, (2, 16)), world_size=world, **kw)
    return run(gm, ctx, assign_units_pass, insert_collectives_pass)


def test_one_all_gather_per_unit_per_pass_and_one_reduce_scatter():
    gm, ctx = _gpt()
    c = _comm(gm)
    for u in ctx.units:
        assert c[("fwd", u.index, meta.AG_ISSUE)] == 1
        assert c[("fwd", u.index, meta.AG_WAIT)] == 1
        assert c[("bwd", u.index, meta.AG_ISSUE)] == 1
        assert c[("bwd", u.index, meta.RS_ISSUE)] == 1
        assert c[("bwd", u.index, meta.RS_WAIT)] == 1
        assert c[("fwd", u.index, meta.FREE)] >= 1 and c[("bwd", u.index, meta.FREE)] >= 1
    verify(gm, ctx)


def test_gather_sits_right_before_the_first_use_and_collectives_are_c10d_functional():
    gm, _ = _gpt()
    ops = {n.target for n in gm.graph.nodes if meta.is_collective_issue(n)}
    assert ops == {torch.ops._c10d_functional.all_gather_into_tensor_out.default,
                   torch.ops._c10d_functional.reduce_scatter_tensor.default}
    for n in gm.graph.nodes:
        if meta.tag(n, meta.COMM) == meta.AG_WAIT:
            assert meta.tag(n.prev, meta.COMM) == meta.AG_ISSUE


def test_placeholders_hold_padded_local_shards_and_grads_come_back_sharded():
    gm, ctx = captured(Odd(), torch.randn(4, 6), world_size=4)
    gm, ctx = run(gm, ctx, assign_units_pass, insert_collectives_pass)
    shapes = {meta.tag(n, meta.FQN): tuple(n.meta["val"].shape)
              for n in gm.graph.nodes if meta.is_param(n)}
    assert shapes["embed.weight"] == (2, 6)  # 7 rows over 4 ranks: 2 each, padded
    assert shapes["tiny"] == (1, 7)  # 1 row: rank 0 holds it, the rest padding
    assert shapes["scale"] == ()  # a scalar is replicated
    out = meta.output_node(gm)
    grads = {r[meta.FQN]: v for v, r in zip(out.args[0], meta.output_roles(gm))
             if r[meta.ROLE] == meta.OUT_GRAD}
    assert "frozen.weight" not in grads and "frozen.bias" not in grads
    assert tuple(grads["embed.weight"].meta["val"].shape) == (2, 6)
    verify(gm, ctx)


@pytest.mark.parametrize("model,x,world", [(TinyNorm, torch.randn(4, 6), 2),
                                            (Odd, torch.randn(4, 6), 4)],
                         ids=["tiny_norm-world2", "odd-world4"])
def test_gathered_parameters_reach_their_ops_contiguous_and_copies_are_freed(model, x, world):
    """A parameter with one row per rank would be a strided view of the gathered buffer
    (TinyNorm's at world size 2); ops read every full parameter contiguous, as eager's, and
    the storage it lives in (a copy of part of the buffer, or the buffer) is freed."""
    torch.manual_seed(0)
    gm, ctx = captured(model(), x, world_size=world)
    gm, ctx = run(gm, ctx, assign_units_pass, insert_collectives_pass)
    shapes = {p.fqn: p.shape for p in ctx.captured.params if p.gathers}
    read = {a for n in gm.graph.nodes if not meta.is_comm(n) and n.op != "output"
            for a in n.all_input_nodes if meta.tag(a, meta.COMM) == meta.AG_UNPACK}
    assert read and all(a.meta["val"].is_contiguous() for a in read)
    assert {tuple(a.meta["val"].shape) for a in read} <= set(shapes.values())
    # the storage each lives in, the gathered buffer or a copy of part of it, is freed
    freed = {alias_base(t) for n in gm.graph.nodes if meta.is_free(n) for t in n.args[0]}
    assert all(alias_base(a) in freed for a in read)
    verify(gm, ctx)


def test_frozen_parameters_are_gathered_but_never_reduced():
    gm, ctx = captured(Odd(), torch.randn(4, 6), world_size=2)
    gm, ctx = run(gm, ctx, assign_units_pass, insert_collectives_pass)
    frozen = next(n for n in gm.graph.nodes if meta.tag(n, meta.FQN) == "frozen.weight")
    assert all(meta.tag(u, meta.COMM) == meta.AG_PACK for u in frozen.users)
    rs = [n for n in gm.graph.nodes if meta.tag(n, meta.COMM) == meta.RS_ISSUE]
    assert len(rs) == 1
    full = rs[0].args[0].meta["val"].numel()
    trainable = sum(p.numel() for p in Odd().parameters() if p.requires_grad and p.dim())
    assert full == 2 * (4 * 6 + 4 + 1 * 7 + 3 * 7 + 3)  # padded rows per rank
    assert full >= trainable - 1
    # the scalar, replicated, is averaged by an all-reduce of its own
    ar = [n for n in gm.graph.nodes if meta.tag(n, meta.COMM) == meta.AR_ISSUE]
    assert [a.args[0].meta["val"].numel() for a in ar] == [1]
    assert meta.group_size(ar[0]) == 2


class _Scaled(torch.nn.Module):
    """Weights scaled in forward: the backward reads ``2 * w2`` (for the gradient of the
    first layer's output)."""

    def __init__(self):
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.randn(6, 6))
        self.w2 = torch.nn.Parameter(torch.randn(6, 6))

    def forward(self, x):
        return (x @ self.w1).relu() @ (2 * self.w2)


def test_parameter_only_forward_nodes_are_recomputed_in_backward():
    gm, ctx = captured(_Scaled(), torch.randn(4, 6), world_size=2)
    gm, ctx = run(gm, ctx, assign_units_pass, insert_collectives_pass)
    recomputed = [n for n in gm.graph.nodes if meta.tag(n, meta.RECOMPUTED)]
    assert recomputed and all(meta.is_backward(n) for n in recomputed)
    assert any(n.target is torch.ops.aten.mul.Tensor for n in recomputed)
    verify(gm, ctx)  # includes: nothing gathered in forward is read in backward


def test_a_weight_transposed_back_is_read_as_gathered():
    """GPT's backward reads each weight through ``t(t(w))``, which capture folds to ``w``
    (``graph.fold_alias_pairs``): nothing of it is left to recompute, and nothing gathered
    in forward is read in backward."""
    gm, ctx = _gpt()
    t = torch.ops.aten.t.default
    assert not any(n.target is t and getattr(n.args[0], "target", None) is t
                   for n in gm.graph.nodes)
    verify(gm, ctx)


def test_keeping_parameters_gathered_skips_the_backward_gather():
    gm, ctx = _gpt(reshard_after_forward=False)
    c = _comm(gm)
    assert not any(k[2] == meta.AG_ISSUE and k[0] == "bwd" for k in c)
    assert sum(v for k, v in c.items() if k[2] == meta.RS_ISSUE) == len(ctx.units)
    verify(gm, ctx)


def test_auto_keeps_only_the_unit_read_last_in_forward():
    gm, ctx = _gpt(reshard_after_forward="auto")
    kept = [u for u in ctx.units if u.stays_gathered]
    # the GPT's head is tied to the embedding: the root unit is read last in forward
    assert [u.name for u in kept] == ["root"]
    c = _comm(gm)
    for u in ctx.units:
        assert c[("bwd", u.index, meta.AG_ISSUE)] == (0 if u.stays_gathered else 1)
    verify(gm, ctx)
    # a unit that is not kept may not be read across: the verifier names the node
    kept[0].stays_gathered = False
    with pytest.raises(VerificationError, match="must be re-gathered in backward"):
        verify(gm, ctx)


def test_gradients_reduced_in_bf16_land_on_fp32_shards_and_verify():
    """A reduce dtype other than the storage dtype casts the gradient shard after unpacking;
    the verifier follows that cast back to its reduce-scatter."""
    import autoshard
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    plan = autoshard.plan(GPT(), (torch.randint(0, 96, (2, 16)),), world_size=4,
                          config=autoshard.Config(verify=True, mp_policy=mp, policy="module"))
    rs = [e for e in plan.schedule if e.op == "reduce_scatter"]
    assert len(rs) == len(plan.units)
    # the send buffer is bf16, like the gathered buffer: padded numel x 2 bytes
    gathered = {u.index: u.bytes for u in plan.units}
    assert all(e.bytes == gathered[e.unit] for e in rs)

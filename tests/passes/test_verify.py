import dataclasses

import pytest
import torch

from autoshard.core import meta
from autoshard.core.models import GPT
from autoshard.passes import assign_units_pass, insert_collectives_pass, run_passes, verify
from autoshard.passes.verify import VerificationError
from graphs import captured, run


def _gpt():
    gm, ctx = captured(GPT(), torch.randint(0, 96, (2, 16)))
    return run(gm, ctx, assign_units_pass, insert_collectives_pass)


def _first(gm, comm, region=None):
    return next(n for n in gm.graph.nodes if meta.tag(n, meta.COMM) == comm
                and (region is None or meta.tag(n, meta.REGION) == region))


def test_clean_graph_verifies():
    gm, ctx = _gpt()
    verify(gm, ctx)


def test_free_before_a_use_is_caught():
    gm, ctx = _gpt()
    free = next(n for n in gm.graph.nodes if meta.is_free(n)
                and meta.tag(n.args[0][0], meta.COMM) == meta.AG_UNPACK)
    wait = _first(gm, meta.AG_WAIT)
    free.args[0][0].prepend(free) if False else None
    target = free.args[0][0]
    target.append(free)  # move the free to right after the tensor is made
    with pytest.raises(VerificationError, match="after it is freed"):
        verify(gm, ctx)
    assert wait is not None


def test_reading_a_parameter_without_its_wait_is_caught():
    gm, ctx = _gpt()
    wait = _first(gm, meta.AG_WAIT)
    issue = wait.args[0]
    for u in list(wait.users):
        u.replace_input_with(wait, issue)
    with pytest.raises(VerificationError, match="without an all-gather wait"):
        verify(gm, ctx)


def test_backward_reading_a_forward_gathered_parameter_is_caught():
    gm, ctx = _gpt()
    fwd_full = _first(gm, meta.AG_UNPACK, "fwd")
    while meta.tag(fwd_full, meta.COMM) == meta.AG_UNPACK and fwd_full.meta["val"].dim() != 2:
        fwd_full = fwd_full.next
    bwd_user = next(n for n in gm.graph.nodes if meta.is_backward(n) and not meta.is_comm(n)
                    and n.op == "call_function" and n.args)
    bwd_user.update_arg(0, fwd_full)
    with pytest.raises(VerificationError):
        verify(gm, ctx)


def test_gradient_returned_without_reduce_scatter_is_caught():
    gm, ctx = _gpt()
    out = meta.output_node(gm)
    rs = _first(gm, meta.RS_ISSUE)
    full = next(a for a in rs.all_input_nodes)
    vals = list(out.args[0])
    i = next(i for i, r in enumerate(meta.output_roles(gm)) if r[meta.ROLE] == meta.OUT_GRAD)
    vals[i] = full
    out.args = (vals,)
    with pytest.raises(VerificationError, match="without a reduce-scatter"):
        verify(gm, ctx)


def test_a_reduction_with_another_reduce_op_than_the_spec_is_caught():
    """A gradient summed where its ParamSpec says averaged (or the reverse, with a divide
    factor set) is an error naming the reduce ops."""
    gm, ctx = _gpt()
    rs = _first(gm, meta.RS_ISSUE)
    rs.update_arg(1, "sum")
    with pytest.raises(VerificationError, match="reduce op 'sum'; its ParamSpec.scaling says "
                                                "'avg'"):
        verify(gm, ctx)


def _reductions(gm):
    """Per gradient output, the collectives it went through, first first."""
    from autoshard.core.graph import alias_base

    out, got = meta.output_node(gm), {}
    for v, r in zip(out.args[0], meta.output_roles(gm)):
        if r[meta.ROLE] != meta.OUT_GRAD:
            continue
        base, steps = alias_base(v), []
        while meta.tag(base, meta.COMM) in (meta.RS_UNPACK, meta.D2H):
            base = alias_base(base.args[0])
        while meta.is_collective_issue(base):
            steps.insert(0, (meta.tag(base, meta.COMM), meta.group_size(base)))
            base = alias_base(base.args[0])
        got[r[meta.FQN]] = steps
    return got


def test_hybrid_gradients_are_reduce_scattered_then_all_reduced():
    gm, ctx = captured(GPT(), torch.randint(0, 96, (2, 16)), world_size=(2, 2))
    gm, ctx = run(gm, ctx, assign_units_pass, insert_collectives_pass, policy="module")
    verify(gm, ctx)
    assert set(map(tuple, _reductions(gm).values())) == {
        ((meta.RS_ISSUE, 2), (meta.AR_ISSUE, 2))}
    # drop the all-reduce: the unpack reads the reduce-scatter's wait instead
    ar = _first(gm, meta.AR_ISSUE)
    rs_wait = ar.args[0]
    ar_wait = next(u for u in ar.users if meta.is_wait(u))
    ar_wait.replace_all_uses_with(rs_wait)
    from autoshard.core.graph import alias_base

    root = alias_base(rs_wait)  # its storage, now read by the unpack: freed no more
    for f in [n for n in gm.graph.nodes if meta.is_free(n)]:
        f.args = ([t for t in f.args[0] if alias_base(t) is not root],)
    with pytest.raises(VerificationError, match="without a reduce-scatter over 2 then "
                                                "all-reduce over 2"):
        verify(gm, ctx)


@pytest.mark.parametrize("sync", [True, False])
def test_ddp_gradients_are_all_reduced_once_or_kept_local(sync):
    gm, ctx = captured(GPT(), torch.randint(0, 96, (2, 16)), world_size=4, strategy="ddp")
    ctx = dataclasses.replace(ctx, grad_sync=sync)
    gm, ctx = run(gm, ctx, assign_units_pass, insert_collectives_pass, policy="module")
    verify(gm, ctx)
    assert not any(meta.tag(n, meta.COMM) == meta.AG_ISSUE for n in gm.graph.nodes)  # as stored
    want = [(meta.AR_ISSUE, 4)] if sync else []
    assert all(steps == want for steps in _reductions(gm).values())
    if sync:  # a step without sync must reduce nothing
        ctx = dataclasses.replace(ctx, grad_sync=False)
        with pytest.raises(VerificationError, match="without a reduction"):
            verify(gm, ctx)


def test_runner_rejects_a_reorder_only_pass_that_adds_nodes():
    gm, ctx = captured(GPT(), torch.randint(0, 96, (2, 16)))

    def reorder_nodes_pass(gm, ctx, *, options):
        x = next(n for n in gm.graph.nodes if n.op == "placeholder")
        with gm.graph.inserting_after(x):
            n = gm.graph.call_function(torch.ops.aten.clone.default, (x,))
        meta.tags(n)[meta.REGION] = meta.FWD
        return gm

    reorder_nodes_pass.reorder_only = True
    with pytest.raises(AssertionError, match="reorder-only"):
        run_passes(gm, ctx, [(reorder_nodes_pass, {})])


def _hpz():
    """A GPT at world size 4 with every unit resharded to groups of 2 (hpZ)."""
    gm, ctx = captured(GPT(), torch.randint(0, 96, (2, 16)), world_size=4,
                       reshard_after_forward=2)
    return run(gm, ctx, assign_units_pass, insert_collectives_pass, policy="module")


def test_hpz_graph_verifies_and_only_chunks_cross():
    gm, ctx = _hpz()
    verify(gm, ctx)
    chunks = [n for n in gm.graph.nodes if meta.tag(n, meta.COMM) == meta.AG_CHUNK]
    assert len(chunks) == len(ctx.units) == 3
    for c in chunks:  # 1/2 of the unit's gathered buffer, sent by its backward all-gather
        assert c.meta["val"].numel() * 2 == c.args[0].meta["val"].numel()
        (issue,) = [u for u in c.users if not meta.is_free(u)]
        assert meta.is_backward(issue) and meta.group_size(issue) == 2
        assert issue.args[2] == "test:groups_of_2"
    fwd_groups = {n.args[2] for n in gm.graph.nodes if meta.tag(n, meta.COMM) == meta.AG_ISSUE
                  and meta.is_forward(n)}
    assert fwd_groups == {"test"}


def test_hpz_chunk_used_after_its_free_is_caught():
    gm, ctx = _hpz()
    chunk = _first(gm, meta.AG_CHUNK)
    free = next(u for u in chunk.users if meta.is_free(u))
    chunk.append(free)  # freed in the forward, before the backward all-gather reads it
    with pytest.raises(VerificationError, match="after it is freed"):
        verify(gm, ctx)


def test_hpz_backward_reading_the_chunk_directly_is_caught():
    gm, ctx = _hpz()
    chunk = _first(gm, meta.AG_CHUNK)
    bwd_user = next(n for n in gm.graph.nodes if meta.is_backward(n) and not meta.is_comm(n)
                    and n.op == "call_function" and n.args)
    with gm.graph.inserting_before(bwd_user):
        extra = gm.graph.call_function(torch.ops.aten.clone.default, (chunk,))
    meta.tags(extra)[meta.REGION] = meta.BWD
    with pytest.raises(VerificationError, match="only the unit's backward all-gather"):
        verify(gm, ctx)


def test_hpz_backward_gathering_over_the_whole_dimension_is_caught():
    gm, ctx = _hpz()
    issue = next(u for u in _first(gm, meta.AG_CHUNK).users if not meta.is_free(u))
    issue.update_arg(1, 4)  # over the shard dimension's 4 ranks instead of the group's 2
    with pytest.raises(VerificationError, match="group of 2"):
        verify(gm, ctx)


def test_hpz_chunk_for_a_unit_without_a_group_is_caught():
    gm, ctx = _hpz()
    ctx.units[0].group = 0  # the plan says unit 0 reshards to the whole dimension
    with pytest.raises(VerificationError, match="unit 0"):
        verify(gm, ctx)

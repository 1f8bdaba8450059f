"""offload_activations: saved activations cross forward -> backward through host copies, and
the step still computes what it did."""

import torch

from autoshard import meta
from autoshard.models import GPT
from autoshard.passes import (assign_units_pass, insert_collectives_pass,
                              offload_activations_pass, prefetch_pass,
                              recompute_activations_pass, run_passes, split_pass, verify)
from autoshard.passes.offload import offloadable, offloaded_bytes
from graphs import captured

INPUTS = (torch.randint(0, 96, (2, 16)),)


def _kinds(gm, kind):
    return [n for n in gm.graph.nodes if meta.tag(n, meta.COMM) == kind]


def test_each_saved_activation_goes_out_after_its_forward_and_back_before_its_backward():
    gm, ctx = captured(GPT(seq=16, layers=2), *INPUTS)
    gm, ctx = run_passes(gm, ctx, [(recompute_activations_pass, {})])
    moved = offloadable(gm, ["blocks.0"])
    assert moved and all((meta.tag(n, meta.MODULE) or "").startswith("blocks.0")
                         for n in moved)
    gm, ctx = run_passes(gm, ctx, [(offload_activations_pass, {"blocks": ["blocks.0"]})],
                         verify_each=True)
    outs, ins = _kinds(gm, meta.ACT_D2H), _kinds(gm, meta.ACT_H2D)
    assert len(outs) == len(ins) == len(moved)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for x in moved:
        out = next(n for n in outs if n.args[0] is x)
        back = next(n for n in ins if n.args[0] is out)
        # the forward reads x no more after its copy, and x is freed right after it
        assert all(order[u] < order[out] for u in x.users if meta.is_forward(u)
                   and not meta.is_free(u) and u is not out)
        assert meta.is_free(out.next) and out.next.args[0] == [x]
        # the backward reads the copy back only; the host copy is freed after it
        assert not any(meta.is_backward(u) for u in x.users)
        assert meta.is_backward(back) and meta.is_free(back.next)
        assert all(meta.is_backward(u) for u in back.users)
    assert offloaded_bytes(gm)["blocks.0"] == sum(meta.val_bytes(x) for x in moved)
    # the rest of the pipeline still proves its invariants on it
    run_passes(gm, ctx, [(assign_units_pass, {"policy": "module"}),
                         (insert_collectives_pass, {}), (prefetch_pass, {}), (split_pass, {})],
               verify_each=True)


def test_no_blocks_is_no_change_and_no_backward_is_nothing_to_move():
    gm, ctx = captured(GPT(seq=16, layers=1), *INPUTS)
    n = len(gm.graph.nodes)
    gm, _ = run_passes(gm, ctx, [(offload_activations_pass, {"blocks": []})])
    assert len(gm.graph.nodes) == n
    gm, ctx = captured(GPT(seq=16, layers=1), *INPUTS, with_grad=False)
    assert offloadable(gm) == []
    verify(gm, ctx)

"""offload_activations: saved activations cross forward -> backward through host copies, and
the step still computes what it did."""

import dataclasses

import torch

from autoshard.core import meta
from autoshard.core.graph import alias_closure
from autoshard.core.models import GPT
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
        assert not any(meta.is_backward(u) for a in alias_closure(x) if meta.is_forward(a)
                       for u in a.users)
        assert meta.is_backward(back) and meta.is_free(back.next)
        assert all(meta.is_backward(u) for u in back.users)
    assert sum(offloaded_bytes(gm).values()) == sum(meta.val_bytes(x) for x in moved)
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


def _offloaded(profile, **prefetch):
    from autoshard.core.cost import PROFILES

    gm, ctx = captured(GPT(seq=16, layers=2), *INPUTS)
    ctx = dataclasses.replace(ctx, profile=PROFILES[profile])
    gm, ctx = run_passes(gm, ctx, [(recompute_activations_pass, {}),
                                   (offload_activations_pass, {}),
                                   (assign_units_pass, {"policy": "module"}),
                                   (insert_collectives_pass, {})])
    before = [n.name for n in gm.graph.nodes]
    gm, ctx = run_passes(gm, ctx, [(prefetch_pass, prefetch)], verify_each=True)
    return before, gm


def _just_before_reader(c) -> bool:
    """Whether no compute runs between the copy ``c`` and its first reader."""
    n = c.next
    while n not in c.users:
        if not meta.is_comm(n):
            return False
        n = n.next
    return True


def test_prefetch_moves_copies_in_earlier_in_order_within_the_backward():
    before, gm = _offloaded("h100")
    after = [n.name for n in gm.graph.nodes]
    nodes = {n.name: n for n in gm.graph.nodes}
    ins = [n for n in gm.graph.nodes if meta.tag(n, meta.COMM) == meta.ACT_H2D]
    first_bwd = min(after.index(n.name) for n in gm.graph.nodes if meta.is_backward(n))
    moved = [c for c in ins if after.index(c.name) < before.index(c.name)]
    assert moved  # the h100's host link is slower than its compute: copies start earlier
    for c in ins:
        assert after.index(c.name) > first_bwd
        assert meta.is_free(nodes[after[after.index(c.name) + 1]])  # its host copy goes next
    # the copies keep their order (they run one after another)
    assert sorted(ins, key=lambda c: before.index(c.name)) == ins
    assert not all(_just_before_reader(c) for c in moved)
    # a bound below one copy's bytes: each copy stays right before its first reader
    _, capped = _offloaded("h100", max_copy_bytes=1)
    ins = [n for n in capped.graph.nodes if meta.tag(n, meta.COMM) == meta.ACT_H2D]
    assert ins and all(_just_before_reader(c) for c in ins)


def test_prefetch_leaves_copies_where_the_host_is_the_device():
    _, gm = _offloaded("cpu")
    ins = [n for n in gm.graph.nodes if meta.tag(n, meta.COMM) == meta.ACT_H2D]
    assert ins and all(_just_before_reader(c) for c in ins)


def _plan(profile, budget=None, offload=None, recompute=True, layers=4, seq=256):
    """(prefer="speed": what is compared is the fastest plan within the budget)"""
    import autoshard

    return autoshard.plan(GPT(seq=seq, layers=layers), (torch.randint(0, 96, (8, seq)),),
                          world_size=8, config=autoshard.Config(
                              policy="module", device_profile=profile, memory_budget=budget,
                              offload_activations=offload, recompute=recompute,
                              prefer="speed"))


def test_planner_takes_offload_or_recomputation_whichever_is_faster_within_the_budget():
    from autoshard.core.cost import PROFILES

    h100 = PROFILES["h100"]
    # 1000x slower compute: recomputing a block costs more than copying its activations
    slow = dataclasses.replace(h100, name="h100-slow-compute", matmul_flops=h100.matmul_flops
                               / 1000, mem_bandwidth=h100.mem_bandwidth / 1000)
    for profile, wins in ((h100, "blocks"), (slow, "offload")):
        min_cut = _plan(profile, offload=False, layers=2)
        budget = min_cut.predicted["peak_bytes"] - 2**20  # the min cut alone does not fit
        plan = _plan(profile, budget, layers=2)
        rows = plan.candidates
        fits = [c for c in rows if c["fits"]]
        assert not any(c["fits"] for c in rows if c["recompute"] in ("none", "min-cut"))
        chosen = next(c for c in rows if c["chosen"])
        assert chosen["recompute"].startswith(wins), rows
        built = [c["step_s"] for c in fits]
        assert chosen["step_s"] == min(built)
        assert plan.predicted["peak_bytes"] <= budget
        # the other way is in the table, fitting but slower, or ruled out as slower
        other = [c for c in rows if c["recompute"].startswith(
            "offload" if wins == "blocks" else "blocks")]
        assert any(c["fits"] is not False for c in other)
        if wins == "offload":
            assert plan.offloaded_activations and "activations offloaded to host memory" in (
                plan.summary_table())
            assert plan.predicted["host_peak_bytes"] >= sum(plan.offloaded_activations.values())
            assert any(e[0] == "copy" for e in plan.events)  # on a lane beside the compute
            # with no host memory for them, the activations stay on the device
            tight = _plan(dataclasses.replace(slow, host_memory=1), budget, layers=2)
            assert next(c for c in tight.candidates if c["chosen"])["recompute"].startswith(
                "blocks") and not tight.offloaded_activations
            assert any("exceed the host memory per device" in c["note"]
                       for c in tight.candidates if c["recompute"].startswith("offload"))
            # nothing fits: the plan shown is the least memory without offload
            none = _plan(dataclasses.replace(slow, host_memory=1), 2**20, layers=2)
            assert none.recompute == "blocks 2/2" and not none.offloaded_activations


def test_where_the_host_is_the_device_offload_is_not_a_choice_and_saves_nothing():
    from autoshard.planner.candidates import offload_choice, recompute_choices
    from autoshard import Config
    from autoshard.core.cost import PROFILES

    blocks = ["blocks.0", "blocks.1"]
    assert offload_choice(Config(), PROFILES["cpu"]) is False
    assert offload_choice(Config(), PROFILES["h100"]) is True
    assert offload_choice(Config(offload_activations=False), PROFILES["h100"]) is False
    labels = [label for label, _ in recompute_choices(True, blocks, True)]
    assert labels == ["min-cut", "offload 1/2", "offload 2/2", "blocks 1/2", "blocks 2/2",
                      "blocks 2/2, offload all"]
    assert recompute_choices(True, blocks, "force") == [
        ("offload 2/2", {"blocks.0": "offload", "blocks.1": "offload"})]
    # forced on the CPU profile: two copies more, and not a byte less at the peak
    forced = _plan("cpu", offload=True, layers=2, seq=64)
    plain = _plan("cpu", offload=False, layers=2, seq=64)
    assert forced.offloaded_activations and not plain.offloaded_activations
    assert forced.predicted["peak_bytes"] >= plain.predicted["peak_bytes"]
    assert forced.predicted["step_s"] > plain.predicted["step_s"]


def test_on_a_big_graph_the_search_finds_the_same_offload_plan(monkeypatch):
    """Over BIG_GRAPH nodes the first choice whose activations fit is found by bisection
    over a ladder that now holds offload choices; the plan is the one the full search
    picks."""
    import autoshard.planner as plan_mod
    import autoshard.planner.search as search_mod
    from autoshard.core.cost import PROFILES

    h100 = PROFILES["h100"]
    slow = dataclasses.replace(h100, name="h100-slow-compute", matmul_flops=h100.matmul_flops
                               / 1000, mem_bandwidth=h100.mem_bandwidth / 1000)
    budget = _plan(slow, offload=False, layers=2).predicted["peak_bytes"] - 2**20
    full = _plan(slow, budget, layers=2)
    monkeypatch.setattr(plan_mod, "BIG_GRAPH", 0)
    monkeypatch.setattr(search_mod, "BIG_GRAPH", 0)
    big = _plan(slow, budget, layers=2)
    assert big.recompute == full.recompute and big.recompute.startswith("offload")
    assert big.predicted == full.predicted

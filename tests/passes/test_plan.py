"""The planner: recomputation chosen with the units, per memory budget, recorded in the plan."""

import pytest
import torch

import autoshard
from autoshard.core.models import GPT
from autoshard.planner.candidates import first_choices, ladder_end, recompute_choices

INPUTS = (torch.randint(0, 96, (16, 32)),)


def _plan(**config):
    """Planned for speed: these tests pin the fastest plan that fits the budget (the default,
    prefer="memory", is tested in test_prefer.py)."""
    return autoshard.plan(GPT(seq=32), INPUTS, world_size=2,
                          config=autoshard.Config(policy="module", **{"prefer": "speed",
                                                                      **config}))


@pytest.fixture(scope="module")
def peaks():
    """The predicted peak of each fixed choice: none < min-cut < blocks in time, the reverse
    in memory."""
    out = {rc: _plan(recompute=rc).predicted for rc in (False, True, "blocks")}
    assert out[False]["peak_bytes"] > out[True]["peak_bytes"] > out["blocks"]["peak_bytes"]
    assert out[False]["step_s"] < out[True]["step_s"] < out["blocks"]["step_s"]
    return {rc: p["peak_bytes"] for rc, p in out.items()}


@pytest.mark.parametrize("between,chosen", [((False, None), "none"), ((True, False), "min-cut"),
                                            (("blocks", True), "blocks")])
def test_auto_recompute_is_the_fastest_choice_that_fits(peaks, between, chosen):
    low, high = between
    budget = peaks[low] + 1 if high is None else (peaks[low] + peaks[high]) // 2
    plan = _plan(recompute="auto", memory_budget=budget)
    assert plan.predicted["peak_bytes"] <= budget
    assert plan.recompute.startswith(chosen), plan.recompute
    fitting = [c for c in plan.candidates if c["fits"]]
    best = min(fitting, key=lambda c: c["step_s"])
    assert best["chosen"] and sum(c["chosen"] for c in plan.candidates) == 1
    assert "plans considered" in str(plan)
    again = autoshard.Plan.from_json(plan.to_json())
    assert again == plan and again.recompute_blocks == plan.recompute_blocks


def test_pinned_recompute_gives_the_same_plan(peaks):
    plan = _plan(recompute="auto", memory_budget=(peaks[True] + peaks["blocks"]) // 2)
    pinned = _plan(recompute=plan.pinned_recompute(), memory_budget=plan.memory_budget)
    assert pinned.predicted["peak_bytes"] == plan.predicted["peak_bytes"]
    assert pinned.recompute == plan.recompute


def test_no_plan_fits_names_the_least_memory_any_plan_takes(peaks):
    with pytest.raises(autoshard.AutoshardError, match="blocks 2/2 recomputation"):
        _plan(recompute="auto", memory_budget=peaks["blocks"] // 2)


def test_recompute_choices_ladder():
    blocks = [f"blocks.{i}" for i in range(8)]
    labels = [label for label, _ in recompute_choices("auto", blocks)]
    assert labels == ["none", "min-cut", "blocks 2/8", "blocks 4/8", "blocks 6/8", "blocks 8/8"]
    _, modes = recompute_choices("auto", blocks)[2]
    assert modes == {"blocks.0": "block", "blocks.1": "block"}
    assert recompute_choices(False, blocks) == [("none", None)]
    # the default: the min cut, and the blocks only where no plan fits with it
    default = recompute_choices(True, blocks)
    assert [label for label, _ in default] == labels[1:] and first_choices(True, default) == 1
    assert recompute_choices(True, []) == [("min-cut", {})]
    # the ladders: offload k/8 and blocks k/8 end at their 8/8; the rest are on none
    both = recompute_choices("auto", blocks, True)
    ends = {both[i][0]: both[ladder_end(both, i)][0] for i in range(len(both))}
    assert ends == {"none": "none", "min-cut": "min-cut", "offload 2/8": "offload 8/8",
                    "offload 8/8": "offload 8/8", "blocks 6/8": "blocks 8/8",
                    **{k: k for k in ("blocks 8/8", "blocks 8/8, offload all")},
                    "offload 4/8": "offload 8/8", "offload 6/8": "offload 8/8",
                    "blocks 2/8": "blocks 8/8", "blocks 4/8": "blocks 8/8"}


def test_the_default_recomputes_whole_blocks_only_where_the_min_cut_leaves_no_plan(peaks):
    roomy = _plan()
    assert roomy.recompute == "min-cut"
    assert {c["recompute"] for c in roomy.candidates} == {"min-cut"}
    budget = (peaks[True] + peaks["blocks"]) // 2  # below every min-cut plan (one grouping)
    tight = _plan(memory_budget=budget)
    assert tight.recompute.startswith("blocks"), tight.recompute
    assert tight.predicted["peak_bytes"] <= budget
    assert [c["fits"] for c in tight.candidates if c["recompute"] == "min-cut"] == [False]
    assert tight.recompute == _plan(recompute="auto", memory_budget=budget).recompute


def test_resharding_search_keeps_every_unit_where_that_is_faster_and_surely_fits():
    auto = _plan(reshard_after_forward="auto")
    assert auto.reshard == "all but the last" and all(
        c["reshard"] == "all but the last" for c in auto.candidates)
    roomy = _plan(reshard_after_forward="search")
    assert roomy.reshard == "none" and all(u.kept for u in roomy.units)
    assert [c["reshard"] for c in roomy.candidates] == ["all but the last", "none"]
    assert roomy.predicted["step_s"] < auto.predicted["step_s"]
    assert "resharded after forward" in roomy.summary_table()
    # the bound: the resharded plan's peak plus every unit it frees after the forward
    held = sum(u.bytes for u in auto.units if not u.kept)
    tight = _plan(reshard_after_forward="search",
                  memory_budget=auto.predicted["peak_bytes"] + held - 1)
    assert tight.reshard == "all but the last" and len(tight.candidates) == 1


def test_on_a_big_graph_choices_after_one_ruled_out_as_slower_are_not_built(monkeypatch):
    """Over BIG_GRAPH nodes, once every plan of a recomputation choice is slower than the
    chosen one by its lower bound, the choices after it (which recompute more) are not built;
    here (communication free) the first choice fits, so every later one is slower."""
    import dataclasses

    import autoshard.planner as plan_mod
    import autoshard.planner.search as search_mod
    from autoshard.core.cost import PROFILES

    free = dataclasses.replace(PROFILES["h100"], name="free", alpha=0.0, beta=0.0)

    def search():
        return autoshard.plan(GPT(seq=32), INPUTS, world_size=2, config=autoshard.Config(
            policy="module", recompute="auto", device_profile=free, prefer="speed"))

    roomy = search()
    monkeypatch.setattr(plan_mod, "BIG_GRAPH", 0)
    monkeypatch.setattr(search_mod, "BIG_GRAPH", 0)
    big = search()
    assert big.predicted == roomy.predicted and big.recompute == roomy.recompute == "none"
    notes = [c["note"] for c in big.candidates]
    assert notes[1].startswith("its compute alone") and big.candidates[1]["recompute"] == "min-cut"
    assert len(notes) == len(roomy.candidates)
    assert notes[2:] and all(n == "recomputes or offloads more than min-cut, whose plans are "
                                  "all slower than the chosen one" for n in notes[2:])
    assert "recomputes or offloads" in big.candidates_table()


def test_on_a_big_graph_a_ladders_last_choice_within_near_spares_those_before_it(monkeypatch):
    """Over BIG_GRAPH nodes with prefer="balanced", each ladder of choices (offload k/n,
    blocks k/n) is tried from its last: when that fits within 2% of the fastest plan (and
    FSDP2's plan's step), the choices before it are recorded, not built. Here the blocks
    ladder's last is near and the offload ladder's is not (its copies are slower), so the
    offload choices are built in order; the plan is the one the full search picks."""
    import autoshard.planner as plan_mod
    import autoshard.planner.search as search_mod

    def search():
        return autoshard.plan(GPT(seq=64, layers=4), (torch.randint(0, 96, (8, 64)),),
                              world_size=8, config=autoshard.Config(
                                  policy="module", device_profile="h100", recompute="auto",
                                  prefer="balanced"))

    full = search()
    monkeypatch.setattr(plan_mod, "BIG_GRAPH", 0)
    monkeypatch.setattr(search_mod, "BIG_GRAPH", 0)
    big = search()
    assert big.recompute == full.recompute == "blocks 4/4"
    assert big.predicted == full.predicted
    labels = [c["recompute"] for c in big.candidates]
    assert labels == [c["recompute"] for c in full.candidates]  # in the ladder's order
    notes = {c["recompute"]: c["note"] for c in big.candidates}
    for k in (1, 2, 3):
        assert notes[f"blocks {k}/4"] == "blocks 4/4, further along, fits within 2% of the " \
                                         "fastest plan"
        assert notes[f"offload {k}/4"] == ""  # built: offload 4/4 is too slow
    built = [c for c in big.candidates if c["step_s"] is not None]
    assert len(built) == len(full.candidates) - 3


def test_the_search_pauses_the_garbage_collector_and_restores_it(monkeypatch):
    import gc

    import autoshard.planner as plan_mod

    monkeypatch.setattr(plan_mod, "COLLECT_NODES", 1)  # a collection after every candidate
    states, real = [], gc.collect
    monkeypatch.setattr(gc, "collect", lambda *a: states.append(
        (gc.isenabled(), gc.get_freeze_count() > 0)) or real(*a))
    assert gc.isenabled() and gc.get_freeze_count() == 0
    try:
        plan = _plan(recompute="auto")
        assert gc.isenabled() and gc.get_freeze_count() == 0  # nothing left frozen
        gc.disable()
        _plan(recompute="auto")
        assert not gc.isenabled()
        gc.enable()
        gc.freeze()  # the process's own: the search leaves it frozen (objects freed by their
        frozen = gc.get_freeze_count()  # references leave it meanwhile)
        _plan(recompute="auto")
        assert frozen * 0.9 < gc.get_freeze_count() <= frozen
    finally:
        gc.unfreeze()
        gc.enable()
    # one collection per candidate, with the collector paused and what lived before the
    # search frozen (not walked), and none for a caller who paused it
    ran = sum(c["step_s"] is not None for c in plan.candidates)
    assert ran > 1 and states[:ran] == [(False, True)] * ran
    assert len(states) == 2 * ran  # and the process that froze its own still collects


def _plan4(**config):
    return autoshard.plan(GPT(seq=32), INPUTS, world_size=4,
                          config=autoshard.Config(policy="module", recompute=True, **config))


def test_resharding_search_tries_hpz_where_keeping_every_unit_does_not_fit():
    """Under "search", a plan whose keep-everything bound (peak plus every resharded unit)
    exceeds the budget is tried once more resharded to groups of 2 of the 4 ranks when the
    peak plus half those bytes fits; hpZ's backward all-gathers over 2 ranks are faster."""
    auto = _plan4(reshard_after_forward="auto")
    held = sum(u.bytes for u in auto.units if not u.kept)
    budget = auto.predicted["peak_bytes"] + held * 3 // 4  # hpZ's bound fits, keeping's not
    plan = _plan4(reshard_after_forward="search", memory_budget=budget)
    assert [c["reshard"] for c in plan.candidates] == ["all but the last",
                                                       "every unit, to groups of 2"]
    assert plan.reshard == "every unit, to groups of 2" and plan.predicted["peak_bytes"] <= budget
    assert [u.group for u in plan.units] == [2] * len(plan.units)
    assert plan.predicted["step_s"] < auto.predicted["step_s"]
    assert "all_gather (2 ranks)" in plan.schedule_table()
    assert "resharded to groups of 2" in plan.units_table()
    again = autoshard.Plan.from_json(plan.to_json())
    assert [u.group for u in again.units] == [2] * len(plan.units)
    # a budget below hpZ's bound: no third plan
    tight = _plan4(reshard_after_forward="search",
                   memory_budget=auto.predicted["peak_bytes"] + held // 2 - 1)
    assert [c["reshard"] for c in tight.candidates] == ["all but the last"]


def test_hpz_sends_its_backward_all_gathers_within_the_group():
    """The plan's bytes sent per rank: P(N-1)/N forward all-gather, P(k-1)/k backward,
    P(N-1)/N reduce-scatter (N = 4, k = 2, P the gathered bytes of every unit)."""
    plan = _plan4(reshard_after_forward=2)
    total = sum(u.bytes for u in plan.units)
    assert plan.predicted["sent_bytes"] == total * 3 // 4 + total // 2 + total * 3 // 4
    # the simulator prices each all-gather by its own group: 2 ranks in the backward
    from autoshard.core.cost import collective_time, get_profile

    cpu = get_profile("cpu")
    issues = [e for e in plan.schedule if e.op == "all_gather"]
    comms = [ev for ev in plan.events if ev[0] == "comm" and "all_gather" in ev[1]]
    assert len(comms) == len(issues) == 2 * len(plan.units)
    for e, ev in zip(issues, comms):
        assert ev[3] == collective_time(e.bytes, e.ranks or 4, cpu)


def test_hpz_group_size_must_divide_the_shard_size():
    with pytest.raises(ValueError, match="reshard_after_forward=2 must divide the shard "
                                         "dimension's size 3"):
        autoshard.plan(GPT(seq=32), INPUTS, world_size=3,
                       config=autoshard.Config(reshard_after_forward=2))


def test_hpz_on_a_hybrid_mesh_gathers_within_each_replica():
    """On a 2 x 4 (replicate x shard) mesh, k = 2 divides the shard size 4: the backward
    all-gathers run over 2 ranks, the reduce-scatter over the shard dimension's 4, the
    all-reduce over the 2 replicas (verified: Config(verify=True))."""
    plan = autoshard.plan(GPT(seq=32), INPUTS, world_size=(2, 4), config=autoshard.Config(
        policy="module", reshard_after_forward=2, verify=True))
    assert plan.reshard == "every unit, to groups of 2" and plan.mesh_shape == [2, 4]
    ops = {(e.region, e.op, e.ranks) for e in plan.schedule if e.op not in ("wait", "free")}
    assert ops == {("fwd", "all_gather", 0), ("bwd", "all_gather", 2),
                   ("bwd", "reduce_scatter", 0), ("bwd", "all_reduce", 0)}

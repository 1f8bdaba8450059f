"""The planner: it chooses among lowered candidates, above the passes.

A plan is a choice of strategy (``Config.strategy``; "auto" searches zero1, zero2 and zero3),
of units (which parameters are gathered together), of recomputation (which activations cross
from forward to backward, per repeated block), of resharding (which units free their gathered
parameters after the forward) and of offload (whether the sharded state lives in host
memory): one frozen ``Candidate``. ``lower`` builds a candidate on a copy of the graph and
predicts it (a ``Lowered``); the ``Planner`` enumerates and bounds them, one ``Search`` per
strategy (``search.py``) and one hosting of the state (its part in host memory) each, and
returns the finished Plan. It is not a pass: the compiler calls ``choose`` on the captured
step; it runs the passes (``autoshard.passes.pipeline``) once per candidate on a copy of the
captured graph, predicts each result's step time and peak memory (``autoshard.core.simulate``)
and keeps the fastest that fits the memory budget; every candidate
tried, with its prediction, is recorded for the plan to show.

Candidates. Recomputation choices, fastest first (each recomputes more than the one before):
keep what eager saves, the min cut, then the first 1/4, 1/2, 3/4 and all of the repeated blocks
recomputed whole (the rest by the min cut). With activation offload a choice
(``Config.offload_activations``, ``offload_choice``), the first 1/4, 1/2, 3/4 and all of the
blocks with their min cut's saved activations in host memory come between the min cut and
whole-block recomputation: one decision per repeated block, not per activation, so that the
ladder stays as short as the blocks' fractions (``autoshard.passes.offload`` moves a block's
every saved value). Any k blocks save the same bytes, since every
block's saved activations are live when the backward starts; the first ones are taken
(``Config.recompute="auto"``; the default, True, tries the choices after the min cut only
when no plan of the hosting fits with it). Per choice, the unit candidates of the "auto"
policy (``autoshard.passes.auto``), fastest first, or the one grouping a fixed policy gives.
Skipped without a pipeline, with the reason recorded: a choice whose activation peak alone
already exceeds the budget; a unit candidate whose lower bound on memory does
(``autoshard.passes.floor``, never above the predicted peak); once a plan fits, a choice
whose compute alone takes longer than that plan's step, and a unit candidate whose compute
plus the copies its grouping surely makes (``copy_floor``, ``gradient_copies``) does. On
graphs over ``BIG_GRAPH`` nodes the first choice whose activations fit is found by bisection,
and within a choice the first unit candidate that fits by an exponential search from the
fastest (peaks fall along both orders), and once every plan of a choice
is ruled out as slower, the choices after it (which recompute more) are not built. There, too,
with ``prefer="balanced"`` each ladder (offload k/n, blocks k/n) is tried from its last
choice: when a plan of it fits within ``NEAR`` of the fastest so far (and meets the target
against FSDP2's plan), the choices before it on the ladder are recorded, not built (peaks
fall along a ladder, so none of them is lighter; at GPT-175B, 6 of the 11 choices). So
there the guarantee holds among the candidates tried. Smaller graphs try every choice and
candidate. Each candidate is predicted on its joint graph
(``autoshard.core.simulate.simulate_joint``, the same prediction as its split program's); only
the chosen one is split.

Resharding ("auto"): every unit but the one gathered last in forward frees its parameters after
the forward and gathers them again in the backward. With ``reshard_after_forward="search"``, a
candidate that fits with communication exposed is tried once more with every unit kept from
forward to backward (no backward all-gathers) when that surely fits: its peak plus every
resharded unit's gathered bytes is within the budget; when that does not fit, once with every
unit resharded to groups of k ranks (hpZ, ``reshard_after_forward=k``) for the least divisor
k of the shard size (1 < k < shard size, and k <= the profile's ``ranks_per_node`` when it
is known) whose bound, the peak plus 1/k of every resharded unit's gathered bytes, fits. One
k only, to bound planning time: under the cost model a smaller group's backward all-gather is
never slower, so the least k that fits is the fastest hpZ plan. Offload: the whole search runs
on the device first and, with no ``Config.offload_policy``, only if nothing fits, again with all of
the sharded state in host memory; if a plan fits then, again for the least of
``search.OFFLOAD_STATE`` that fits, by bisection (the state of the last parameters first,
``autoshard.core.spec.hosted``; peaks fall as more is offloaded). A fraction is not searched when
the least peak tried with all of the state on the host, plus the optimizer state it brings back
onto the device (held all step), exceeds the budget. Among plans equally fast, the one with
less state on the host is kept. Offloaded, each unit candidate is tried with none of the
resharded units copying their shards in again for the backward (all hold the forward's copy
on the device); if that does not fit, with all of them, then with the least of
``search.OFFLOAD_PARAMS`` between that fits, by bisection (for one grouping, fewer copies is faster
and takes more memory).

Memory against FSDP2 (``Config.prefer="memory"``, the default): before the search, FSDP2's
plan for the model is lowered and predicted once (``Planner._fsdp2``); among the plans that
fit, those predicted within ``PEAK_TARGET`` of its peak and ``STEP_CAP`` of its step win over
those that are not, then the fastest (``Search._better``; a candidate is ruled out as slower
only once the best meets that), and ``plan.choice`` says why where the fastest plan's peak
is over the target. "speed" keeps the fastest that fits.

    captured -copy-> recompute(choice) -copy-> units(k) -> collectives -> prefetch
                              -> simulate_joint -> (time, peak) -> keep best -> split
"""

from __future__ import annotations

import dataclasses
import gc
import math
from typing import Optional

import torch.fx as fx

from autoshard.core import progress
from autoshard.core.config import reshard_group_size
from autoshard.core.cost import collective_time, share_node_times
from autoshard.core.options import Prefetch
from autoshard.passes.auto import BIG_GRAPH
from autoshard.planner.candidates import (Candidate, Lowered, lower, host_state, reshard_label,
                                          shard_size)
from autoshard.planner.readout import make_plan
from autoshard.passes.pipeline import run_passes
from autoshard.passes.split import split_pass
from autoshard.planner.search import Search, lightest_near
from autoshard.core.plans import ScheduleEntry, fmt_bytes, offload_label


# nodes of lowered candidates between two runs of Python's cyclic garbage collector (see
# _Garbage): about 8 candidates of GPT-175B (some 30,000 nodes each)
COLLECT_NODES = 250_000
# Config(prefer="memory"): the plan taken is the fastest predicted to peak at most PEAK_TARGET
# of FSDP2's plan's peak and to take at most STEP_CAP of its step, where one is. The target
# is the 0.85x FSDP2's measured peak autoshard promises, less the error of FSDP2's predicted
# peak: measured, FSDP2 peaks up to 3% below its plan's prediction (hf-t5: 36.2 MiB against
# 37.4 predicted), so a plan predicted at 0.84x measured 0.86x. The cap keeps
# the trade from going slower than FSDP2 itself: autoshard runs a plan's graphs with less
# overhead than FSDP2's eager hooks and DTensor dispatch (on the benchmark models FSDP2's
# measured step is 1.3x to 5x the prediction of its plan; BENCHMARKS.md), so 1.25x its plan's
# prediction stays under FSDP2's measured step
PEAK_TARGET, STEP_CAP = 0.82, 1.25
# Config(prefer="balanced"): plans within this fraction of the fastest's predicted step are
# as fast; the lightest of them is taken
NEAR = 0.02
# Config(prefer="balanced"): a peak above FSDP2's plan's by less than this fraction of the
# memory budget counts as no higher. A GPU's own peak moves by more (the allocator's
# rounding, cuBLAS's workspace, NCCL's buffers), and without it a small model in the
# launch-bound regime took a plan 70x slower than the fastest (and 2.2x eager's ops, 4.7x
# its step on an H200) to save 20 KiB
IMMATERIAL = 1e-3


def preference(config, profile) -> str:
    """``Config.prefer`` as the planner applies it: "auto" is "memory" where the device is
    the host (a profile with no host link: its memory is the machine's), else
    "balanced"."""
    if config.prefer != "auto":
        return config.prefer
    return "balanced" if profile is not None and profile.host_bandwidth > 0 else "memory"


def _target(prefer: str, reference, budget: int) -> Optional[tuple]:
    """(peak bytes, step seconds) a plan should stay within, from FSDP2's plan's
    ``reference`` Prediction and the memory ``budget``; None where there is no such
    bound."""
    if reference is None:
        return None
    if prefer == "memory":
        return PEAK_TARGET * reference.peak_bytes, STEP_CAP * reference.total
    return reference.peak_bytes + IMMATERIAL * budget, reference.total


STRATEGIES_SEARCHED = ("zero1", "zero2", "zero3")  # Config.strategy="auto", least memory last


def choose(gm: fx.GraphModule, ctx, options: dict):
    """Choose and build the plan: ``(split graph, PassContext, Plan)`` of the chosen
    candidate.

    Reads: the captured joint graph (untouched: every candidate works on a copy) and in
    ``ctx`` the profile and budget. Options: ``config`` (the Config), ``other_static_bytes``
    (buffers and inputs, held all step), ``local_grad_bytes`` (of those, the full local
    gradients a step without gradient sync holds), ``hosting`` (the fraction of the state an
    earlier plan stored in host memory, kept as the specs say; None: searched), ``verify``.
    Returns the context the chosen candidate was built in (units, split program, parameter
    descriptions with the strategy's placements) and the finished Plan: every candidate
    tried, the entries after the optimizer step, and ``plan.unfit`` saying why when nothing
    fits (the plan with the least peak is chosen then). Shows progress
    (``autoshard.core.progress``) per candidate.
    """
    with _Garbage() as garbage, progress.phase("planning", unit="candidates") as bar:
        return Planner(gm, ctx, options, garbage, bar).run()


class Planner:
    """The search: per strategy (``Config.strategy``, or each of ``STRATEGIES_SEARCHED`` for
    "auto") a ``Search`` over hostings, recomputation, units and resharding; the fastest
    plan that fits wins, else the one with the least peak."""

    def __init__(self, gm, ctx, options: dict, garbage, bar):
        self.gm, self.ctx, self.options, self.garbage = gm, ctx, options, garbage
        self.bar = bar  # autoshard.core.progress: one step per candidate lowered
        self.config = options["config"]

    def run(self):
        """``(split graph, the chosen context, its Plan)``: per strategy the
        best plan (``Search``), then among those the fastest that fits the budget and, with
        ``Config(prefer="memory")``, that meets the target against FSDP2's plan where one
        does (``lightest_near``); the plan says why when the fastest was not taken."""
        config = self.config
        share_node_times(self.gm.graph.nodes)
        prefer = preference(config, self.ctx.profile)
        with progress.timed("plan: FSDP2's plan"):
            ref_low = self._fsdp2(prefer)
        reference = ref_low.prediction if ref_low is not None else None
        target = _target(prefer, reference, self.ctx.memory_budget)
        self.options = {**self.options, "target": target,
                        "near": NEAR if prefer == "balanced" else 0.0}
        strategies = STRATEGIES_SEARCHED if config.strategy == "auto" else (config.strategy,)
        outcomes = []
        for s in strategies:
            with progress.timed(f"plan: strategy {s}"):
                outcomes.append(self._strategy(s))
        tried = [o for o in outcomes if o[2].unfit is None] or [outcomes[-1]]
        # none fits: zero3's says what would
        fits = [o for o in tried if o[2].predicted["peak_bytes"] <= o[2].memory_budget]
        if (prefer == "balanced" and fits and ref_low is not None
                and ref_low.prediction.peak_bytes <= ref_low.ctx.memory_budget):
            # FSDP2's plan is a candidate too: the plan taken is never predicted slower or
            # heavier than it beyond IMMATERIAL (a big graph's bisection may not build it)
            outcomes.append(self._fsdp2_outcome(ref_low))
            tried.append(outcomes[-1])
            fits.append(outcomes[-1])
        out, best, plan = lightest_near(fits or tried, lambda o: o[1], target,
                                        self.options["near"])
        if len(outcomes) > 1:
            plan.candidates = [dict(c, strategy=o[2].strategy,
                                    chosen=c["chosen"] and o[2] is plan)
                               for o in tried for c in o[2].candidates]
        if reference is not None:
            plan.predicted["fsdp2_peak_bytes"] = reference.peak_bytes
            plan.predicted["fsdp2_step_s"] = reference.total
            plan.choice = _choice(plan, reference, prefer, target)
        return out, best.ctx, plan

    def _fsdp2(self, prefer: str):
        """FSDP2's plan for this model, predicted as every candidate is (``lower``): one unit
        per repeated block plus the root, every unit but the one read last in forward
        resharded after it (FSDP2 keeps its root), nothing recomputed, a prefetch of one
        unit, all of the state on the device. It lowered (``Lowered``), or None where the
        planner does not weigh plans against it: ``Config(prefer="speed")``, nothing left
        to the search, no module tree (an exported program), parameters not sharded
        (``strategy="ddp"``), or under "memory" a graph over ``BIG_GRAPH`` nodes (planned
        by bisection for the budget, where the extra lowering is seconds)."""
        config, ctx = self.config, self.ctx
        if (prefer == "speed" or not self._searched() or ctx.model is None
                or config.strategy == "ddp"
                or (prefer == "memory" and len(self.gm.graph.nodes) > BIG_GRAPH)):
            return None
        specs = [dataclasses.replace(p, replica=False) for p in ctx.captured.params]
        ctx = dataclasses.replace(ctx, captured=dataclasses.replace(ctx.captured, params=specs),
                                  reshard_after_forward="auto")
        hosting = host_state(ctx, 0.0, config, self.options)
        # FSDP2 recomputes nothing and offloads no activation (recompute=False refuses
        # offload_activations=True, which the user's Config may hold)
        fsdp2 = dataclasses.replace(config, policy="module", units=None, recompute=False,
                                    offload_activations=False,
                                    bucket=False, prefetch=Prefetch(depth=1),
                                    reshard_after_forward="auto", strategy="zero3")
        cand = Candidate("zero3", 0.0, "none", None, 0, "auto", 1.0)
        return lower(self.gm, hosting, cand, fsdp2, {})

    def _fsdp2_outcome(self, low: Lowered):
        """FSDP2's plan (``low``) as a strategy's outcome: split, with a candidate row of its
        own (the plan lists every outcome's rows)."""
        pred = low.prediction
        row = {"recompute": "none", "offload": 0.0, "offload_params": None,
               "units": len(low.ctx.units), "reshard": reshard_label("auto"),
               "step_s": pred.total, "peak_bytes": pred.peak_bytes,
               "fits": pred.peak_bytes <= low.ctx.memory_budget,
               "note": "FSDP2's plan: one unit per repeated block and the root"}
        out, split = run_passes(low.gm, low.ctx, [(split_pass, {})],
                                verify_each=self.options.get("verify", False))
        best = dataclasses.replace(low, ctx=split)
        return out, best, self._finish(best, [dict(row, chosen=True)], "zero3")

    def _searched(self) -> bool:
        """Whether the user left a choice to the search (then a plan that does not fit is an
        error, not the user's)."""
        config = self.config
        return (config.policy == "auto" and config.units is None) or config.recompute == "auto"

    def _strategy(self, strategy: str):
        """``(split graph, best Lowered, its Plan)`` for one strategy."""
        config, ctx = self.config, self.ctx
        setting = ("search" if config.strategy == "auto" and strategy == "zero3"
                   else "auto" if config.strategy == "auto" else reshard_group_size(
                       config.reshard_after_forward, shard_size(ctx)))
        if config.strategy == "auto":
            specs = [dataclasses.replace(p, replica=strategy == "zero1" and p.sharded)
                     for p in ctx.captured.params]
            ctx = dataclasses.replace(ctx, captured=dataclasses.replace(ctx.captured,
                                                                        params=specs))
        ctx = dataclasses.replace(ctx, reshard_after_forward=(
            False if strategy == "zero2" else "auto" if setting == "search" else setting))
        best, candidates = Search(self.gm, ctx, self.options, self.garbage, strategy,
                                   setting, self.bar).run()
        out, split = run_passes(best.gm, best.ctx, [(split_pass, {})],
                                verify_each=self.options.get("verify", False))
        best = dataclasses.replace(best, ctx=split)
        return out, best, self._finish(best, candidates, strategy)

    def _finish(self, best: Lowered, candidates: list, strategy: str):
        """The Plan of ``best`` (split): its schedule and prediction, the candidates, the gathers
        after the optimizer step, and why it is not enough when it does not fit."""
        with progress.timed("plan: finish"):
            return self._plan(best, candidates, strategy)

    def _plan(self, best: Lowered, candidates: list, strategy: str):
        ctx, config, pred = best.ctx, self.config, best.prediction
        specs = {p.fqn: p for p in ctx.captured.params}
        mesh_shape = ctx.captured.params[0].mesh_shape if ctx.captured.params else (1,)
        state = best.state
        plan = make_plan(
            math.prod(mesh_shape), ctx.units, specs, [ctx.split.fwd, ctx.split.bwd],
            prediction=pred, profile=ctx.profile, budget=ctx.memory_budget,
            policy="pinned" if config.units is not None else config.policy_name,
            model_state_bytes=state["params"] + state["grads"] + state["optimizer"],
            host_state_bytes=state["host"], candidates=candidates,
            recompute=(best.candidate.recompute, best.candidate.modes),
            offload=best.candidate.offload, offload_params=ctx.offload_params,
            reshard=(reshard_label(ctx.reshard_after_forward)
                     if any(p.gathers for p in ctx.captured.params) else "nothing gathered"),
            strategy=strategy, mesh_shape=mesh_shape, grad_sync=ctx.grad_sync)
        plan.predicted["local_grad_bytes"] = self.options.get("local_grad_bytes", 0)
        if any(p.replica for p in ctx.captured.params):
            _after_step(plan, ctx)
        plan.unfit = (_unfit(plan, best, config)
                      if self._searched() and pred.peak_bytes > ctx.memory_budget else None)
        return plan


def _after_step(plan, ctx) -> None:
    """A plan whose parameters have replicas (ZeRO-1) also gathers, per unit and compute
    dtype, the shards the optimizer updated into them before the next call: schedule entries
    ("after step"), and their time (exposed: nothing runs beside it) and bytes in the
    prediction."""
    specs = {p.fqn: p for p in ctx.captured.params}
    for unit in ctx.units:
        by_dtype = {}
        for f in unit.fqns:
            if specs[f].replica:
                by_dtype.setdefault(specs[f].compute_dtype, []).append(specs[f])
        for group in by_dtype.values():
            nbytes, n = sum(s.gathered_bytes() for s in group), group[0].shards
            plan.schedule.append(ScheduleEntry("after step", unit.index, "all_gather", nbytes,
                                               "(optimizer step)", ""))
            t = collective_time(nbytes, n, ctx.profile)
            for key in ("step_s", "exposed_comm_s"):
                plan.predicted[key] += t
            plan.predicted["comm_bytes"] += nbytes
            plan.predicted["sent_bytes"] += nbytes * (n - 1) // n


def _choice(plan, reference, prefer: str, target: tuple) -> Optional[str]:
    """Why the plan is not the fastest that fits, or why it is though it misses the target
    against FSDP2's plan (``reference``, its Prediction; ``target``, the bound ``_target``
    made of it); None when the fastest was taken and meets it. Reads the plan's candidates
    (the chosen one marked)."""
    rows = [c for c in plan.candidates if c["fits"] and c["step_s"] is not None]
    chosen = next((c for c in plan.candidates if c.get("chosen")), None)
    if not rows or chosen is None:
        return None
    fastest = min(rows, key=lambda c: (c["step_s"], c["peak_bytes"]))
    peak = reference.peak_bytes
    slower = 100 * (chosen["step_s"] / fastest["step_s"] - 1)
    if prefer == "balanced":
        bound = (f"FSDP2's plan's predicted step and peak ({reference.total * 1e3:.3f} ms, "
                 f"{fmt_bytes(peak)})")
        if fastest["peak_bytes"] > target[0] and chosen["peak_bytes"] <= target[0]:
            return (f"the fastest plan peaks at {fastest['peak_bytes'] / peak:.2f}x FSDP2's "
                    f"plan's predicted peak; chose the fastest within {bound}, "
                    f"{slower:.1f}% slower; Config(prefer='speed') takes the fastest")
        if chosen is not fastest and chosen["step_s"] <= fastest["step_s"] * (1 + NEAR):
            return (f"chose the lightest plan within {100 * NEAR:.0f}% of the fastest's "
                    f"step: {slower:.1f}% slower, at "
                    f"{chosen['peak_bytes'] / fastest['peak_bytes']:.2f}x its peak")
        if chosen["peak_bytes"] > target[0] or chosen["step_s"] > reference.total:
            return f"no plan that fits is predicted within {bound}, so the fastest is chosen"
        if chosen["peak_bytes"] > peak:
            return (f"the plan peaks {fmt_bytes(chosen['peak_bytes'] - peak)} above FSDP2's "
                    f"plan's predicted peak ({fmt_bytes(peak)}), under "
                    f"{100 * IMMATERIAL:g}% of the memory budget, which buys nothing")
        return None
    if fastest["peak_bytes"] <= PEAK_TARGET * peak:
        return None
    head = (f"the fastest plan peaks at {fastest['peak_bytes'] / peak:.2f}x FSDP2's plan's "
            f"predicted peak ({fmt_bytes(peak)})")
    if chosen["step_s"] > fastest["step_s"]:
        return (f"{head}; chose the fastest within {PEAK_TARGET}x "
                f"({chosen['peak_bytes'] / peak:.2f}x), {slower:.0f}% slower; "
                "Config(prefer='speed') takes the fastest")
    return (f"{head}; no plan within {PEAK_TARGET}x is predicted within {STEP_CAP}x of its "
            f"step ({reference.total * 1e3:.3f} ms), so the fastest is chosen")


def _unfit(plan, best: Lowered, config) -> str:
    """Why no plan fits: the smallest plan the search made (the last candidates tried are
    the least memory a plan can take: one unit per parameter, and with recompute True or
    "auto" every repeated block recomputed whole) and what would make one fit."""
    ctx, cand = best.ctx, best.candidate
    budget, world_size = ctx.memory_budget, plan.world_size
    return (
        f"no plan fits the memory budget of {fmt_bytes(budget)} per rank on "
        f"{world_size} ranks: the smallest plan autoshard can make ({cand.recompute} "
        f"recomputation, {len(ctx.units)} units"
        + (f", the model state in host memory (offload: "
           f"{offload_label(cand.offload, ctx.offload_params)})" if cand.offload else "")
        + f") needs {fmt_bytes(plan.predicted['peak_bytes'])}. "
        "Raise Config.memory_budget to at least that, shard over more ranks, use a "
        "smaller batch" + (", or Config(recompute=True) to recompute activations"
                           if config.recompute is False else "") + ".")


class _Garbage:
    """Python's cyclic garbage collector, paused while the planner searches and run once
    every ``COLLECT_NODES`` nodes of lowered candidates instead (by nodes, not candidates:
    a small model's plan leaves its garbage to the collector's next ordinary run, where one
    collection every 8 candidates made 67 in test_floor's and test_auto's plans, 6.1 s of
    their 80). Each candidate builds graphs of up to 10^5 nodes and drops them; fx nodes and
    their graph form cycles, which survive into the oldest generation, so the collector ran
    full collections over every live graph again and again: a third of the time planning
    GPT-175B. What lives when the search starts (the
    imported libraries, the model, the captured graph) lives through it, so it is frozen
    (``gc.freeze``): a collection walks only what the search made. Unless the process froze
    objects of its own (then every collection walks everything, as before). Restored as it
    was on the way out."""

    def __enter__(self):
        self.enabled, self.nodes = gc.isenabled(), 0
        gc.disable()
        self.frozen = self.enabled and gc.get_freeze_count() == 0
        if self.frozen:
            gc.freeze()
        return self

    def __exit__(self, *exc):
        if self.frozen:
            gc.unfreeze()
        if self.enabled:
            gc.enable()

    def candidate_done(self, nodes: int) -> None:
        """A candidate of ``nodes`` nodes lowered."""
        self.nodes += nodes
        if self.enabled and self.nodes >= COLLECT_NODES:  # the caller may want none
            self.nodes = 0
            with progress.timed("plan: gc"):
                gc.collect()

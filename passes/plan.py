"""plan_step: the planner, as the one pass the compiler runs.

A plan is a choice of strategy (``Config.strategy``; "auto" searches zero1, zero2 and zero3),
of units (which parameters are gathered together), of recomputation (which activations cross
from forward to backward, per repeated block), of resharding (which units free their gathered
parameters after the forward) and of offload (whether the sharded state lives in host
memory): one frozen ``Candidate``. ``lower`` builds a candidate on a copy of the graph and
predicts it (a ``Lowered``); the ``Planner`` enumerates and bounds them, one ``_Search`` per
strategy and one ``_Placement`` per placement of the state, and returns the finished Plan.
This pass runs the rest of the pipeline once per candidate on a
copy of the captured graph, predicts each result's step time and peak memory
(``autoshard.simulate``) and keeps the fastest that fits the memory budget; every candidate
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
when no plan of the placement fits with it). Per choice, the unit candidates of the "auto"
policy (``autoshard.passes.auto``), fastest first, or the one grouping a fixed policy gives.
Skipped without a pipeline, with the reason recorded: a choice whose activation peak alone
already exceeds the budget; a unit candidate whose lower bound on memory does
(``autoshard.passes.auto``); once a plan fits, a choice whose compute alone takes longer
than that plan's step, and a unit candidate whose compute plus the copies its grouping
surely makes (``copy_floor``, ``gradient_copies``) does. On graphs over ``BIG_GRAPH`` nodes
the first choice whose activations fit, and within a choice the first unit candidate that
fits, are found by bisection (peaks fall along both orders), and once every plan of a choice
is ruled out as slower, the choices after it (which recompute more) are not built; so there
the guarantee holds among the candidates tried. Smaller graphs try every choice and
candidate. Each candidate is predicted on its joint graph
(``autoshard.simulate.simulate_joint``, the same prediction as its split program's); only
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
``OFFLOAD_STATE`` that fits, by bisection (the state of the last parameters first,
``autoshard.spec.hosted``; peaks fall as more is offloaded). A fraction is not searched when
the least peak tried with all of the state on the host, plus the optimizer state it brings back
onto the device (held all step), exceeds the budget. Among plans equally fast, the one with
less state on the host is kept. Offloaded, each unit candidate is tried with none of the
resharded units copying their shards in again for the backward (all hold the forward's copy
on the device); if that does not fit, with all of them, then with the least of
``OFFLOAD_PARAMS`` between that fits, by bisection (for one grouping, fewer copies is faster
and takes more memory).

Memory against FSDP2 (``Config.prefer="memory"``, the default): before the search, FSDP2's
plan for the model is lowered and predicted once (``Planner._fsdp2``); among the plans that
fit, those predicted within ``PEAK_TARGET`` of its peak and ``STEP_CAP`` of its step win over
those that are not, then the fastest (``_Search._better``; a candidate is ruled out as slower
only once the best meets that), and ``plan.choice`` says why where the fastest plan's peak
is over the target. "speed" keeps the fastest that fits.

    captured -copy-> recompute(choice) -copy-> units(k) -> collectives -> prefetch
                              -> simulate_joint -> (time, peak) -> keep best -> split
"""

from __future__ import annotations

import dataclasses
import gc
import math
from collections.abc import Mapping
from typing import Any, Optional

import torch.fx as fx

from autoshard.config import reshard_group_size, reshard_group_sizes
from autoshard.graph import clone_graph
from autoshard.plans import _fmt_bytes
from autoshard.passes.auto import BIG_GRAPH

LADDER = (0.25, 0.5, 0.75, 1.0)
# with no Config.offload_policy and nothing fitting on the device, the fractions of the
# sharded state in host memory tried (PassContext.offload), least first
OFFLOAD_STATE = (0.25, 0.5, 0.75, 1.0)
# with the state on the host, the fractions of units copying their shards in twice tried
# (PassContext.offload_params), fastest first
OFFLOAD_PARAMS = (0.0, 0.25, 0.5, 0.75, 1.0)
# candidate pipelines between two runs of Python's cyclic garbage collector (see _Garbage)
COLLECT_EVERY = 8
# which units free their gathered parameters after the forward (Config.reshard_after_forward)
RESHARD = {True: "every unit", "auto": "all but the last", False: "none"}
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


def preference(config, profile) -> str:
    """``Config.prefer`` as the planner applies it: "auto" is "memory" where the device is
    the host (a profile with no host link: its memory is the machine's), else
    "balanced"."""
    if config.prefer != "auto":
        return config.prefer
    return "balanced" if profile is not None and profile.host_bandwidth > 0 else "memory"


def _target(prefer: str, reference) -> Optional[tuple]:
    """(peak bytes, step seconds) a plan should stay within, from FSDP2's plan's
    ``reference`` Prediction; None where there is no such bound."""
    if reference is None:
        return None
    if prefer == "memory":
        return PEAK_TARGET * reference.peak_bytes, STEP_CAP * reference.total
    return reference.peak_bytes, reference.total


def reshard_label(reshard) -> str:
    """How a plan reshards after the forward: ``RESHARD``'s label, or for an int k (hpZ)
    "every unit, to groups of k"."""
    if isinstance(reshard, int) and not isinstance(reshard, bool):
        return f"every unit, to groups of {reshard}"
    return RESHARD[reshard]


def shard_size(ctx) -> int:
    """The ranks of the shard dimension (the mesh's last) the captured parameters name."""
    params = ctx.captured.params
    return params[0].mesh_shape[-1] if params else 1


def recompute_choices(setting, blocks: list, offload=False) -> list:
    """``[(label, modes)]`` for ``Config.recompute``: ``modes`` is the recompute pass's
    ``{block path: mode}`` (``{}``: the min cut everywhere), or None for no recomputation.
    For True, the choices after the first are tried only when no plan fits with it
    (``first_choices``). ``offload`` (``offload_choice``): True adds, after the min cut,
    the first 1/4, 1/2, 3/4 and all of the blocks with their saved activations offloaded
    (mode "offload": ``autoshard.passes.offload``), before whole-block recomputation;
    "force" gives one choice, every block offloaded ({"*": "offload"} with no blocks: every
    saved activation). True also ends the ladder with every block recomputed whole and what
    then crosses (the blocks' inputs) offloaded: the least device memory of all."""
    if setting is False:
        return [("none", None)]
    if isinstance(setting, Mapping):
        return [(_label(setting, blocks), dict(setting))]
    if offload == "force":
        return ([(f"offload {len(blocks)}/{len(blocks)}", {b: "offload" for b in blocks})]
                if blocks else [("offload all", {"*": "offload"})])
    whole = [("blocks", {b: "block" for b in blocks})] if blocks else [("min-cut", {})]
    if setting == "blocks":
        return whole
    out, seen = [("none", None), ("min-cut", {})], set()
    for frac in LADDER if offload else ():
        k = max(1, round(frac * len(blocks)))
        if k not in seen and blocks:
            seen.add(k)
            out.append((f"offload {k}/{len(blocks)}", {b: "offload" for b in blocks[:k]}))
    seen = set()
    for frac in LADDER:
        k = max(1, round(frac * len(blocks)))
        if k not in seen and blocks:
            seen.add(k)
            out.append((f"blocks {k}/{len(blocks)}", {b: "block" for b in blocks[:k]}))
    if offload and blocks:  # the least memory: every block whole, what crosses offloaded
        out.append((f"blocks {len(blocks)}/{len(blocks)}, offload all",
                    {**{b: "block" for b in blocks}, "*": "offload"}))
    return out[1:] if setting is True else out


def offload_choice(config, profile):
    """``recompute_choices``'s ``offload`` for a Config on a profile: "force" for
    ``offload_activations=True``; for None, whether the profile has a host link (where the
    host is the device, a copy to it frees nothing)."""
    setting = config.offload_activations
    if setting is None:
        return profile is not None and profile.host_bandwidth > 0
    return "force" if setting else False


def offloaded_blocks(modes) -> Optional[list]:
    """The module paths whose saved activations ``modes`` offloads ([]: none; None: every
    saved activation)."""
    paths = [p for p, m in (modes or {}).items() if m == "offload"]
    return None if "*" in paths else paths


def first_choices(setting, choices: list) -> int:
    """How many of ``choices`` (``recompute_choices``) are always tried; the rest only when
    no plan fits with those: recompute=True recomputes whole blocks only where the min cut
    leaves no plan that fits the budget."""
    return 1 if setting is True else len(choices)


def _label(modes: dict, blocks: list) -> str:
    whole = sum(m == "block" for m in modes.values())
    kept = sum(m == "keep" for m in modes.values())
    moved = sum(m == "offload" for p, m in modes.items() if p != "*")
    parts = [f"blocks {whole}/{len(blocks)}"] if whole else []
    parts += [f"kept {kept}/{len(blocks)}"] if kept else []
    parts += [f"offload {moved}/{len(blocks)}"] if moved else []
    parts += ["offload all"] if modes.get("*") == "offload" else []
    return ", ".join(parts) or "min-cut"


STRATEGIES_SEARCHED = ("zero1", "zero2", "zero3")  # Config.strategy="auto", least memory last


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One choice of everything a plan decides: the sharding flavour, the fraction of the
    sharded state in host memory, the recomputation (its label and the recompute pass's
    ``{block path: mode}``, None for none), the unit candidate (an index into
    ``autoshard.passes.auto.tries``, 0 for a fixed policy), which units reshard after the
    forward (``RESHARD``'s keys, or an int k: every unit to groups of k, hpZ) and, offloaded,
    the fraction of resharded units copying their shards in again for the backward."""

    strategy: str
    offload: float
    recompute: str
    modes: Optional[Mapping]
    units: int
    reshard: Any
    offload_params: float


@dataclasses.dataclass
class Lowered:
    """A candidate lowered: its joint graph with every collective in place (not yet split),
    the pass context that built it (its units, placement and model state) and the
    simulator's prediction of its step."""

    candidate: Candidate
    gm: fx.GraphModule
    ctx: Any
    prediction: Any


def lower(base: fx.GraphModule, ctx, cand: Candidate, config, cache: dict, *,
          verify: bool = False) -> Lowered:
    """``cand`` built on ``base`` (the captured graph with ``cand``'s recomputation applied,
    left untouched) and predicted: units, collectives, prefetch, then the simulator. Reads
    ``ctx`` (the placement's context: specs, profile, bytes held all step) without changing
    it. ``cache``: the per-graph cache of ``autoshard.passes.auto``."""
    from autoshard.passes import (default_passes, recompute_activations_pass, run_passes,
                                  split_pass)
    from autoshard.passes.collectives import offloaded_units
    from autoshard.simulate import simulate_joint

    cctx = dataclasses.replace(ctx, reshard_after_forward=cand.reshard,
                               offload_params=cand.offload_params)
    # recomputation is done already, per choice; the chosen plan alone is split
    passes = [p for p in default_passes(config, candidate=cand.units, auto_cache=cache)
              if p[0] not in (recompute_activations_pass, split_pass)]
    out, cctx = run_passes(clone_graph(base), cctx, passes, verify_each=verify, lint=False)
    params = cand.offload_params
    if ctx.offload:  # the fraction that took effect: a whole number of units copy again
        specs = {p.fqn: p for p in ctx.captured.params}
        hosted = offloaded_units(cctx.units, specs)
        params = sum(not u.held for u in hosted) / len(hosted) if hosted else 0.0
    pred = simulate_joint(out, ctx.profile, ctx.sim_static_bytes,
                          ctx.state["host"] - ctx.state["host_grads"])
    cctx = dataclasses.replace(cctx, offload_params=params, prediction=pred,
                               recompute=(cand.recompute, cand.modes))
    return Lowered(cand, out, cctx, pred)


def plan_step_pass(gm: fx.GraphModule, ctx, *, options):
    """Choose and build the plan: returns the chosen candidate's split graph and the context
    it was built in.

    Needs: the captured joint graph (untouched: every candidate works on a copy) and in
    ``ctx`` the profile and budget. Options: ``config`` (the Config), ``other_static_bytes``
    (buffers and inputs, held all step), ``local_grad_bytes`` (of those, the full local
    gradients a step without gradient sync holds), ``placed`` (the fraction of the state an
    earlier plan stored in host memory, kept as the specs say; None: searched), ``verify``.
    Guarantees: the context returned is the chosen candidate's (units, split program,
    parameter descriptions with the strategy's placement), its ``prediction`` the
    Prediction, its ``plan`` the finished Plan: every candidate tried, the entries after
    the optimizer step, and ``plan.unfit`` saying why when nothing fits (the plan with the
    least peak is chosen then). Shows progress (``autoshard.progress``) per candidate.
    Does nothing else to ``gm``.
    """
    from autoshard import progress

    with _Garbage() as garbage, progress.phase("planning", unit="candidates") as bar:
        return Planner(gm, ctx, options, garbage, bar).run()


class Planner:
    """The search: per strategy (``Config.strategy``, or each of ``STRATEGIES_SEARCHED`` for
    "auto") a ``_Search`` over placements, recomputation, units and resharding; the fastest
    plan that fits wins, else the one with the least peak."""

    def __init__(self, gm, ctx, options: dict, garbage, bar):
        self.gm, self.ctx, self.options, self.garbage = gm, ctx, options, garbage
        self.bar = bar  # autoshard.progress: one step per candidate lowered
        self.config = options["config"]

    def run(self):
        """``(split graph, the chosen context's fields with its "plan")``: per strategy the
        best plan (``_Search``), then among those the fastest that fits the budget and, with
        ``Config(prefer="memory")``, that meets the target against FSDP2's plan where one
        does (``_meets``); the plan says why when the fastest was not taken."""
        config = self.config
        prefer = preference(config, self.ctx.profile)
        ref_low = self._fsdp2(prefer)
        reference = ref_low.prediction if ref_low is not None else None
        target = _target(prefer, reference)
        self.options = {**self.options, "target": target,
                        "near": NEAR if prefer == "balanced" else 0.0}
        strategies = STRATEGIES_SEARCHED if config.strategy == "auto" else (config.strategy,)
        outcomes = [self._strategy(s) for s in strategies]
        tried = [o for o in outcomes if o[2].unfit is None] or [outcomes[-1]]
        # none fits: zero3's says what would
        fits = [o for o in tried if o[2].predicted["peak_bytes"] <= o[2].memory_budget]
        if (prefer == "balanced" and fits and ref_low is not None
                and ref_low.prediction.peak_bytes <= ref_low.ctx.memory_budget):
            # FSDP2's plan is a candidate too: the plan taken is never predicted slower or
            # heavier than it (a big graph's bisection may not build it)
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
            plan.choice = _choice(plan, reference, prefer)
        chosen = {f.name: getattr(best.ctx, f.name) for f in dataclasses.fields(best.ctx)}
        return out, {**chosen, "plan": plan}

    def _fsdp2(self, prefer: str):
        """FSDP2's plan for this model, predicted as every candidate is (``lower``): one unit
        per repeated block plus the root, every unit but the one read last in forward
        resharded after it (FSDP2 keeps its root), nothing recomputed, a prefetch of one
        unit, all of the state on the device. It lowered (``Lowered``), or None where the
        planner does not weigh plans against it: ``Config(prefer="speed")``, nothing left
        to the search, no module tree (an exported program), parameters not sharded
        (``strategy="ddp"``), or under "memory" a graph over ``BIG_GRAPH`` nodes (planned
        by bisection for the budget, where the extra lowering is seconds)."""
        from autoshard.config import Prefetch

        config, ctx = self.config, self.ctx
        if (prefer == "speed" or not self._searched() or ctx.model is None
                or config.strategy == "ddp"
                or (prefer == "memory" and len(self.gm.graph.nodes) > BIG_GRAPH)):
            return None
        specs = [dataclasses.replace(p, replica=False) for p in ctx.captured.params]
        ctx = dataclasses.replace(ctx, captured=dataclasses.replace(ctx.captured, params=specs),
                                  reshard_after_forward="auto")
        placed = _placed(ctx, 0.0, config, self.options)
        # FSDP2 recomputes nothing and offloads no activation (recompute=False refuses
        # offload_activations=True, which the user's Config may hold)
        fsdp2 = dataclasses.replace(config, policy="module", units=None, recompute=False,
                                    offload_activations=False,
                                    bucket=False, prefetch=Prefetch(depth=1),
                                    reshard_after_forward="auto", strategy="zero3")
        cand = Candidate("zero3", 0.0, "none", None, 0, "auto", 1.0)
        return lower(self.gm, placed, cand, fsdp2, {})

    def _fsdp2_outcome(self, low: Lowered):
        """FSDP2's plan (``low``) as a strategy's outcome: split, with a candidate row of its
        own (the plan lists every outcome's rows)."""
        from autoshard.passes import run_passes, split_pass

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
        from autoshard.passes import run_passes, split_pass

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
        best, candidates = _Search(self.gm, ctx, self.options, self.garbage, strategy,
                                   setting, self.bar).run()
        out, split = run_passes(best.gm, best.ctx, [(split_pass, {})],
                                verify_each=self.options.get("verify", False))
        best = dataclasses.replace(best, ctx=split)
        return out, best, self._finish(best, candidates, strategy)

    def _finish(self, best: Lowered, candidates: list, strategy: str):
        """The Plan of ``best`` (split): its schedule and prediction, the candidates, the gathers
        after the optimizer step, and why it is not enough when it does not fit."""
        from autoshard.plans import make_plan

        ctx, config, pred = best.ctx, self.config, best.prediction
        specs = {p.fqn: p for p in ctx.captured.params}
        mesh_shape = ctx.captured.params[0].mesh_shape if ctx.captured.params else (1,)
        state = ctx.state
        plan = make_plan(
            math.prod(mesh_shape), ctx.units, specs, [ctx.split.fwd, ctx.split.bwd],
            prediction=pred, profile=ctx.profile, budget=ctx.memory_budget,
            policy="pinned" if config.units is not None else config.policy_name,
            model_state_bytes=state["params"] + state["grads"] + state["optimizer"],
            host_state_bytes=state["host"], recompute=ctx.recompute, candidates=candidates,
            offload=ctx.offload, offload_params=ctx.offload_params,
            reshard=(reshard_label(ctx.reshard_after_forward)
                     if any(p.gathers for p in ctx.captured.params) else "nothing gathered"),
            strategy=strategy, mesh_shape=mesh_shape, grad_sync=ctx.grad_sync)
        plan.predicted["local_grad_bytes"] = self.options.get("local_grad_bytes", 0)
        if any(p.replica for p in ctx.captured.params):
            _after_step(plan, ctx)
        plan.unfit = (_unfit(plan, ctx, config)
                      if self._searched() and pred.peak_bytes > ctx.memory_budget else None)
        return plan


class _Search:
    """One strategy's search: the placements of the state (on the device; with no
    ``Config.offload_policy`` and nothing fitting there, in host memory, as little as fits)
    and per placement every recomputation choice and unit candidate (``_Placement``).
    ``setting``: the strategy's ``reshard_after_forward`` ("search" tries keeping every unit
    gathered too)."""

    def __init__(self, gm, ctx, options, garbage, strategy: str, setting, bar):
        self.gm, self.ctx, self.options, self.garbage, self.bar = gm, ctx, options, garbage, bar
        self.config, self.strategy, self.setting = options["config"], strategy, setting
        self.candidates: list = []  # every candidate tried or ruled out, as the plan shows it
        self.best: Optional[Lowered] = None
        self.best_row: Optional[dict] = None  # its row in ``candidates``
        # Config(prefer="balanced"): the best's class (fits, meets the target) within
        # options["near"] of its fastest, as (Lowered, row); the lightest is taken
        self.near: list = []
        self.searched: dict = {}  # the parameters on the host -> whether a plan fits
        self.all_hosted = None  # (least peak, optimizer bytes) with all of the state hosted
        # what every placement computes alike: each choice's graph and activations, the unit
        # groupings
        self.bases, self.activations, self.groupings = {}, {}, {}

    def run(self):
        """``(best Lowered, candidates)``; the best is the least peak when none fits."""
        from autoshard.config import offloads

        forced, placed = offloads(self.config), self.options.get("placed")
        may_offload = self.config.offload_policy is None  # when nothing fits on the device
        if placed is not None:  # an earlier plan stored the state: the specs say where
            self.placement(placed, None, keep=True)
        elif forced:
            self.placement(forced, None)
        elif (not self.placement(0.0, "unfit" if may_offload else None) and may_offload
              and self.placement(1.0, "all")):
            lo, hi = 0, len(OFFLOAD_STATE) - 1  # OFFLOAD_STATE[-1] fits
            while lo < hi:
                mid = (lo + hi) // 2
                lo, hi = (lo, mid) if self.placement(OFFLOAD_STATE[mid], "all") else (mid + 1,
                                                                                      hi)
        if self.near and self._class(self.best)[0]:  # with none that fits: the least peak
            self.best, self.best_row = lightest_near(
                self.near, lambda o: o[0], self.options.get("target"), self.options["near"])
        for c in self.candidates:
            c["chosen"] = c is self.best_row
        return self.best, self.candidates

    def placement(self, offload: float, reuse, keep: bool = False) -> bool:
        """Search with ``offload`` of the state on the host (once per placement: on a small
        model two fractions can place alike); whether a plan fits then. ``reuse``: whether a
        later placement reads the choices' graphs (None: none; "unfit": one does if no plan
        fits; "all"). ``keep``: the specs' devices are the placement (``offload`` its
        fraction)."""
        budget = self.ctx.memory_budget
        placed = _placed(self.ctx, offload, self.config, self.options, keep)
        key = frozenset(s.fqn for s in placed.captured.params if s.device == "host")
        if key in self.searched:
            return self.searched[key]
        # brought back onto the device, optimizer state is held all step: every plan tried
        # with all of the state on the host needs that much more, at least
        if self.all_hosted is not None:
            least, hosted_optimizer = self.all_hosted
            back = placed.state["optimizer"] - hosted_optimizer
            if least + back > budget:
                self.candidates.append({
                    "recompute": "-", "offload": offload, "offload_params": None,
                    "units": None, "step_s": None, "peak_bytes": least + back, "fits": False,
                    "note": f"the least peak with all of the state on the host plus the "
                            f"{_fmt_bytes(back)} of optimizer state this brings back exceeds "
                            "the budget"})
                self.searched[key] = False
                return False
        _Placement(self, placed, reuse).run()
        self.searched[key] = any(c["fits"] and c["offload"] == offload for c in self.candidates)
        if offload == 1.0:
            self.all_hosted = (min(c["peak_bytes"] for c in self.candidates
                                   if c["offload"] == 1.0 and c["step_s"] is not None),
                               placed.state["optimizer"])
        return self.searched[key]

    def consider(self, low: Lowered, row: dict) -> None:
        """Record a lowered candidate; keep it if it is the best so far."""
        self.candidates.append(row)
        if self.best is None or self._better(low, self.best):
            self.best, self.best_row = low, row
        if self.options.get("near"):
            self.near = [o for o in self.near + [(low, row)]
                         if self._class(o[0]) == self._class(self.best) and
                         o[0].prediction.total <= self.bound()]
        self.garbage.candidate_done()
        self.bar.step(note=f"{low.candidate.strategy}, {row['recompute']} recomputation, "
                           f"{row['units']} units, best {self.best.prediction.total * 1e3:.1f} ms")

    def best_fits(self) -> bool:
        """Whether the best plan so far fits the budget and meets the peak target (then a
        candidate surely slower than it cannot win, and is ruled out unbuilt)."""
        return (self.best is not None and self.best.prediction.peak_bytes <= self.ctx.memory_budget
                and _meets(self.best.prediction, self.options.get("target")))

    def bound(self) -> float:
        """The predicted step a candidate must beat to be kept: the best's, plus
        ``options["near"]`` of it (a lighter plan that close to the fastest may win)."""
        return self.best.prediction.total * (1 + self.options.get("near", 0.0))

    def _class(self, low: Lowered) -> tuple:
        pred = low.prediction
        return (pred.peak_bytes <= self.ctx.memory_budget,
                _meets(pred, self.options.get("target")))

    def _better(self, a: Lowered, b: Lowered) -> bool:
        """Fits first, then (``Config(prefer="memory")``) meets the target against FSDP2's
        plan (``options["target"]``, see ``_meets``), then fastest, then the least state on
        the host; among the unfit, the least memory."""
        budget, target = self.ctx.memory_budget, self.options.get("target")
        pa, pb = a.prediction, b.prediction
        a_fits, b_fits = pa.peak_bytes <= budget, pb.peak_bytes <= budget
        if a_fits != b_fits:
            return a_fits
        if not a_fits:
            return pa.peak_bytes < pb.peak_bytes
        if _meets(pa, target) != _meets(pb, target):
            return _meets(pa, target)
        return (pa.total, a.ctx.state["host"]) < (pb.total, b.ctx.state["host"])


@dataclasses.dataclass
class _Choice:
    """One recomputation choice within a placement: its graph and what every unit candidate
    on it shares."""

    label: str
    modes: Optional[Mapping]
    base: fx.GraphModule
    cache: dict  # autoshard.passes.auto's per-graph cache
    floor: int  # bytes held all step plus its activations
    compute: float = 0.0  # seconds of compute, plus the gradient copies every plan makes
    cands: list = dataclasses.field(default_factory=list)  # auto.tries: (s, bound, groups)
    tried: set = dataclasses.field(default_factory=set)
    read: set = dataclasses.field(default_factory=set)  # parameters the forward reads


class _Placement:
    """Every recomputation choice and unit candidate for one placement of the state (``ctx``
    from ``_placed``), recorded in the search. Choices go from recomputing nothing to
    recomputing most; see the module docstring for what is skipped and why."""

    def __init__(self, search: _Search, ctx, reuse):
        from autoshard.passes.units import repeated_blocks

        self.search, self.ctx, self.reuse = search, ctx, reuse
        self.start = len(search.candidates)  # this placement's rows come after
        config = self.config = search.config
        self.verify = search.options.get("verify", False)
        blocks = repeated_blocks(ctx.model) if ctx.model is not None else []
        self.choices = recompute_choices(config.recompute, blocks,
                                         offload_choice(config, ctx.profile))
        self.searching_units = config.policy == "auto" and config.units is None
        self.big = len(search.gm.graph.nodes) > BIG_GRAPH
        self.budget = ctx.memory_budget
        # offloaded, the fractions of units copying their shards in twice to try per candidate
        pinned = config.offload_options.params if config.offload_options else None
        self.ladder = (((pinned,) if pinned is not None else OFFLOAD_PARAMS) if ctx.offload
                       else (1.0,))
        self.specs = {p.fqn: p for p in ctx.captured.params}
        self.floors: dict = {}  # choice -> bytes held all step plus its activations
        # trying the fallback choices for Config(prefer="memory")'s target (``run``): each
        # with its fastest unit candidate only
        self.for_target = False

    def row(self, label, **fields) -> dict:
        """A candidate's row as the plan shows it."""
        return {"recompute": label, "offload": self.ctx.offload, "offload_params": None,
                **fields}

    def prepare(self, i: int):
        """Choice ``i``'s graph, and its floor: the bytes held all step plus its activations."""
        from autoshard.passes import (offload_activations_pass, recompute_activations_pass,
                                      run_passes)
        from autoshard.simulate import activations

        s = self.search
        if i not in s.bases:
            base = clone_graph(s.gm)
            modes = self.choices[i][1]
            if modes is not None:
                passes = [(recompute_activations_pass, {"blocks": modes})]
                moved = offloaded_blocks(modes)
                if moved is None or moved:
                    passes.append((offload_activations_pass, {"blocks": moved}))
                base, _ = run_passes(base, self.ctx, passes, verify_each=self.verify)
            host = self.ctx.profile is not None and self.ctx.profile.host_bandwidth > 0
            s.activations[i] = activations(base, host=host)
            s.bases[i] = base
        self.floors[i] = self.ctx.static_bytes + s.activations[i][0]
        return s.bases[i], self.floors[i]

    def first_fitting_choice(self, first: int) -> int:
        """On a big graph, the first choice whose activations fit, by bisection: each
        recomputes more than the one before, so its floor is lower (offload choices, whose
        floors fall along their own ladder but not against whole-block recomputation, are
        tried whatever it finds: ``run``)."""
        lo, hi = 0, len(self.choices) - 1
        if first < len(self.choices) and self.prepare(first - 1)[1] <= self.budget:
            hi = first - 1  # a choice always tried holds one: no fallback is built
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (mid + 1, hi) if self.prepare(mid)[1] > self.budget else (lo, mid)
        return lo

    def run(self) -> None:
        s = self.search
        first = first_choices(self.config.recompute, self.choices)
        tried_before = len(s.candidates)
        start = self.first_fitting_choice(first) if self.big else 0
        slower = None  # on a big graph, a choice whose plans were all slower than the chosen
        for i, (label, modes) in enumerate(self.choices):
            if i == first and self.fastest_meets(s.candidates[tried_before:]):
                break  # the rest are fallbacks, and a plan of this placement fits without them
            if i == first and any(c["fits"] for c in s.candidates[tried_before:]):
                self.for_target = True  # the fallbacks are tried for the target alone
            if slower is not None:  # each choice recomputes more than the one before
                s.candidates.append(self.row(
                    label, units=None, step_s=None, peak_bytes=None, fits=None,
                    note=f"recomputes or offloads more than {slower}, whose plans are all "
                         "slower than the chosen one"))
                continue
            # an offload choice's floor (copies taken as instant) is not ordered with the
            # recomputation choices': the bisection says nothing of it, so it is tried
            moved = offloaded_blocks(modes)
            if i < start and i not in self.floors and not (moved is None or moved):
                j = min(k for k in self.floors if k > i and self.floors[k] > self.budget)
                s.candidates.append(self.row(
                    label, units=None, step_s=None, peak_bytes=self.floors[j], fits=False,
                    note=f"recomputes less than {self.choices[j][0]}, whose activations alone "
                         "exceed the budget"))
                continue
            before = len(s.candidates)
            slower = self.choice(i, label, modes)
            if self.for_target and self.fastest_meets(s.candidates[before:]):
                break  # a fallback met the target: those after it recompute more

    def fastest_meets(self, rows: list) -> bool:
        """Whether a plan among ``rows`` fits and the fastest of those meets
        ``Config(prefer="memory")``'s target (``_meets``). If it does not, the recomputation
        choices after the first are tried too, in order, each with its fastest unit candidate
        only, until one meets the target: recomputing some blocks may meet it faster than
        smaller units do."""
        fit = [c for c in rows if c["fits"] and c["step_s"] is not None]
        if not fit:
            return False
        fastest = min(fit, key=lambda c: c["step_s"])
        target = self.search.options.get("target")
        return target is None or (fastest["peak_bytes"] <= target[0]
                                  and fastest["step_s"] <= target[1])

    def choice(self, i: int, label: str, modes):
        """Try choice ``i``'s unit candidates; the label if, on a big graph, every plan of it
        was slower than the chosen one (the choices after it are not built), else None."""
        from autoshard.cost import node_time

        s = self.search
        base, floor = self.prepare(i)
        last = i == len(self.choices) - 1  # built even if it does not fit: the plan shown
        if i and self.over_host(base, label):
            if not last or any(c["step_s"] is not None for c in s.candidates[self.start:]):
                return None
            i, (label, modes) = i - 1, self.choices[i - 1]  # the same without offload
            base, floor = self.prepare(i)
        if self.reuse is None or (self.reuse == "unfit" and s.best_fits()):
            for j in [j for j in s.bases if j <= i]:  # no later placement reads them
                del s.bases[j]
        # and per choice, its activations and unit candidates, computed once
        ch = _Choice(label, modes, base, {"groupings": s.groupings,
                                          "activations": s.activations[i]}, floor)
        if not last and floor > self.budget:
            s.candidates.append(self.row(label, units=None, step_s=None, peak_bytes=floor,
                                         fits=False,
                                         note="activations alone exceed the budget"))
            return None
        ch.compute = sum(node_time(n, self.ctx.profile) for n in base.graph.nodes)
        if s.best_fits() and ch.compute >= s.bound():
            s.candidates.append(self.row(
                label, units=None, step_s=None, peak_bytes=floor, fits=None,
                note=f"its compute alone ({ch.compute * 1e3:.1f} ms) is slower than the "
                     "chosen plan"))
            return label if self.big else None
        outcomes = self.unit_candidates(ch)
        return label if self.big and all(o is None for o in outcomes) else None

    def over_host(self, base, label: str) -> bool:
        """Whether the activations ``base`` offloads, with the state on the host, exceed the
        profile's host memory per device (recorded, not built, then; the last choice, with
        no plan of the placement built, gives way to the one before it, which offloads
        nothing)."""
        from autoshard.passes.offload import offloaded_bytes

        limit = getattr(self.ctx.profile, "host_memory", 0)
        moved = sum(offloaded_bytes(base).values()) if limit else 0
        if not moved or moved + self.ctx.state["host"] <= limit:
            return False
        self.search.candidates.append(self.row(
            label, units=None, step_s=None, peak_bytes=None, fits=False,
            note=f"its offloaded activations ({_fmt_bytes(moved)} per rank) exceed the host "
                 f"memory per device ({_fmt_bytes(limit)}, DeviceProfile.host_memory)"))
        return True

    def unit_candidates(self, ch: _Choice) -> list:
        """Each unit candidate's outcome (``attempt``): all of them, or on a big graph the
        first that fits, by bisection (fastest first is most memory first)."""
        from autoshard import meta
        from autoshard.passes import unit_options
        from autoshard.passes.auto import gradient_copies, tries

        if self.searching_units:
            ch.cands = tries(ch.base, self.ctx, {**unit_options(self.config),
                                                 "auto_cache": ch.cache})
        ch.compute += gradient_copies(ch.base, self.specs, self.ctx.profile)
        ch.read = {meta.tag(p, meta.FQN) for p in ch.base.graph.nodes
                   if meta.is_param(p) and any(meta.is_forward(u) for u in p.users)}
        if not self.searching_units or self.for_target:
            return [self.attempt(ch, 0)]
        if not self.big:
            return [self.attempt(ch, k) for k in range(len(ch.cands))]
        lo, hi, outcomes = 0, len(ch.cands) - 1, []
        while lo < hi:
            mid = (lo + hi) // 2
            outcomes.append(self.attempt(ch, mid))
            lo, hi = (mid + 1, hi) if outcomes[-1] is False else (lo, mid)
        if lo not in ch.tried:
            outcomes.append(self.attempt(ch, lo))
        return outcomes

    def slower_floor(self, ch: _Choice, k: int) -> bool:
        """Whether candidate ``k``'s compute and the copies its grouping surely makes are
        already slower than the best plan that fits (then it is recorded, not built)."""
        from autoshard.passes.auto import copy_floor

        s = self.search
        if not s.best_fits():
            return False
        floor_s = ch.compute + (copy_floor(ch.cands[k][2], self.specs, self.ctx.profile,
                                           ch.read, self.ctx.reshard_after_forward)
                                if self.searching_units else 0.0)
        if floor_s < s.bound():
            return False
        s.candidates.append(self.row(
            ch.label, units=len(ch.cands[k][2]) if self.searching_units else None,
            step_s=None, peak_bytes=ch.cands[k][1] if self.searching_units else ch.floor,
            fits=None,
            note=f"its compute and copies alone ({floor_s * 1e3:.1f} ms) are slower than the "
                 "chosen plan"))
        return True

    def attempt(self, ch: _Choice, k: int):
        """Unit candidate ``k`` through the pipeline: whether it fits, or None when its
        compute and copies alone are slower than the best plan that fits (not built).
        Offloaded, the fewest units copying their shards in twice that fits, among the
        ladder's fractions of the n offloaded units (each count once); peaks fall along it,
        so the last is tried (if it does not fit, none does), then the least that fits
        between, by bisection. A plan that fits with communication exposed is tried again
        with every unit kept from forward to backward (``reshard_after_forward="search"``)
        when its bound (the peak plus every resharded unit held) surely fits, else resharded
        to the least group that surely fits (``reshard_less``)."""
        from autoshard.passes.collectives import offloaded_units

        ch.tried.add(k)
        if self.slower_floor(ch, k):
            return None
        reshard = self.ctx.reshard_after_forward
        low = self.evaluate(ch, k, reshard, self.ladder[0])
        fits = low.prediction.peak_bytes <= self.budget
        n = len(offloaded_units(low.ctx.units, self.specs)) if self.ctx.offload else 0
        steps = sorted({round(f * n) for f in self.ladder}) if n else [0]
        if not fits and len(steps) > 1:
            last = self.evaluate(ch, k, reshard, steps[-1] / n)
            if last.prediction.peak_bytes <= self.budget:
                low, fits, lo, hi = last, True, 1, len(steps) - 1
                while lo < hi:
                    mid = (lo + hi) // 2
                    got = self.evaluate(ch, k, reshard, steps[mid] / n)
                    if got.prediction.peak_bytes <= self.budget:
                        low, hi = got, mid
                    else:
                        lo = mid + 1
        if fits and self.search.setting == "search" and low.prediction.exposed_comm > 0:
            self.reshard_less(ch, k, low)
        return fits

    def reshard_less(self, ch: _Choice, k: int, low: Lowered) -> None:
        """``reshard_after_forward="search"``: candidate ``k`` (``low``, which fits with
        communication exposed) again with every unit kept from forward to backward when its
        bound (the peak plus every resharded unit's gathered bytes) surely fits; else with
        every unit resharded to groups of g (hpZ) for the least g (of
        ``reshard_group_sizes``: the divisors of the shard size within a node) whose bound
        (the peak plus 1/g of every resharded unit's gathered bytes, the chunks held) surely
        fits. One more plan per candidate at most: keeping is never slower than hpZ (no
        backward all-gather at all), and a smaller group's backward all-gather never slower
        than a larger's (fewer ring steps, a link within a node), so the least that fits is
        the fastest of them."""
        pred = low.prediction
        held = sum(self.specs[f].gathered_bytes() for u in low.ctx.units if not u.keep
                   for f in u.fqns)
        if held <= 0:
            return
        if pred.peak_bytes + held <= self.budget:
            self.evaluate(ch, k, False, low.ctx.offload_params)
            return
        sizes = reshard_group_sizes("search", shard_size(self.ctx),
                                    self.ctx.profile.ranks_per_node if self.ctx.profile else 0)
        fitting = [g for g in sizes if pred.peak_bytes + held // g <= self.budget]
        if fitting:
            self.evaluate(ch, k, fitting[0], low.ctx.offload_params)

    def evaluate(self, ch: _Choice, k: int, reshard, params) -> Lowered:
        """Unit candidate ``k`` with ``reshard`` and ``offload_params`` as ``params``, lowered,
        predicted and recorded."""
        cand = Candidate(self.search.strategy, self.ctx.offload, ch.label, ch.modes, k, reshard,
                         params)
        low = lower(ch.base, self.ctx, cand, self.config, ch.cache, verify=self.verify)
        pred = low.prediction
        self.search.consider(low, self.row(
            ch.label, offload_params=low.ctx.offload_params if self.ctx.offload else None,
            units=len(low.ctx.units), reshard=reshard_label(reshard), step_s=pred.total,
            peak_bytes=pred.peak_bytes, fits=pred.peak_bytes <= self.budget, note=""))
        return low


def _placed(ctx, offload: float, config, options, keep: bool = False):
    """``ctx`` with ``offload`` of the sharded state kept on the host (``hosted``), the rest on
    the device (``keep``: as the specs place it already), and the bytes held all step that
    follow."""
    from autoshard.config import OPTIMIZER_STATES
    from autoshard.spec import hosted, model_state_bytes

    specs = ctx.captured.params
    host = ({s.fqn for s in specs if s.device == "host"} if keep
            else hosted([(s.fqn, s.shape) for s in specs], offload))
    if any((s.device == "host") != (s.fqn in host) for s in specs):
        specs = [dataclasses.replace(s, device="host" if s.fqn in host else "device")
                 for s in specs]
        ctx = dataclasses.replace(ctx, captured=dataclasses.replace(ctx.captured, params=specs))
    state = model_state_bytes(specs, OPTIMIZER_STATES[config.optimizer])
    other = options.get("other_static_bytes", 0)
    return dataclasses.replace(
        ctx, state=state, offload=offload,
        static_bytes=state["params"] + state["grads"] + state["optimizer"] + other,
        sim_static_bytes=state["params"] + state["optimizer"] + other)


def _after_step(plan, ctx) -> None:
    """A plan whose parameters have replicas (ZeRO-1) also gathers, per unit and compute
    dtype, the shards the optimizer updated into them before the next call: schedule entries
    ("after step"), and their time (exposed: nothing runs beside it) and bytes in the
    prediction."""
    from autoshard.cost import collective_time
    from autoshard.plans import ScheduleEntry

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


def lightest_near(options: list, lowered, target, near: float):
    """Of ``options``, the best by (meets the target, step, state on the host), or with
    ``near`` > 0 the lightest of those in its class predicted within ``near`` of its step
    (and no slower than the target): the least state on the host, then the least peak.
    ``lowered(option)`` gives an option's Lowered."""
    def key(o):
        low = lowered(o)
        return (not _meets(low.prediction, target), low.prediction.total,
                low.ctx.state["host"])

    best = min(options, key=key)
    if not near:
        return best
    limit = lowered(best).prediction.total * (1 + near)
    if target is not None and not key(best)[0]:  # and no slower than the target says
        limit = min(limit, target[1])
    return min((o for o in options if key(o)[0] == key(best)[0]
                and lowered(o).prediction.total <= limit),
               key=lambda o: (lowered(o).ctx.state["host"], lowered(o).prediction.peak_bytes,
                              lowered(o).prediction.total))


def _meets(pred, target) -> bool:
    """Whether a prediction meets ``target``: ``(peak bytes, step seconds)`` at most, from
    FSDP2's plan (``PEAK_TARGET``, ``STEP_CAP``); True when there is none."""
    return target is None or (pred.peak_bytes <= target[0] and pred.total <= target[1])


def _choice(plan, reference, prefer: str) -> Optional[str]:
    """Why the plan is not the fastest that fits, or why it is though it misses the target
    against FSDP2's plan (``reference``, its Prediction); None when the fastest was taken
    and meets it. Reads the plan's candidates (the chosen one marked)."""
    rows = [c for c in plan.candidates if c["fits"] and c["step_s"] is not None]
    chosen = next((c for c in plan.candidates if c.get("chosen")), None)
    if not rows or chosen is None:
        return None
    fastest = min(rows, key=lambda c: (c["step_s"], c["peak_bytes"]))
    peak = reference.peak_bytes
    slower = 100 * (chosen["step_s"] / fastest["step_s"] - 1)
    if prefer == "balanced":
        bound = (f"FSDP2's plan's predicted step and peak ({reference.total * 1e3:.3f} ms, "
                 f"{_fmt_bytes(peak)})")
        if fastest["peak_bytes"] > peak and chosen["peak_bytes"] <= peak:
            return (f"the fastest plan peaks at {fastest['peak_bytes'] / peak:.2f}x FSDP2's "
                    f"plan's predicted peak; chose the fastest within {bound}, "
                    f"{slower:.1f}% slower; Config(prefer='speed') takes the fastest")
        if chosen is not fastest and chosen["step_s"] <= fastest["step_s"] * (1 + NEAR):
            return (f"chose the lightest plan within {100 * NEAR:.0f}% of the fastest's "
                    f"step: {slower:.1f}% slower, at "
                    f"{chosen['peak_bytes'] / fastest['peak_bytes']:.2f}x its peak")
        if chosen["peak_bytes"] > peak or chosen["step_s"] > reference.total:
            return f"no plan that fits is predicted within {bound}, so the fastest is chosen"
        return None
    if fastest["peak_bytes"] <= PEAK_TARGET * peak:
        return None
    head = (f"the fastest plan peaks at {fastest['peak_bytes'] / peak:.2f}x FSDP2's plan's "
            f"predicted peak ({_fmt_bytes(peak)})")
    if chosen["step_s"] > fastest["step_s"]:
        return (f"{head}; chose the fastest within {PEAK_TARGET}x "
                f"({chosen['peak_bytes'] / peak:.2f}x), {slower:.0f}% slower; "
                "Config(prefer='speed') takes the fastest")
    return (f"{head}; no plan within {PEAK_TARGET}x is predicted within {STEP_CAP}x of its "
            f"step ({reference.total * 1e3:.3f} ms), so the fastest is chosen")


def _unfit(plan, ctx, config) -> str:
    """Why no plan fits: the smallest plan the search made (the last candidates tried are
    the least memory a plan can take: one unit per parameter, and with recompute True or
    "auto" every repeated block recomputed whole) and what would make one fit."""
    from autoshard.plans import offload_label

    budget, world_size = ctx.memory_budget, plan.world_size
    return (
        f"no plan fits the memory budget of {_fmt_bytes(budget)} per rank on "
        f"{world_size} ranks: the smallest plan autoshard can make ({ctx.recompute[0]} "
        f"recomputation, {len(ctx.units)} units"
        + (f", the model state in host memory (offload: "
           f"{offload_label(ctx.offload, ctx.offload_params)})" if ctx.offload else "")
        + f") needs {_fmt_bytes(plan.predicted['peak_bytes'])}. "
        "Raise Config.memory_budget to at least that, shard over more ranks, use a "
        "smaller batch" + (", or Config(recompute=True) to recompute activations"
                           if config.recompute is False else "") + ".")


class _Garbage:
    """Python's cyclic garbage collector, paused while the planner searches and run once
    every ``COLLECT_EVERY`` candidates instead. Each candidate builds graphs of up to 10^5
    nodes and drops them; fx nodes and their graph form cycles, which survive into the
    oldest generation, so the collector ran full collections over every live graph again and
    again: a third of the time planning GPT-175B. Restored as it was on the way out."""

    def __enter__(self):
        self.enabled, self.count = gc.isenabled(), 0
        gc.disable()
        return self

    def __exit__(self, *exc):
        if self.enabled:
            gc.enable()

    def candidate_done(self) -> None:
        self.count += 1
        if self.enabled and self.count % COLLECT_EVERY == 0:  # the caller may want none
            gc.collect()

"""plan_step: the planner, as the one pass the API runs.

A plan is a choice of units (which parameters are gathered together), of recomputation
(which activations cross from forward to backward, per repeated block), of resharding (which
units free their gathered parameters after the forward) and of offload (whether the sharded
state lives in host memory). This pass runs the rest of the pipeline once per candidate on a
copy of the captured graph, predicts each result's step time and peak memory
(``autoshard.simulate``) and keeps the fastest that fits the memory budget; every candidate
tried, with its prediction, is recorded for the plan to show.

Candidates. Recomputation choices, fastest first (each recomputes more than the one before):
keep what eager saves, the min cut, then the first 1/4, 1/2, 3/4 and all of the repeated blocks
recomputed whole (the rest by the min cut). Any k blocks save the same bytes, since every
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
resharded unit's gathered bytes is within the budget. Offload: the whole search runs on the
device first and, with no ``Config.offload_policy``, only if nothing fits, again with all of
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

    captured -copy-> recompute(choice) -copy-> units(k) -> collectives -> prefetch
                              -> simulate_joint -> (time, peak) -> keep best -> split
"""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Mapping

import torch.fx as fx

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


def recompute_choices(setting, blocks: list) -> list:
    """``[(label, modes)]`` for ``Config.recompute``: ``modes`` is the recompute pass's
    ``{block path: mode}`` (``{}``: the min cut everywhere), or None for no recomputation.
    For True, the choices after the first are tried only when no plan fits with it
    (``first_choices``)."""
    if setting is False:
        return [("none", None)]
    if isinstance(setting, Mapping):
        return [(_label(setting, blocks), dict(setting))]
    whole = [("blocks", {b: "block" for b in blocks})] if blocks else [("min-cut", {})]
    if setting == "blocks":
        return whole
    out, seen = [("none", None), ("min-cut", {})], set()
    for frac in LADDER:
        k = max(1, round(frac * len(blocks)))
        if k not in seen and blocks:
            seen.add(k)
            out.append((f"blocks {k}/{len(blocks)}", {b: "block" for b in blocks[:k]}))
    return out[1:] if setting is True else out


def first_choices(setting, choices: list) -> int:
    """How many of ``choices`` (``recompute_choices``) are always tried; the rest only when
    no plan fits with those: recompute=True recomputes whole blocks only where the min cut
    leaves no plan that fits the budget."""
    return 1 if setting is True else len(choices)


def _label(modes: dict, blocks: list) -> str:
    whole = sum(m == "block" for m in modes.values())
    kept = sum(m == "keep" for m in modes.values())
    parts = [f"blocks {whole}/{len(blocks)}"] if whole else []
    parts += [f"kept {kept}/{len(blocks)}"] if kept else []
    return ", ".join(parts) or "min-cut"


def plan_step_pass(gm: fx.GraphModule, ctx, *, options) -> fx.GraphModule:
    """Choose and build the plan: returns the chosen candidate's graph.

    Needs: the captured joint graph (untouched: every candidate works on a copy) and in
    ``ctx`` the profile and budget. Options: ``config`` (the Config), ``other_static_bytes``
    (buffers and inputs, held all step), ``verify``. With no ``Config.offload_policy``,
    offload is tried when nothing fits on the device.
    Guarantees: ``ctx`` is the chosen candidate's (units, split program, parameter
    descriptions), ``ctx.prediction`` its Prediction, ``ctx.recompute`` its recomputation
    (label, modes), ``ctx.state`` its model state (``autoshard.spec.model_state_bytes``),
    ``ctx.candidates`` every candidate tried; when none fits, the one with the least peak is
    chosen (the caller says what it needs). Does nothing else to ``gm``.
    """
    with _Garbage() as garbage:
        return _plan_step(gm, ctx, options, garbage)


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


def _plan_step(gm, ctx, options, garbage):
    from autoshard import passes
    from autoshard.config import offloads

    config, budget = options["config"], ctx.memory_budget
    candidates, best, shared = [], None, {"garbage": garbage}

    searched = {}  # the parameters on the host -> whether a plan fits

    def search(offload: float, reuse) -> bool:
        """Search with ``offload`` of the state on the host (once per placement: on a small
        model two fractions can place alike); whether a plan fits then. ``reuse``: whether a
        later search reads the choices' graphs (None: none; "unfit": one does if no plan
        fits; "all")."""
        nonlocal best
        placed = _placed(ctx, offload, config, options)
        key = frozenset(s.fqn for s in placed.captured.params if s.device == "host")
        if key in searched:
            return searched[key]
        # brought back onto the device, optimizer state is held all step: every plan tried
        # with all of the state on the host needs that much more, at least
        back = placed.state["optimizer"] - shared.get("all_hosted", (0, 0))[1]
        if "all_hosted" in shared and shared["all_hosted"][0] + back > budget:
            candidates.append({
                "recompute": "-", "offload": offload, "offload_params": None, "units": None,
                "step_s": None, "peak_bytes": shared["all_hosted"][0] + back, "fits": False,
                "note": f"the least peak with all of the state on the host plus the "
                        f"{_fmt_bytes(back)} of optimizer state this brings back exceeds "
                        "the budget"})
            searched[key] = False
            return False
        shared["reuse"] = reuse
        best = _search(gm, placed, options, candidates, best, shared)
        searched[key] = any(c["fits"] and c["offload"] == offload for c in candidates)
        if offload == 1.0:
            shared["all_hosted"] = (min(c["peak_bytes"] for c in candidates
                                        if c["offload"] == 1.0 and c["step_s"] is not None),
                                    placed.state["optimizer"])
        return searched[key]

    forced = offloads(config)
    planner = config.offload_policy is None  # may offload when nothing fits on the device
    if forced:
        search(forced, None)
    elif not search(0.0, "unfit" if planner else None) and planner and search(1.0, "all"):
        lo, hi = 0, len(OFFLOAD_STATE) - 1  # OFFLOAD_STATE[-1] fits
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if search(OFFLOAD_STATE[mid], "all") else (mid + 1, hi)
    pred, out, chosen = best
    out = passes.run_passes(out, chosen, [(passes.split_pass, {})],
                            verify_each=options.get("verify", False))
    chosen_at = next(i for i, c in enumerate(candidates) if c.pop("best", False))
    for i, c in enumerate(candidates):
        c["chosen"] = i == chosen_at
    for f in dataclasses.fields(ctx):
        setattr(ctx, f.name, getattr(chosen, f.name))
    ctx.candidates = candidates
    return out


def _placed(ctx, offload: float, config, options):
    """``ctx`` with ``offload`` of the sharded state kept on the host (``hosted``), the rest on
    the device, and the bytes held all step that follow."""
    from autoshard.config import OPTIMIZER_STATES
    from autoshard.spec import hosted, model_state_bytes

    specs = ctx.captured.params
    host = hosted([(s.fqn, s.shape) for s in specs], offload)
    if any((s.device == "host") != (s.fqn in host) for s in specs):
        specs = [dataclasses.replace(s, device="host" if s.fqn in host else "device")
                 for s in specs]
        ctx = dataclasses.replace(ctx, captured=dataclasses.replace(ctx.captured, params=specs))
    else:
        ctx = dataclasses.replace(ctx)
    state = model_state_bytes(specs, OPTIMIZER_STATES[config.optimizer])
    other = options.get("other_static_bytes", 0)
    ctx.state, ctx.offload = state, offload
    ctx.static_bytes = state["params"] + state["grads"] + state["optimizer"] + other
    ctx.sim_static_bytes = state["params"] + state["optimizer"] + other
    return ctx


def _search(gm, ctx, options, candidates: list, best, shared: dict):
    """Every recomputation choice and unit candidate for one placement of the state; appends
    to ``candidates`` and returns the better of ``best`` and what it found. ``shared``: what
    every search computes alike (each choice's graph and activations, the unit groupings)."""
    from autoshard import meta
    from autoshard.passes import (default_passes, recompute_activations_pass, run_passes,
                                  split_pass, unit_options)
    from autoshard.passes.auto import copy_floor, gradient_copies, tries
    from autoshard.passes.collectives import offloaded_units
    from autoshard.passes.units import repeated_blocks
    from autoshard.cost import node_time
    from autoshard.simulate import activations, simulate_joint

    config, verify = options["config"], options.get("verify", False)
    blocks = repeated_blocks(ctx.model) if ctx.model is not None else []
    choices = recompute_choices(config.recompute, blocks)
    searching_units = config.policy == "auto" and config.units is None
    big = len(gm.graph.nodes) > BIG_GRAPH
    budget = ctx.memory_budget
    # offloaded, the fractions of units copying their shards in twice to try per candidate
    ladder = ((config.offload_params,) if config.offload_params is not None
              else OFFLOAD_PARAMS) if ctx.offload else (1.0,)
    # as every candidate of this search records it
    where = {"offload": ctx.offload, "offload_params": None}
    # whether a later search reads the choices' graphs (see _plan_step)
    reuse = shared["reuse"]

    specs = {p.fqn: p for p in ctx.captured.params}
    gathered = {f: p.gathered_bytes() for f, p in specs.items()}

    def evaluate(base, label, modes, k, reshard, params):
        """Run unit candidate ``k`` with ``reshard`` and ``offload_params`` as ``params``
        through the pipeline and simulate it; record it, and keep it if it is the best so
        far."""
        nonlocal best
        cctx = dataclasses.replace(ctx, reshard_after_forward=reshard, offload_params=params)
        # recomputation is done already, per choice; the chosen plan alone is split
        passes = [p for p in default_passes(config, candidate=k, auto_cache=cache)
                  if p[0] not in (recompute_activations_pass, split_pass)]
        out = run_passes(clone_graph(base), cctx, passes, verify_each=verify, lint=False)
        if ctx.offload:  # the fraction that took effect: a whole number of units copy again
            hosted = offloaded_units(cctx.units, specs)
            cctx.offload_params = (sum(not u.held for u in hosted) / len(hosted) if hosted
                                   else 0.0)
        pred = simulate_joint(out, ctx.profile, ctx.sim_static_bytes,
                              ctx.state["host"] - ctx.state["host_grads"])
        cctx.prediction, cctx.recompute = pred, (label, modes)
        candidates.append({"recompute": label, **where,
                           "offload_params": cctx.offload_params if ctx.offload else None,
                           "units": len(cctx.units),
                           "reshard": RESHARD[reshard], "step_s": pred.total,
                           "peak_bytes": pred.peak_bytes, "fits": pred.peak_bytes <= budget,
                           "note": ""})
        if best is None or better((pred, out, cctx), best):
            for c in candidates:
                c.pop("best", None)
            best = (pred, out, cctx)
            candidates[-1]["best"] = True
        shared["garbage"].candidate_done()
        return cctx, pred

    def better(a, b):  # fits first, then fastest, then the least state on the host; among
        # the unfit, the least memory
        a_fits, b_fits = a[0].peak_bytes <= budget, b[0].peak_bytes <= budget
        if a_fits != b_fits:
            return a_fits
        if not a_fits:
            return a[0].peak_bytes < b[0].peak_bytes
        return (a[0].total, a[2].state["host"]) < (b[0].total, b[2].state["host"])

    bases = shared.setdefault("bases", {})
    acts = shared.setdefault("activations", {})
    floors = {}

    def prepare(i):
        """Choice ``i``'s graph, and its floor: the bytes held all step plus its activations."""
        if i not in bases:
            base = clone_graph(gm)
            if choices[i][1] is not None:
                base = run_passes(base, dataclasses.replace(ctx),
                                  [(recompute_activations_pass, {"blocks": choices[i][1]})],
                                  verify_each=verify)
            acts[i] = activations(base)
            bases[i] = base
        floors[i] = ctx.static_bytes + acts[i][0]
        return bases[i], floors[i]

    first, tried_before = first_choices(config.recompute, choices), len(candidates)
    start = 0  # the first choice whose activations fit; each recomputes more than the one
    if big:  # before, so its floor is lower: bisected on a big graph
        lo, hi = 0, len(choices) - 1
        if first < len(choices) and prepare(first - 1)[1] <= budget:
            hi = first - 1  # a choice always tried holds one: no fallback is built
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (mid + 1, hi) if prepare(mid)[1] > budget else (lo, mid)
        start = lo
    # the unit groupings (autoshard.passes.auto), the same for every choice
    groupings = shared.setdefault("groupings", {})
    slower = None  # on a big graph, a choice whose plans were all slower than the chosen one
    for i, (label, modes) in enumerate(choices):
        if i == first and any(c["fits"] for c in candidates[tried_before:]):
            break  # the rest are fallbacks, and a plan of this placement fits without them
        if slower is not None:  # each choice recomputes more than the one before
            candidates.append({"recompute": label, **where, "units": None, "step_s": None,
                               "peak_bytes": None, "fits": None,
                               "note": f"recomputes more than {slower}, whose plans are all "
                                       "slower than the chosen one"})
            continue
        if i < start and i not in floors:
            j = min(k for k in floors if k > i and floors[k] > budget)
            candidates.append({"recompute": label, **where, "units": None,
                               "step_s": None, "peak_bytes": floors[j], "fits": False,
                               "note": f"recomputes less than {choices[j][0]}, whose "
                                       "activations alone exceed the budget"})
            continue
        base, floor = prepare(i)
        if reuse is None or (reuse == "unfit" and best is not None
                             and best[0].peak_bytes <= budget):
            for j in [j for j in bases if j <= i]:  # no later search reads them
                del bases[j]
        # and per choice, its activations and unit candidates, computed once
        cache = {"groupings": groupings, "activations": acts[i]}
        last_choice = i == len(choices) - 1
        if not last_choice and floor > budget:
            candidates.append({"recompute": label, **where, "units": None,
                               "step_s": None, "peak_bytes": floor, "fits": False,
                               "note": "activations alone exceed the budget"})
            continue
        compute = sum(node_time(n, ctx.profile) for n in base.graph.nodes)
        if best is not None and best[0].peak_bytes <= budget and compute >= best[0].total:
            candidates.append({"recompute": label, **where, "units": None,
                               "step_s": None, "peak_bytes": floor, "fits": None,
                               "note": f"its compute alone ({compute * 1e3:.1f} ms) is "
                                       "slower than the chosen plan"})
            slower = label if big else None
            continue
        if searching_units:
            cands = tries(base, ctx, {**unit_options(config), "auto_cache": cache})
        tried = set()
        compute += gradient_copies(base, specs, ctx.profile)
        read = {meta.tag(p, meta.FQN) for p in base.graph.nodes
                if meta.is_param(p) and any(meta.is_forward(u) for u in p.users)}

        def run(k, params):
            return evaluate(base, label, modes, k, ctx.reshard_after_forward, params)

        def attempt(k):
            """Candidate ``k`` through the pipeline: whether it fits, or None when its compute
            and copies alone are slower than the best plan that fits (not run)."""
            tried.add(k)
            if best is not None and best[0].peak_bytes <= budget:
                floor_s = compute + (copy_floor(cands[k][2], specs, ctx.profile, read,
                                                ctx.reshard_after_forward)
                                     if searching_units else 0.0)
                if floor_s >= best[0].total:
                    candidates.append({
                        "recompute": label, **where,
                        "units": len(cands[k][2]) if searching_units else None,
                        "step_s": None,
                        "peak_bytes": cands[k][1] if searching_units else floor, "fits": None,
                        "note": f"its compute and copies alone ({floor_s * 1e3:.1f} ms) are "
                                "slower than the chosen plan"})
                    return None
            cctx, pred = run(k, ladder[0])
            fits = pred.peak_bytes <= budget
            n = len(offloaded_units(cctx.units, specs)) if ctx.offload else 0
            # offloaded: the fewest units copying their shards in twice that fits, among the
            # ladder's fractions of these n units (each count once); peaks fall along it, so
            # the last is tried (if it does not fit, none does), then the least that fits
            # between, by bisection
            steps = sorted({round(f * n) for f in ladder}) if n else [0]
            if not fits and len(steps) > 1:
                last = run(k, steps[-1] / n)
                if last[1].peak_bytes <= budget:
                    (cctx, pred), fits, lo, hi = last, True, 1, len(steps) - 1
                    while lo < hi:
                        mid = (lo + hi) // 2
                        got = run(k, steps[mid] / n)
                        if got[1].peak_bytes <= budget:
                            (cctx, pred), hi = got, mid
                        else:
                            lo = mid + 1
            # every unit kept from forward to backward saves the backward's all-gathers; tried
            # when its bound (the peak plus every resharded unit held) surely fits and some
            # communication is exposed
            held = sum(gathered[f] for u in cctx.units if not u.keep for f in u.fqns)
            if (fits and config.reshard_after_forward == "search" and pred.exposed_comm > 0
                    and 0 < held and pred.peak_bytes + held <= budget):
                evaluate(base, label, modes, k, False, cctx.offload_params)
            return fits

        if not searching_units:
            outcomes = [attempt(0)]
        elif big:  # the first that fits, by bisection: fastest first is most memory first
            lo, hi, outcomes = 0, len(cands) - 1, []
            while lo < hi:
                mid = (lo + hi) // 2
                outcomes.append(attempt(mid))
                if outcomes[-1] is False:
                    lo = mid + 1
                else:
                    hi = mid
            if lo not in tried:
                outcomes.append(attempt(lo))
        else:
            outcomes = [attempt(k) for k in range(len(cands))]
        if big and all(o is None for o in outcomes):
            slower = label
    return best

"""The planner's search: ``Search``, one per strategy, and one hosting of the state each.

A ``Search`` walks the hostings of the sharded state (on the device, then in host memory
by the fractions of ``OFFLOAD_STATE``); per hosting, the recomputation choices and unit
candidates in order, bounded and bisected as the planner's docstring
(``planner/__init__.py``) says, and keeps the best ``Lowered`` it predicts. The planner runs
one per strategy and picks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Optional

import torch.fx as fx

from autoshard.core import meta, progress
from autoshard.core.config import offloads, reshard_group_sizes
from autoshard.core.cost import node_time
from autoshard.core.graph import clone_graph
from autoshard.passes.auto import BIG_GRAPH, copy_floor, gradient_copies, tries
from autoshard.planner.candidates import (Candidate, Lowered, Hosting, first_choices, lower,
                                          ladder_end, offload_choice, offloaded_blocks, host_state,
                                          recompute_choices, reshard_label, shard_size)
from autoshard.passes.collectives import offloaded_units
from autoshard.passes.offload import offload_activations_pass, offloaded_bytes
from autoshard.passes.pipeline import run_passes, unit_options
from autoshard.passes.remat import recompute_activations_pass
from autoshard.passes.groupings import repeated_blocks
from autoshard.core.plans import fmt_bytes
from autoshard.core.simulate import activations


# with no Config.offload_policy and nothing fitting on the device, the fractions of the
# sharded state in host memory tried (Hosting.offload), least first
OFFLOAD_STATE = (0.25, 0.5, 0.75, 1.0)
# with the state on the host, the fractions of units copying their shards in twice tried
# (PassContext.offload_params), fastest first
OFFLOAD_PARAMS = (0.0, 0.25, 0.5, 0.75, 1.0)


class Search:
    """One strategy's search: the hostings of the state (on the device; with no
    ``Config.offload_policy`` and nothing fitting there, in host memory, as little as fits)
    and per hosting every recomputation choice and unit candidate (``_HostingSearch``).
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
        # what every hosting computes alike: each choice's graph and activations, the unit
        # groupings
        self.bases, self.activations, self.groupings = {}, {}, {}
        self.cuts: dict = {}  # the recompute pass's cut_cache, for the choices' copies of gm

    def run(self):
        """``(best Lowered, candidates)``; the best is the least peak when none fits."""
        forced, stored = offloads(self.config), self.options.get("offload_stored")
        may_offload = self.config.offload_policy is None  # when nothing fits on the device
        if stored is not None:  # an earlier plan stored the state: the specs say where
            self.try_hosting(stored, None, as_specs=True)
        elif forced:
            self.try_hosting(forced, None)
        elif (not self.try_hosting(0.0, "unfit" if may_offload else None) and may_offload
              and self.try_hosting(1.0, "all")):
            lo, hi = 0, len(OFFLOAD_STATE) - 1  # OFFLOAD_STATE[-1] fits
            while lo < hi:
                mid = (lo + hi) // 2
                lo, hi = (lo, mid) if self.try_hosting(OFFLOAD_STATE[mid], "all") else (mid + 1,
                                                                                      hi)
        if self.near and self._class(self.best)[0]:  # with none that fits: the least peak
            self.best, self.best_row = lightest_near(
                self.near, lambda o: o[0], self.options.get("target"), self.options["near"])
        for c in self.candidates:
            c["chosen"] = c is self.best_row
        return self.best, self.candidates

    def try_hosting(self, offload: float, reuse, as_specs: bool = False) -> bool:
        """Search with ``offload`` of the state on the host (once per hosting: on a small
        model two fractions can place alike); whether a plan fits then. ``reuse``: whether a
        later hosting reads the choices' graphs (None: none; "unfit": one does if no plan
        fits; "all"). ``as_specs``: the specs' devices are the hosting (``offload`` its
        fraction)."""
        budget = self.ctx.memory_budget
        hosting = host_state(self.ctx, offload, self.config, self.options, as_specs)
        key = frozenset(s.fqn for s in hosting.ctx.captured.params if s.device == "host")
        if key in self.searched:
            return self.searched[key]
        # brought back onto the device, optimizer state is held all step: every plan tried
        # with all of the state on the host needs that much more, at least
        if self.all_hosted is not None:
            least, hosted_optimizer = self.all_hosted
            back = hosting.state["optimizer"] - hosted_optimizer
            if least + back > budget:
                self.candidates.append({
                    "recompute": "-", "offload": offload, "offload_params": None,
                    "units": None, "step_s": None, "peak_bytes": least + back, "fits": False,
                    "note": f"the least peak with all of the state on the host plus the "
                            f"{fmt_bytes(back)} of optimizer state this brings back exceeds "
                            "the budget"})
                self.searched[key] = False
                return False
        _HostingSearch(self, hosting, reuse).run()
        self.searched[key] = any(c["fits"] and c["offload"] == offload for c in self.candidates)
        if offload == 1.0:
            self.all_hosted = (min(c["peak_bytes"] for c in self.candidates
                                   if c["offload"] == 1.0 and c["step_s"] is not None),
                               hosting.state["optimizer"])
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
            self.near = _undominated(self.near)
        self.garbage.candidate_done(len(low.gm.graph.nodes))
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
        return (pa.total, a.state["host"]) < (pb.total, b.state["host"])


@dataclasses.dataclass
class _Choice:
    """One recomputation choice within a hosting: its graph and what every unit candidate
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


class _HostingSearch:
    """Every recomputation choice and unit candidate for one hosting of the state
    (``host_state``), recorded in the search. Choices go from recomputing nothing to
    recomputing most; see the planner's docstring (``planner/__init__.py``) for what is
    skipped and why."""

    def __init__(self, search: Search, hosting: Hosting, reuse):
        self.search, self.hosting, self.reuse = search, hosting, reuse
        ctx = self.ctx = hosting.ctx
        self.start = len(search.candidates)  # this hosting's rows come after
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
        self.ladder = (((pinned,) if pinned is not None else OFFLOAD_PARAMS)
                       if hosting.offload else (1.0,))
        self.specs = {p.fqn: p for p in ctx.captured.params}
        self.floors: dict = {}  # choice -> bytes held all step plus its activations
        # trying the fallback choices for Config(prefer="memory")'s target (``run``): each
        # with its fastest unit candidate only
        self.for_target = False

    def row(self, label, **fields) -> dict:
        """A candidate's row as the plan shows it."""
        return {"recompute": label, "offload": self.hosting.offload, "offload_params": None,
                **fields}

    def prepare(self, i: int):
        """Choice ``i``'s graph, and its floor: the bytes held all step plus its activations."""
        s = self.search
        if i not in s.bases:
            with progress.timed("plan: recompute choices"):
                self._build(i)
        self.floors[i] = self.ctx.static_bytes + s.activations[i][0]
        return s.bases[i], self.floors[i]

    def _build(self, i: int) -> None:
        """Choice ``i``'s graph (recomputed and offloaded as it says) and its activations,
        kept in the search for every hosting."""
        s = self.search
        base = clone_graph(s.gm)
        modes = self.choices[i][1]
        if modes is not None:
            passes = [(recompute_activations_pass, {"blocks": modes, "cut_cache": s.cuts})]
            moved = offloaded_blocks(modes)
            if moved is None or moved:
                passes.append((offload_activations_pass, {"blocks": moved}))
            base, _ = run_passes(base, self.ctx, passes, verify_each=self.verify)
        host = self.ctx.profile is not None and self.ctx.profile.host_bandwidth > 0
        s.activations[i] = activations(base, host=host)
        s.bases[i] = base

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
        # choices tried out of order (-> (``choice``'s result, their rows)), and those tried
        # or made needless by their ladder's last (``end_dominates``)
        self.ahead, self.skip = {}, set()
        for i, (label, modes) in enumerate(self.choices):
            if i in self.skip:
                continue
            if i in self.ahead:  # tried already, as its ladder's last: its rows go here
                result, rows = self.ahead.pop(i)
                slower = slower or result
                self._move_last(rows)
                continue
            if i == first and self.fastest_meets(s.candidates[tried_before:]):
                break  # the rest are fallbacks, and a plan of this hosting fits without them
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
            end = ladder_end(self.choices, i) if self.big and s.options.get("near") else i
            if (end > i and end not in self.ahead and not self.for_target
                    and self.end_dominates(end)):
                at = len(s.candidates) - len(self.ahead.pop(end)[1])  # before the end's rows
                s.candidates[at:at] = [self.row(
                    self.choices[k][0], units=None, step_s=None, peak_bytes=None, fits=None,
                    note=f"{self.choices[end][0]}, further along, fits within "
                         f"{100 * s.options['near']:g}% of the fastest plan")
                    for k in range(i, end)]
                self.skip.update(range(i + 1, end + 1))
                continue
            before = len(s.candidates)
            slower = self.choice(i, label, modes)
            if self.for_target and self.fastest_meets(s.candidates[before:]):
                break  # a fallback met the target: those after it recompute more
        for _, rows in self.ahead.values():  # the loop ended before them
            self._move_last(rows)

    def _move_last(self, rows: list) -> None:
        """``rows`` (of a choice tried ahead) moved to the end of the candidates, after the
        rows of the choices before it on its ladder."""
        cands = self.search.candidates
        cands[:] = [c for c in cands if not any(c is r for r in rows)] + rows

    def end_dominates(self, end: int) -> bool:
        """On a big graph with ``Config(prefer="balanced")``: try choice ``end``, the last of
        a ladder, before the ones leading to it; whether a plan of it fits and is predicted
        within ``options["near"]`` of the fastest so far in the best's class. Then it is the
        lightest plan of its ladder the lightest-near rule (``lightest_near``) can take, and
        the choices before it on the ladder are not built: at GPT-175B, 6 of 11 choices."""
        s = self.search
        before = len(s.candidates)
        result = self.choice(end, *self.choices[end])
        rows = self.ahead[end] = (result, s.candidates[before:])
        return s.best_fits() and any(
            c["fits"] and c["step_s"] is not None and c["step_s"] <= s.bound()
            and _row_meets(c, s.options.get("target")) for c in rows[1])

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
        return _row_meets(fastest, self.search.options.get("target"))

    def choice(self, i: int, label: str, modes):
        """Try choice ``i``'s unit candidates; the label if, on a big graph, every plan of it
        was slower than the chosen one (the choices after it are not built), else None."""
        s = self.search
        base, floor = self.prepare(i)
        last = i == len(self.choices) - 1  # built even if it does not fit: the plan shown
        if i and self.over_host(base, label):
            if not last or any(c["step_s"] is not None for c in s.candidates[self.start:]):
                return None
            i, (label, modes) = i - 1, self.choices[i - 1]  # the same without offload
            base, floor = self.prepare(i)
        if self.reuse is None or (self.reuse == "unfit" and s.best_fits()):
            for j in [j for j in s.bases if j <= i]:  # no later hosting reads them
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
        no plan of the hosting built, gives way to the one before it, which offloads
        nothing)."""
        limit = getattr(self.ctx.profile, "host_memory", 0)
        moved = sum(offloaded_bytes(base).values()) if limit else 0
        if not moved or moved + self.hosting.state["host"] <= limit:
            return False
        self.search.candidates.append(self.row(
            label, units=None, step_s=None, peak_bytes=None, fits=False,
            note=f"its offloaded activations ({fmt_bytes(moved)} per rank) exceed the host "
                 f"memory per device ({fmt_bytes(limit)}, DeviceProfile.host_memory)"))
        return True

    def unit_candidates(self, ch: _Choice) -> list:
        """Each unit candidate's outcome (``attempt``): all of them, or on a big graph the
        first that fits (fastest first is most memory first), by exponential search: the
        first, the second, the fourth, ... until one fits, then bisection between it and the
        last that did not. The candidates are those whose memory bound fits
        (``autoshard.passes.floor``), close enough to their peaks that the first fits where
        any does, or else the second: at GPT-175B one or two pipelines per recomputation
        choice, where a bisection of the six built two or three."""
        if self.searching_units:
            with progress.timed("plan: unit candidates"):
                ch.cands = tries(ch.base, self.ctx, {**unit_options(self.config),
                                                     "auto_cache": ch.cache,
                                                     "prefetch": self.config.prefetch_options,
                                                     "bucket": bool(self.config.bucket_options)})
        ch.compute += gradient_copies(ch.base, self.specs, self.ctx.profile)
        ch.read = {meta.tag(p, meta.FQN) for p in ch.base.graph.nodes
                   if meta.is_param(p) and any(meta.is_forward(u) for u in p.users)}
        if not self.searching_units or self.for_target:
            return [self.attempt(ch, 0)]
        if not self.big:
            return [self.attempt(ch, k) for k in range(len(ch.cands))]
        lo, hi, outcomes, k = 0, len(ch.cands) - 1, [], 0
        while k < hi:  # the first, second, fourth, eighth ...
            outcomes.append(self.attempt(ch, k))
            if outcomes[-1] is not False:
                hi = k
                break
            lo, k = k + 1, 2 * k + 1
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
        ch.tried.add(k)
        if self.slower_floor(ch, k):
            return None
        reshard = self.ctx.reshard_after_forward
        low = self.evaluate(ch, k, reshard, self.ladder[0])
        fits = low.prediction.peak_bytes <= self.budget
        n = len(offloaded_units(low.ctx.units, self.specs)) if self.hosting.offload else 0
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
        held = sum(self.specs[f].gathered_bytes() for u in low.ctx.units if not u.stays_gathered
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
        cand = Candidate(self.search.strategy, self.hosting.offload, ch.label, ch.modes, k,
                         reshard, params)
        with progress.timed("plan: lower candidates"):
            low = lower(ch.base, self.hosting, cand, self.config, ch.cache, verify=self.verify)
        pred = low.prediction
        self.search.consider(low, self.row(
            ch.label, offload_params=low.ctx.offload_params if self.hosting.offload else None,
            units=len(low.ctx.units), reshard=reshard_label(reshard), step_s=pred.total,
            peak_bytes=pred.peak_bytes, fits=pred.peak_bytes <= self.budget, note=""))
        return low


def _undominated(near: list) -> list:
    """``near`` (``(Lowered, row)`` of one class) less each plan another of them dominates:
    no slower, and lighter by (state on the host, peak, step). ``lightest_near`` never takes
    such a plan whatever bound it ends with (the other is within any bound it is, and first
    by its order), so dropping it early changes nothing but frees its graph: at GPT-175B a
    dozen plans come within 2% of the fastest, and the collector walked every one of them."""
    def key(o):
        pred = o[0].prediction
        return o[0].state["host"], pred.peak_bytes, pred.total

    return [a for a in near if not any(b[0].prediction.total <= a[0].prediction.total
                                       and key(b) < key(a) for b in near)]


def lightest_near(options: list, lowered, target, near: float):
    """Of ``options``, the best by (meets the target, step, state on the host), or with
    ``near`` > 0 the lightest of those in its class predicted within ``near`` of its step
    (and no slower than the target): the least state on the host, then the least peak.
    ``lowered(option)`` gives an option's Lowered."""
    def key(o):
        low = lowered(o)
        return (not _meets(low.prediction, target), low.prediction.total,
                low.state["host"])

    best = min(options, key=key)
    if not near:
        return best
    limit = lowered(best).prediction.total * (1 + near)
    if target is not None and not key(best)[0]:  # and no slower than the target says
        limit = min(limit, target[1])
    return min((o for o in options if key(o)[0] == key(best)[0]
                and lowered(o).prediction.total <= limit),
               key=lambda o: (lowered(o).state["host"], lowered(o).prediction.peak_bytes,
                              lowered(o).prediction.total))


def _meets(pred, target) -> bool:
    """Whether a prediction meets ``target``: ``(peak bytes, step seconds)`` at most, from
    FSDP2's plan (``PEAK_TARGET``, ``STEP_CAP``); True when there is none."""
    return target is None or (pred.peak_bytes <= target[0] and pred.total <= target[1])


def _row_meets(row: dict, target) -> bool:
    """``_meets`` for a candidate's row (its predicted peak and step)."""
    return target is None or (row["peak_bytes"] <= target[0] and row["step_s"] <= target[1])

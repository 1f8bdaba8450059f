"""The planner's candidates and how one is built: ``Candidate``, ``lower`` and ``Lowered``.

A candidate is one frozen choice of strategy, units, recomputation, resharding and offload;
``lower`` runs the pipeline for it on a copy of the captured graph and predicts it. The
choice ladders the search walks (``recompute_choices``, ``first_choices``) and one hosting
of the sharded state in host or device memory (``Hosting``, ``host_state``) live here
too, so that the search (``search.py``) and the planner (``planner/__init__.py``) share one
way to build a candidate. What the planner keeps of a candidate (its hosting's bytes, its
prediction) is its own, in these records; the pass context holds only what passes decide and
read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Optional

import torch.fx as fx

from autoshard.core import progress
from autoshard.core.config import OPTIMIZER_STATES
from autoshard.core.graph import clone_graph
from autoshard.passes.collectives import offloaded_units
from autoshard.passes.pipeline import default_passes, run_passes
from autoshard.passes.remat import recompute_activations_pass
from autoshard.passes.split import split_pass
from autoshard.core.simulate import simulate_joint
from autoshard.core.spec import hosted, model_state_bytes


LADDER = (0.25, 0.5, 0.75, 1.0)
# which units free their gathered parameters after the forward (Config.reshard_after_forward)
RESHARD = {True: "every unit", "auto": "all but the last", False: "none"}


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


def ladder_end(choices: list, i: int) -> int:
    """The index of the last choice of the ladder ``choices[i]`` is on (``recompute_choices``'
    "offload k/n" or "blocks k/n": one mode over the first k blocks, k growing), or ``i``
    when it is on none. Along a ladder each choice recomputes or offloads more than the
    one before, so its peak is lower."""
    def mode(j):
        modes = choices[j][1]
        kinds = set(modes.values()) if modes and "*" not in modes else set()
        return kinds.pop() if len(kinds) == 1 else None

    m, j = mode(i), i
    while m is not None and j + 1 < len(choices) and mode(j + 1) == m:
        j += 1
    return j


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


@dataclasses.dataclass(frozen=True)
class Hosting:
    """The sharded state with ``offload`` of it in host memory: the pass context whose
    parameter descriptions place it so, with the bytes held all step that follow, and the
    model state's bytes (``autoshard.core.spec.model_state_bytes``: on the device and the host)."""

    ctx: Any  # autoshard.passes.pipeline.PassContext
    offload: float
    state: dict


@dataclasses.dataclass
class Lowered:
    """A candidate lowered: its joint graph with every collective in place (not yet split),
    the pass context that built it (its units and hosting), its hosting's model state
    bytes and the simulator's prediction of its step."""

    candidate: Candidate
    gm: fx.GraphModule
    ctx: Any
    prediction: Any
    state: dict


def lower(base: fx.GraphModule, hosting: Hosting, cand: Candidate, config, cache: dict, *,
          verify: bool = False) -> Lowered:
    """``cand`` built on ``base`` (the captured graph with ``cand``'s recomputation applied,
    left untouched) and predicted: units, collectives, prefetch, then the simulator. Reads
    ``hosting`` (the hosting's context: specs, profile, bytes held all step) without
    changing it. ``cache``: the per-graph cache of ``autoshard.passes.auto``."""
    ctx, state = hosting.ctx, hosting.state
    cctx = dataclasses.replace(ctx, reshard_after_forward=cand.reshard,
                               offload_params=cand.offload_params)
    # recomputation is done already, per choice; the chosen plan alone is split
    passes = [p for p in default_passes(config, candidate=cand.units, auto_cache=cache)
              if p[0] not in (recompute_activations_pass, split_pass)]
    with progress.timed("plan: clone"):
        out = clone_graph(base)
    out, cctx = run_passes(out, cctx, passes, verify_each=verify, lint=False)
    params = cand.offload_params
    if hosting.offload:  # the fraction that took effect: a whole number of units copy again
        specs = {p.fqn: p for p in ctx.captured.params}
        hosted = offloaded_units(cctx.units, specs)
        params = sum(not u.held for u in hosted) / len(hosted) if hosted else 0.0
    with progress.timed("plan: simulate"):
        pred = simulate_joint(out, ctx.profile, ctx.sim_static_bytes, ctx.sim_host_bytes)
    return Lowered(cand, out, dataclasses.replace(cctx, offload_params=params), pred, state)


def host_state(ctx, offload: float, config, options, as_specs: bool = False) -> Hosting:
    """``ctx`` with ``offload`` of the sharded state kept on the host (``hosted``), the rest on
    the device (``as_specs``: as the specs place it already), and the bytes held all step
    that follow."""
    specs = ctx.captured.params
    host = ({s.fqn for s in specs if s.device == "host"} if as_specs
            else hosted([(s.fqn, s.shape) for s in specs], offload))
    if any((s.device == "host") != (s.fqn in host) for s in specs):
        specs = [dataclasses.replace(s, device="host" if s.fqn in host else "device")
                 for s in specs]
        ctx = dataclasses.replace(ctx, captured=dataclasses.replace(ctx.captured, params=specs))
    state = model_state_bytes(specs, OPTIMIZER_STATES[config.optimizer])
    other = options.get("other_static_bytes", 0)
    return Hosting(dataclasses.replace(
        ctx, static_bytes=state["params"] + state["grads"] + state["optimizer"] + other,
        sim_static_bytes=state["params"] + state["optimizer"] + other,
        sim_host_bytes=state["host"] - state["host_grads"]), offload, state)

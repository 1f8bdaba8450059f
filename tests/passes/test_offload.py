"""Offload (CPUOffloadPolicy): the copies are graph nodes, and the plan counts host and device.

On this machine the host is the device, so the plans here use the H100 profile: its host link
(``host_bandwidth``) prices the copies, and only device memory counts against the budget."""

from copy import deepcopy

import pytest
import torch
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

import autoshard
from autoshard import Offload
from autoshard.core import meta
from autoshard.core.cost import PROFILES, node_time, tensor_bytes
from autoshard.core.models import GPT

INPUTS = (torch.randint(0, 96, (8, 32)),)
MP = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _plan(offload, layers=2, world_size=2, **config):
    """``offload``: True (CPUOffloadPolicy), False (OffloadPolicy(): none), None (the
    planner's choice), or an ``Offload`` (its fractions)."""
    from torch.distributed.fsdp import OffloadPolicy

    policy = offload
    if not (offload is None or isinstance(offload, Offload)):
        policy = CPUOffloadPolicy() if offload else OffloadPolicy()
    return autoshard.plan(GPT(seq=32, layers=layers), INPUTS, world_size=world_size,
                          config=autoshard.Config(policy="module", prefetch=False,
                                                  device_profile="h100", verify=True,
                                                  offload_policy=policy, **config))


def _sharded_compiled(offload, layers=2, **config):
    """``offload``: an ``Offload``, True (CPUOffloadPolicy) or False (none)."""
    from autoshard.compiler import compile_step

    model = GPT(seq=32, layers=layers)
    policy = offload if isinstance(offload, Offload) else CPUOffloadPolicy() if offload else None
    cfg = autoshard.Config(policy="module", prefetch=False, device_profile="h100",
                           verify=True, offload_policy=policy, **config)
    with torch.enable_grad():
        _, ctx, plan = compile_step(model, type(model).forward, INPUTS, {}, world_size=2,
                                    group_name="plan", device=torch.device("cpu"), config=cfg)
    return ctx, plan


@pytest.mark.parametrize("state", [None, 0.5], ids=["all", "half"])
@pytest.mark.parametrize("mp", [None, MP], ids=["fp32", "bf16"])
def test_every_offloaded_shard_goes_through_a_copy_to_the_device_and_its_gradient_back(mp,
                                                                                      state):
    """All of the state on the host, or (``Offload.state``) the last half of it: exactly the
    offloaded parameters are copied in and their gradient shards out."""
    ctx, plan = _sharded_compiled(Offload(state=state, params=1.0), mp_policy=mp)
    specs = {p.fqn: p for p in ctx.captured.params}
    homes = {s.device for s in specs.values() if s.sharded}
    assert homes == ({"host"} if state is None else {"host", "device"})
    for gm in (ctx.split.fwd, ctx.split.bwd):
        for ph in gm.graph.nodes:
            if not meta.is_param(ph) or not specs[meta.tag(ph, meta.FQN)].sharded:
                continue
            copies = [u for u in ph.users if meta.tag(u, meta.COMM) == meta.H2D]
            if specs[meta.tag(ph, meta.FQN)].device == "device":
                assert not copies
                continue
            # the host shard is read only by its copies to the device (and handed on to the
            # backward)
            assert ph.meta["val"].device.type == "cpu"
            assert copies and copies == [u for u in ph.users if u.op != "output"]
            for copy in copies:
                assert copy.kwargs["device"] == torch.device("cpu")  # the step's device here
                assert meta.tag(copy, meta.UNIT) == meta.tag(ph, meta.UNIT)
    out = meta.output_node(ctx.split.bwd)
    grads = [(v, r) for v, r in zip(out.args[0], ctx.split.bwd_roles)
             if r[meta.ROLE] == meta.OUT_GRAD]
    assert grads
    for v, r in grads:
        copied = meta.tag(v, meta.COMM) == meta.D2H
        assert copied == (specs[r[meta.FQN]].device == "host"), r[meta.FQN]
        assert v.meta["val"].dtype == specs[r[meta.FQN]].dtype  # fp32 masters' gradients


def test_the_plan_holds_the_model_state_on_the_host_and_prices_the_copies():
    on, off = _plan(False), _plan(Offload(params=1.0))
    state = on.predicted["model_state_bytes"]
    assert off.predicted["model_state_bytes"] == 0
    assert off.predicted["host_state_bytes"] == state
    assert "offloaded to host memory" in off.summary_table()
    # the device holds the gathered units and activations, not the shards, gradient shards
    # and AdamW state; what it holds instead is one unit's shards copied in before packing
    ctx, _ = _sharded_compiled(Offload(params=1.0))
    copies = [n for gm in (ctx.split.fwd, ctx.split.bwd) for n in gm.graph.nodes
              if meta.tag(n, meta.COMM) in (meta.H2D, meta.D2H)]
    staged = max(sum(tensor_bytes(n.meta["val"]) for n in copies
                     if meta.tag(n, meta.COMM) == meta.H2D and meta.tag(n, meta.UNIT) == u)
                 for u in {meta.tag(n, meta.UNIT) for n in copies})
    # on the device, shards and AdamW's two moments are held all step (3/4 of the state),
    # gradient shards as the backward makes them
    peak_on, peak_off = on.predicted["peak_bytes"], off.predicted["peak_bytes"]
    assert peak_on - state <= peak_off <= peak_on - state * 3 // 4 + staged
    # each copy costs its bytes over the host link, on the compute stream
    moved = sum(tensor_bytes(n.meta["val"]) for n in copies)
    extra = off.predicted["step_s"] - on.predicted["step_s"]
    assert extra == pytest.approx(moved / PROFILES["h100"].host_bandwidth, rel=0.02)


def test_no_offload_policy_plans_as_no_policy_where_the_device_has_room():
    assert _plan(False).predicted == _plan(None).predicted


def test_the_planner_offloads_only_when_nothing_fits_on_the_device_and_as_little_as_fits():
    on, off = _plan(False), _plan(True)
    budget = (on.predicted["peak_bytes"] + off.predicted["peak_bytes"]) // 2
    roomy = _plan(None, memory_budget=on.predicted["peak_bytes"])
    assert not roomy.offload and all(not c["offload"] for c in roomy.candidates)
    # whole blocks recomputed come before offload: at this budget they fit on the device
    recomputed = _plan(None, memory_budget=budget)
    assert not recomputed.offload and recomputed.recompute.startswith("blocks")
    assert recomputed.predicted["peak_bytes"] <= budget
    tight = _plan(None, memory_budget=budget, recompute={})  # the min cut alone
    # on the device first, then all of the state on the host, then by bisection the least
    # fraction that fits: 1/2 does, 1/4 does not
    tried = [c["offload"] for c in tight.candidates]
    assert tried == sorted(tried, key=[0.0, 1.0, 0.5, 0.25].index)
    assert {c["offload"]: c["fits"] for c in tight.candidates} == {
        0.0: False, 1.0: True, 0.5: True, 0.25: False}
    assert tight.offload == 0.5 and tight.predicted["peak_bytes"] <= budget
    # 1/4 is ruled out unbuilt: its bound (the least peak with all of it on the host plus
    # the optimizer state brought back) exceeds the budget, and bounds the real plan's peak
    quarter = next(c for c in tight.candidates if c["offload"] == 0.25)
    assert quarter["units"] is None and "brings back" in quarter["note"]
    real = _plan(Offload(state=0.25), memory_budget=budget,
                 recompute={}).predicted["peak_bytes"]
    assert budget < quarter["peak_bytes"] <= real
    fast = min(c["step_s"] for c in tight.candidates if c["fits"])
    assert tight.predicted["step_s"] == fast
    # half the state's elements on the host: the last block's and the final norm's
    assert 0 < tight.predicted["host_state_bytes"] < off.predicted["host_state_bytes"]
    assert tight.predicted["model_state_bytes"] + tight.predicted["host_state_bytes"] == (
        on.predicted["model_state_bytes"])
    assert [u.hosted for u in tight.units][2] == 1.0 and tight.units[1].hosted < 1
    assert "state 1/2" in tight.candidates_table() and "host 33%" in tight.units_table()
    again = autoshard.Plan.from_json(tight.to_json())
    assert again.offload == 0.5 and again.units == tight.units
    # OffloadPolicy() says "no offload": the planner keeps to the device
    kept = _plan(False, memory_budget=budget, recompute={})
    assert not kept.offload and kept.predicted["peak_bytes"] > budget


@pytest.mark.filterwarnings("ignore:autoshard. no process group")
def test_the_runtime_applies_the_fraction_the_planner_offloads_and_keeps_it():
    """The plan places the shards: the fraction the planner chose without an offload policy
    is stored in host memory before the first step (marked on the parameters, in place, so
    an optimizer built before it keeps them), the step equals eager's, and a later plan
    keeps that placement; the same plan as the policy asking for that fraction."""
    from autoshard.core.spec import ON_HOST

    on, off = _plan(False, world_size=1), _plan(True, world_size=1)
    budget = (on.predicted["peak_bytes"] + off.predicted["peak_bytes"]) // 2
    # the min cut alone: whole blocks recomputed would fit on the device
    config = dict(policy="module", prefetch=False, device_profile="h100", memory_budget=budget,
                  recompute={})
    planned = _plan(None, world_size=1, memory_budget=budget, recompute={})
    assert 0 < planned.offload < 1
    torch.manual_seed(0)
    eager = GPT(seq=32)
    model = deepcopy(eager)
    model = autoshard.autoshard(model, config=autoshard.Config(**config))
    params = dict(model.named_parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert not any(getattr(p, ON_HOST, False) for p in params.values())
    model(*INPUTS).sum().backward()
    assert model.plan.offload == planned.offload
    assert model.plan.predicted == planned.predicted
    hosted = {f for f, p in params.items() if getattr(p, ON_HOST, False)}
    assert hosted == {s.fqn for s in model._autoshard.last.captured.params
                      if s.device == "host"} and 0 < len(hosted) < len(params)
    assert all(p is params[f] for f, p in model.named_parameters())  # in place
    eager(*INPUTS).sum().backward()
    for f, p in model.named_parameters():
        torch.testing.assert_close(p.grad.full_tensor(), eager.get_parameter(f).grad,
                                   rtol=1e-5, atol=1e-6)
    opt.step()
    # a new input shape is planned again, on the placement the first plan chose
    model(INPUTS[0][:, :16]).sum().backward()
    assert model.plan.offload == planned.offload
    assert {s.fqn for s in model._autoshard.last.captured.params if s.device == "host"} == hosted
    given = autoshard.autoshard(GPT(seq=32), config=autoshard.Config(
        **config, offload_policy=Offload(state=planned.offload)))
    given(*INPUTS)
    assert given.plan.predicted == planned.predicted


def _copies_in(ctx, region=None):
    return [n for gm in (ctx.split.fwd, ctx.split.bwd) for n in gm.graph.nodes
            if meta.tag(n, meta.COMM) == meta.H2D
            and (region is None or meta.tag(n, meta.REGION) == region)]


@pytest.mark.parametrize("mp", [None, MP], ids=["fp32", "bf16"])
def test_a_unit_holding_its_shards_copies_them_in_once_per_step(mp):
    held, again = (_sharded_compiled(Offload(params=f), layers=4, mp_policy=mp)
                   for f in (0.0, 1.0))
    (hctx, hplan), (actx, aplan) = held, again
    resharded = [u.index for u in hctx.units if not u.stays_gathered]
    assert [u.index for u in hctx.units if u.held] == resharded and len(resharded) == 4
    assert not any(u.held for u in actx.units)
    assert [u.held for u in hplan.units] == [u.held for u in hctx.units]
    # held: no copy in the backward; its all-gathers send the buffer the forward packed,
    # handed over as a saved value, in the compute dtype
    assert not _copies_in(hctx, meta.BWD) and _copies_in(actx, meta.BWD)
    assert len(_copies_in(hctx)) == len(_copies_in(actx, meta.FWD))
    sent = [n.args[0] for n in hctx.split.bwd.graph.nodes
            if meta.tag(n, meta.COMM) == meta.AG_ISSUE]
    assert len(sent) == len(resharded)
    dtype = torch.float32 if mp is None else torch.bfloat16
    assert all(s.op == "placeholder" and s.meta["val"].dtype == dtype for s in sent)
    # the step saves those copies' time (and their packing again) and holds their bytes
    # instead
    packs = [n for n in actx.split.bwd.graph.nodes
             if meta.tag(n, meta.COMM) in (meta.H2D, meta.AG_PACK)]
    assert any(meta.tag(n, meta.COMM) == meta.H2D for n in packs)
    saved = aplan.predicted["step_s"] - hplan.predicted["step_s"]
    assert saved == pytest.approx(sum(node_time(n, PROFILES["h100"]) for n in packs),
                                  rel=0.02)
    extra = hplan.predicted["peak_bytes"] - aplan.predicted["peak_bytes"]
    assert 0 < extra <= sum(tensor_bytes(s.meta["val"]) for s in sent)
    assert aplan.predicted["host_state_bytes"] == hplan.predicted["host_state_bytes"]


def test_the_planner_copies_in_again_only_as_many_units_as_it_must():
    peaks = {f: _plan(Offload(params=f), layers=4).predicted["peak_bytes"]
             for f in (0.0, 0.25, 1.0)}
    assert peaks[0.0] > peaks[0.25] > peaks[1.0]
    # the least that fits is chosen: all held first, then all copied again, then bisection
    # (prefer="speed": the default on h100 takes the lightest plan within 2% of the fastest,
    # all units copying again here)
    tight = _plan(True, layers=4, memory_budget=peaks[0.25], prefer="speed")
    assert tight.offload and tight.offload_params == 0.25
    assert tight.predicted["peak_bytes"] == peaks[0.25]
    tried = [(c["offload_params"], c["fits"]) for c in tight.candidates]
    assert tried == [(0.0, False), (1.0, True), (0.5, True), (0.25, True)]
    assert sum(u.held for u in tight.units) == 3
    assert "state + params 1/4" in tight.candidates_table()
    assert "state + params 1/4" in tight.summary_table()
    again = autoshard.Plan.from_json(tight.to_json())
    assert again.offload_params == 0.25 and [u.held for u in again.units] == [
        u.held for u in tight.units]
    # roomy: every resharded unit holds its shards
    assert _plan(True, layers=4).offload_params == 0.0



def test_each_number_of_units_copying_again_is_tried_once():
    """With two offloaded units the ladder's 1/4 and 3/4 round to 0 and 2 units: the planner
    tries 0, 2 and 1 of them, once each, and records the fraction that took effect."""
    peak = _plan(Offload(params=1.0)).predicted["peak_bytes"]
    plan = _plan(True, memory_budget=peak)
    tried = [c["offload_params"] for c in plan.candidates]
    assert len(tried) == len(set(tried)) and set(tried) <= {0.0, 0.5, 1.0}
    assert tried[:2] == [0.0, 1.0] and plan.predicted["peak_bytes"] <= peak

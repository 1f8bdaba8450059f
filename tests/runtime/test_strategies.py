"""Config.strategy (DDP, ZeRO-1/2/3, auto), hybrid sharding and gradient accumulation without
sync (gloo, fp32), against unsharded eager training in one process with the same init, data
and AdamW, and hybrid sharding against FSDP2's HSDP on the same 2 x 2 mesh. hpZ
(``reshard_after_forward=2``) on a 1-D mesh of 4 against eager and against FSDP2's
``fully_shard(reshard_after_forward=2)``, which runs on gloo (3 steps: the same tolerances).

Tolerances: max |Δloss| <= 1e-5 over 10 steps (3 with accumulation), max |Δparam| <= 1e-5
after them, as the parity tests.
"""

import pytest
import torch

from harness import run_ranks
from parity_workers import reference
from strategy_workers import (ACCUMULATE, HPZ_STEPS, NAMES, STRATEGIES, hsdp_worker,
                              strategy_worker, submesh_worker)

TOL = 1e-5


@pytest.fixture(scope="module")
def flavours():
    return 2, run_ranks(2, strategy_worker, NAMES)


@pytest.fixture(scope="module")
def hybrid():
    return 4, run_ranks(4, hsdp_worker, ("gpt", "hf_llama"))


def _close(got, ref_losses, ref_state, what):
    dloss = max(abs(a - b) for a, b in zip(got["losses"], ref_losses))
    assert dloss <= TOL, f"{what}: max |Δloss| {dloss:.3g}"
    dparam = max((got["params"][k] - ref_state[k]).abs().max().item() for k in ref_state
                 if k in got["params"])
    assert dparam <= TOL, f"{what}: max |Δparam| {dparam:.3g}"


@pytest.mark.parametrize("name", NAMES)
def test_every_strategy_matches_eager(flavours, name):
    world, results = flavours
    torch.set_num_threads(1)
    ref_losses, ref_state = reference(name, world)
    keys = set()
    for strategy in STRATEGIES:
        got = results[0][(name, strategy)]
        _close(got, ref_losses, ref_state, f"{name} {strategy}")
        keys.add(tuple(got["state_keys"]))
    assert len(keys) == 1  # the same state-dict keys under every strategy
    ddp, zero3 = results[0][(name, "ddp")], results[0][(name, "zero3")]
    assert ddp["placements"] == ["(Replicate(),)"] and "Shard(dim=0)" in str(zero3["placements"])
    assert ddp["ops"] == ["all_reduce"]  # no all-gather, no reduce-scatter
    assert {"all_gather", "reduce_scatter"} <= set(zero3["ops"])
    assert results[0][(name, "zero1")]["gathered_in"] == ["after step"]
    assert results[0][(name, "zero2")]["gathered_in"] == ["fwd"]  # once, kept for the bwd
    # DDP holds everything on every rank, the ZeRO flavours their shards
    assert ddp["local_numel"] > 1.5 * zero3["local_numel"]  # (padded rows: not 2x)
    assert results[0][(name, "auto")]["strategy"] in ("zero1", "zero2", "zero3")


def test_a_checkpoint_saved_under_one_strategy_loads_under_another(flavours):
    """DCP: DDP's replicated tensors load into ZeRO-3's and ZeRO-1's shards and back; the
    parameters and the next call's logits are the same bit for bit."""
    world, results = flavours
    for r in results:
        assert set(r["moved"]) == {("ddp", "zero3"), ("ddp", "zero1"), ("zero3", "ddp")}
        assert all(v == (0.0, 0.0) for v in r["moved"].values()), r["moved"]


def test_flavours_send_the_textbook_bytes(flavours):
    """Per rank per step, the plan's ring bytes: DDP's all-reduce, ZeRO-1/2's reduce-scatter
    plus one all-gather, and ZeRO-3's two all-gathers (except the unit kept) plus one
    reduce-scatter: 2, 2, 2 and about 3 times (N-1)/N of the model's bytes."""
    world, results = flavours
    r = {s: results[0][("gpt", s)]["sent"] for s in STRATEGIES}
    assert r["ddp"] == pytest.approx(r["zero1"], rel=0.02)
    assert r["zero2"] == pytest.approx(r["zero1"], rel=0.02)
    assert 1.2 * r["zero2"] < r["zero3"] <= 1.5 * r["zero2"]


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero3"])
def test_accumulation_without_sync_matches_eager(flavours, strategy):
    world, results = flavours
    torch.set_num_threads(1)
    got = results[0][("accumulate", strategy)]
    assert got["sync"] == [False, True]  # the first micro-batch kept its gradients local
    # the plans count the full local gradients those steps hold
    assert got["local_grads"] == [got["param_bytes"]] * 2
    ref_losses, ref_state = reference("gpt", world, 3, ACCUMULATE)
    _close(got, ref_losses, ref_state, f"accumulation {strategy}")


@pytest.mark.parametrize("name", ["gpt", "hf_llama"])
def test_hybrid_sharding_matches_eager(hybrid, name):
    world, results = hybrid
    torch.set_num_threads(1)
    ref_losses, ref_state = reference(name, world)
    for strategy in ("zero3", "zero2"):
        got = results[0][(name, strategy)]
        _close(got, ref_losses, ref_state, f"HSDP {name} {strategy}")
        assert got["placements"] == ["(Replicate(), Shard(dim=0))"]
        assert {"all_gather", "reduce_scatter", "all_reduce"} <= set(got["ops"])
    # replicas hold the same shard: rank 0 and rank 2 (same shard coordinate) agree
    assert results[0][(name, "zero3")]["local_numel"] == results[2][(name, "zero3")]["local_numel"]


def test_hybrid_sharding_matches_fsdp2_hsdp(hybrid):
    world, results = hybrid
    fsdp, ours = results[0]["fsdp2"], results[0][("gpt", "zero3")]
    dloss = max(abs(a - b) for a, b in zip(fsdp["losses"], ours["losses"]))
    assert dloss <= TOL, f"max |Δloss| vs FSDP2 HSDP {dloss:.3g}"
    dparam = max((fsdp["params"][k] - ours["params"][k]).abs().max().item()
                 for k in fsdp["params"])
    assert dparam <= TOL


def test_hybrid_accumulation_matches_eager(hybrid):
    world, results = hybrid
    torch.set_num_threads(1)
    ref_losses, ref_state = reference("gpt", world, 3, ACCUMULATE)
    _close(results[0][("accumulate", "hsdp")], ref_losses, ref_state, "HSDP accumulation")


def test_meshes_autoshard_refuses():
    msgs = run_ranks(4, submesh_worker, None)[0]
    assert "covers 2 of the 4 ranks" in msgs[0] and "partial_mesh=True" in msgs[0]
    assert msgs[1].startswith("Sharded")
    assert "('replicate', 'shard')" in msgs[2]


def test_hpz_matches_eager_and_fsdp2(hybrid):
    """Every unit resharded to groups of 2 of the 4 ranks after the forward: the backward
    all-gathers run over 2 ranks, and training matches eager and FSDP2's int reshard."""
    world, results = hybrid
    torch.set_num_threads(1)
    ref_losses, ref_state = reference("gpt", world, HPZ_STEPS)
    got = results[0]["hpz"]["1d"]
    _close(got, ref_losses, ref_state, "hpZ k=2")
    _close(results[0]["hpz"]["fsdp2"], ref_losses, ref_state, "FSDP2 reshard_after_forward=2")
    fsdp = results[0]["hpz"]["fsdp2"]
    dloss = max(abs(a - b) for a, b in zip(fsdp["losses"], got["losses"]))
    assert dloss <= TOL, f"max |Δloss| vs FSDP2 int reshard {dloss:.3g}"
    assert got["reshard"] == "every unit, to groups of 2"
    assert got["groups"] == [2, 2, 2] and got["ranks"] == [2]
    hsdp = results[0]["hpz"]["2d"]  # a 2-D mesh of 1 x 4: the groups of 2 within the replica
    _close(hsdp, ref_losses, ref_state, "hpZ k=2 on a 1 x 4 mesh")
    assert hsdp["reshard"] == "every unit, to groups of 2"


def test_hpz_on_a_2x2_mesh_is_validated(hybrid):
    """On HSDP's 2 x 2 mesh the shard size is 2: k=2 is False's meaning (nothing resharded),
    k=1 True's, and 4 does not divide 2 (hpZ proper on a 2-D mesh: the 1 x 4 case above)."""
    world, results = hybrid
    hsdp = {k[1]: v for k, v in results[0]["hpz"].items() if isinstance(k, tuple)}
    assert hsdp[2] == "none" and hsdp[1] == "every unit"
    assert ("Config.reshard_after_forward=4 must divide the shard dimension's size 2" in hsdp[4]
            and "accepted: 1, 2, True, False" in hsdp[4])

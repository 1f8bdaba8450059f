"""Checkpoints and exports commit whole (``autoshard.runtime.commit``): a rank killed during
a write, a full disk on one rank, an unwritable path each end every live rank with an
``AutoshardError`` naming the rank, the path and the cause; an interrupted write never loads,
and one over an earlier checkpoint or export leaves that one loadable, value for value
(gloo, world size 2)."""

from __future__ import annotations

import os

import pytest
import torch

from commit_workers import (failed_write_worker, fake_backend_worker, interrupted_worker,
                            reload_worker)
from harness import run_ranks
from rankpool import context

CASES = ["overwrite", "export", "fresh", "committed"]


def _rank(rank, world, fn, payload, store, out):
    import torch.distributed as dist

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=world)
    torch.save(fn(rank, world, payload), os.path.join(out, f"result{rank}.pt"))


def _run_with_a_death(world, fn, payload, out, limit_s=120) -> dict:
    """``fn`` on ``world`` ranks of which one may die: each rank that returns leaves its
    result; ranks still running after ``limit_s`` fail the test."""
    ctx = context()
    store = os.path.join(out, "store")
    procs = [ctx.Process(target=_rank, args=(r, world, fn, payload, store, out))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(limit_s)
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
    assert not hung, f"ranks {hung} still ran after {limit_s} s"
    return {r: torch.load(os.path.join(out, f"result{r}.pt"), weights_only=False)
            for r in range(world) if os.path.exists(os.path.join(out, f"result{r}.pt"))}


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
    runs = {}
    for case in CASES:
        root = str(tmp_path_factory.mktemp(case))
        runs[case] = (root, _run_with_a_death(2, interrupted_worker, (root, case), root))
    reloaded = run_ranks(2, reload_worker, [runs[c][0] for c in CASES])
    return {c: (*runs[c], [r[c] for r in reloaded]) for c in CASES}


@pytest.mark.parametrize("case", ["overwrite", "export", "fresh"])
def test_a_rank_killed_during_a_write_is_named_on_the_live_rank(interrupted, case):
    root, got, _ = interrupted[case]
    assert list(got) == [0], "rank 1 was killed, rank 0 reports"
    msg = got[0]["error"]
    assert msg.startswith("AutoshardError"), msg
    target = {"overwrite": "ck", "export": "ex", "fresh": "new"}[case]
    assert f"{root}/{target}" in msg and "no answer from peer ranks [1]" in msg, msg
    kept = "still holds the previous" if case != "fresh" else "nothing was written"
    assert kept in msg, msg


def test_an_interrupted_overwrite_leaves_the_previous_checkpoint_whole(interrupted):
    _, got, reloaded = interrupted["overwrite"]
    for rank in (0, 1):
        assert reloaded[rank]["ck"] == "ok", reloaded[rank]["ck"]
        for key, v in got[0]["before"]["values"].items():  # step 1's, not a mix with step 2
            assert torch.equal(reloaded[rank]["ck_values"][key], v), key


def test_an_interrupted_write_to_a_fresh_path_never_loads(interrupted):
    root, _, reloaded = interrupted["fresh"]
    for rank in (0, 1):
        msg = reloaded[rank]["new"]
        assert f"{root}/new is an incomplete checkpoint: a write to it was interrupted" in msg


def test_an_interrupted_export_overwrite_leaves_the_previous_export_whole(interrupted):
    _, got, reloaded = interrupted["export"]
    for rank in (0, 1):
        assert reloaded[rank]["ex"] == "ok", reloaded[rank]["ex"]
        assert torch.equal(reloaded[rank]["ex_out"], got[0]["before"]["out"])


def test_a_write_committed_before_a_rank_died_stands(interrupted):
    _, got, reloaded = interrupted["committed"]
    assert list(got) == [1] and got[1]["error"] == "ok", got
    assert reloaded[0]["ex2"] == "ok" and reloaded[1]["ex2"] == "ok"


@pytest.fixture(scope="module")
def failed(tmp_path_factory):
    return run_ranks(2, failed_write_worker, str(tmp_path_factory.mktemp("failed")))


@pytest.mark.parametrize("case", ["save_enospc", "export_enospc"])
def test_a_full_disk_on_one_rank_is_an_error_on_every_rank(failed, case):
    for rank in (0, 1):
        msg = failed[rank][case]
        assert msg.startswith("AutoshardError: the "), msg
        assert "failed on rank 1; nothing was committed" in msg, msg
        assert "still holds the previous" in msg and "No space left on device" in msg, msg


def test_an_unwritable_or_foreign_path_is_refused_as_an_exception(failed):
    for rank in (0, 1):
        assert "AutoshardError" in failed[rank]["unwritable"], failed[rank]["unwritable"]
        assert "afile/ck" in failed[rank]["unwritable"]
        assert "a directory holding other files" in failed[rank]["foreign"]


def test_ranks_given_different_paths_are_named_with_their_paths(failed):
    for rank in (0, 1):
        msg = failed[rank]["paths"]
        assert "the ranks called the checkpoint with different paths" in msg, msg
        assert "rank 0: to " in msg and "ck0: free" in msg and "ck1: free" in msg, msg


def test_after_failed_writes_the_checkpoint_loads_and_the_next_save_commits(failed):
    for rank in (0, 1):
        r = failed[rank]
        assert r["kept"] == "ok" and r["kept_equal"], r
        assert r["again"] == "ok" and r["again_equal"], r
        assert len(r["listing"]) == 2 and "checkpoint.json" in r["listing"], r["listing"]
        assert len(r["swept"]) == 2 and r["swept"] != r["listing"], (r["listing"], r["swept"])


def test_a_backend_that_cannot_run_the_export_is_refused(interrupted):
    root = interrupted["overwrite"][0]
    msg = run_ranks(1, fake_backend_worker, f"{root}/ex", fresh=True)[0]  # replaces the group
    assert "AutoshardError: cannot load the export" in msg and "runs 'fake'" in msg, msg
    assert "need gloo" in msg, msg

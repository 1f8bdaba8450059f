"""Two jobs writing to one checkpoint or export path, and loads during a write
(``autoshard.runtime.commit``): one writer at a time, the second refused naming the first;
a load reads the previous checkpoint or the new one, whole, never a folder a sweep removed;
a module loaded from an export keeps its files while it lives.

The interleavings are forced: a hook at a point of one write or load runs the other job's
write there (in one process, two models at world size 1; across two processes, events; on
two ranks, a flag file). The stress test leaves them to chance: two processes saving to one
path and one loading it."""

from __future__ import annotations

import os
import queue

import pytest

from concurrent_workers import (equal, held_worker, interleaved_worker, paused_writer,
                                second_writer, stress_reader, stress_writer)
from harness import run_ranks
from rankpool import context


@pytest.fixture(scope="module")
def interleaved(tmp_path_factory):
    return run_ranks(1, interleaved_worker, str(tmp_path_factory.mktemp("interleaved")))[0]


def _refusal(got: dict, path: str) -> str:
    return (f"AutoshardError: cannot write the checkpoint to {path}: another job is writing "
            f"to it, a checkpoint by pid {got['pid']} on host {got['host']} that started at ")


@pytest.mark.parametrize("point", ["commit", "sweep"])
def test_a_second_writer_during_a_write_is_refused_naming_the_first(interleaved, point):
    got = interleaved[point]
    assert "error" not in got, got
    assert got["a"] == "ok", got["a"]
    # the refused job names the writer (here the same process: two jobs' models in one)
    path = got["b"].split(" to ", 1)[1].split(": another job", 1)[0]
    assert path.endswith(f"/{point}"), got["b"]
    assert got["b"].startswith(_refusal(interleaved, path)), got["b"]
    assert "Nothing of this checkpoint was written" in got["b"], got["b"]
    load, vals = got["load"]
    assert load == "ok", load  # main: both checkpoints lost, the marker naming a swept folder
    assert equal(vals, interleaved["values"]["a"])
    assert len(got["listing"]) == 2 and "checkpoint.json" in got["listing"], got["listing"]


def test_a_load_during_a_save_reads_the_previous_checkpoint_whole(interleaved):
    got = interleaved["read"]
    assert "error" not in got, got
    assert got["b"] == "ok", got["b"]  # the other job's save commits
    load, vals = got["load"]
    assert load == "ok", load  # main: DCP's FileNotFoundError, the folder swept mid-read
    assert equal(vals, interleaved["values"]["a"])
    # the folder read was left to the next sweep, and no lock file stays
    assert len(got["listing"]) == 3 and not [n for n in got["listing"] if n.startswith(".")]
    (load, vals), after = got["after"]
    assert got["again"] == "ok" and load == "ok" and equal(vals, interleaved["values"]["b"])
    assert len(after) == 2, after


def test_a_load_whose_folder_went_before_it_locked_reads_the_new_checkpoint(interleaved):
    got = interleaved["moved"]
    assert "error" not in got, got
    assert got["b"] == "ok", got["b"]
    load, vals = got["load"]
    assert load == "ok", load
    assert equal(vals, interleaved["values"]["b"])
    assert len(got["listing"]) == 2, got["listing"]


def test_without_locks_saves_and_loads_go_on_with_a_warning(interleaved):
    ro = interleaved["readonly"]
    assert "error" not in ro, ro
    assert ro["load"][0] == "ok" and equal(ro["load"][1], interleaved["values"]["a"])
    assert not [w for w in ro["warnings"] if "cannot lock" in w], ro["warnings"]
    nl = interleaved["nolock"]
    assert "error" not in nl, nl
    assert nl["saved"] == ["ok", "ok"] and nl["load"][0] == "ok", nl
    assert equal(nl["load"][1], interleaved["values"]["b"])
    assert nl["listing"] == sorted(nl["listing"]) and len(nl["listing"]) == 2, nl["listing"]
    assert any("cannot lock" in w and "No locks available" in w for w in nl["warnings"]), nl


def test_a_loaded_export_keeps_working_after_another_export_replaces_it(interleaved):
    got = interleaved["export"]
    assert "error" not in got, got
    assert got["replaced"] == "ok", got["replaced"]
    assert got["second"] == "ok", got["second"]  # main: FileNotFoundError of program.json
    assert got["equal"], "the loaded module runs the export it loaded, both programs"
    assert got["fresh_equal"], "a load after the replacement runs the new export"
    # the loaded folder is kept, under its reader's lock, while the module lives
    held = [n for n in got["listing"] if n.startswith(".")]
    assert len(held) == 1 and held[0][len(".lock-"):] in got["listing"], got["listing"]
    assert len(got["listing"]) == 4, got["listing"]
    assert got["after"] == "ok" and len(got["after_listing"]) == 2, got["after_listing"]


def test_a_replaced_export_without_locks_says_to_load_it_again(interleaved):
    got = interleaved["export_nolock"]
    assert "error" not in got, got
    assert got["replaced"] == "ok", got["replaced"]
    msg = got["second"]
    assert msg.startswith("AutoshardError: the export at ") and msg.endswith(
        "was replaced after it was loaded (its data folder "
        f"{msg.split('its data folder ')[1].split(' ')[0]} is gone); load it again"), msg


def test_ranks_loading_during_another_jobs_write_read_one_folder(tmp_path):
    got = run_ranks(2, held_worker, str(tmp_path))
    for rank in (0, 1):
        ck = got[rank]["checkpoint"]
        assert ck["load"] == "ok", ck["load"]
        assert set(ck["dcp_read"]) == {ck["first"]}, (rank, ck)  # rank 0's folder on both
        ex = got[rank]["export"]
        assert ex["load"].startswith(
            f"AutoshardError: the ranks read different exports at {tmp_path}/ex"), ex["load"]
        assert "load it again" in ex["load"] and ex["again"] == "ok", ex


def _collect(results, n: int, limit_s: float = 120) -> dict:
    """The first ``n`` (name, result) pairs the processes put on ``results``, by name."""
    out = {}
    try:
        for _ in range(n):
            name, got = results.get(timeout=limit_s)
            out[name] = got
    except queue.Empty:
        pass
    return out


def _join(procs) -> None:
    for p in procs:
        p.join(30)
        if p.is_alive():
            p.kill()


def test_two_processes_a_second_save_during_a_commit_is_refused(tmp_path):
    ctx = context()
    in_window, go_on, results = ctx.Event(), ctx.Event(), ctx.Queue()
    path = str(tmp_path / "ck")
    procs = [ctx.Process(target=fn, args=(path, in_window, go_on, results))
             for fn in (paused_writer, second_writer)]
    for p in procs:
        p.start()
    try:
        got = _collect(results, 2)
    finally:
        _join(procs)
    assert set(got) == {"paused", "second"}, got
    first, second = got["paused"], got["second"]
    assert first["save"] == "ok", first
    assert second["save"].startswith(_refusal(first, path)), second["save"]
    assert first["load"] == "ok" and first["equal"], first  # main: both checkpoints lost


SAVES = 20


def test_stress_two_jobs_saving_and_one_loading_lose_nothing(tmp_path):
    ctx = context()
    path = str(tmp_path / "ck")
    start, done, results = ctx.Barrier(3), ctx.Event(), ctx.Queue()
    writers = [ctx.Process(target=stress_writer, args=(path, seed, SAVES, start, results))
               for seed in (1, 2)]
    reader = ctx.Process(target=stress_reader, args=(path, (1, 2), start, done, results))
    procs = writers + [reader]
    for p in procs:
        p.start()
    try:
        got = _collect(results, 2)
        done.set()
        got.update(_collect(results, 1))
    finally:
        done.set()
        _join(procs)
    assert set(got) == {"writer1", "writer2", "reader"}, got
    w1, w2, r = got["writer1"], got["writer2"], got["reader"]
    print(f"\nsaves ok/refused: {w1['ok']}/{w1['refused']}, {w2['ok']}/{w2['refused']}; "
          f"loads ok {r['ok']}, failed {len(r['failed'])}, mixed {r['mixed']}")
    assert not w1["failed"] and not w2["failed"], (w1["failed"], w2["failed"])
    assert w1["ok"] + w1["refused"] == SAVES and w2["ok"] + w2["refused"] == SAVES
    assert w1["ok"] and w2["ok"], "each job committed some of its saves"
    assert not r["failed"] and not r["mixed"], r  # main: failed loads, a lost checkpoint
    assert r["ok"] >= 2, r
    assert "checkpoint.json" in r["listing"], r["listing"]

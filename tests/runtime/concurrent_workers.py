"""What the processes of the concurrent-write tests run: two jobs writing to one checkpoint
or export path, and loads during a write, each interleaving forced at a point of the write or
the load (a hook), or left to chance (the stress test)."""

from __future__ import annotations

import gc
import json
import os
import shutil
import socket
import time
import warnings

import torch

import autoshard
from autoshard import Config
from autoshard.runtime import checkpoint, commit, dcpio, export
from harness import outcome

from commit_workers import Net, X

X2 = torch.randn(2, 8, generator=torch.Generator().manual_seed(8))


def job(seed: int, compiled: bool = True):
    """A job's model: its own values (``seed``), compiled for X and X2 (an export holds
    both programs; a checkpoint needs none)."""
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # world size 1 says so
        model = autoshard.autoshard(Net(), config=Config(timeout=30))
    if compiled:
        model(X)
        model(X2)
    return model


def values(model) -> dict:
    return {n: p.full_tensor().clone() for n, p in model.named_parameters()}


def equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)



def loaded(path) -> tuple:
    """(outcome, values) of a load of the checkpoint at ``path`` into a fresh model."""
    model = job(99, compiled=False)
    got = outcome(lambda: autoshard.load_checkpoint(path, model))
    return got, values(model) if got == "ok" else None


def listing(path) -> list:
    return sorted(os.listdir(path))


def _once(obj, name: str, before):
    """Run ``before()`` the first time ``obj.name`` is called, then the real one; returns a
    function that puts the real one back."""
    real = getattr(obj, name)
    done = []

    def hooked(*args, **kwargs):
        if not done:
            done.append(1)
            before()
        return real(*args, **kwargs)

    setattr(obj, name, hooked)
    return lambda: setattr(obj, name, real)


def interleaved_worker(rank, world, root) -> dict:
    """In one process (world size 1), two jobs' models ``a`` and ``b``, and writes and loads
    of one path interleaved at fixed points by hooks, each case in a folder of its own:

    - ``commit``, ``sweep``: b saves while a's save is between writing its data and its
      commit, or between its commit and its sweep;
    - ``read``: b saves while a load reads a's checkpoint (after the marker, before DCP
      reads its metadata);
    - ``moved``: b commits and sweeps after a load read the marker and before it locked
      the folder the marker named;
    - ``readonly``, ``nolock``: loads where no lock file can be made; saves and loads on a
      file system without flock;
    - ``export``: an export loaded, one program called, then b exported to the path, then
      the other program called; ``export_nolock``: the same where nothing can be locked.

    A case that raises leaves ``{"error": ...}`` (the others still run)."""
    a, b = job(1), job(2)
    out = {"pid": os.getpid(), "host": socket.gethostname(),
           "values": {"a": values(a), "b": values(b)}}
    cases = {"commit": lambda p: _write_during_write(p, a, b, commit, "_commit"),
             "sweep": lambda p: _write_during_write(p, a, b, commit, "_sweep"),
             "read": lambda p: _write_during_read(p, a, b),
             "moved": lambda p: _moved_before_lock(p, a, b),
             "readonly": lambda p: _read_only(p, a),
             "nolock": lambda p: _no_flock(lambda: _saves_and_load(p, a, b)),
             "export": lambda p: _export_replaced(p, a, b),
             "export_nolock": lambda p: _no_flock(lambda: _export_replaced(p, a, b))}
    for name, case in cases.items():
        try:
            out[name] = case(os.path.join(root, name))
        except BaseException as e:  # noqa: BLE001 - the test names it
            out[name] = {"error": f"{type(e).__name__}: {e}"}
    return out


def _write_during_write(path, a, b, obj, name) -> dict:
    """b saves when a's save calls ``obj.name`` (over an earlier checkpoint of b's)."""
    autoshard.save(path, b)
    other = []
    undo = _once(obj, name, lambda: other.append(outcome(lambda: autoshard.save(path, b))))
    try:
        mine = outcome(lambda: autoshard.save(path, a))
    finally:
        undo()
    return {"a": mine, "b": other[0], "load": loaded(path), "listing": listing(path)}


def _write_during_read(path, a, b) -> dict:
    """b saves while a load of a's checkpoint reads it; then b saves again."""
    autoshard.save(path, a)
    other = []
    undo = _once(dcpio.SafeReader, "read_metadata",
                 lambda: other.append(outcome(lambda: autoshard.save(path, b))))
    try:
        during = loaded(path)
    finally:
        undo()
    out = {"b": other[0], "load": during, "listing": listing(path)}
    out["again"] = outcome(lambda: autoshard.save(path, b))
    out["after"] = (loaded(path), listing(path))
    return out


def _moved_before_lock(path, a, b) -> dict:
    """b commits and sweeps between a load's read of the marker and its lock."""
    autoshard.save(path, a)
    other = []
    undo = _once(commit, "_take", lambda: other.append(outcome(lambda: autoshard.save(path, b))))
    try:
        moved = loaded(path)
    finally:
        undo()
    return {"b": other[0], "load": moved, "listing": listing(path)}


def _read_only(path, a) -> dict:
    """A load where the lock file cannot be made (a directory this user cannot write)."""
    autoshard.save(path, a)
    real = commit._open_lock

    def refused(where):
        raise PermissionError(13, "Permission denied", where)

    commit._open_lock = refused
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = loaded(path)
    finally:
        commit._open_lock = real
    return {"load": got, "warnings": [str(w.message) for w in caught]}


def _no_flock(fn):
    """``fn()`` as on a file system whose flock fails with ENOLCK (NFS without lockd)."""
    real = commit.fcntl

    class NoFlock:
        LOCK_SH, LOCK_EX, LOCK_NB = real.LOCK_SH, real.LOCK_EX, real.LOCK_NB

        @staticmethod
        def flock(fd, how):
            raise OSError(37, "No locks available")

    commit.fcntl = NoFlock
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = fn()
    finally:
        commit.fcntl = real
    return dict(out, warnings=[str(w.message) for w in caught])


def _saves_and_load(path, a, b) -> dict:
    saved = [outcome(lambda: autoshard.save(path, a)), outcome(lambda: autoshard.save(path, b))]
    return {"saved": saved, "load": loaded(path), "listing": listing(path)}


def _export_replaced(path, a, b) -> dict:
    """a exported to ``path`` and loaded; one call (which reads its program); b exported to
    ``path``; the other call (whose program is read now)."""
    a.export(path, inference=False)
    model = autoshard.load(path)
    first = model(X).detach()
    res = {"replaced": outcome(lambda: b.export(path, inference=False))}
    second = []
    res["second"] = outcome(lambda: second.append(model(X2).detach()))
    res["equal"] = (torch.equal(first, a(X).detach()) and bool(second)
                    and torch.equal(second[0], a(X2).detach()))
    res["listing"] = listing(path)
    fresh = autoshard.load(path)
    res["fresh_equal"] = torch.equal(fresh(X2).detach(), b(X2).detach())
    del model, fresh
    gc.collect()
    res["after"] = outcome(lambda: b.export(path, inference=False))
    res["after_listing"] = listing(path)
    return res


def held_worker(rank, world, root) -> dict:
    """Two ranks load a checkpoint and an export while another job commits a new one and
    sweeps: after rank 0 read the marker and before rank 1 does (a hook on each rank's
    ``commit.hold``). The other job's write is made here by hand on rank 1 (a copy of the
    folder under a new name, a marker naming it, a sweep), as a job with its own process
    group would leave it."""
    model = job(1)
    out = {}
    ck, ex = os.path.join(root, "ck"), os.path.join(root, "ex")
    autoshard.save(ck, model)
    model.export(ex, inference=False)
    for what, path, marker in (("checkpoint", ck, checkpoint.MARKER),
                               ("export", ex, export.MANIFEST)):
        flag = os.path.join(root, f"{what}.held")
        with open(os.path.join(path, marker)) as f:
            first = json.load(f)["data"]
        read = []

        def on_rank1(path=path, marker=marker, flag=flag):
            while not os.path.exists(flag):
                time.sleep(0.01)
            _replace(path, marker)

        real = commit.hold

        def hooked(*args, _real=real, _flag=flag, **kwargs):
            if rank == 1 and not read:
                on_rank1()
            held = _real(*args, **kwargs)
            if rank == 0 and not read:
                open(_flag, "w").close()
            read.append(held.doc.get("data") if isinstance(held.doc, dict) else None)
            return held

        commit.hold = hooked
        real_read = dcpio.SafeReader.read_metadata
        dcp_read = []

        def read_metadata(self, *args, **kwargs):
            dcp_read.append(os.path.basename(os.fspath(self.path)))
            return real_read(self, *args, **kwargs)

        dcpio.SafeReader.read_metadata = read_metadata
        try:
            if what == "checkpoint":
                fresh = job(99, compiled=False)
                got = outcome(lambda: autoshard.load_checkpoint(path, fresh))
            else:
                got = outcome(lambda: autoshard.load(path))
        finally:
            commit.hold = real
            dcpio.SafeReader.read_metadata = real_read
        out[what] = {"load": got, "first": first, "dcp_read": dcp_read,
                     "again": outcome(lambda: autoshard.load(path)) if what == "export" else None}
    return out


def _replace(path, marker) -> None:
    """Another job's write to ``path``: a new data folder (a copy of the current one), the
    marker naming it (an export's manifest rewritten to name it, its hash again), a sweep."""
    with open(os.path.join(path, marker)) as f:
        text = f.read()
    old = json.loads(text)["data"]
    new = commit.DATA + "0ther0job000"
    shutil.copytree(os.path.join(path, old), os.path.join(path, new))
    doc = json.loads(text.replace(old, new))
    if marker == export.MANIFEST:
        doc["hash"] = export._content_hash(doc["files"])
    tmp = os.path.join(path, f".{marker}.{new}")
    with open(tmp, "w") as f:
        json.dump(doc, f)
    os.replace(tmp, os.path.join(path, marker))
    commit._sweep(path, spare=new)


# --- two processes -------------------------------------------------------------------------


def _quiet():
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")


def paused_writer(path, in_window, go_on, result) -> None:
    """A job saving to ``path`` that stops between its commit and its sweep until ``go_on``,
    then loads the path."""
    _quiet()
    model = job(1, compiled=False)
    autoshard.save(path, job(3, compiled=False))  # an earlier checkpoint there

    def pause():
        in_window.set()
        go_on.wait(60)

    undo = _once(commit, "_sweep", pause)
    mine = outcome(lambda: autoshard.save(path, model))
    undo()
    got, vals = loaded(path)
    result.put(("paused", {"save": mine, "load": got, "pid": os.getpid(),
                           "host": socket.gethostname(),
                           "equal": vals is not None and equal(vals, values(model))}))


def second_writer(path, in_window, go_on, result) -> None:
    """Another job saving to ``path`` while the first is paused in its write."""
    _quiet()
    model = job(2, compiled=False)
    in_window.wait(60)
    mine = outcome(lambda: autoshard.save(path, model))
    go_on.set()
    result.put(("second", {"save": mine, "pid": os.getpid()}))


def stress_writer(path, seed, saves, start, result) -> None:
    """``saves`` saves of one job's model to ``path``, a pause between two (its training
    steps); the first job's first save before the others start (so there is a checkpoint
    to load)."""
    _quiet()
    model = job(seed, compiled=False)
    counts = {"ok": 0, "refused": 0, "failed": []}
    if seed == 1:
        autoshard.save(path, model)
    start.wait(60)
    for _ in range(saves):
        got = outcome(lambda: autoshard.save(path, model))
        if got == "ok":
            counts["ok"] += 1
        elif "another job is writing to it" in got:
            counts["refused"] += 1
        else:
            counts["failed"].append(got)
        time.sleep(0.02)
    result.put((f"writer{seed}", counts))


def stress_reader(path, seeds, start, writers_done, result) -> None:
    """Loads of ``path`` until the writers end, then one more: each must load, and load one
    job's values whole."""
    _quiet()
    want = [values(job(s, compiled=False)) for s in seeds]
    model = job(99, compiled=False)
    counts = {"ok": 0, "failed": [], "mixed": 0}
    start.wait(60)

    def once():
        got = outcome(lambda: autoshard.load_checkpoint(path, model))
        if got != "ok":
            counts["failed"].append(got)
        elif not any(equal(values(model), w) for w in want):
            counts["mixed"] += 1
        else:
            counts["ok"] += 1

    while not writers_done.is_set():
        once()
    once()
    counts["listing"] = listing(path)
    result.put(("reader", counts))

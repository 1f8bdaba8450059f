"""Reading an export safely and boundedly: readers hold the export's reader lock while they
read; a graph whose nodes would compute too much, and a document too large, are refused
before any work, naming the bound and how to raise it; a program's files are checked, as
they are read at its first call, against the hashes the load read.

The bounds are checked on hand-made graph documents in this process; the rest on exports
a one-rank run writes (``_export``)."""

from __future__ import annotations

import fcntl
import glob
import json
import os
import shutil
import time

import pytest
import torch
import torch.fx as fx
import torch.nn as nn

import autoshard
from autoshard.core import _compat
from autoshard.__main__ import main as cli
from autoshard.core.errors import AutoshardError
from autoshard.runtime import commit, export, export_load, graphcost, graphio
from harness import outcome, run_ranks

aten = torch.ops.aten


# --- an export of a small model, written by one rank ----------------------------------------


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


X = torch.randn(4, 8, generator=torch.Generator().manual_seed(7))


def _export(rank, world, path):
    torch.manual_seed(0)
    model = autoshard.autoshard(Net())
    model(X).pow(2).mean().backward()
    model.export(path)


def _forward_files(path: str) -> list:
    with open(os.path.join(path, "manifest.json")) as f:
        data = json.load(f)["data"]
    return sorted(glob.glob(os.path.join(path, data, "programs", "*", "forward.json")))


def _first_calls(rank, world, root):
    """Each case: the export loaded, then its forward graphs changed (or not), then called."""
    src, out = f"{root}/ex", {}
    _export(rank, world, src)

    def case(name, change):
        path = f"{root}/{name}"
        shutil.copytree(src, path)
        model = autoshard.load(path)  # every file hashed here, as written
        for f in _forward_files(path):
            change(f)
        out[name] = outcome(lambda: model(X).pow(2).mean().backward())

    def replaced(f):  # the same graph, written another way: other bytes, other hash
        with open(f) as fh:
            doc = json.load(fh)
        with open(f, "w") as fh:
            json.dump(doc, fh, indent=2)

    def same_size(f):  # tanh -> sinh: another computation, as many bytes
        with open(f, "rb") as fh:
            data = fh.read()
        assert b"aten::tanh.default" in data
        with open(f, "wb") as fh:
            fh.write(data.replace(b"aten::tanh.default", b"aten::sinh.default"))

    def symlinked(f):  # a copy outside, the same bytes: only the link tells
        outside = f"{root}/outside_{len(os.listdir(root))}.json"
        shutil.copy(f, outside)
        os.remove(f)
        os.symlink(outside, f)

    case("untouched", lambda f: None)
    case("replaced", replaced)
    case("same_size", same_size)
    case("symlinked", symlinked)
    return out


@pytest.fixture(scope="module")
def first_calls(tmp_path_factory):
    return run_ranks(1, _first_calls, str(tmp_path_factory.mktemp("first")))[0]


def test_an_untouched_export_runs_at_its_first_call(first_calls):
    assert first_calls["untouched"] == "ok", first_calls["untouched"]


@pytest.mark.parametrize("name, words", [
    ("replaced", ("bytes, not the", "since the export was written or loaded")),
    ("same_size", ("SHA-256", "since the export was written or loaded")),
    ("symlinked", ("symlink",)),
])
def test_a_graph_file_changed_after_the_load_is_refused_at_the_first_call(first_calls, name,
                                                                           words):
    got = first_calls[name]
    assert got.startswith("AutoshardError") and "forward.json" in got, got
    for w in words:
        assert w in got, (w, got)


# --- readers hold the reader lock -----------------------------------------------------------


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("held") / "ex")
    run_ranks(1, _export, path)
    return path


def _held_while_read(monkeypatch, path) -> list:
    """Patch the read of each program.json to note whether a writer's sweep could take the
    data folder's lock then (it takes it exclusively, without waiting)."""
    with open(os.path.join(path, "manifest.json")) as f:
        lock = os.path.join(path, commit.READ_LOCK + json.load(f)["data"])
    seen, read = [], export_load.read_json

    def watched(root, rel, files=None):
        fd = os.open(lock, os.O_RDONLY) if os.path.exists(lock) else None
        try:
            if fd is not None:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            seen.append("sweepable")
        except BlockingIOError:
            seen.append("held")
        finally:
            if fd is not None:
                os.close(fd)
        return read(root, rel, files)

    monkeypatch.setattr(export, "read_json", watched)
    return seen


@pytest.mark.parametrize("reader", ["describe", "stored_plan", "inspect"])
def test_a_reader_holds_the_reader_lock_while_it_reads(exported, monkeypatch, capsys, reader):
    seen = _held_while_read(monkeypatch, exported)
    if reader == "describe":
        assert "program 0" in export.describe(exported)
    elif reader == "stored_plan":
        assert export.stored_plan(exported, 0).units is not None
    else:
        assert cli(["inspect", exported]) == 0
        assert "program 0" in capsys.readouterr().out
    assert seen and set(seen) == {"held"}, seen
    # and let go of it afterwards: a sweep may take it again
    assert not [n for n in os.listdir(exported) if commit.is_lock(n)]


# --- the bounds on a graph and on a document ------------------------------------------------


def _doc(build, *shapes) -> dict:
    """The graph document of ``build(graph, *placeholders)`` over float32 inputs of
    ``shapes``."""
    g = fx.Graph()
    phs = [g.placeholder(f"x{i}") for i in range(len(shapes))]
    with _compat.FakeTensorMode():
        for p, s in zip(phs, shapes):
            p.meta["val"] = torch.empty(s)
    g.output(build(g, *phs))
    return graphio.dump_graph(fx.GraphModule({}, g))[0]


def _expand_sum(g, x):
    """A 2^36-element expand of one element, summed: 256 GiB of float32, read by the sum."""
    big = g.call_function(aten.expand.default, (x, [2 ** 18, 2 ** 18]))
    return g.call_function(aten.sum.default, (big,))


def test_a_node_past_the_byte_bound_is_refused_quickly_naming_it(monkeypatch):
    doc = _doc(_expand_sum, [1])
    t0 = time.perf_counter()
    with pytest.raises(AutoshardError, match=r"f\.json: node expand_default "
                       r"\(aten::expand\.default\) computes 274,877,906,944 bytes.*"
                       r"AUTOSHARD_GRAPH_MAX_NODE_BYTES \(68,719,476,736\).*raise it"):
        graphio.load_graph(doc, {}, source="f.json")
    assert time.perf_counter() - t0 < 5
    # the bound is what refused it: raised, the graph loads (on fake values; nothing ran)
    monkeypatch.setenv("AUTOSHARD_GRAPH_MAX_NODE_BYTES", str(2 ** 38))
    gm = graphio.load_graph(doc, {}, source="f.json")
    assert [n.meta["val"].shape for n in gm.graph.nodes if n.op == "call_function"] == [
        (2 ** 18, 2 ** 18), ()]


def _matmuls(n):
    def build(g, x):
        for _ in range(n):
            x = g.call_function(aten.mm.default, (x, x))
        return x
    return build


def test_a_graph_past_the_work_bound_is_refused_at_the_node_that_crosses_it(monkeypatch):
    # each product of 2^15 x 2^15 matrices: 2^46 floating-point operations, a 4 GiB output;
    # 200 of them pass the default bound (2^53) at the 128th
    doc = _doc(_matmuls(200), [2 ** 15, 2 ** 15])
    t0 = time.perf_counter()
    with pytest.raises(AutoshardError, match=r"the graph up to node mm_default_127 "
                       r"\(aten::mm\.default\) takes [\d,]+ units of work.*"
                       r"AUTOSHARD_GRAPH_MAX_WORK \(9,007,199,254,740,992\)"):
        graphio.load_graph(doc, {}, source="g.json")
    assert time.perf_counter() - t0 < 10
    monkeypatch.setenv("AUTOSHARD_GRAPH_MAX_WORK", str(2 ** 60))
    graphio.load_graph(doc, {}, source="g.json")
    # and lowered, a small graph is refused: 2 x 64 x 64 x 64 operations, 3 x 4096 elements
    monkeypatch.setenv("AUTOSHARD_GRAPH_MAX_WORK", "536576")
    small = _doc(_matmuls(1), [64, 64])
    graphio.load_graph(small, {})
    monkeypatch.setenv("AUTOSHARD_GRAPH_MAX_WORK", "536575")
    with pytest.raises(AutoshardError, match=r"takes 536,576 units of work"):
        graphio.load_graph(small, {})


def test_a_bound_set_to_no_number_is_named(monkeypatch):
    monkeypatch.setenv("AUTOSHARD_GRAPH_MAX_WORK", "lots")
    with pytest.raises(AutoshardError, match="AUTOSHARD_GRAPH_MAX_WORK='lots' is not a "
                       "positive whole number"):
        graphio.load_graph(_doc(_matmuls(1), [4, 4]), {})


def test_a_document_past_its_bound_is_refused_before_it_is_read(tmp_path, monkeypatch):
    big = tmp_path / "forward.json"
    with open(big, "wb") as f:  # 200 MiB, not JSON: read, it would be refused as not JSON
        f.truncate(200 << 20)
    t0 = time.perf_counter()
    with pytest.raises(AutoshardError, match=r"forward\.json holds 209,715,200 bytes in one "
                       r"JSON document, more than AUTOSHARD_MAX_DOCUMENT_BYTES "
                       r"\(134,217,728\).*checked before reading it"):
        export_load.read_json(str(tmp_path), "forward.json")
    assert time.perf_counter() - t0 < 1
    small = tmp_path / "program.json"
    small.write_text(json.dumps({"a": "x" * 2000}))
    monkeypatch.setenv("AUTOSHARD_MAX_DOCUMENT_BYTES", "1000")
    with pytest.raises(AutoshardError, match="AUTOSHARD_MAX_DOCUMENT_BYTES"):
        export_load.read_json(str(tmp_path), "program.json")
    monkeypatch.setenv("AUTOSHARD_MAX_DOCUMENT_BYTES", "3000")
    assert export_load.read_json(str(tmp_path), "program.json") == {"a": "x" * 2000}


def test_a_document_is_read_through_no_symlink(tmp_path):
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "program.json").write_text("{}")
    (tmp_path / "ex").mkdir()
    os.symlink(tmp_path / "outside", tmp_path / "ex" / "programs")
    with pytest.raises(AutoshardError, match=r"is under programs, a symlink or not a folder"):
        export_load.read_json(str(tmp_path / "ex"), "programs/program.json")
    assert graphcost.DOCUMENT_BYTES.value() == 2 ** 27

"""Progress lines: nothing for a short phase, lines past the threshold, off with one setting."""

import io
import threading
import time

import pytest
import torch

from autoshard.core import progress


@pytest.fixture
def quick(monkeypatch):
    monkeypatch.setattr(progress, "AFTER_S", 0.05)
    monkeypatch.setattr(progress, "EVERY_S", 0.05)
    monkeypatch.setattr(progress, "_enabled", None)
    monkeypatch.delenv("AUTOSHARD_PROGRESS", raising=False)


def _run(steps, pause, **kw):
    out = io.StringIO()
    with progress.phase("planning", total=steps, unit="candidates", stream=out, **kw) as p:
        for i in range(steps):
            time.sleep(pause)
            p.step(note=f"candidate {i}")
    return out.getvalue()


def test_short_phase_is_silent(monkeypatch):
    monkeypatch.setattr(progress, "_enabled", None)
    assert _run(3, 0.0) == ""


def test_long_phase_logs_count_and_end(quick):
    text = _run(4, 0.06)
    lines = text.splitlines()
    assert lines, text
    assert "[autoshard] planning: " in lines[0] and "/4 candidates" in lines[0]
    assert lines[-1].endswith("(done)") and "4/4 candidates" in lines[-1]


def test_a_phase_without_steps_logs_while_it_waits(quick):
    out = io.StringIO()
    with progress.phase("compiling with inductor", stream=out):
        time.sleep(1.3)  # the ticker writes while the caller is busy
    assert "[autoshard] compiling with inductor: " in out.getvalue()


@pytest.mark.parametrize("how", ["env", "call"])
def test_off_with_one_setting(quick, monkeypatch, how):
    if how == "env":
        monkeypatch.setenv("AUTOSHARD_PROGRESS", "0")
    else:
        progress.enable(False)
    assert _run(3, 0.06) == ""


def _tickers():
    return [t for t in threading.enumerate() if t.name.startswith("autoshard-progress-")]


@pytest.mark.parametrize("on", [True, False])
def test_a_phase_that_cannot_show_costs_no_thread(quick, on):
    progress.enable(on)
    with progress.phase("loading a checkpoint", stream=io.StringIO()) as p:
        running = _tickers()
        p.step()
    assert bool(running) == on and not _tickers()


class _Double(torch.nn.Module):
    def forward(self, x):
        return x * 2


def test_inductor_compiles_inside_a_phase(monkeypatch):
    from autoshard.runtime.inductor import CompiledGraph

    seen = []

    def compile_(self, g, example):  # stands in for inductor: what phase is it run under
        seen.append([p.name for p in progress._stack])
        return lambda args: g(*args)

    monkeypatch.setattr(CompiledGraph, "_compile", compile_)
    graph = CompiledGraph(torch.fx.symbolic_trace(_Double()), "forward", boxed=False)
    for _ in range(2):  # compiled on the first call only
        assert torch.equal(graph(torch.ones(3)), torch.full((3,), 2.0))
    assert seen == [["compiling the forward graph with inductor"]] and not progress._stack


def _checkpoint_phases(rank, world, root):
    from autoshard import autoshard
    from autoshard.core.models import GPT

    names, phase = [], progress.phase

    def recording(name, *args, **kwargs):
        names.append(name)
        return phase(name, *args, **kwargs)

    progress.phase = recording  # in this spawned rank only
    model = autoshard(GPT(vocab=16, dim=8, heads=2, layers=1))
    autoshard.save(root, model)
    autoshard.load_checkpoint(root, model)
    return names


def test_checkpoint_save_and_load_are_phases(tmp_path):
    from harness import run_ranks

    (names,) = run_ranks(1, _checkpoint_phases, str(tmp_path / "ckpt"))
    ours = [n for n in names if "checkpoint" in n]
    assert ours == ["saving a checkpoint", "loading a checkpoint"], names

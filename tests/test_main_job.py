"""The README's main job, the torchrun example, and the debug output."""

import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _env():
    # this checkout's autoshard, also for a script whose folder (examples/) is sys.path[0]
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}


def test_demo_trains_beside_the_reference_and_shows_the_plan():
    out = subprocess.run([sys.executable, "-m", "autoshard", "demo", "--steps", "4"], cwd=ROOT,
                         env=_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    rows = re.findall(r"^\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.e+-]+)", out.stdout, re.M)
    assert [int(r[0]) for r in rows] == [0, 1, 2, 3]
    for _, mine, ref, diff in rows:
        assert abs(float(mine) - float(ref)) <= 1e-5 and float(diff) <= 1e-5
    assert float(rows[-1][1]) < float(rows[0][1])  # it learns
    for part in ("units", "schedule", "all_gather", "reduce_scatter", "parameter bytes per rank"):
        assert part in out.stdout
    ratios = re.findall(r"^\s+[01]\s+[\d.]+ KiB\s+[\d.]+ KiB\s+([\d.]+)$", out.stdout, re.M)
    assert len(ratios) == 2 and all(abs(float(r) - 0.5) < 0.01 for r in ratios)


def test_example_runs_under_torchrun():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--standalone", "examples/train_gpt.py", "--steps", "3", "--layers", "2"]
    out = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "step   2  loss" in out.stdout and "2 ranks, cpu" in out.stdout


def test_example_runs_as_a_module_under_torchrun():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--standalone", "-m", "autoshard.examples.train_gpt", "--steps", "2", "--layers", "1"]
    out = subprocess.run(cmd, cwd=ROOT / "docs", env=_env(), capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "step   1  loss" in out.stdout and "2 ranks, cpu" in out.stdout


def test_debug_level_prints_each_pass(monkeypatch, capfd):
    import torch

    import autoshard
    from autoshard.core.models import GPT

    monkeypatch.setenv("AUTOSHARD_DEBUG", "1")
    autoshard.plan(GPT(), (torch.randint(0, 96, (2, 16)),), world_size=2)
    err = capfd.readouterr().err
    for name in ("assign_units_pass", "insert_collectives_pass", "split_pass"):
        assert re.search(rf"pass \d {name}: [\d.]+ ms", err), err

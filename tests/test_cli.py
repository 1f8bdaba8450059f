import importlib.metadata
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch

import autoshard
from autoshard.core import progress
from autoshard.__main__ import main
from autoshard.runtime import export

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_plan_command_prints_and_writes_the_plan(tmp_path):
    cmd = [sys.executable, "-m", "autoshard", "plan", "autoshard.examples.gpt_shapes:gpt_small",
           "--world-size", "4", "--batch", "2", "--seq", "16", "--device-profile", "cpu",
           "--policy", "module", "--trace", str(tmp_path / "t.json"),
           "--json", str(tmp_path / "p.json"), "--plot", str(tmp_path / "m.png")]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "predicted step time" in out.stdout and "reduce_scatter" in out.stdout
    assert "capturing the training step" in out.stderr  # progress
    plan = autoshard.Plan.from_json((tmp_path / "p.json").read_text())
    assert plan.world_size == 4 and [u.name for u in plan.units][:2] == ["root", "blocks.0"]
    assert json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    assert (tmp_path / "m.png").stat().st_size > 1000
    free_row = re.compile(r"^\s*\d+\s+\w+\s+\S+\s+free\s", re.M)  # "#  pass  unit  free"
    assert not free_row.search(out.stdout) and "free rows not shown" in out.stdout
    frees = subprocess.run(cmd[:15] + ["--frees", "--quiet"], cwd=ROOT, capture_output=True,
                           text=True, timeout=300)
    assert free_row.search(frees.stdout) and "free rows not shown" not in frees.stdout
    short = subprocess.run(cmd[:15] + ["--summary-only", "--quiet"], cwd=ROOT,
                           capture_output=True, text=True, timeout=300)
    assert short.returncode == 0 and "reduce_scatter" not in short.stdout


def _cli(*args, env=None, timeout=120):
    environ = {k: v for k, v in os.environ.items() if k != "AUTOSHARD_DEBUG"}
    return subprocess.run([sys.executable, "-m", "autoshard", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout,
                          env={**environ, **(env or {})})


def _one_error_line(out, command, message):
    """The command failed with ``message`` as one line on stderr, and no traceback."""
    assert out.returncode == 1, (out.returncode, out.stderr)
    assert "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith(f"python -m autoshard {command}: error: "), lines[0]
    assert message in lines[0], lines[0]


def test_bad_factory_is_named():
    _one_error_line(_cli("plan", "autoshard.examples.gpt_shapes:nope"), "plan",
                    "cannot load autoshard.examples.gpt_shapes:nope")
    _one_error_line(_cli("check", "nope"), "check", "expected MODULE:FACTORY")


SMALL = ("autoshard.examples.gpt_shapes:gpt_small", "--batch", "2", "--seq", "16",
         "--device-profile", "cpu")


@pytest.mark.parametrize("args, message", [
    (["--world-size", "6", "--replicate", "4"], "--replicate 4 must divide --world-size 6"),
    (["--world-size", "0"], "--world-size must be at least 1, got 0"),
    (["--memory-budget", "banana"], "Config.memory_budget: cannot read 'banana' as a size"),
    (["--memory-budget", "1KiB", "--quiet"],
     "no plan fits the memory budget of 1.00 KiB per rank"),
    (["--world-size", "6", "--reshard-after-forward", "4", "--quiet"],
     "Config.reshard_after_forward=4 must divide the shard dimension's size 6"),
    (["--reshard-after-forward", "two"], "--reshard-after-forward two is not accepted"),
])
def test_plan_mistakes_are_one_line(args, message):
    _one_error_line(_cli("plan", *SMALL, *args), "plan", message)


def test_debug_shows_the_traceback():
    out = _cli("plan", *SMALL, "--memory-budget", "banana", env={"AUTOSHARD_DEBUG": "1"})
    assert out.returncode != 0
    assert "Traceback" in out.stderr and "ValueError: Config.memory_budget" in out.stderr


def test_help_shows_defaults_and_choices():
    top = _cli("--help")
    assert top.returncode == 0, top.stderr
    for command in ("demo", "plan", "check", "export", "inspect"):
        assert command in top.stdout
    text = _cli("plan", "--help").stdout
    for shown in ("(default: 8)", "(default: 2048)", "{h100,h200,a100,cpu}", "(default: h100)",
                  "{auto,module,size,per-parameter,whole-model}", "(default: auto)",
                  "{auto,min-cut,blocks,none}", "{ddp,zero1,zero2,zero3,auto}",
                  "(default: zero3)", "{float32,bfloat16,float16}"):
        assert shown in " ".join(text.split()), shown
    for command in ("demo", "check", "export", "inspect"):
        out = _cli(command, "--help")
        assert out.returncode == 0 and "(default: " in out.stdout, (command, out.stderr)
    check = " ".join(_cli("check", "--help").stdout.split())
    assert "(default: 16)" in check and "(default: Config's, auto)" in check


def test_version_names_autoshard_and_torch():
    out = _cli("--version")
    assert out.returncode == 0, out.stderr
    version = getattr(autoshard, "__version__", None) or importlib.metadata.version("autoshard")
    assert out.stdout.strip() == f"autoshard {version} (torch {torch.__version__})"


def test_quiet_turns_progress_off(monkeypatch):
    monkeypatch.setattr(progress, "_enabled", None)
    monkeypatch.setattr(sys, "argv", ["autoshard"])
    monkeypatch.delenv("AUTOSHARD_DEBUG", raising=False)
    monkeypatch.delenv("AUTOSHARD_PROGRESS", raising=False)
    assert main(["plan", *SMALL, "--world-size", "0"]) == 1  # stops before planning
    assert progress.enabled()
    assert main(["plan", *SMALL, "--world-size", "0", "--quiet"]) == 1
    assert not progress.enabled()


def test_model_state_per_rank_is_params_grads_and_adam_over_n():
    sys.path.insert(0, str(ROOT))
    from autoshard.examples.gpt_shapes import gpt_1_3b

    with torch.device("meta"):
        model = gpt_1_3b()
    n = 64
    plan = autoshard.plan(model, (torch.zeros(1, 128, dtype=torch.long),), world_size=n,
                          config=autoshard.Config(policy="module", device_profile="h100"))
    params = sum(p.numel() for p in model.parameters())
    expected = (params * 4) * (1 + 1 + 2) / n  # fp32 parameters, gradients, two Adam moments
    assert abs(plan.predicted["model_state_bytes"] / expected - 1) < 0.01


def test_export_and_inspect_commands(tmp_path):
    out_dir = tmp_path / "gpt"
    cmd = [sys.executable, "-m", "autoshard", "export", "autoshard.examples.gpt_shapes:gpt_small",
           "--world-size", "2", "--batch", "2", "--seq", "16", "--out", str(out_dir),
           "--quiet"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert sorted(p.name for p in out_dir.glob("data-*/checkpoint/*.distcp")) == [
        "__0_0.distcp", "__1_0.distcp"]
    # an earlier export is replaced whole; a directory holding anything else is refused
    foreign = [*cmd[:-3], "--out", str(tmp_path), "--quiet"]
    again = subprocess.run(foreign, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert again.returncode != 0 and "a directory holding other files" in again.stderr

    cmd = [sys.executable, "-m", "autoshard", "inspect", str(out_dir), "--program", "1",
           "--trace", str(tmp_path / "t.json"), "--plot", str(tmp_path / "m.png")]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert f"autoshard-export version {export.VERSION}" in text and "2 ranks, cpu" in text
    assert "(verified)" in text and "peak memory per rank" in text
    assert "args[0] int64[2, 16] (train, grad)" in text
    assert "args[0] int64[2, 16] (eval, no grad)" in text
    for op in ("all_gather", "wait", "free", "reduce_scatter"):
        assert f" {op} " in text, op
    assert json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    assert (tmp_path / "m.png").stat().st_size > 1000

    next(out_dir.glob("data-*/model.json")).write_text("{}")
    out = subprocess.run(cmd[:5], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert "model.json is 2 bytes, but the export wrote" in out.stderr

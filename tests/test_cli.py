import json
import pathlib
import subprocess
import sys

import torch

import autoshard

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_plan_command_prints_and_writes_the_plan(tmp_path):
    cmd = [sys.executable, "-m", "autoshard", "plan", "examples.gpt_shapes:gpt_small",
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


def test_bad_factory_is_named():
    out = subprocess.run([sys.executable, "-m", "autoshard", "plan", "examples.gpt_shapes:nope"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "cannot load examples.gpt_shapes:nope" in out.stderr


def test_model_state_per_rank_is_params_grads_and_adam_over_n():
    sys.path.insert(0, str(ROOT))
    from examples.gpt_shapes import gpt_1_3b

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
    cmd = [sys.executable, "-m", "autoshard", "export", "examples.gpt_shapes:gpt_small",
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
    assert "autoshard-export version 2" in text and "2 ranks, cpu" in text
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

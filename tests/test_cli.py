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

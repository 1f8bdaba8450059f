"""``python -m bench.gpu_check --dry-run``: the GPU script's stages at tiny sizes on the CPU,
so the command a GPU loan runs does not rot between loans."""

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_dry_run_reports_every_stage_it_ran(tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "bench.gpu_check", "--dry-run", "--out", str(out),
           "--only", "env,smoke,fake8,hostcost,pytest", "--systems", "autoshard,fsdp2",
           "--budget", "500"]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads((out / "gpu_check.json").read_text())
    stages = report["stages"]
    assert list(stages) == ["env", "smoke", "fake8", "hostcost", "pytest"]
    assert all(s["status"] == "ok" for s in stages.values()), stages
    # the tests start beside the smoke stage; the stage that times steps starts after all
    start = {k: (v["started"], v["started"] + v["seconds"]) for k, v in stages.items()}
    assert start["pytest"][0] <= start["smoke"][0] < start["pytest"][1]
    assert start["smoke"][1] - 0.2 <= start["fake8"][0] < start["hostcost"][0]  # in order
    assert start["hostcost"][0] >= max(start["pytest"][1], start["fake8"][1]) - 0.2  # rounding
    assert all(stages["env"]["checks"].values())
    assert [r["system"] for r in stages["smoke"]["rows"]] == ["autoshard", "fsdp2"]
    assert all(r["ok"] for r in stages["smoke"]["rows"])
    # the GPU's own test command: its tests are collected, and skip on the CPU
    assert re.search(r"\b[1-9]\d* skipped", stages["pytest"]["summary"]), stages["pytest"]
    assert not re.search(r"failed|error", stages["pytest"]["summary"]), stages["pytest"]
    auto = stages["fake8"]["rows"][0]
    assert auto["system"] == "autoshard" and auto["predicted_gib"] > 0
    assert "| env" in (out / "gpu_check.md").read_text()
    assert sorted(p.name for p in out.iterdir()) == [
        "env.log", "fake8.log", "gpu_check.json", "gpu_check.md", "hostcost.log", "pytest.log",
        "smoke.log"]
    rows = {r["model"]: r for r in stages["hostcost"]["rows"]}
    assert sorted(rows) == ["llama4", "mlp48"]
    assert all(r["graph ops"] > 0 and r["eager ms"] > 0 for r in rows.values())

"""How long planning takes, and how much memory, for the big GPT shapes, and where the time
goes.

    python -m bench.plan_scale [--models gpt_175b,gpt_1t] [--world-size 512] [--seq 512]
        [--batch 1] [--param-dtype bfloat16]

Each model is planned in a fresh process (``python -m autoshard plan``, run by this module's
``--child``) so its wall time and peak resident memory are its own; prints a table, then the
time per phase: the capture, each pass the runner applied and each of the planner's phases
("plan: ..."), as ``autoshard.core.progress.TIMES`` counted them (nested phases count in each,
so the rows do not add up to the wall time).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

from tabulate import tabulate

TIMES_MARK = "plan_scale times: "  # the child's last line on stderr: its TIMES as JSON


def run(model: str, args) -> tuple:
    cmd = [sys.executable, "-m", "bench.plan_scale", "--child", "plan",
           f"autoshard.examples.gpt_shapes:{model}", "--world-size", str(args.world_size),
           "--batch", str(args.batch), "--seq", str(args.seq),
           "--device-profile", args.device_profile, "--summary-only", "--quiet"]
    if args.param_dtype:
        cmd += ["--param-dtype", args.param_dtype]
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    summary = {}
    for line in out.stdout.splitlines():
        parts = line.split("  ")
        key, val = parts[0].strip(), parts[-1].strip()
        if key:
            summary[key] = val
    times = {}
    for line in out.stderr.splitlines():
        if line.startswith(TIMES_MARK):
            times = json.loads(line[len(TIMES_MARK):])
    return wall, max(rss, before) / 2**20, out.returncode, summary, out.stderr[-500:], times


def child(argv: list) -> None:
    """``python -m autoshard plan`` with ``argv``, then its phases' times on stderr."""
    from autoshard.core import progress
    from autoshard.__main__ import main as autoshard_main

    code = autoshard_main(argv)
    sys.stdout.flush()
    print(TIMES_MARK + json.dumps(dict(progress.TIMES)), file=sys.stderr, flush=True)
    os._exit(code)  # as the command does: the planner's objects left to the system


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        return child(sys.argv[2:])
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="gpt_175b")
    ap.add_argument("--world-size", type=int, default=512)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--param-dtype", default=None)
    ap.add_argument("--device-profile", default="h100")
    args = ap.parse_args()
    rows, phases = [], {}
    for m in args.models.split(","):
        wall, rss, rc, s, err, phases[m] = run(m, args)
        if rc:
            print(err, file=sys.stderr)
        rows.append((m, args.world_size, args.seq, f"{wall:.1f}", f"{rss:.2f}",
                     s.get("units", "-"), s.get("peak memory per rank", "-"),
                     s.get("model state (params + grads + optimizer)", "-"),
                     s.get("predicted step time", "-")))
    print(tabulate(rows, headers=["model", "ranks", "seq", "plan s", "max RSS GiB", "units",
                                  "peak/rank", "model state/rank", "step"]))
    names = sorted({k for t in phases.values() for k in t})
    print()
    print(tabulate([(k, *(f"{phases[m].get(k, 0.0):.2f}" for m in phases)) for k in names],
                   headers=["phase (s)", *phases]))


if __name__ == "__main__":
    main()

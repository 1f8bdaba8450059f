"""How long planning takes, and how much memory, for the big GPT shapes.

    python -m bench.plan_scale [--models gpt_175b,gpt_1t] [--world-size 512]

Each model is planned in a fresh process (``python -m autoshard plan``) so its wall time and
peak resident memory are its own; prints a table.
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import time

from tabulate import tabulate


def run(model: str, world: int, seq: int, profile: str) -> tuple:
    cmd = [sys.executable, "-m", "autoshard", "plan", f"autoshard.examples.gpt_shapes:{model}",
           "--world-size", str(world), "--seq", str(seq), "--device-profile", profile,
           "--summary-only", "--quiet"]
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
    return wall, max(rss, before) / 2**20, out.returncode, summary, out.stderr[-500:]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="gpt_175b")
    ap.add_argument("--world-size", type=int, default=512)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--device-profile", default="h100")
    args = ap.parse_args()
    rows = []
    for m in args.models.split(","):
        wall, rss, rc, s, err = run(m, args.world_size, args.seq, args.device_profile)
        if rc:
            print(err, file=sys.stderr)
        rows.append((m, args.world_size, args.seq, f"{wall:.1f}", f"{rss:.2f}",
                     s.get("units", "-"), s.get("peak memory per rank", "-"),
                     s.get("model state (params + grads + optimizer)", "-"),
                     s.get("predicted step time", "-")))
    print(tabulate(rows, headers=["model", "ranks", "seq", "plan s", "max RSS GiB", "units",
                                  "peak/rank", "model state/rank", "step"]))


if __name__ == "__main__":
    main()

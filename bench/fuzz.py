"""Long runs of the differential fuzzer (``autoshard.fuzz``): random models, training loops
and Configs, each sharded on fresh gloo ranks and compared with an unsharded eager reference.

    python -m bench.fuzz --cases 200 --seed 1000 --world-sizes 1,2,3,4 --shrink

prints one line per case, then a summary: cases run, each status's count, how many cases
exercised each feature, and every failure with its seed, spec and (with ``--shrink``) the
smallest spec that still fails. Exit status 1 if any case failed. ``--json FILE`` writes the
failures (seed, status, details, spec, shrunk spec) as a list.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=20, help="how many seeds to run")
    ap.add_argument("--seed", type=int, default=0, help="the first seed")
    ap.add_argument("--world-sizes", default="1,2,3,4", help="comma-separated rank counts")
    ap.add_argument("--factory", default=None,
                    help="MODULE:FACTORY: fuzz loops and Configs over this model instead")
    ap.add_argument("--shrink", action="store_true", help="shrink each failure")
    ap.add_argument("--max-shrink-runs", type=int, default=30)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per case")
    ap.add_argument("--json", default=None, help="write the failures here")
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from autoshard import fuzz

    worlds = tuple(int(w) for w in args.world_sizes.split(","))
    summary = fuzz.fuzz(range(args.seed, args.seed + args.cases), world_sizes=worlds,
                        factory=args.factory, do_shrink=args.shrink,
                        max_shrink_runs=args.max_shrink_runs, timeout=args.timeout,
                        log=lambda m: print(m, flush=True))
    print(summary.render())
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{"seed": r.spec["seed"], "status": r.status, "details": r.details,
                        "spec": r.spec, "shrunk": summary.shrunk.get(r.spec["seed"])}
                       for r in summary.results if not r.ok], f, indent=1)
    return 0 if all(r.ok for r in summary.results) else 1


if __name__ == "__main__":
    sys.exit(main())

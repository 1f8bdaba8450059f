"""The largest batch (or sequence) that fits, with and without activation offload (predicted).

    python -m bench.activation_offload [--models llama3_8b:8,llama3_70b:64] [--seq 8192]
        [--vary batch|seq]

Per model (``autoshard.examples.llama_shapes``) and world size, on the ``h100`` profile, the
largest per-rank batch at sequence ``--seq`` whose plan fits the profile's memory, for three
configurations planned alike (fake tensors, no GPU):

- autoshard: the planner's default, activation offload off (``offload_activations=False``);
- autoshard + offload: activation offload a plan choice (``offload_activations=None``);
- FSDP2 + full AC: one unit per transformer block, every block recomputed whole, every unit
  resharded after the forward, no offload: what ``fully_shard`` per block with full activation
  checkpointing runs.

The search plans batch 1, 2, 4, ... until a plan does not fit, then bisects between the last
that fits and the first that does not: every answer is a plan that fits beside one, a batch
larger, that does not. ``--vary seq`` does the same for the sequence at batch 1, in steps of
``--seq-step`` tokens. Prints a table (batch, the chosen recomputation, its peak and step
time at that batch, planning seconds).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from tabulate import tabulate

CONFIGS = ("autoshard", "autoshard + offload", "FSDP2 + full AC")


def config(name: str):
    """The Config of ``name`` (``CONFIGS``); the sharded state stays on the device in all
    three (``OffloadPolicy()``): activation offload is what differs."""
    from torch.distributed.fsdp import OffloadPolicy

    from autoshard import Config

    if name == "FSDP2 + full AC":
        return Config(policy="module", recompute="blocks", reshard_after_forward=True,
                      offload_activations=False, device_profile="h100",
                      offload_policy=OffloadPolicy())
    return Config(device_profile="h100", offload_policy=OffloadPolicy(),
                  offload_activations=None if name.endswith("offload") else False)


def plan_at(factory, world: int, batch: int, seq: int, name: str):
    """The plan of ``factory()`` (built on the meta device) at ``batch`` x ``seq``, and
    whether it fits."""
    import autoshard
    from autoshard.core.errors import AutoshardError

    with torch.device("meta"):
        model = factory()
    try:
        plan = autoshard.plan(model, (torch.zeros(batch, seq, dtype=torch.long),),
                              world_size=world, config=config(name))
    except AutoshardError:  # no plan fits (the planner says why)
        return None, False
    p = plan.predicted
    return plan, plan.unfit is None and p["peak_bytes"] <= plan.memory_budget


def largest(plan_of, limit: int, say) -> tuple:
    """``(k, its plan, the plans made)``: the largest ``k`` up to ``limit`` whose plan
    ``plan_of(k)`` (``(plan, fits)``) fits, by doubling then bisection (0 and None when
    ``k`` = 1 does not fit)."""
    made, fit, over = 0, (0, None), None
    k = 1
    while k <= limit:
        plan, ok = plan_of(k)
        made += 1
        say(f"{k}: {'fits' if ok else 'does not fit'}")
        if not ok:
            over = k
            break
        fit = (k, plan)
        k *= 2
    lo, hi = fit[0], over if over is not None else limit + 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        plan, ok = plan_of(mid)
        made += 1
        say(f"{mid}: {'fits' if ok else 'does not fit'}")
        lo, hi, fit = (mid, hi, (mid, plan)) if ok else (lo, mid, fit)
    return fit[0], fit[1], made


def main(argv=None) -> None:
    from autoshard.examples import llama_shapes
    from autoshard.core.plans import fmt_bytes

    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="llama3_8b:8,llama3_70b:64",
                    help="MODEL:WORLD_SIZE,... of autoshard.examples.llama_shapes")
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--limit", type=int, default=64, help="largest batch tried")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--vary", choices=("batch", "seq"), default="batch",
                    help="batch: the largest batch at --seq; seq: the largest sequence (in "
                         "steps of --seq-step) at batch 1")
    ap.add_argument("--seq-step", type=int, default=1024)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()

    def say(msg):
        print(f"[{time.perf_counter() - t0:7.1f}s] {msg}", file=sys.stderr, flush=True)

    rows = []
    for item in args.models.split(","):
        model, world = item.split(":")
        factory = getattr(llama_shapes, model)
        for name in args.configs.split(","):
            start = time.perf_counter()

            def plan_of(k, name=name, factory=factory, world=int(world)):
                batch, seq = (k, args.seq) if args.vary == "batch" else (1, k * args.seq_step)
                return plan_at(factory, world, batch, seq, name)

            k, plan, made = largest(plan_of, args.limit,
                                    lambda msg, name=name: say(f"{name} {args.vary} {msg}"))
            batch, seq = ((k, args.seq) if args.vary == "batch" else (1, k * args.seq_step))
            spent = f"{(time.perf_counter() - start) / made:.0f} s x {made}"
            if plan is None:
                rows.append((model, world, seq if k else "-", name, batch if k else 0, "-",
                             "-", "-", "-", spent))
                continue
            p = plan.predicted
            rows.append((model, world, seq, name, batch, plan.recompute,
                         fmt_bytes(sum(plan.offloaded_activations.values())),
                         fmt_bytes(p["peak_bytes"]), f"{p['step_s'] * 1e3:.0f} ms", spent))
    print(tabulate(rows, headers=["model", "ranks", "seq", "plan", "batch",
                                  "recompute at it", "offloaded/rank", "peak/rank", "step",
                                  "planning"]))


if __name__ == "__main__":
    main()

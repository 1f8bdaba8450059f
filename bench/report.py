"""Write BENCHMARKS.md: autoshard against FSDP2 and DDP, compile cost, and ablations.

    python -m bench.report [--steps 20] [--reps 5]

Every number comes from a run made by this command on the machine it names.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time

import torch
from tabulate import tabulate

from bench import compare


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    return (f"{os.cpu_count()} CPU cores ({cpu}), GPU: {gpu}, Python {platform.python_version()},"
            f" torch {torch.__version__}")


def _compare(model, systems, steps, reps):
    args = compare.argparse.Namespace(model=model, world_size=2, steps=steps, reps=reps,
                                      batch=8, seq=64, systems=systems)
    per_rank = compare.run(args)
    rows = per_rank[0]
    peaks = {k: max(pr[k]["peak"] for pr in per_rank) for k in rows}
    return rows, peaks


def _compile_cost(depth: int) -> float:
    code = ("import time, torch, autoshard\nfrom autoshard.models import GPT\n"
            f"m = GPT(vocab=256, dim=64, heads=4, layers={depth}, seq=64)\n"
            "t = time.perf_counter()\n"
            "autoshard.plan(m, (torch.randint(0, 256, (8, 64)),), world_size=2,"
            " config=autoshard.Config(policy='module'))\n"
            "print(time.perf_counter() - t)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.split()[-1])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.report")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="BENCHMARKS.md")
    args = ap.parse_args(argv)
    started = time.time()
    lines = ["# Benchmarks", "",
             f"Machine: {_machine()}. World size 2, gloo, fp32, per-rank batch 8, sequence 64,"
             " AdamW.", "",
             f"Command: `python -m bench.report --steps {args.steps} --reps {args.reps}` "
             "(each table below is also one `python -m bench.compare ...` run; see its "
             "docstring for how time, memory and bytes are measured).", ""]
    lines += ["## autoshard, FSDP2 and DDP", "",
              "Median step time over every timed step of 5 interleaved repetitions; peak "
              "per-rank memory (model state at step start + the allocator's largest rise in "
              "one step); bytes each rank sends per step and collectives per step, counted at "
              "the calls; the ZeRO-3 bound 3P(N-1)/N.", ""]
    for model in compare.MODELS:
        rows, peaks = _compare(model, "autoshard,fsdp2,ddp", args.steps, args.reps)
        n = 2
        bound = 3 * rows["autoshard"]["param_bytes"] * (n - 1) // n
        table = [(name, f"{r['ms']:.1f}", f"{r['ms'] / rows['fsdp2']['ms']:.2f}",
                  f"{r['ms'] / rows['ddp']['ms']:.2f}", f"{peaks[name] / 2**20:.2f}",
                  f"{peaks[name] / peaks['fsdp2']:.2f}", r["bytes"], r["calls"], bound)
                 for name, r in rows.items()]
        lines += [f"### {model}", "", tabulate(
            table, headers=["system", "step ms", "x FSDP2", "x DDP", "peak MiB", "x FSDP2",
                            "bytes/rank/step", "collectives", "ZeRO-3 bound"],
            tablefmt="github"), ""]
    lines += ["## Ablations (gpt-deep, 8 layers)", "",
              "`autoshard` is the default (policy auto, no prefetch); the variants change one "
              "thing (see VARIANTS in bench/compare.py; `cap1`/`cap4` are module units with "
              "prefetch depth 1 and 4).", ""]
    systems = ("autoshard,autoshard:prefetch,autoshard:module,autoshard:prefetch-module,"
               "autoshard:cap1,autoshard:cap4,autoshard:bucket,autoshard:nobucket,"
               "autoshard:whole,fsdp2")
    rows, peaks = _compare("gpt-deep", systems, args.steps, args.reps)
    table = [(name, f"{r['ms']:.1f}", f"{r['ms'] / rows['fsdp2']['ms']:.2f}",
              f"{peaks[name] / 2**20:.2f}", r["calls"]) for name, r in rows.items()]
    lines += [tabulate(table, headers=["variant", "step ms", "x FSDP2", "peak MiB",
                                       "collectives"], tablefmt="github"), ""]
    lines += ["## Compile cost", "",
              "Capture + passes + prediction of a GPT (dim 64) for world size 2, module "
              "policy, in a fresh process.", ""]
    cost = [(d, f"{_compile_cost(d):.2f}") for d in (2, 8, 32)]
    lines += [tabulate(cost, headers=["layers", "seconds"], tablefmt="github"), ""]
    lines += [f"Generated in {time.time() - started:.0f} s."]
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

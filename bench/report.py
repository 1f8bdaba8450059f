"""Write BENCHMARKS.md: autoshard against FSDP2 and DDP, compile cost, and ablations.

    python -m bench.report [--steps 20] [--reps 5]

Every number comes from a run made by this command on the machine it names.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time

import torch
from tabulate import tabulate

from autoshard import planner
from bench import compare, membound, strategies


STEP_TARGET, PEAK_TARGET = 0.7, 0.85  # x FSDP2's step time and peak memory
# the default plan's memory: peak <= PEAK_TARGET x FSDP2's at step <= MEMORY_STEP_TARGET x
MEMORY_STEP_TARGET = 0.8
MEMORY_TITLE = "## The default plan's memory against FSDP2"


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


def _compare(model, systems, steps, reps, trace=None):
    args = compare.argparse.Namespace(model=model, world_size=2, steps=steps, reps=reps,
                                      batch=8, seq=64, systems=systems, trace=trace)
    per_rank = compare.run(args)
    rows = per_rank[0]
    peaks = {k: max(pr[k]["peak"] for pr in per_rank) for k in rows}
    return rows, peaks


def _why_not(model, rows, peaks, step, peak, exposed) -> list:
    """A line per target the default plan misses on ``model``, from the measured figures and
    the plan's own candidates."""
    out = []
    if step > STEP_TARGET:
        above = rows["autoshard"]["ms"] - rows["ddp"]["ms"]
        comp = rows["autoshard:compiled"]["ms"] / rows["fsdp2"]["ms"]
        out.append(
            f"- {model}: step {step:.2f}x FSDP2 (DDP's: "
            f"{rows['ddp']['ms'] / rows['fsdp2']['ms']:.2f}x). It is {above:.1f} ms above "
            f"DDP's; in a recorded step the rank waited {exposed:.1f} ms on communication "
            "(that figure includes the ranks' skew at the first collective): the plan "
            "gathers the whole model in one unit before the first op and reduce-scatters "
            "it after the last (its fastest plan here: on 2 cores gloo's transfers take "
            "CPU from the compute, so more units hide little and cost more calls). Besides "
            "communication, autoshard has a cost of its own over the same kernels: mostly "
            "the fx graphs' execution in Python, op by op, where eager runs its backward "
            "in C++, plus recomputation and the gradients' copies into the reduce-scatter's "
            "buffer (the world-size-1 table below isolates it). With `compile=True` the "
            "step is "
            f"{comp:.2f}x FSDP2's.")
    if peak > PEAK_TARGET:
        least = _least_peak_plan(model)
        out.append(
            f"- {model}: peak {peak:.2f}x FSDP2. The plan, the fastest one, gathers the "
            "whole model in one unit; of its plans "
            "predicted within 10% of its step, the one with the least peak has "
            f"{least['units']} units and predicts "
            f"{least['peak_bytes'] / 2**20:.2f} MiB against the chosen "
            f"{least['chosen_peak'] / 2**20:.2f} MiB at {least['slower']:.2f}x the "
            "predicted step. The planner keeps the fastest plan that fits the budget; "
            "`Config(memory_budget=...)` below the chosen plan's peak makes it take a "
            "leaner one.")
    return out


def _least_peak_plan(model) -> dict:
    """Of ``model``'s plan candidates (world size 2, the benchmark's batch): the one with
    the least predicted peak, and how it compares with the chosen one."""
    import autoshard

    torch.manual_seed(0)
    x, _ = compare.batch_for(model, 8, 64, torch.Generator().manual_seed(0))
    plan = autoshard.plan(compare.MODELS[model](), x if isinstance(x, dict) else (x,),
                          world_size=2)
    chosen = next(c for c in plan.candidates if c["chosen"])
    # the least peak among plans whose predicted step is within 10% of the chosen one's
    near = [c for c in plan.candidates
            if c["step_s"] is not None and c["step_s"] <= 1.1 * chosen["step_s"]]
    least = min(near, key=lambda c: (c["peak_bytes"], c["step_s"]))
    return {"units": least["units"], "peak_bytes": least["peak_bytes"],
            "chosen_peak": chosen["peak_bytes"], "slower": least["step_s"] / chosen["step_s"]}


def memory_section(steps: int, reps: int) -> list:
    """One interleaved run (autoshard's default Config, FSDP2, DDP) per model of
    ``compare.MODELS``, the models of a missing library skipped and said so: measured step
    and peak against FSDP2's, the targets, and the plan's own prediction against FSDP2's
    plan (``Config.prefer``)."""
    rows, skipped = [], []
    for model in compare.MODELS:
        if compare.missing(model):
            skipped.append(f"{model} ({compare.missing(model)} is not installed)")
            continue
        r, peaks = _compare(model, "autoshard,fsdp2,ddp", steps, reps)
        a, f, plan = r["autoshard"], r["fsdp2"], r["autoshard"]["plan"]
        step, peak = a["ms"] / f["ms"], peaks["autoshard"] / peaks["fsdp2"]
        rows.append((model, f"{a['ms']:.1f}", f"{f['ms']:.1f}", f"{step:.2f}",
                     "yes" if step <= MEMORY_STEP_TARGET else "no",
                     f"{peaks['autoshard'] / 2**20:.2f}", f"{peaks['fsdp2'] / 2**20:.2f}",
                     f"{peak:.2f}", "yes" if peak <= PEAK_TARGET else "no", plan["units"],
                     f"{plan['peak'] / 2**20:.2f}", f"{plan['fsdp2_peak'] / 2**20:.2f}",
                     f"{f['ms'] / (plan['fsdp2_step_s'] * 1e3):.2f}", plan["choice"] or "-"))
    return [MEMORY_TITLE, "",
            f"`python -m bench.report --only memory --steps {steps} --reps {reps}`: per "
            "model one `bench.compare` run of autoshard's default Config, FSDP2 (each block, "
            "then the root) and DDP, interleaved; step: the median of every timed step of "
            f"{reps} repetitions of {steps} steps; peak: measured as in the tables above "
            f"(the larger rank's). Targets: peak <= {PEAK_TARGET}x FSDP2's at step <= "
            f"{MEMORY_STEP_TARGET}x FSDP2's. `pred.`: the plan's own prediction (the default "
            "`Config(prefer=\"memory\")` takes the fastest plan predicted within "
            f"{planner.PEAK_TARGET}x of FSDP2's plan's peak and {planner.STEP_CAP}x its step, "
            "docs/planning.md); "
            "`FSDP2 measured / its plan`: FSDP2's measured step over the prediction of its "
            "plan; `why`: the plan's reason where the fastest plan peaks above the target. "
            "tt-llama3: torchtitan's llama3; x-llama, x-encdec: x-transformers' Llama-style "
            "decoder and encoder-decoder (bench/libmodels.py), all width 128.", "",
            tabulate(rows, headers=["model", "step ms", "FSDP2 ms", "step x FSDP2",
                                    f"<= {MEMORY_STEP_TARGET}", "peak MiB", "FSDP2 MiB",
                                    "peak x FSDP2", f"<= {PEAK_TARGET}", "units",
                                    "pred. peak MiB", "pred. FSDP2 plan MiB",
                                    "FSDP2 measured / its plan", "why"],
                     tablefmt="github"), ""] + (
        [f"Skipped: {', '.join(skipped)}.", ""] if skipped else [])


def _splice(path: str, section: list) -> None:
    """``section`` (its first line a ``## `` title) in place of the section of that title in
    ``path``, or before "## Compiled graphs" where it has none."""
    with open(path) as f:
        lines = f.read().splitlines()
    if section[0] in lines:
        start = lines.index(section[0])
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")),
                   len(lines))
    else:
        start = end = next((i for i, line in enumerate(lines)
                            if line == "## Compiled graphs"), len(lines))
    with open(path, "w") as f:
        f.write("\n".join(lines[:start] + section + lines[end:]) + "\n")


def world_one_section() -> list:
    """``bench.gpu`` on this machine's CPU for one of the models: world size 1, so nothing is
    communicated, and the step's remaining cost over eager is autoshard's own."""
    out = subprocess.run([sys.executable, "-m", "bench.gpu", "--model", "hf-llama", "--steps",
                          "6", "--reps", "5"], capture_output=True, text=True, check=True)
    blocks = [b.strip() for b in out.stdout.split("\n\n") if b.strip()]
    return ["World size 1 on this CPU (`python -m bench.gpu --model hf-llama --steps 6 "
            "--reps 5`: gloo, one thread, median of 5 interleaved repetitions): nothing is "
            "communicated, so autoshard's cost over eager is its own; the second table is a "
            "world of 8 faked with torch's fake process group, for memory.", "", "```",
            *"\n\n".join(blocks[-2:]).splitlines(), "```"]


def _compile_cost(depth: int, policy: str = "module", runs: int = 3) -> float:
    """The median seconds of ``runs`` fresh processes."""
    return statistics.median(_compile_cost_once(depth, policy) for _ in range(runs))


def _compile_cost_once(depth: int, policy: str) -> float:
    code = ("import time, torch, autoshard\nfrom autoshard.core.models import GPT\n"
            f"m = GPT(vocab=256, dim=64, heads=4, layers={depth}, seq=64)\n"
            "t = time.perf_counter()\n"
            "autoshard.plan(m, (torch.randint(0, 256, (8, 64)),), world_size=2,"
            f" config=autoshard.Config(policy={policy!r}))\n"
            "print(time.perf_counter() - t)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.split()[-1])


STRATEGIES_INTRO = (
    "Bytes each rank sends in one step and stores after the backward (parameters, gradients, "
    "optimizer state, ZeRO-1's replicas), for every `Config.strategy` and hybrid sharding "
    "on a 2 x 2 mesh, gpt-small at world size 4, against the textbook formulas (see "
    "bench/strategies.py and docs/strategies.md). `-reshard`: every unit resharded after "
    "the forward; by default the unit gathered last is kept and not gathered twice. "
    "`-hpz2`: every unit resharded after the forward to groups of 2 ranks "
    "(`reshard_after_forward=2`); across groups: the bytes for ranks outside the rank's "
    "group of 2 (counted as bench/strategies.py says).")


def strategies_section() -> list:
    args = strategies.argparse.Namespace(model="gpt-small", world_size=4, steps=3, batch=4,
                                         seq=64, systems=",".join(strategies.SYSTEMS),
                                         port=29533)
    rows = strategies.run(args)
    return ["## Strategies: bytes against the textbook", "", STRATEGIES_INTRO, "",
            f"P = {rows[0]['P']} parameter bytes.", "", strategies.table(rows), ""]


def membound_section() -> list:
    args = membound.parse_args(["--model", "hf-llama-wide", "--max-batch", "64",
                                "--steps", "5", "--reps", "5"])
    result = membound.run(args)
    return ["## Memory-bound: the largest batch within a budget", "",
            "hf-llama-wide at world size 2 (`python -m bench.membound`, whose docstring has "
            "the method): DDP needs "
            f"{result['ddp_peak'] / 2**20:.2f} MiB per rank at batch {result['ref_batch']} "
            f"per rank; the budget is 0.7x that, {result['budget'] / 2**20:.2f} MiB. Each "
            "system trains the largest per-rank batch whose measured peak fits it: autoshard "
            "planning for the budget (`Config(memory_budget=...)`), FSDP2 per block with and "
            "without activation checkpointing of every block, and DDP. Throughput: samples "
            "per second over both ranks at that batch (the median step of 5 interleaved "
            "repetitions of 5 steps).", "",
            membound.table(result, "github"), ""] + _membound_misses(result)


def _guards(steps: int) -> list:
    """The guard check's cost per call against the step (``bench.guards``)."""
    from bench import guards

    rows = [guards.measure(m, max(steps, 10), 2000) for m in compare.MODELS
            if not compare.missing(m)]
    return ["## Guard check per call", "",
            "Before each call reuses a captured step, every guard capture recorded (the "
            "module tree, hooks and dtypes, the attributes, globals and closure cells the "
            "forward read) is compared with the value now (docs/capture.md). "
            "`python -m bench.guards`: world size 1, the median of 2000 checks against the "
            "median training step, same models and batch as above.", "",
            tabulate([(r["model"], r["guards"], f"{r['check_us']:.0f}", f"{r['step_ms']:.1f}",
                       f"{100 * r['ratio']:.2f}%") for r in rows],
                     headers=["model", "guards", "check us", "step ms", "check / step"],
                     tablefmt="github"), ""]


def _membound_misses(result: dict) -> list:
    over = membound.over_budget(result)
    if not over:
        return []
    peaks = ", ".join(f"batch {b}: {p / membound.MiB:.2f} MiB" for b, p in over.items())
    return [f"autoshard's planner predicted a plan within the budget at larger batches too, "
            f"whose measured peaks were above it ({peaks}). The prediction leaves out part of "
            "gloo's scratch copies for gathers in flight, which live until gloo's worker "
            "thread drops them, so their overlap varies with thread timing "
            "(docs/cost_model.md, \"How good is it?\"); the search counts the measured "
            "peak.", ""]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.report")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="BENCHMARKS.md")
    ap.add_argument("--only", choices=["memory"], default=None,
                    help="run only this section and replace it in --out, keeping the rest")
    args = ap.parse_args(argv)
    if args.only == "memory":
        section = memory_section(args.steps, args.reps)
        _splice(args.out, section)
        print("\n".join(section))
        return
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
              "the calls; the ZeRO-3 bound 3P(N-1)/N. `autoshard` is the default Config; "
              "`autoshard:compiled` the same with `compile=True` (inductor, C++ kernels). "
              "Models: two GPTs of this repository, and Hugging Face Llama, GPT-2, a wider "
              "Llama (hidden 256), Mixtral (mixture of experts), T5 (encoder-decoder) and "
              "ViT (32 x 32 images) at small random configurations.", ""]
    summary, compiled, misses = [], [], []
    for model in [m for m in compare.MODELS if not compare.missing(m)]:
        rows, peaks = _compare(model, "autoshard,autoshard:compiled,fsdp2,ddp", args.steps,
                               args.reps)
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
        for name in ("autoshard", "autoshard:compiled"):
            t = rows[name]["ms"] / rows["fsdp2"]["ms"]
            m = peaks[name] / peaks["fsdp2"]
            ov = rows[name]["overlap"]
            exposed = (ov["in_flight_s"] - ov["hidden_s"]) * 1e3
            summary.append((model, name, f"{t:.2f}", "yes" if t <= STEP_TARGET else "no",
                            f"{m:.2f}", "yes" if m <= PEAK_TARGET else "no",
                            f"{rows['ddp']['ms'] / rows['fsdp2']['ms']:.2f}",
                            f"{rows[name]['ms'] - rows['ddp']['ms']:.1f}", f"{exposed:.1f}"))
            if name == "autoshard":
                misses += _why_not(model, rows, peaks, t, m, exposed)
        plain, comp = rows["autoshard"], rows["autoshard:compiled"]
        compiled.append((model, f"{plain['ms']:.1f}", f"{comp['ms']:.1f}",
                         f"{plain['ms'] / comp['ms']:.2f}", f"{plain['first_s']:.1f}",
                         f"{comp['first_s']:.1f}"))
    lines += ["### Against the targets", "",
              f"Step <= {STEP_TARGET}x FSDP2's and peak <= {PEAK_TARGET}x FSDP2's, from the "
              "tables above. `DDP step x FSDP2`: DDP runs the same kernels with one "
              "all-reduce and nothing gathered, so where it is above the step target no "
              "sharded step with these kernels reaches it. `ms above DDP`: the step's time "
              "over DDP's; `exposed comm ms`: of a recorded step, the time a collective was in "
              "flight and the rank waited on it (`model.record`).", "",
              tabulate(summary, headers=["model", "system", "step x FSDP2",
                                         f"<= {STEP_TARGET}", "peak x FSDP2",
                                         f"<= {PEAK_TARGET}", "DDP step x FSDP2",
                                         "ms above DDP", "exposed comm ms"],
                       tablefmt="github"), ""]
    if misses:
        lines += ["Where the default plan misses a target, and why:", "", *misses, "",
                  *world_one_section(), ""]
    lines += memory_section(args.steps, args.reps)
    lines += ["## Compiled graphs", "",
              "`Config(compile=True)` against the default (fx code), from the runs above: "
              "median step, speed-up, and the first step's seconds (capture, passes and plan; "
              "compiled: also inductor's compilation of the forward and backward graphs, "
              "with inductor's on-disk cache as the run found it).", "",
              tabulate(compiled, headers=["model", "fx ms", "compiled ms", "speed-up",
                                          "first step s (fx)", "first step s (compiled)"],
                       tablefmt="github"), ""]
    lines += ["## Ablations (gpt-deep, 8 layers)", "",
              "`autoshard` is the default Config (policy auto, prefetch on, recompute on, the "
              "unit read last in forward kept gathered); each variant changes one thing (see "
              "VARIANTS in bench/compare.py): `module` = one unit per block (prefetch on, "
              "depth 2), `module-noprefetch` = the same without prefetch, `depth1`/`depth4` "
              "= module units with prefetch depth 1 / 4, `cap256k`/`cap1m` = module units "
              "with at most 256 KiB / 1 MiB of gathered bytes in flight, `bucket`/`nobucket` "
              "= one unit per parameter with/without bucketing, `reshard` = every unit "
              "resharded after forward (the pure ZeRO-3 schedule), `norecompute` = every "
              "activation saved as eager does, `whole` = one unit. Communication in flight "
              "/ hidden: from one recorded step (`model.record`): the time some collective "
              "was in flight, and the part of it the rank computed through instead of "
              "waiting. The timeline of the `module` variant's step is in "
              "`bench/trace_gpt_deep_module.json` (chrome://tracing or Perfetto).", ""]
    systems = ("autoshard:module,autoshard,autoshard:module-noprefetch,autoshard:depth1,"
               "autoshard:depth4,autoshard:cap256k,autoshard:cap1m,autoshard:bucket,"
               "autoshard:nobucket,autoshard:reshard,autoshard:norecompute,autoshard:whole,"
               "fsdp2")
    trace = os.path.join(os.path.dirname(__file__), "trace_gpt_deep_module.json")
    rows, peaks = _compare("gpt-deep", systems, args.steps, args.reps, trace=trace)
    table = []
    for name, r in rows.items():
        ov = r["overlap"]
        table.append((name, f"{r['ms']:.1f}", f"{r['ms'] / rows['fsdp2']['ms']:.2f}",
                      f"{peaks[name] / 2**20:.2f}", f"{peaks[name] / peaks['fsdp2']:.2f}",
                      r["calls"], r["bytes"],
                      f"{ov['in_flight_s'] * 1e3:.1f} / {ov['hidden_s'] * 1e3:.1f}" if ov
                      else "-"))
    lines += [tabulate(table, headers=["variant", "step ms", "x FSDP2", "peak MiB", "x FSDP2",
                                       "collectives", "bytes/rank/step",
                                       "comm ms in flight / hidden"], tablefmt="github"), ""]
    lines += membound_section()
    lines += strategies_section()
    lines += _guards(args.steps)
    lines += ["## Compile cost", "",
              "Capture + passes + prediction of a GPT (dim 64) for world size 2, the median "
              "of 3 fresh processes, with the module policy and with the default (auto) "
              "policy; the last column is the auto policy's seconds per layer added since the "
              "row above, flat when the cost is linear in depth.", ""]
    cost, prev = [], None
    for d in (2, 8, 32):
        mod, auto = _compile_cost(d), _compile_cost(d, "auto")
        step = f"{(auto - prev[1]) / (d - prev[0]):.3f}" if prev else "-"
        cost.append((d, f"{mod:.2f}", f"{auto:.2f}", step))
        prev = (d, auto)
    lines += [tabulate(cost, headers=["layers", "seconds (module)", "seconds (auto)",
                                      "auto s per added layer"], tablefmt="github"), ""]
    lines += [f"Generated in {time.time() - started:.0f} s."]
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

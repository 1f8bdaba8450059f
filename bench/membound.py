"""The largest batch each system trains within a per-rank memory budget, and its throughput.

    python -m bench.membound --model hf-llama-wide --max-batch 64 --steps 3 --reps 3

A memory-bound comparison: the budget sits below what DDP needs, and each system trains the
largest per-rank batch whose measured peak fits it. Systems:
- ``autoshard``: ``autoshard(model, config=Config(memory_budget=budget))``; the planner plans
  for that budget (units, recomputation, ...). An ``AutoshardError`` (no plan fits) means
  the batch does not fit;
- ``fsdp2``: FSDP2's ``fully_shard`` on each repeated block, then on the root;
- ``fsdp2-ac``: the same, each block first wrapped in activation checkpointing
  (``checkpoint_wrapper``, non-reentrant);
- ``ddp``: ``DistributedDataParallel``.

Method (the ranks are spawned here: gloo on CPU, NCCL with one GPU per rank; one thread per
rank; seq 64, fp32, AdamW lr 1e-3):
- the budget is ``--budget`` (a size such as 40MiB) or, by default, ``--fraction`` (0.7) of
  DDP's measured peak at ``--ref-batch`` (8) per rank;
- a trial of a system at batch B builds a fresh model (seed 0) and its optimizer, runs one
  warm-up step, then measures the peak per rank of one step with ``bench.compare._peak``:
  the model state when the step starts (parameters, gradients, buffers, optimizer state,
  inputs) plus the largest rise of the allocator's live bytes during the step (torch.profiler
  on CPU, the CUDA peak counter on GPU). The peak is the maximum over ranks; an exception on
  any rank (``AutoshardError`` or another) makes the trial fail on all of them;
- B fits when the trial succeeds and its peak is <= the budget. The search tries B = 1, 2, 4,
  ... doubling until one does not fit (capped at ``--max-batch``), then bisects between the
  last fitting and the first failing B. It assumes the peak grows with B;
- then every system at its largest fitting B, all built at once (a fresh model each, one
  warm-up step): ``--reps`` repetitions of ``--steps`` timed steps of each, in a rotating
  order so that no system always goes first, each step started after a barrier; throughput
  = B x world size / the median over all of a system's timed steps (the slowest rank's).
"""

from __future__ import annotations

import gc
import os
import statistics
import time

import torch
import torch.distributed as dist

from autoshard.core.options import parse_bytes
from bench.compare import (MODELS, _blocks, _build, _peak, _step, _to, batch_for, parser,
                           init_rank, spawn)

SYSTEMS = ("autoshard", "fsdp2", "fsdp2-ac", "ddp")
MiB = 2**20


def _build_ac(name):
    """FSDP2 per block, each block wrapped in (non-reentrant) activation checkpointing."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing, checkpoint_wrapper)
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = MODELS[name]()
    blocks = set(_blocks(model))
    apply_activation_checkpointing(model, checkpoint_wrapper_fn=checkpoint_wrapper,
                                   check_fn=lambda m: m in blocks)
    wrapped = _blocks(model)  # the block lists now hold the wrappers
    assert all(type(b).__name__ == "CheckpointWrapper" for b in wrapped), wrapped
    for blk in wrapped:
        fully_shard(blk)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _make(system, name, budget):
    if system == "fsdp2-ac":
        return _build_ac(name)
    config = {"memory_budget": budget} if system == "autoshard" else {}
    model, opt, _, _ = _build(system, name, config)
    return model, opt


def _agree(value: float, failed: bool) -> tuple:
    """(max over ranks of value, whether any rank failed)."""
    t = torch.tensor([value, float(failed)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t[0].item(), bool(t[1].item())


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _built(system, args, batch, budget, device, rank):
    """``system`` built at per-rank ``batch`` with two batches of data, after one warm-up step
    (autoshard captures and plans in it): (model, optimizer, data)."""
    gen = torch.Generator().manual_seed(rank)
    model, opt = _make(system, args.model, budget)
    data = [_to(batch_for(args.model, batch, args.seq, gen), device) for _ in range(2)]
    _step(model, opt, *data[0])
    _sync(device)
    return model, opt, data


def _trial(system, args, batch, budget, device, rank):
    """Build ``system`` at per-rank ``batch``, warm up one step, measure the peak. Returns
    (peak bytes max over ranks or None, error text or None); identical on every rank."""
    err, peak = None, 0.0
    model = opt = None
    try:
        model, opt, data = _built(system, args, batch, budget, device, rank)
        peak = float(_peak(model, opt, *data[0]))
    except Exception as e:  # noqa: BLE001 - any failure is "does not fit", on every rank
        from autoshard.core.errors import AutoshardError

        err = ("no plan fits" if isinstance(e, AutoshardError)
               else f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}")
    peak, failed = _agree(peak, err is not None)
    if failed:
        err = err or "failed on another rank"
        peak = None
    del model, opt
    gc.collect()
    return peak, err


def _timed(batches: dict, args, budget, device, rank) -> dict:
    """Every system of ``batches`` (system -> per-rank batch) built at its batch at once, then
    ``args.reps`` repetitions of ``args.steps`` steps of each, in a rotating order: system ->
    the median seconds of its steps (the slowest rank's)."""
    built = {s: _built(s, args, b, budget, device, rank) for s, b in batches.items()}
    times = {s: [] for s in built}
    order = list(built)
    for rep in range(args.reps):
        for s in order[rep % len(order):] + order[: rep % len(order)]:
            model, opt, data = built[s]
            for i in range(args.steps):
                dist.barrier()
                t0 = time.perf_counter()
                _step(model, opt, *data[i % len(data)])
                _sync(device)
                times[s].append(time.perf_counter() - t0)
    return {s: _agree(statistics.median(t), False)[0] for s, t in times.items()}


def _search(system, args, budget, device, rank, log):
    """The largest per-rank batch that fits ``budget`` (0 if none), with its peak."""
    trials = {}

    def fits(b):
        peak, err = _trial(system, args, b, budget, device, rank)
        ok = err is None and peak <= budget
        trials[b] = (peak, err)
        log(f"  {system:9s} batch {b:4d}: "
            + (f"peak {peak / MiB:8.2f} MiB" if peak is not None else err)
            + ("  fits" if ok else "  does not fit"))
        return ok

    good, bad, b = 0, None, 1
    while True:
        if fits(b):
            good = b
            if b >= args.max_batch:
                break
            b = min(2 * b, args.max_batch)
        else:
            bad = b
            break
    if bad is not None:
        while bad - good > 1:
            mid = (good + bad) // 2
            if fits(mid):
                good = mid
            else:
                bad = mid
    return good, (trials[good][0] if good else None), trials


def _rank(rank, world, args, store, out_path):
    # a finite timeout: a rank left waiting in a collective fails instead of hanging
    device = init_rank(rank, world, store, timeout=args.timeout)

    def log(msg):
        if rank == 0:
            print(msg, flush=True)

    t_start = time.perf_counter()
    ddp_peak, ddp_err = _trial("ddp", args, args.ref_batch, None, device, rank)
    if args.budget:
        budget = parse_bytes(args.budget, "--budget")
    elif ddp_peak is None:
        raise RuntimeError(f"DDP failed at the reference batch: {ddp_err}")
    else:
        budget = int(args.fraction * ddp_peak)
    log(f"DDP needs {ddp_peak / MiB:.2f} MiB per rank at batch {args.ref_batch}/rank"
        if ddp_peak is not None else f"DDP failed at batch {args.ref_batch}: {ddp_err}")
    log(f"budget: {budget / MiB:.2f} MiB per rank"
        + ("" if args.budget else f" ({args.fraction:g} x DDP's need)"))
    found = {s: _search(s, args, budget, device, rank, log) for s in args.systems.split(",")}
    secs = _timed({s: f[0] for s, f in found.items() if f[0]}, args, budget, device, rank)
    rows = [{"system": s, "batch": best, "peak": peak, "budget": budget,
             "step_s": secs.get(s), "samples_s": best * world / secs[s] if best else None,
             "trials": trials} for s, (best, peak, trials) in found.items()]
    log(f"total {time.perf_counter() - t_start:.1f} s")
    rows = {"rows": rows, "ddp_peak": ddp_peak, "ref_batch": args.ref_batch, "budget": budget}
    if rank == 0:
        torch.save(rows, out_path)
    dist.barrier()
    # results are saved: skip the C++ teardown of gloo's and the profiler's threads, which
    # can abort at exit
    os._exit(0)


def parse_args(argv=None):
    ap = parser("membound", "hf-llama-wide", world_size=2, seq=64)
    ap.add_argument("--budget", default=None,
                    help="per-rank memory budget, e.g. 40MiB (default: --fraction of DDP's "
                         "peak at --ref-batch)")
    ap.add_argument("--fraction", type=float, default=0.7)
    ap.add_argument("--ref-batch", type=int, default=8, help="per rank")
    ap.add_argument("--max-batch", type=int, default=256, help="per rank")
    ap.add_argument("--steps", type=int, default=5,
                    help="timed steps at the largest batch, per repetition")
    ap.add_argument("--reps", type=int, default=5, help="interleaved repetitions")
    ap.add_argument("--systems", default=",".join(SYSTEMS),
                    help="comma list of " + ", ".join(SYSTEMS))
    ap.add_argument("--timeout", type=float, default=600,
                    help="seconds a rank waits in a collective before failing")
    args = ap.parse_args(argv)
    for s in args.systems.split(","):
        if s not in SYSTEMS:
            ap.error(f"unknown system {s!r}; choose from {', '.join(SYSTEMS)}")
    return args


def run(args) -> dict:
    """Spawn the ranks (``args`` from ``parse_args``). Returns ``{"rows", "ddp_peak",
    "ref_batch", "budget"}``; each row: system, batch (largest per rank, 0 if none fits),
    peak (bytes per rank at it), budget, step_s, samples_s, trials (batch -> (peak or None,
    error or None))."""
    return spawn(_rank, args)


def over_budget(result: dict, system: str = "autoshard") -> dict:
    """``system``'s batches that built and ran (for autoshard: whose plan was predicted to fit
    the budget) but measured above it: batch -> measured peak bytes."""
    row = next((r for r in result["rows"] if r["system"] == system), None)
    return {b: peak for b, (peak, err) in sorted((row or {}).get("trials", {}).items())
            if err is None and peak > result["budget"]}


def table(result: dict, fmt: str = "simple") -> str:
    from tabulate import tabulate

    rows = result["rows"]
    ref = next((r["samples_s"] for r in rows if r["system"] == "fsdp2"), None)
    out = []
    for r in rows:
        sps = r["samples_s"]
        out.append((r["system"], r["batch"],
                    f"{r['peak'] / MiB:.2f}" if r["peak"] is not None else "-",
                    f"{r['budget'] / MiB:.2f}",
                    f"{r['step_s'] * 1e3:.1f}" if r["step_s"] else "-",
                    f"{sps:.1f}" if sps else "-",
                    f"{sps / ref:.2f}" if sps and ref else "-"))
    return tabulate(out, headers=["system", "largest batch/rank", "peak MiB/rank",
                                  "budget MiB", "step ms (median)", "samples/s",
                                  "x FSDP2 throughput"], tablefmt=fmt)


def main(argv=None):
    args = parse_args(argv)
    t0 = time.perf_counter()
    result = run(args)
    print(f"\n{args.model}, world size {args.world_size}, seq {args.seq}; DDP needs "
          + (f"{result['ddp_peak'] / MiB:.2f} MiB" if result["ddp_peak"] is not None else "-")
          + f" per rank at batch {result['ref_batch']}/rank")
    print(table(result))
    print(f"wall time {time.perf_counter() - t0:.1f} s")
    return result


if __name__ == "__main__":
    main()

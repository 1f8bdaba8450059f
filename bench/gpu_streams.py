"""Do the offload copies overlap compute? One offloaded step on a GPU under torch.profiler.

    python -m bench.gpu_streams [--model hf-llama-wide] [--batch 8] [--seq 64] [--steps 3]
                                [--trace PATH]

World size 1 on NCCL with ``Config(offload_policy=CPUOffloadPolicy())``: parameter shards,
gradient shards and optimizer state in pinned host memory, each unit's shards copied to the
device before its all-gather and each gradient shard back after its reduce-scatter. The same
model is run twice, with the copies on copy streams (``autoshard.runtime.streams``, the
default) and on the compute stream (``AUTOSHARD_COPY_STREAMS=0``); after ``--steps`` steps
each, one step is profiled. Printed per run: the step's time, the copy kernels' time (Memcpy
HtoD and DtoH), and the fraction of it overlapped with compute: the copy kernels' time that
intersects the compute kernels' intervals (every kernel but NCCL's), over all copy time.
``--trace PATH`` writes the Chrome trace of the copy-stream run's step (open it in Perfetto).

Needs a CUDA device: on a CPU the host is the device and nothing runs on a side stream, so it
exits with a message saying so.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from bench.compare import MODELS, _step, _to, batch_for, parser

COPY_CATS = ("gpu_memcpy",)
COMPUTE_CATS = ("kernel",)


def _union(intervals: list) -> list:
    out = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


def _covered(s: float, e: float, union: list) -> float:
    return sum(max(0.0, min(e, b) - max(s, a)) for a, b in union)


def overlap(trace: dict) -> dict:
    """What a Chrome trace (torch.profiler's ``export_chrome_trace``, read as JSON) says of
    host<->device copies: ``copy_us`` (total Memcpy HtoD/DtoH kernel time), ``overlapped_us``
    (the part of it during which a compute kernel, any kernel but NCCL's, ran),
    ``fraction`` (their ratio; 0 with no copy), and the streams each ran on
    (``copy_streams``, ``compute_streams``)."""
    copies, compute = [], []
    for ev in trace.get("traceEvents", []):
        if ev.get("ph") != "X" or "dur" not in ev:
            continue
        name, cat = ev.get("name", ""), ev.get("cat", "")
        span = (float(ev["ts"]), float(ev["ts"]) + float(ev["dur"]),
                ev.get("args", {}).get("stream"))
        if cat in COPY_CATS and ("HtoD" in name or "DtoH" in name):
            copies.append(span)
        elif cat in COMPUTE_CATS and "nccl" not in name.lower():
            compute.append(span)
    union = _union([[s, e] for s, e, _ in compute])
    total = sum(e - s for s, e, _ in copies)
    hidden = sum(_covered(s, e, union) for s, e, _ in copies)
    return {"copy_us": total, "overlapped_us": hidden,
            "fraction": hidden / total if total else 0.0,
            "copy_streams": sorted({st for *_, st in copies if st is not None}),
            "compute_streams": sorted({st for *_, st in compute if st is not None})}


def profiled_step(model, opt, batches: list, steps: int, trace_path: str) -> float:
    """Run ``steps`` steps of ``model`` on ``batches`` (in turn), then one more under
    torch.profiler, whose Chrome trace goes to ``trace_path``; returns that step's time (s)."""
    from torch.profiler import ProfilerActivity, profile

    for i in range(steps):
        _step(model, opt, *batches[i % len(batches)])
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        _step(model, opt, *batches[0])
        torch.cuda.synchronize()
        took = time.perf_counter() - t0
    prof.export_chrome_trace(trace_path)
    return took


def _run(args, streams: bool, trace_path: str) -> dict:
    from torch.distributed.fsdp import CPUOffloadPolicy

    from autoshard import Config, autoshard

    os.environ["AUTOSHARD_COPY_STREAMS"] = "1" if streams else "0"  # read as programs build
    torch.manual_seed(0)
    model = autoshard(MODELS[args.model]().cuda(),
                      config=Config(offload_policy=CPUOffloadPolicy()))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    data = [_to(batch_for(args.model, args.batch, args.seq, gen), torch.device("cuda"))
            for _ in range(2)]
    took = profiled_step(model, opt, data, args.steps, trace_path)
    with open(trace_path) as f:
        out = overlap(json.load(f))
    out["step_ms"] = took * 1e3
    return out


def main(argv=None):
    from tabulate import tabulate

    ap = parser("gpu_streams", "hf-llama-wide", batch=8, seq=64, steps=3)
    ap.add_argument("--trace", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench.gpu_streams needs a CUDA device: only a GPU runs the offload copies on "
                 "copy streams (on a CPU the host is the device and the copies run in order)")
    torch.cuda.set_device(0)
    rows = {}
    saved = os.environ.get("AUTOSHARD_COPY_STREAMS")
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("nccl", init_method=f"file://{tmp}/s", rank=0, world_size=1)
        try:
            for streams in (True, False):
                path = (args.trace if streams and args.trace
                        else os.path.join(tmp, f"trace{int(streams)}.json"))
                rows["copy streams" if streams else "compute stream"] = _run(args, streams,
                                                                             path)
        finally:
            dist.destroy_process_group()
            if saved is None:
                os.environ.pop("AUTOSHARD_COPY_STREAMS", None)
            else:
                os.environ["AUTOSHARD_COPY_STREAMS"] = saved
    print(f"\n{args.model}, batch {args.batch}, seq {args.seq}, CPUOffloadPolicy, world size 1"
          f" on {torch.cuda.get_device_name(0)}")
    print(tabulate([(k, f"{r['step_ms']:.2f}", f"{r['copy_us'] / 1e3:.3f}",
                     f"{r['overlapped_us'] / 1e3:.3f}", f"{r['fraction']:.2f}",
                     r["copy_streams"], r["compute_streams"]) for k, r in rows.items()],
                   headers=["copies on", "step ms", "copy ms", "overlapped ms", "fraction",
                            "copy streams", "compute streams"]))
    return rows


if __name__ == "__main__":
    main()

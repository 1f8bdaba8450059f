"""autoshard on one device: the real backend at world size 1, and a larger world faked.

    python -m bench.gpu [--model hf-llama-wide] [--batch 8] [--steps 20] [--reps 5]
                        [--fake-world 8] [--trace PATH]

Made for one GPU (NCCL); it also runs on a CPU (gloo), which is how it is checked without
one. In one process:

1. World size 1 on the real backend: the plain model (eager), autoshard (default Config),
   autoshard with ``compile=True`` and FSDP2 (``fully_shard`` per block, then the root), on
   the same data and AdamW; ``--reps`` interleaved repetitions of ``--steps`` steps; the
   median step and the peak memory of one step (``bench.compare._peak``: the state when the
   step starts plus the allocator's largest rise: the CUDA peak counter on a GPU).
2. World size ``--fake-world`` faked with torch's fake process group: its collectives return
   at once without sending anything, so values are meaningless, but every buffer has the
   size it has on that many ranks. Reported: autoshard's and FSDP2's peak memory per rank
   for one step, and autoshard's predicted peak.
3. ``--trace PATH``: a torch.profiler Chrome trace of one autoshard step of part 1.

At world size 1 the collectives still run (a one-rank all-gather or reduce-scatter is a
copy; a plan may have many units), but nothing is sent: part 1 measures autoshard's and
FSDP2's overhead against eager; their communication and its overlap need two or more devices.
``python -m bench.gpu_check`` runs this and every other GPU check in stages.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

from bench.compare import MODELS, _blocks, _peak, _step, _to, batch_for, parser

MiB = 2**20


def _system(name, model_name, device, compile_=False):
    from torch.distributed.fsdp import fully_shard

    from autoshard import Config, autoshard

    torch.manual_seed(0)
    model = MODELS[model_name]().to(device)
    if name == "autoshard":
        model = autoshard(model, config=Config(compile=compile_))
    elif name == "fsdp2":
        for blk in _blocks(model):
            fully_shard(blk)
        fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def world_one(args, device) -> list:
    """Part 1: ``[(system, median ms, peak bytes)]``."""
    systems = {"eager": ("eager", False), "autoshard": ("autoshard", False),
               "autoshard:compiled": ("autoshard", True), "fsdp2": ("fsdp2", False)}
    built = {k: _system(s, args.model, device, c) for k, (s, c) in systems.items()}
    gen = torch.Generator().manual_seed(0)
    data = [_to(batch_for(args.model, args.batch, args.seq, gen), device) for _ in range(4)]
    times = {k: [] for k in built}
    order = list(built)
    for rep in range(args.reps):
        for k in order[rep % len(order):] + order[: rep % len(order)]:
            model, opt = built[k]
            for i in range(args.steps):
                x, y = data[i % len(data)]
                _sync(device)
                t0 = time.perf_counter()
                _step(model, opt, x, y)
                _sync(device)
                if rep or i:  # the first step captures, plans and compiles
                    times[k].append(time.perf_counter() - t0)
    x, y = data[0]
    rows = [(k, statistics.median(times[k]) * 1e3, _peak(*built[k], x, y)) for k in built]
    if args.trace:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda"
                                         else [])
        with profile(activities=acts) as prof:
            _step(*built["autoshard"], x, y)
            _sync(device)
        prof.export_chrome_trace(args.trace)
    return rows


def fake_world(args, device) -> list:
    """Part 2, in a child process (a process has one default group): ``[(system, peak
    bytes, predicted bytes or None)]``."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "fake.pt")
        mp.spawn(_fake_rank, args=(args, device.type, out), nprocs=1, join=True)
        return torch.load(out, weights_only=False)


def _fake_rank(_, args, device_type, out):
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.fake_world)
    device = torch.device(device_type, 0) if device_type == "cuda" else torch.device("cpu")
    gen = torch.Generator().manual_seed(0)
    x, y = _to(batch_for(args.model, args.batch, args.seq, gen), device)
    rows = []
    for name in ("autoshard", "fsdp2"):
        model, opt = _system(name, args.model, device)
        _step(model, opt, x, y)
        peak = _peak(model, opt, x, y)
        pred = model.plan.predicted["peak_bytes"] if name == "autoshard" else None
        rows.append((name, peak, pred))
        del model, opt
    torch.save(rows, out)
    os._exit(0)


def main(argv=None):
    from tabulate import tabulate

    ap = parser("gpu", "hf-llama-wide", batch=8, seq=64, steps=20, reps=5, fake_world=8)
    ap.add_argument("--trace", default=None)
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(0)
    else:
        torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{tmp}/s",
                                rank=0, world_size=1)
        rows = world_one(args, device)
        dist.destroy_process_group()
    ref = {k: (ms, peak) for k, ms, peak in rows}
    name = torch.cuda.get_device_name(0) if cuda else "CPU"
    print(f"\n{args.model}, batch {args.batch}, seq {args.seq}, world size 1 on {name} "
          f"({'NCCL' if cuda else 'gloo'})")
    print(tabulate([(k, f"{ms:.2f}", f"{ms / ref['eager'][0]:.2f}", f"{ms / ref['fsdp2'][0]:.2f}",
                     f"{peak / MiB:.1f}", f"{peak / ref['fsdp2'][1]:.2f}")
                    for k, ms, peak in rows],
                   headers=["system", "step ms", "x eager", "x FSDP2", "peak MiB",
                            "x FSDP2"]))
    fake = fake_world(args, device)
    fsdp2 = next(p for k, p, _ in fake if k == "fsdp2")
    print(f"\nfaked world size {args.fake_world} (fake process group): peak per rank")
    print(tabulate([(k, f"{p / MiB:.1f}", f"{p / fsdp2:.2f}",
                     f"{pred / MiB:.1f}" if pred else "-") for k, p, pred in fake],
                   headers=["system", "peak MiB", "x FSDP2", "predicted MiB"]))
    return rows, fake


if __name__ == "__main__":
    main()

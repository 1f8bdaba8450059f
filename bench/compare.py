"""autoshard against FSDP2 and DDP on the same model, data and optimizer, in one run.

    python -m bench.compare --model gpt-small --world-size 2 --steps 20 --reps 5

Spawns the ranks itself (gloo on CPU, NCCL with one GPU per rank). Each repetition runs
``steps`` steps of every system, in a rotating order so that no system always goes first;
a step is forward, backward, AdamW step and zero_grad, started after a barrier.

Reported per system, on rank 0:
- step time: the median over every timed step of every repetition (the first step of each
  system's first repetition is warm-up and not timed);
- peak memory per rank: the bytes the model state holds when a step starts (parameters,
  gradients, buffers, optimizer state, the inputs; each storage once) plus the largest rise
  of the allocator's live bytes during one step, read from torch.profiler's allocation events
  (CPU) or torch.cuda's peak counter (GPU): the same method for all three systems. DDP's
  gradient buckets, allocated when DDP wraps the model, are outside that accounting;
- bytes sent per rank per step and collectives per step, counted in an untimed step where
  each system calls its collectives: autoshard's c10d functional ops (a dispatch mode), FSDP2's
  all_gather_single / reduce_scatter_single, DDP's bucket all-reduces (a comm hook). A ring
  all-gather or reduce-scatter of a buffer of S bytes sends S (N-1)/N per rank, an all-reduce
  2 S (N-1)/N;
- the ZeRO-3 bound 3 P (N-1)/N for P parameter bytes;
- the first step's time (not in the median): for autoshard it includes capture, the passes,
  planning and, with ``compile``, inductor's compilation of both graphs;
- for autoshard, one more step recorded (``model.record``): the time its collectives were in
  flight, and how much of it this rank computed through (hidden) rather than waited (the
  rest); ``--trace PATH`` writes that timeline as a Chrome trace.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

from autoshard import Prefetch
from autoshard.core.models import GPT, gpt_loss, tiny_hf
from bench import libmodels

VOCAB = 256
CLASSES = 10


# name -> the model, built from seed 0; the inputs each takes are in ``batch_for``
MODELS = {
    "gpt-small": lambda: GPT(vocab=VOCAB, dim=64, heads=4, layers=2, seq=64),
    "gpt-deep": lambda: GPT(vocab=VOCAB, dim=64, heads=4, layers=8, seq=64),
    "hf-llama": lambda: tiny_hf("llama", VOCAB, layers=4, hidden=128),
    "hf-gpt2": lambda: tiny_hf("gpt2", VOCAB, layers=4, hidden=128),
    # a wider Llama, whose parameters outweigh its activations at this batch (2.5M)
    "hf-llama-wide": lambda: tiny_hf("llama", VOCAB, layers=4, hidden=256),
    "hf-mixtral": lambda: tiny_hf("mixtral", VOCAB, layers=4, hidden=128),  # MoE, 4 experts
    "hf-t5": lambda: tiny_hf("t5", VOCAB, layers=3, hidden=128),  # encoder-decoder
    # vision transformer, 32 x 32 images in 4 x 4 patches
    "hf-vit": lambda: tiny_hf("vit", CLASSES, layers=4, hidden=128, image_size=32),
    # libraries of their own (bench/libmodels.py): torchtitan's llama3, x-transformers'
    # Llama-style decoder and its encoder-decoder, all width 128
    "tt-llama3": lambda: libmodels.titan_llama3(VOCAB),
    "x-llama": lambda: libmodels.x_llama(VOCAB),
    "x-encdec": lambda: libmodels.XEncoderDecoder(VOCAB),
}
# the library a model needs beyond torch and transformers: without it the model is skipped
REQUIRES = {"tt-llama3": "torchtitan", "x-llama": "x_transformers",
            "x-encdec": "x_transformers"}


def missing(name: str):
    """The module model ``name`` needs and this environment lacks, else None."""
    import importlib.util

    need = REQUIRES.get(name)
    return need if need and importlib.util.find_spec(need) is None else None


def batch_for(name, batch, seq, gen):
    """One step's (inputs, targets) for model ``name``: token sequences (a decoder-only LM,
    or T5 reading and writing the same sequence) or images with class labels. ``inputs``
    is a tensor (the positional input) or a dict (keyword inputs)."""
    if name == "hf-vit":
        return ({"pixel_values": torch.randn(batch, 3, 32, 32, generator=gen)},
                torch.randint(0, CLASSES, (batch,), generator=gen))
    tokens = torch.randint(0, VOCAB, (batch, seq + 1), generator=gen)
    x, y = tokens[:, :-1], tokens[:, 1:]
    if name == "hf-t5":
        return {"input_ids": x, "decoder_input_ids": x}, y
    if name == "x-encdec":
        return {"src": x, "tgt": x}, y
    return ({"input_ids": x} if name.startswith("hf") else x), y


BLOCK_LISTS = ("blocks", "model.layers", "transformer.h", "encoder.block", "decoder.block",
               "vit.layers", "vit.encoder.layer", "layers", "attn_layers.layers",
               "xt.encoder.attn_layers.layers", "xt.decoder.net.attn_layers.layers")


def _blocks(model):
    """The repeated blocks FSDP2 wraps one by one (every list of them the model has)."""
    found = []
    for name in BLOCK_LISTS:
        mod = model
        try:
            for part in name.split("."):
                mod = getattr(mod, part)
        except AttributeError:
            continue
        for blk in (mod.values() if isinstance(mod, torch.nn.ModuleDict) else mod):
            # x-transformers' entries are ModuleList([norms, layer, residual]), whose own
            # forward is never called: the attention or feed-forward layer is the block
            found.append(blk[1] if isinstance(blk, torch.nn.ModuleList) else blk)
    if not found:
        raise ValueError("no block list found")
    return found


def _loss(out, y):
    logits = out.logits if hasattr(out, "logits") else out
    if logits.dim() == 2:  # a classifier
        return torch.nn.functional.cross_entropy(logits, y)
    return gpt_loss(logits, y)


class _Count:
    """Bytes each rank sends and collectives it calls, counted at the calls."""

    def __init__(self, world):
        self.world, self.bytes, self.calls, self.on = world, 0, 0, False

    def add(self, nbytes, allreduce=False):
        if self.on:
            self.calls += 1
            self.bytes += nbytes * (2 if allreduce else 1) * (self.world - 1) // self.world


_GATHERS = (torch.ops._c10d_functional.all_gather_into_tensor_out.default,
            torch.ops._c10d_functional.all_gather_into_tensor.default)


class _FunctionalCount(TorchDispatchMode):
    def __init__(self, count):
        super().__init__()
        self.count = count

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _GATHERS:  # into a planned buffer, or (compiled graphs) a new one
            self.count.add(out.numel() * out.element_size())
        elif func is torch.ops._c10d_functional.reduce_scatter_tensor.default:
            self.count.add(args[0].numel() * args[0].element_size())
        return out


@contextlib.contextmanager
def _count_fsdp2(count):
    ag, rs = dist.all_gather_single, dist.reduce_scatter_single

    def ag_(output, *a, **k):
        count.add(output.numel() * output.element_size())
        return ag(output, *a, **k)

    def rs_(output, input, *a, **k):
        count.add(input.numel() * input.element_size())
        return rs(output, input, *a, **k)

    dist.all_gather_single, dist.reduce_scatter_single = ag_, rs_
    try:
        yield
    finally:
        dist.all_gather_single, dist.reduce_scatter_single = ag, rs


def _build(system, name, config):
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    from autoshard import Config, autoshard

    torch.manual_seed(0)
    model = MODELS[name]()
    count = _Count(dist.get_world_size())
    if system == "autoshard":
        model = autoshard(model, config=Config(**(config or {})))
        ctx = lambda: _FunctionalCount(count)  # noqa: E731
    elif system == "fsdp2":
        for blk in _blocks(model):
            fully_shard(blk)
        fully_shard(model)
        ctx = lambda: _count_fsdp2(count)  # noqa: E731
    else:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        model = DDP(model)

        def hook(state, bucket):
            count.add(bucket.buffer().numel() * bucket.buffer().element_size(), allreduce=True)
            return default_hooks.allreduce_hook(state, bucket)

        model.register_comm_hook(dist.group.WORLD, hook)
        ctx = contextlib.nullcontext
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, opt, count, ctx


def _forward(model, x):
    return model(**x) if isinstance(x, dict) else model(x)


def _tensors(x) -> list:
    return list(x.values()) if isinstance(x, dict) else [x]


def _step(model, opt, x, y):
    _loss(_forward(model, x), y).backward()
    opt.step()
    opt.zero_grad()


def _peak(model, opt, x, y):
    from autoshard.runtime.record import state_bytes

    base = state_bytes(model, opt) + sum(t.numel() * t.element_size()
                                         for t in (*_tensors(x), y))
    if y.is_cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        _step(model, opt, x, y)
        torch.cuda.synchronize()
        return base + torch.cuda.max_memory_allocated() - start
    from torch.profiler import ProfilerActivity, profile

    from autoshard.core._compat import allocation_events

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        _step(model, opt, x, y)
    live = peak = 0
    for _, d in allocation_events(prof):
        live += d
        peak = max(peak, live)
    return base + peak


def init_rank(rank, world, store, timeout=None) -> torch.device:
    """Join the ranks' process group (NCCL with one GPU per rank, else gloo; one thread per
    rank); returns this rank's device. ``timeout``: seconds a collective may wait."""
    import datetime

    torch.set_num_threads(1)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(rank)
    extra = {"timeout": datetime.timedelta(seconds=timeout)} if timeout else {}
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{store}",
                            rank=rank, world_size=world, **extra)
    return torch.device("cuda", rank) if cuda else torch.device("cpu")


def spawn(fn, args) -> object:
    """Run ``fn(rank, world, args, store, out_path)`` on ``args.world_size`` spawned ranks;
    returns what rank 0 saved at ``out_path``."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.pt")
        mp.spawn(fn, args=(args.world_size, args, os.path.join(tmp, "store"), out),
                 nprocs=args.world_size, join=True)
        return torch.load(out, weights_only=False)


def _rank(rank, world, args, store, out_path):
    device = init_rank(rank, world, store)
    cuda = device.type == "cuda"
    systems = {}
    for spec in args.systems.split(","):
        system, variant = system_of(spec), spec.partition(":")[2]
        config = dict(VARIANTS[variant]) if variant else {}
        systems[spec] = _build(system, args.model, config)
    gen = torch.Generator().manual_seed(rank)
    data = [_to(batch_for(args.model, args.batch, args.seq, gen), device) for _ in range(4)]
    times = {k: [] for k in systems}
    first = {}  # each system's first step: capture, planning (and compiling) for autoshard
    order = list(systems)
    for rep in range(args.reps):
        for name in order[rep % len(order):] + order[: rep % len(order)]:
            model, opt, count, ctx = systems[name]
            for i in range(args.steps):
                x, y = data[i % len(data)]
                dist.barrier()
                t0 = time.perf_counter()
                _step(model, opt, x, y)
                if cuda:
                    torch.cuda.synchronize()
                dt = time.perf_counter() - t0
                if rep or i:
                    times[name].append(dt)
                else:
                    first[name] = dt
    rows = {}
    for name, (model, opt, count, ctx) in systems.items():
        x, y = data[0]
        # counted and measured in steps of their own, so no counter slows a timed step
        count.on = True
        with ctx():
            _step(model, opt, x, y)
        count.on = False
        overlap, planned = {}, None
        if system_of(name) == "autoshard":  # the recorded timeline of one step
            planned = _planned(model.plan)
            with model.record(opt, *_tensors(x), y) as rec:
                _step(model, opt, x, y)
            overlap = rec.overlap()
            if args.trace and rank == 0 and name == args.systems.split(",")[0]:
                rec.to_chrome_trace(args.trace)
        peak = _peak(model, opt, x, y)
        params = sum(p.numel() * p.element_size() for p in MODELS[args.model]().parameters())
        rows[name] = {"ms": statistics.median(times[name]) * 1e3, "peak": peak,
                      "first_s": first[name],
                      "bytes": count.bytes, "calls": count.calls, "param_bytes": params,
                      "overlap": overlap, "plan": planned}
    gathered = [None] * world
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        torch.save(gathered, out_path)
    dist.barrier()
    # results are saved: skip the C++ teardown of gloo's and the profiler's threads, which
    # can abort at exit
    os._exit(0)


def _planned(plan) -> dict:
    """What the plan predicted: units, peak and step, FSDP2's plan's peak and step (absent
    with Config(prefer="speed")) and why it was chosen (``plan.choice``)."""
    p = plan.predicted
    return {"units": len(plan.units), "peak": p["peak_bytes"], "step_s": p["step_s"],
            "fsdp2_peak": p.get("fsdp2_peak_bytes"), "fsdp2_step_s": p.get("fsdp2_step_s"),
            "choice": plan.choice}


def _to(batch, device):
    x, y = batch
    x = {k: v.to(device) for k, v in x.items()} if isinstance(x, dict) else x.to(device)
    return x, y.to(device)


def system_of(spec: str) -> str:
    return spec.partition(":")[0]


# one change each against the default Config (policy auto, prefetch, recompute, the unit read
# last in forward kept gathered)
VARIANTS = {
    "module": {"policy": "module"},
    "module-noprefetch": {"policy": "module", "prefetch": False},
    "depth1": {"policy": "module", "prefetch": Prefetch(depth=1)},
    "depth4": {"policy": "module", "prefetch": Prefetch(depth=4)},
    "cap256k": {"policy": "module", "prefetch": Prefetch(bytes="256KiB")},
    "cap1m": {"policy": "module", "prefetch": Prefetch(bytes="1MiB")},
    "bucket": {"policy": "per-parameter", "bucket": True},
    "nobucket": {"policy": "per-parameter", "bucket": False},
    "reshard": {"reshard_after_forward": True},
    "norecompute": {"recompute": False},
    "whole": {"policy": "whole-model"},
    "compiled": {"compile": True},
}


def run(args) -> list:
    return spawn(_rank, args)


def parser(prog: str, model: str, **shape) -> argparse.ArgumentParser:
    """A benchmark's command line with the options every one takes: ``--model`` (of
    ``MODELS``) and, for each of ``shape``'s names (world_size, batch, seq, steps, reps), that
    option with the value as its default."""
    ap = argparse.ArgumentParser(prog=f"python -m bench.{prog}")
    ap.add_argument("--model", default=model, choices=list(MODELS))
    for name, default in shape.items():
        ap.add_argument("--" + name.replace("_", "-"), type=int, default=default)
    return ap


def main(argv=None):
    from tabulate import tabulate

    ap = parser("compare", "gpt-small", world_size=2, steps=20, reps=5, batch=8, seq=64)
    ap.add_argument("--systems", default="autoshard,fsdp2,ddp",
                    help="comma list; autoshard:VARIANT for " + ", ".join(VARIANTS))
    ap.add_argument("--trace", default=None,
                    help="write the first system's recorded step (autoshard) as a Chrome trace")
    args = ap.parse_args(argv)
    if missing(args.model):
        print(f"{args.model}: skipped, {missing(args.model)} is not installed "
              "(.ci/run installs it)")
        return {}
    per_rank = run(args)
    rows = per_rank[0]
    n = args.world_size
    bound = 3 * next(iter(rows.values()))["param_bytes"] * (n - 1) // n
    ref = rows.get("fsdp2")
    table = []
    for name, r in rows.items():
        peak = max(pr[name]["peak"] for pr in per_rank)
        ov = r["overlap"]
        table.append((name, f"{r['ms']:.2f}", f"{r['ms'] / ref['ms']:.2f}" if ref else "-",
                      f"{peak / 2**20:.2f}",
                      f"{peak / max(pr['fsdp2']['peak'] for pr in per_rank):.2f}" if ref else "-",
                      r["bytes"], r["calls"], bound,
                      f"{ov['in_flight_s'] * 1e3:.2f} / {ov['hidden_s'] * 1e3:.2f}" if ov else "-"))
    print(tabulate(table, headers=["system", "step ms (median)", "x FSDP2", "peak MiB/rank",
                                   "x FSDP2", "bytes sent/rank/step", "collectives/step",
                                   "ZeRO-3 bound", "comm ms in flight / hidden"]))
    return rows


if __name__ == "__main__":
    main()

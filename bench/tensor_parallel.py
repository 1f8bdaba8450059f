"""autoshard with a tensor-parallel plan against FSDP2 + TP applied as torchtitan applies it,
on one (dp, tp) mesh, the same model, plan, data and optimizer, in one run.

    python -m bench.tensor_parallel --dp 2 --tp 2 --steps 10 --reps 5

Spawns dp x tp ranks (gloo on CPU). The plan is Megatron's for a Hugging Face Llama: q, k, v,
gate and up column-wise, o and down row-wise. FSDP2 + TP: ``parallelize_module`` over "tp",
then ``fully_shard`` over "dp" per decoder layer and at the root. Each repetition runs
``steps`` steps of both systems, in alternating order; a step is forward, backward, AdamW
step and zero_grad, started after a barrier. Reported on rank 0, as ``bench.compare``
reports: the median step time over every timed step (the first step of each system is
warm-up), and the peak per rank (the state a step starts with plus the largest rise of the
allocator's live bytes during one step), the largest over the ranks.
"""

from __future__ import annotations

import os
import statistics
import time

import torch
import torch.distributed as dist

from bench.compare import VOCAB, _peak, _step, batch_for, init_rank, parser, spawn

LLAMA_PLAN = {f"model.layers.*.{name}": style for name, style in (
    ("self_attn.q_proj", "col"), ("self_attn.k_proj", "col"), ("self_attn.v_proj", "col"),
    ("self_attn.o_proj", "row"), ("mlp.gate_proj", "col"), ("mlp.up_proj", "col"),
    ("mlp.down_proj", "row"))}


def plan() -> dict:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {k: ColwiseParallel() if v == "col" else RowwiseParallel()
            for k, v in LLAMA_PLAN.items()}


def _build(system, args, mesh):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    from autoshard import Config, autoshard
    from autoshard.core.models import tiny_hf

    torch.manual_seed(0)
    model = tiny_hf("llama", VOCAB, layers=args.layers, hidden=args.hidden)
    if system == "autoshard":
        model = autoshard(model, mesh=mesh, config=Config(tensor_parallel=plan()))
    else:
        parallelize_module(model, mesh["tp"], plan())
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _rank(rank, world, args, store, out_path):
    from torch.distributed.device_mesh import init_device_mesh

    init_rank(rank, world, store)
    mesh = init_device_mesh("cpu", (args.dp, args.tp), mesh_dim_names=("dp", "tp"))
    systems = {name: _build(name, args, mesh) for name in ("autoshard", "fsdp2+tp")}
    gen = torch.Generator().manual_seed(mesh["dp"].get_local_rank())  # tp ranks: same rows
    data = [batch_for("hf-llama", args.batch, args.seq, gen) for _ in range(4)]
    times = {k: [] for k in systems}
    order = list(systems)
    for rep in range(args.reps):
        for name in order[rep % 2:] + order[: rep % 2]:
            model, opt = systems[name]
            for i in range(args.steps):
                x, y = data[i % len(data)]
                dist.barrier()
                t0 = time.perf_counter()
                _step(model, opt, x, y)
                if rep or i:
                    times[name].append(time.perf_counter() - t0)
    rows = {}
    for name, (model, opt) in systems.items():
        x, y = data[0]
        rows[name] = {"ms": statistics.median(times[name]) * 1e3,
                      "peak": _peak(model, opt, x, y)}
    gathered = [None] * world
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        torch.save(gathered, out_path)
    dist.barrier()
    os._exit(0)  # results saved: skip gloo's and the profiler's teardown, which can abort


def main(argv=None) -> dict:
    from tabulate import tabulate

    ap = parser("tensor_parallel", "hf-llama", dp=2, tp=2, steps=10, reps=5, batch=8,
                seq=64, layers=4, hidden=128)
    args = ap.parse_args(argv)
    args.world_size = args.dp * args.tp
    per_rank = spawn(_rank, args)
    ref = per_rank[0]["fsdp2+tp"]
    ref_peak = max(r["fsdp2+tp"]["peak"] for r in per_rank)
    table, out = [], {}
    for name, r in per_rank[0].items():
        peak = max(pr[name]["peak"] for pr in per_rank)
        out[name] = {"ms": r["ms"], "peak": peak}
        table.append((name, f"{r['ms']:.2f}", f"{r['ms'] / ref['ms']:.2f}",
                      f"{peak / 2**20:.2f}", f"{peak / ref_peak:.2f}"))
    print(f"hf-llama ({args.layers} layers, hidden {args.hidden}), batch {args.batch} x "
          f"{args.seq} per dp rank, mesh (dp {args.dp}, tp {args.tp})")
    print(tabulate(table, headers=["system", "step ms (median)", "x FSDP2+TP",
                                   "peak MiB/rank", "x FSDP2+TP"]))
    return out


if __name__ == "__main__":
    main()

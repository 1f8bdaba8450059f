"""What autoshard's runtime costs on the host: ATen ops per step and step time at world size 1.

    python -m bench.host_cost [--models mlp48,llama4,gpt-small,hf-llama] [--steps 10] [--reps 5]

In the launch-bound regime (small ops, where a GPU waits for the host) a step costs what the
host spends dispatching it. World size 1 on gloo, one thread, fp32, AdamW; systems: eager
(the plain module), autoshard (default Config) and FSDP2 (``fully_shard`` on each repeated
block, then on the root). Reported per model:

- ``eager ops``: the ATen ops eager dispatches in one forward and backward (a dispatch
  mode counts them);
- ``graph ops``: the ATen ops autoshard's compiled forward and backward graphs hold (their
  nodes, less ``getitem``, placeholders and the output), and their ratio to eager's;
- ``dispatched``: the ATen ops autoshard dispatches in the same forward and backward (the
  graphs' plus what runs around them);
- ``us/node``: the time in autoshard's two graphs over their ops, per step;
- step medians over ``--reps`` repetitions of ``--steps`` steps of every system in turn,
  rotating which goes first, and autoshard's and FSDP2's ratio to eager's;
- where the step goes (``--split``, a second table): medians of each part of the step
  (forward and loss, ``backward``, ``opt.step()``, ``zero_grad``), each part ended by a
  synchronize on a GPU (so that each is timed to its last kernel: the parts add up to more
  than the step, whose host work overlaps the GPU's across parts).

Models: ``mlp48`` (48 blocks of Linear(8, 8) and ReLU, batch 4), ``llama4`` (a 4-layer
Hugging Face Llama, hidden 32, batch 2 x 16), and any of ``bench.compare``'s (batch 8 x 64).
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import tempfile
import time
import warnings

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from bench import compare

SMALL = {"mlp48": 8, "llama4": 128}  # the launch-bound models: their output width


def _build(name):
    torch.manual_seed(0)
    if name == "mlp48":
        blocks = [torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
                  for _ in range(48)]
        return torch.nn.Sequential(*blocks), blocks
    if name == "llama4":
        from autoshard.core.models import tiny_hf

        model = tiny_hf("llama", SMALL[name], layers=4, hidden=32)
        return model, list(model.model.layers)
    model = compare.MODELS[name]()
    return model, compare._blocks(model)


def _batch(name, gen):
    if name == "mlp48":
        return torch.randn(4, 8, generator=gen), torch.randint(0, 8, (4,), generator=gen)
    if name == "llama4":
        tokens = torch.randint(0, SMALL[name], (2, 17), generator=gen)
        return {"input_ids": tokens[:, :-1]}, tokens[:, 1:]
    return compare.batch_for(name, 8, 64, gen)


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def _fwd_bwd_ops(model, x, y) -> int:
    with _Ops() as ops:
        compare._loss(compare._forward(model, x), y).backward()
    return ops.n


def graph_ops(program) -> int:
    """The ATen ops ``program``'s forward and backward graphs hold."""
    return sum(isinstance(n.target, torch._ops.OpOverload)
               for g in (program.split.fwd, program.split.bwd) if g is not None
               for n in g.graph.nodes if n.op == "call_function")


def _systems(name, device):
    from torch.distributed.fsdp import fully_shard

    from autoshard import autoshard

    out = {}
    for system in ("eager", "autoshard", "fsdp2"):
        model, blocks = _build(name)
        model.to(device)
        if system == "autoshard":
            model = autoshard(model)
        elif system == "fsdp2":
            for b in blocks:
                fully_shard(b)
            fully_shard(model)
        out[system] = (model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    return out


def _to(x, device):
    return {k: v.to(device) for k, v in x.items()} if isinstance(x, dict) else x.to(device)


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _mark(device) -> float:
    _sync(device)
    return time.perf_counter()


def measure(name: str, steps: int, reps: int, device=torch.device("cpu"),
            split: bool = False) -> dict:
    """``name``'s row: ops counted and steps timed on ``device`` (a GPU's steps end with a
    synchronize, so each is timed to its last kernel); with ``split``, under ``"split"``
    one row per system of the parts' medians (``_split``)."""
    from autoshard.runtime.executor import Program

    gen = torch.Generator().manual_seed(0)
    x, y = (_to(t, device) for t in _batch(name, gen))
    systems = _systems(name, device)
    for model, opt in systems.values():  # warm-up: capture, planning, first allocations
        for _ in range(3):
            compare._step(model, opt, x, y)
    row = {"model": name}
    eager, sharded = systems["eager"][0], systems["autoshard"][0]
    row["eager ops"] = _fwd_bwd_ops(eager, x, y)
    row["dispatched"] = _fwd_bwd_ops(sharded, x, y)
    for model, opt in systems.values():
        opt.zero_grad()
    row["graph ops"] = graph_ops(sharded._autoshard.last)
    row["x eager ops"] = round(row["graph ops"] / row["eager ops"], 2)

    in_graphs = [0.0]
    call = Program.call

    def timed_call(self, gm, *args):
        t0 = time.perf_counter()
        try:
            return call(self, gm, *args)
        finally:
            in_graphs[0] += time.perf_counter() - t0

    times = collections.defaultdict(list)
    names = list(systems)
    for rep in range(reps):
        for system in names[rep % len(names):] + names[: rep % len(names)]:
            model, opt = systems[system]
            if system == "autoshard":
                Program.call = timed_call
            try:
                for _ in range(steps):
                    _sync(device)
                    t0 = time.perf_counter()
                    compare._step(model, opt, x, y)
                    _sync(device)
                    times[system].append(time.perf_counter() - t0)
            finally:
                Program.call = call
    med = {s: statistics.median(t) for s, t in times.items()}
    if split:
        row["split"] = _split(systems, x, y, steps, reps, device)
    row["us/node"] = round(in_graphs[0] / len(times["autoshard"]) / row["graph ops"] * 1e6, 2)
    for s in names:
        row[f"{s} ms"] = round(med[s] * 1e3, 2)
    row["autoshard x eager"] = round(med["autoshard"] / med["eager"], 2)
    row["fsdp2 x eager"] = round(med["fsdp2"] / med["eager"], 2)
    return row


PARTS = ("forward", "backward", "opt.step", "zero_grad")


def _split(systems, x, y, steps, reps, device) -> list:
    """Per system, the medians (ms) of the step's parts, each ended by a synchronize."""
    times = {s: collections.defaultdict(list) for s in systems}
    names = list(systems)
    for rep in range(reps):
        for system in names[rep % len(names):] + names[: rep % len(names)]:
            model, opt = systems[system]
            for _ in range(steps):
                marks = [_mark(device)]
                loss = compare._loss(compare._forward(model, x), y)
                marks.append(_mark(device))
                loss.backward()
                marks.append(_mark(device))
                opt.step()
                marks.append(_mark(device))
                opt.zero_grad()
                marks.append(_mark(device))
                for p, a, b in zip(PARTS, marks, marks[1:]):
                    times[system][p].append(b - a)
    return [{"system": s, **{f"{p} ms": round(statistics.median(times[s][p]) * 1e3, 3)
                             for p in PARTS}} for s in names]


def main(argv=None) -> list:
    from tabulate import tabulate

    ap = argparse.ArgumentParser(prog="python -m bench.host_cost", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="mlp48,llama4,gpt-small,hf-llama")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--split", action="store_true",
                    help="also time the step's parts, each ended by a synchronize")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", module="torch.distributed")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 's')}",
                                rank=0, world_size=1)
        try:
            for name in args.models.split(","):
                rows.append(measure(name, args.steps, args.reps, split=args.split))
                print(tabulate([{k: v for k, v in r.items() if k != "split"} for r in rows],
                               headers="keys", tablefmt="github"), flush=True)
                if args.split:
                    print(tabulate([{"model": r["model"], **p} for r in rows
                                    for p in r["split"]], headers="keys", tablefmt="github"))
        finally:
            dist.destroy_process_group()
    return rows


if __name__ == "__main__":
    main()

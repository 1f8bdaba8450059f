"""What committing a write whole costs: a save and an export against DCP alone.

    python -m bench.writes [--reps 5] [--models gpt-small,hf-llama] [--world-size 2]

For each benchmark model (``bench.compare``'s) on ``world-size`` gloo ranks spawned here,
after one training step (so the optimizer holds its state), each repetition times, in turn:

- ``dcp.save`` of ``{"model": get_model_state_dict, "optim": get_optimizer_state_dict}`` to
  a new directory (what FSDP2 users write), against ``autoshard.save`` of the same state
  over the previous repetition's checkpoint (staged folder, the ranks' agreement, the
  marker's rename, the previous folder removed);
- ``dcp.load`` into the model's own tensors against ``autoshard.load_checkpoint`` (which
  reads into new tensors and copies them in once every rank read its part);
- ``dcp.save`` of the tensors an export stores against ``sharded.export`` over the previous
  repetition's export (programs, graphs, hashes of every file, the commit);
- ``autoshard.load`` of that export (manifest, every file's SHA-256, the checkpoint), and
  its first training step (reading and checking the program's graphs); the export's size.

Each time is the slowest rank's, between two barriers; the table shows medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
import warnings
from typing import Optional

import torch
import torch.distributed as dist

from bench.compare import MODELS, _forward, _loss, batch_for


def _timed(fn) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    took = torch.tensor([time.perf_counter() - t0])
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return took.item()


def _measure(rank: int, world: int, name: str, reps: int, root: str, out: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict,
                                                         get_optimizer_state_dict)

    import autoshard
    from autoshard.runtime.checkpoint import module_state

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = autoshard.autoshard(MODELS[name]())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = batch_for(name, 2, 32, torch.Generator().manual_seed(rank))
    _loss(_forward(model, x), y).backward()
    opt.step()

    def state():
        return {"model": get_model_state_dict(model),
                "optim": get_optimizer_state_dict(model, opt)}

    times: dict = {k: [] for k in ("dcp_save", "save", "dcp_load", "load", "dcp_tensors",
                                   "export", "export_load", "first_step")}
    for i in range(reps):
        times["dcp_save"].append(_timed(lambda: dcp.save(
            state(), checkpoint_id=f"{root}/dcp{i}")))
        times["save"].append(_timed(lambda: autoshard.save(f"{root}/ck", model, opt)))

        def plain_load():
            s = state()
            dcp.load(s, checkpoint_id=f"{root}/dcp{i}")

        times["dcp_load"].append(_timed(plain_load))
        times["load"].append(_timed(lambda: autoshard.load_checkpoint(f"{root}/ck", model,
                                                                      opt)))
        times["dcp_tensors"].append(_timed(lambda: dcp.save(
            {"tensors": module_state(model, every_buffer=True)},
            checkpoint_id=f"{root}/tensors{i}")))
        times["export"].append(_timed(lambda: model.export(f"{root}/ex", inference=False)))
        loaded = []
        times["export_load"].append(_timed(lambda: loaded.append(autoshard.load(f"{root}/ex"))))
        times["first_step"].append(_timed(lambda: _loss(_forward(loaded[0], x), y).backward()))
        del loaded
    if rank == 0:
        row = {k: statistics.median(v) for k, v in times.items()}
        torch.save(dict(row, model=name, mib=_mib(f"{root}/dcp0"), export_mib=_mib(
            f"{root}/ex", "manifest.json")), out)


def _mib(folder: str, marker: Optional[str] = None) -> float:
    """The bytes under ``folder``; with ``marker``, those of the write it names (and the
    marker), not the folders of earlier writes a loaded module still holds."""
    if marker is not None:
        with open(os.path.join(folder, marker)) as f:
            data = json.load(f)["data"]
        return (_mib(os.path.join(folder, data)) * 2**20 + os.path.getsize(
            os.path.join(folder, marker))) / 2**20
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(folder)
               for f in fs) / 2**20


def _rank(rank, world, names, reps, outdir):
    for name in names:
        with tempfile.TemporaryDirectory(dir=outdir) as root:
            dist.barrier()
            shared = os.path.join(outdir, f"{name}.root")
            if rank == 0:
                with open(shared, "w") as f:
                    f.write(root)
            dist.barrier()
            with open(shared) as f:
                root = f.read()
            _measure(rank, world, name, reps, root, os.path.join(outdir, f"{name}.pt"))


def run(names, reps: int, world: int) -> list:
    from autoshard.runtime.dist import spawn_ranks

    with tempfile.TemporaryDirectory() as outdir:
        spawn_ranks(world, _rank, names, reps, outdir)
        return [torch.load(os.path.join(outdir, f"{n}.pt")) for n in names]


def table(rows) -> str:
    from tabulate import tabulate

    def ms(s):
        return f"{1e3 * s:.0f}"

    return tabulate(
        [(r["model"], f"{r['mib']:.1f}", ms(r["dcp_save"]), ms(r["save"]),
          f"{r['save'] / r['dcp_save']:.2f}x", ms(r["dcp_load"]), ms(r["load"]),
          f"{r['load'] / r['dcp_load']:.2f}x", ms(r["dcp_tensors"]), ms(r["export"]),
          f"{r['export'] / r['dcp_tensors']:.2f}x", f"{r.get('export_mib', 0):.2f}",
          ms(r.get("export_load", 0)), ms(r.get("first_step", 0))) for r in rows],
        headers=["model", "MiB", "dcp.save ms", "autoshard.save ms", "ratio", "dcp.load ms",
                 "load_checkpoint ms", "ratio", "dcp.save (export's) ms", "export ms",
                 "ratio", "export MiB", "autoshard.load ms", "first step ms"],
        tablefmt="github")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--world-size", type=int, default=2)
    args = ap.parse_args(argv)
    print(table(run(args.models.split(","), args.reps, args.world_size)))


if __name__ == "__main__":
    main()

"""What each rank runs in the commit tests: saves and exports that a killed rank, a full disk
or an unwritable path interrupts, and the loads after them."""

from __future__ import annotations

import errno
import os
import signal

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn

import autoshard
from autoshard import Config
from autoshard.runtime import commit
from harness import outcome


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


X = torch.randn(4, 8, generator=torch.Generator().manual_seed(7))


def model_and_optimizer():
    torch.manual_seed(0)
    model = autoshard.autoshard(Net(), config=Config(timeout=30))
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


def step(model, opt):
    model(X).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def values(model, opt) -> dict:
    out = {f"p:{n}": p.full_tensor().clone() for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        out[f"m:{n}"] = opt.state[p]["exp_avg"].full_tensor().clone()
    return out



def _fail_writes_on(rank: int, how: str) -> None:
    """From now on DCP's file writer on ``rank`` kills this process or reports a full
    disk before writing its file."""
    writer = dcp.filesystem._FileSystemWriter
    real = writer.write_data

    def write_data(self, plan, planner):
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    if torch.distributed.get_rank() == rank:
        writer.write_data = write_data
    return real


def interrupted_worker(rank, world, payload):
    """A complete save and export; a step; then the ``case`` write killed on rank 1:
    over the checkpoint, over the export, to a fresh path, or rank 0 killed right after it
    committed an export (the write stands)."""
    root, case = payload
    model, opt = model_and_optimizer()
    step(model, opt)
    autoshard.save(f"{root}/ck", model, opt)
    model.export(f"{root}/ex", inference=False)
    before = {"values": values(model, opt), "out": model(X).detach()}
    step(model, opt)
    if case == "committed":
        real = commit._commit

        def commit_then_die(*args):
            real(*args)
            os.kill(os.getpid(), signal.SIGKILL)

        if rank == 0:
            commit._commit = commit_then_die
        return {"before": before,
                "error": outcome(lambda: model.export(f"{root}/ex2", inference=False))}
    _fail_writes_on(1, "kill")
    target = {"overwrite": f"{root}/ck", "export": f"{root}/ex", "fresh": f"{root}/new"}[case]
    if case == "export":
        write = lambda: model.export(target, inference=False)  # noqa: E731
    else:
        write = lambda: autoshard.save(target, model, opt)  # noqa: E731
    return {"before": before, "error": outcome(write)}


def reload_worker(rank, world, roots):
    """What loads from the paths the interrupted writes left (one dict per root)."""
    return {os.path.basename(root).rstrip("0123456789"): _reload(root) for root in roots}


def _reload(root):
    out = {}
    model, opt = model_and_optimizer()
    out["ck"] = outcome(lambda: autoshard.load_checkpoint(f"{root}/ck", model, opt))
    out["ck_values"] = values(model, opt) if out["ck"] == "ok" else None
    out["new"] = outcome(lambda: autoshard.load_checkpoint(f"{root}/new", model, opt))
    loaded = {}
    out["ex"] = outcome(lambda: loaded.update(m=autoshard.load(f"{root}/ex")))
    out["ex_out"] = loaded["m"](X).detach() if "m" in loaded else None
    if os.path.exists(f"{root}/ex2"):
        out["ex2"] = outcome(lambda: autoshard.load(f"{root}/ex2"))
    return out


def failed_write_worker(rank, world, root):
    """Writes that fail without a lost peer: the group stays whole, the earlier checkpoint
    and export stay loadable, and the next write succeeds."""
    model, opt = model_and_optimizer()
    step(model, opt)
    autoshard.save(f"{root}/ck", model, opt)
    model.export(f"{root}/ex", inference=False)
    saved = values(model, opt)
    step(model, opt)
    out = {}
    real = _fail_writes_on(1, "enospc")
    out["save_enospc"] = outcome(lambda: autoshard.save(f"{root}/ck", model, opt))
    out["export_enospc"] = outcome(lambda: model.export(f"{root}/ex", inference=False))
    dcp.filesystem._FileSystemWriter.write_data = real
    with open(f"{root}/afile", "w") as f:
        f.write("not a directory")
    out["unwritable"] = outcome(lambda: autoshard.save(f"{root}/afile/ck", model, opt))
    out["foreign"] = outcome(lambda: autoshard.save(root, model, opt))
    out["paths"] = outcome(lambda: autoshard.save(f"{root}/ck{rank}", model, opt))
    out["listing"] = sorted(os.listdir(f"{root}/ck"))
    fresh, fresh_opt = model_and_optimizer()
    out["kept"] = outcome(lambda: autoshard.load_checkpoint(f"{root}/ck", fresh, fresh_opt))
    out["kept_equal"] = all(torch.equal(a, b) for a, b in
                            zip(saved.values(), values(fresh, fresh_opt).values()))
    out["again"] = outcome(lambda: autoshard.save(f"{root}/ck", model, opt))
    now = values(model, opt)
    out["again_equal"] = (outcome(lambda: autoshard.load_checkpoint(f"{root}/ck", fresh,
                                                                    fresh_opt)) == "ok" and
                          all(torch.equal(a, b) for a, b in
                              zip(now.values(), values(fresh, fresh_opt).values())))
    out["swept"] = sorted(os.listdir(f"{root}/ck"))
    return out


def fake_backend_worker(rank, world, path):
    """An export loaded into torch's fake process group, whose collectives move nothing."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    return outcome(lambda: autoshard.load(path))

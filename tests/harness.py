"""Run a function on N gloo ranks (spawned processes) and collect what each rank returns; and
what tests of one rank and of many share: an eager model and its sharded twin, a training step
whose loss is averaged over the ranks."""

from __future__ import annotations

import os
import socket
import tempfile
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rankpool import RankPool


def _entry(rank, world, fn, payload, tmp, port):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    if port is None:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank,
                                world_size=world)
    else:  # a torchrun environment: autoshard() creates the process group itself
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    out = fn(rank, world, payload)
    torch.save(out, os.path.join(tmp, f"result{rank}.pt"))
    try:
        dist.barrier()
    except RuntimeError:  # a fault test left the group broken (a timed-out peer)
        pass
    if port is None and dist.is_initialized():  # our group: destroy it, as a script must
        dist.destroy_process_group()
    # else autoshard created it and destroys it at exit; the rank exits as a script does


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(world: int, fn, payload=None, *, torchrun_env: bool = False,
              fresh: bool = False) -> list:
    """``fn(rank, world, payload)`` on ``world`` processes; returns each rank's result.

    By default the ranks are the session's pooled processes for ``world`` (see ``RankPool``),
    each call in a process group of its own. ``fresh``: newly spawned processes instead, for a
    call that kills a rank, breaks or replaces its group, or patches a module it does not
    restore. With ``torchrun_env`` (always fresh) the ranks get torchrun's variables instead
    of a process group."""
    if not (fresh or torchrun_env or os.environ.get("AUTOSHARD_TEST_SPAWN")):
        return RankPool.get(world).run(fn, payload)
    port = _free_port() if torchrun_env else None
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_entry, args=(world, fn, payload, tmp, port), nprocs=world, join=True)
        return [torch.load(os.path.join(tmp, f"result{r}.pt"), weights_only=False)
                for r in range(world)]


def eager_and_sharded(build):
    """Two models from ``build()`` after ``torch.manual_seed(0)``: the first eager, the second
    given its values and sharded by ``autoshard`` at world size 1."""
    from autoshard import autoshard

    torch.manual_seed(0)
    ref, model = build(), build()
    model.load_state_dict(ref.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # world size 1 says so
        sharded = autoshard(model)
    return ref, sharded


def train_step(loss, opt, world: int) -> float:
    """Backward ``loss``, step ``opt`` and zero its gradients; the loss averaged over the
    ``world`` ranks (each rank's value summed as a float32 on the host)."""
    loss.backward()
    opt.step()
    opt.zero_grad()
    # on the group's device: an NCCL group (a torchrun environment with GPUs) has no CPU
    # backend
    nccl = "nccl" in str(dist.get_backend())
    t = torch.tensor([loss.item()], device="cuda" if nccl else "cpu")
    dist.all_reduce(t)
    return t.item() / world


def outcome(fn) -> str:
    """``"ok"`` if ``fn()`` returned, ``"AutoshardError: ..."`` if it raised that, otherwise
    ``"escaped <type>: ..."``: what a rank reports of a call a test expects to be refused."""
    from autoshard.errors import AutoshardError

    try:
        fn()
        return "ok"
    except AutoshardError as e:
        return f"AutoshardError: {e}"
    except BaseException as e:  # noqa: BLE001 - the test names what escaped
        return f"escaped {type(e).__name__}: {e}"

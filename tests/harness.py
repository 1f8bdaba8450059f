"""Run a function on N gloo ranks (pooled or spawned processes) and collect what each rank
returns; and what tests of one rank and of many share: an eager model and its sharded twin,
a training step whose loss is averaged over the ranks, and the one training loop (``train``)
that every worker file runs its sharded models and their eager references with."""

from __future__ import annotations

import os
import socket
import tempfile
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rankpool import RankPool, as_a_new_process


def _entry(rank, world, fn, payload, tmp, port, env):
    as_a_new_process(env)
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
    call that kills a rank, breaks or replaces its group, or needs a process that ran nothing
    before (a load of an export whose module is gone, a resume). With ``torchrun_env``
    (always fresh) the ranks get torchrun's variables instead of a process group."""
    if not (fresh or torchrun_env or os.environ.get("AUTOSHARD_TEST_SPAWN")):
        return RankPool.get(world).run(fn, payload)
    port = _free_port() if torchrun_env else None
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_entry, args=(world, fn, payload, tmp, port, dict(os.environ)), nprocs=world,
                 join=True, start_method="forkserver")
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
    return mean_over_ranks(loss.item(), world)


def outcome(fn) -> str:
    """``"ok"`` if ``fn()`` returned, ``"AutoshardError: ..."`` if it raised that, otherwise
    ``"escaped <type>: ..."``: what a rank reports of a call a test expects to be refused."""
    from autoshard.core.errors import AutoshardError

    try:
        fn()
        return "ok"
    except AutoshardError as e:
        return f"AutoshardError: {e}"
    except BaseException as e:  # noqa: BLE001 - the test names what escaped
        return f"escaped {type(e).__name__}: {e}"


@dataclass(frozen=True)
class Recipe:
    """What a test trains: ``build()`` the model (seeded: the same values on every call),
    ``data(step)`` that step's global batch, a tuple of tensors (each rank its rows of
    each), ``loss(model, *share)`` on a share of it, ``steps`` optimizer steps of
    ``optimizer(params)``, each over ``accumulate`` micro-batches per rank; ``seed(step,
    rank)``, if given, runs before each share's forward (the same dropout masks in eager
    and sharded). ``divide(step)``: what the gradients summed over the ranks are divided by
    at that step, and the reported loss with them (None: the world size, their mean)."""

    build: Callable[[], Any]
    data: Callable[[int], tuple]
    loss: Callable[..., torch.Tensor]
    steps: int
    optimizer: Callable[[Any], torch.optim.Optimizer]
    accumulate: int = 1
    seed: Optional[Callable[[int, int], None]] = None
    divide: Optional[Callable[[int], float]] = None


def train(model, recipe: Recipe, rank: int = 0, world: int = 1, *, eager: bool = False,
          local: bool = False, before_step=None, after_backward=None) -> list:
    """Train ``model`` by ``recipe``; each step's loss of the global batch.

    Sharded (the default): this rank's share of each batch, all micro-batches but the last
    without gradient sync; the loss averaged over the ranks. ``eager``: the reference in one
    process, every rank's share in turn, each loss divided by the world size (or by
    ``recipe.divide``), so that the summed gradients are the ranks' mean, what data-parallel
    training computes. ``local``: each rank's own loss (no collective).
    ``before_step(step, model)`` runs before a step's forwards (a setting switched mid-run),
    ``after_backward(step, i, model)`` after each backward, the ``i``-th of the step in this
    process (the last one runs before the optimizer step: gradients to read or clip)."""
    opt = recipe.optimizer(model.parameters())
    k = recipe.accumulate
    losses = []
    for step in range(recipe.steps):
        divide = world if recipe.divide is None else recipe.divide(step)
        scale = divide * k if eager else k
        if before_step is not None:
            before_step(step, model)
        batch = recipe.data(step)
        total, i = 0.0, 0
        for r in range(world) if eager else [rank]:
            shares = zip(*(t.chunk(world)[r].chunk(k) for t in batch))
            for micro, share in enumerate(shares):
                if k > 1 and not eager:
                    model.set_requires_gradient_sync(micro == k - 1)
                if recipe.seed is not None:
                    recipe.seed(step, r)
                loss = recipe.loss(model, *share)
                loss = loss / scale if scale != 1 else loss
                loss.backward()
                total += loss.item()
                if after_backward is not None:
                    after_backward(step, i, model)
                i += 1
        opt.step()
        opt.zero_grad()
        losses.append(total if eager or local else mean_over_ranks(total, divide))
    return losses


def mean_over_ranks(value: float, world: int) -> float:
    """``value`` summed over the ranks (as a float32 on the host), divided by ``world``."""
    # on the group's device: an NCCL group (a torchrun environment with GPUs) has no CPU
    # backend
    nccl = "nccl" in str(dist.get_backend())
    t = torch.tensor([value], device="cuda" if nccl else "cpu")
    dist.all_reduce(t)
    return t.item() / world


def reference(recipe: Recipe, world: int = 1, **kwargs) -> tuple:
    """The eager reference of ``recipe`` on ``world`` ranks, in one process: its losses and
    its final state (parameters and buffers)."""
    model = recipe.build()
    losses = train(model, recipe, 0, world, eager=True, **kwargs)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def train_sharded(recipe: Recipe, shard, rank: int, world: int, **kwargs) -> tuple:
    """``shard(recipe.build())`` (autoshard or FSDP2 around the model) trained by ``recipe``
    on this rank: the sharded model and its losses."""
    model = shard(recipe.build())
    return model, train(model, recipe, rank, world, **kwargs)

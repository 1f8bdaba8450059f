"""What each rank runs in the tests of writes to parameters between calls: the ways a training
loop writes its parameters outside the optimizer, each between two calls of a ZeRO-1 model
(which keeps a full replica of each parameter from call to call)."""

from __future__ import annotations

import torch
from torch.distributed.tensor import distribute_tensor

from autoshard import Config, autoshard
from harness import train
from models import build, call
from parity_workers import batches, recipe


def _values(p, seed):
    """A DTensor like ``p`` (same mesh and placements) with new values, equal on every rank."""
    g = torch.Generator().manual_seed(seed)
    full = 0.05 * torch.randn(p.shape, generator=g, dtype=p.dtype)
    return distribute_tensor(full, p.device_mesh, p.placements)


def _swap(model, others):
    for (_, p), o in zip(model.named_parameters(), others):
        torch.utils.swap_tensors(p, o)


# kind -> fn(model, rank, state): writes the model's parameters (``state`` keeps what a
# later write needs). Each is a way a training loop writes outside the optimizer.
def _mul(model, rank, state):
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)


def _copy(model, rank, state):
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.copy_(_values(p, i))


def _ema_in(model, rank, state):
    """Validation with EMA weights: swap them in (``swap_tensors``, what ``p.data = ...``
    does for a plain tensor); ``_ema_out`` swaps the trained ones back."""
    ema = [torch.nn.Parameter(_values(p, 100 + i)) for i, p in enumerate(model.parameters())]
    _swap(model, ema)
    state["ema"] = ema  # now holds the trained weights


def _ema_out(model, rank, state):
    _swap(model, state.pop("ema"))


def _load(model, rank, state):
    full = model.full_state_dict()
    model.load_state_dict({k: v * 0.25 + 0.01 for k, v in full.items()})


def _local(model, rank, state):
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().add_(0.01)


def _one_rank(model, rank, state):
    """A write on rank 0 only (a bug under data parallelism, but one the step must not hang
    on): every rank reads the parameter its shards make, as FSDP2 gathers it."""
    if rank == 0:
        with torch.no_grad():
            next(model.parameters()).mul_(3.0)


def _data(model, rank, state):
    """``p.data = x`` and ``vector_to_parameters`` (which does that) leave a DTensor
    parameter as it was (torch's DTensor keeps its local tensor); the next call reads what
    the parameters hold, as the others."""
    for i, p in enumerate(model.parameters()):
        p.data = _values(p, 200 + i)
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    torch.nn.utils.vector_to_parameters(torch.zeros(n), params)


WRITES = {"mul_": _mul, "copy_": _copy, "ema_in": _ema_in, "ema_out": _ema_out,
          "load_state_dict": _load, "to_local": _local, "one_rank": _one_rank, "data": _data}


def writes_worker(rank, world, names):
    """Per model: a training step, then each write between two calls; for each, the largest
    difference of the second call's output from eager on the parameters as they now are
    (``full_state_dict``, gathered from the shards), and whether the write changed them.
    The call after a write runs with gradients for every other write, without for the
    others."""
    out = {}
    for name in names:
        sharded = autoshard(build(name), config=Config(policy="module", strategy="zero1",
                                                       verify=True))
        ref = build(name)
        train(sharded, recipe(name, steps=1, lr=1e-2), rank, world, local=True)
        xr = batches(name, 0)[0].chunk(world)[rank]
        state = {}
        for k, (kind, write) in enumerate(WRITES.items()):
            with torch.no_grad():
                call(name, sharded, xr)  # the replicas are current
            before = sharded.full_state_dict()
            write(sharded, rank, state)
            now = sharded.full_state_dict()
            changed = max((now[f] - before[f]).abs().max().item() for f in now)
            ref.load_state_dict(now)
            with torch.set_grad_enabled(k % 2 == 0):
                got = call(name, sharded, xr)
                want = call(name, ref, xr)
            got, want = (getattr(o, "logits", o) for o in (got, want))
            out[(name, kind)] = ((got - want).abs().max().item(), changed)
    return out

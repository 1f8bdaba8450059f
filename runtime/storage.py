"""Sharded storage: parameters become DTensor Shard(0) on the mesh, FSDP2's layout."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from autoshard.passes.collectives import ShardLayout
from autoshard.runtime import optim


def parameter_owners(model: torch.nn.Module) -> dict:
    """id(parameter) -> [(module, attribute name)], over every (tied) reference."""
    owners = {}
    for mod in model.modules():
        for name, p in mod._parameters.items():
            if p is not None:
                owners.setdefault(id(p), []).append((mod, name))
    return owners


def fqn_aliases(model: torch.nn.Module) -> dict:
    """Every parameter name (tied ones too) -> the canonical (first) FQN."""
    first = {}
    out = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        first.setdefault(id(p), name)
        out[name] = first[id(p)]
    return out


def _contiguous_stride(shape) -> tuple:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(stride))


def shard_module(model: torch.nn.Module, mesh, device: torch.device) -> None:
    """Replace every parameter by a DTensor parameter holding this rank's rows.

    Rows are split as ``torch.chunk`` does (ceil(dim0/N) per rank; the last ranks may hold
    fewer or none), exactly as DTensor and FSDP2 store uneven shards. Scalars are replicated.
    Tied parameters stay tied (one DTensor, every reference). Buffers move to ``device``.
    Each rank keeps only its own rows; the full tensor is released as the model drops it.
    """
    rank, world = mesh.get_local_rank(), mesh.size()
    owners = parameter_owners(model)
    done = set()
    for _, p in list(model.named_parameters()):
        if id(p) in done:
            continue
        done.add(id(p))
        if isinstance(p, DTensor):
            raise ValueError("the model's parameters are already DTensors; autoshard it once")
        lay = ShardLayout(p.shape, world)
        if lay.sharded:
            a, b = lay.local_range(rank)
            if p.device.type == "meta":
                local = torch.empty((b - a, *lay.inner), dtype=p.dtype, device=device)
            else:
                local = p.detach()[a:b].to(device, copy=True).contiguous()
            dt = DTensor.from_local(
                local, mesh, [Shard(0)], run_check=False, shape=p.shape,
                stride=_contiguous_stride(p.shape),
            )
        else:
            dt = DTensor.from_local(p.detach().to(device, copy=True), mesh, [Replicate()],
                                    run_check=False)
        new = torch.nn.Parameter(dt, requires_grad=p.requires_grad)
        optim.mark(new)
        for mod, name in owners[id(p)]:
            mod._parameters[name] = new
    for mod in model.modules():
        for name, b in mod._buffers.items():
            if b is not None and b.device != device:
                mod._buffers[name] = b.to(device)


def full_state_dict(model: torch.nn.Module) -> dict:
    """The model's state dict with every DTensor gathered to a full tensor (on every rank)."""
    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach()
        for k, v in model.state_dict().items()
    }

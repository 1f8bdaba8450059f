"""Checkpoints of a sharded model.

autoshard stores every parameter as FSDP2 does (a DTensor ``Shard(0)`` slice, ``torch.chunk``
rows), so torch.distributed.checkpoint (DCP) and its state-dict helpers
(``get_model_state_dict`` / ``set_model_state_dict`` / ``get_optimizer_state_dict`` /
``set_optimizer_state_dict``) work on the model unchanged, at the same or another world size.
``save`` and ``load`` below are that recipe and nothing more.

What a plain ``sharded.load_state_dict(sd)`` needs on top is here (``localize_state_dict``,
called by ``ShardedModule``): a full tensor loads as this rank's rows, and a DTensor shard
written by another rank or at another world size (a per-rank ``torch.save`` file) is refused.
The rank that wrote a shard is read from the DTensor itself: a pickled DeviceMesh keeps the
coordinate of the process that pickled it, so the state-dict keys stay as they are.
"""

from __future__ import annotations

import itertools

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

_HOW = (
    "A per-rank state dict (torch.save(sharded.state_dict())) loads only on the rank and world "
    "size that saved it; to change either, save with torch.distributed.checkpoint (dcp.save of "
    "get_model_state_dict and get_optimizer_state_dict; then dcp.load, set_model_state_dict "
    "and set_optimizer_state_dict), or load full tensors (sharded.full_state_dict())."
)


def save(checkpoint_id, model: torch.nn.Module, optimizer=None) -> None:
    """``dcp.save`` of the model (and the optimizer's) state under ``"model"`` (``"optim"``),
    as FSDP2 users write it. Every rank calls it."""
    import torch.distributed.checkpoint as dcp

    dcp.save(_state(model, optimizer), checkpoint_id=checkpoint_id)


def load(checkpoint_id, model: torch.nn.Module, optimizer=None) -> None:
    """Load what ``save`` wrote, at this or another world size, into the model's parameters
    (and the optimizer's state) in place. Every rank calls it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    state = _state(model, optimizer)
    dcp.load(state, checkpoint_id=checkpoint_id)
    set_model_state_dict(model, state["model"])
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state["optim"])


def _state(model, optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    state = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        state["optim"] = get_optimizer_state_dict(model, optimizer)
    return state


def localize_state_dict(model: torch.nn.Module, state_dict: dict, prefix: str = "") -> None:
    """Rewrite in place the entries of ``state_dict`` (keys ``prefix + name``) that load into
    ``model``'s DTensor parameters and buffers, before ``nn.Module`` copies them:

    - a plain tensor of the full shape becomes this rank's rows (a DTensor with the
      parameter's mesh and placements; no communication);
    - a DTensor must be this rank's shard at this world size (same mesh size, placements,
      mesh coordinate and local shape); otherwise ValueError naming the key, before anything
      is copied;
    - a plain tensor of another shape is refused the same way (a local shard does not say
      whose rows it holds).

    Keys missing from ``state_dict`` or not naming a DTensor are left to ``nn.Module``
    (``strict`` and its missing / unexpected keys work as usual).
    """
    named = itertools.chain(model.named_parameters(remove_duplicate=False),
                            model.named_buffers(remove_duplicate=False))
    problems = []
    for name, target in named:
        key = prefix + name
        if not isinstance(target, DTensor) or key not in state_dict:
            continue
        value = state_dict[key]
        if isinstance(value, DTensor):
            why = _foreign(value, target)
        elif isinstance(value, torch.Tensor):
            why = None if value.shape == target.shape else (
                f"is a plain tensor of shape {tuple(value.shape)}, but the parameter is "
                f"sharded from the full shape {tuple(target.shape)}: pass the full tensor "
                "(each rank keeps its own rows) or this rank's DTensor shard")
            if why is None:
                state_dict[key] = distribute_tensor(
                    value.detach(), target.device_mesh, target.placements, src_data_rank=None)
        else:
            continue
        if why is not None:
            problems.append((key, why))
    if problems:
        key, why = problems[0]
        more = f" (and {len(problems) - 1} more keys)" if len(problems) > 1 else ""
        raise ValueError(f"cannot load {key!r}{more}: it {why}. {_HOW}")


def _foreign(value: DTensor, target: DTensor):
    """Why ``value`` is not this rank's shard of ``target`` at this world size, or None."""
    src, dst = value.device_mesh, target.device_mesh
    if src.size() != dst.size():
        return (f"is a shard saved at world size {src.size()}, and this model is sharded over "
                f"{dst.size()} ranks")
    if tuple(value.placements) != tuple(target.placements):
        return (f"has placements {tuple(value.placements)}, and the parameter "
                f"{tuple(target.placements)}")
    mine = dst.get_coordinate()
    theirs = src.get_coordinate()
    if theirs != mine and not all(p.is_replicate() for p in target.placements):
        whose = f"rank {theirs[0]}" if theirs else "no rank of this mesh"
        return (f"is the shard of {whose} (of {src.size()}), and this is rank {mine[0]}")
    if value.shape == target.shape and value.to_local().shape != target.to_local().shape:
        return (f"holds {tuple(value.to_local().shape)} local rows, and this rank's shard is "
                f"{tuple(target.to_local().shape)}")
    return None

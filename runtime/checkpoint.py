"""Checkpoints of a sharded model.

autoshard stores every parameter as FSDP2 does (a DTensor ``Shard(0)`` slice, ``torch.chunk``
rows), so torch.distributed.checkpoint (DCP) and its state-dict helpers
(``get_model_state_dict`` / ``set_model_state_dict`` / ``get_optimizer_state_dict`` /
``set_optimizer_state_dict``) work on the model unchanged, at the same or another world size.

``save`` and ``load`` (what ``autoshard.save`` / ``autoshard.load_checkpoint`` run, handed the
model's agreement of its ranks) are that recipe, committed whole (``autoshard.runtime.commit``):
the checkpoint directory holds ``checkpoint.json`` and the DCP folder it names. An
interrupted save, over a fresh path or over an earlier checkpoint, never loads as a mix: the
earlier checkpoint stays whole and is what loads, or the load says the path is incomplete.
A load reads into new tensors and copies them into the model and the optimizer only once
every rank read its part, so a failed load leaves both as they were. Above one rank a save
also keeps each rank's own buffers (``RANK_BUFFERS``), which a load at that world size
restores; a parameter without optimizer state (never stepped) loads without any.

What a plain ``sharded.load_state_dict(sd)`` needs on top is here (``localize_state_dict``,
called by ``ShardedModule``): a full tensor loads as this rank's rows, and a DTensor shard
written by another rank or at another world size (a per-rank ``torch.save`` file) is refused.
The rank that wrote a shard is read from the DTensor itself: a pickled DeviceMesh keeps the
coordinate of the process that pickled it, so the state-dict keys stay as they are.
"""

from __future__ import annotations

import itertools
import os
import time
import warnings

import torch
from torch.distributed.tensor import DTensor, distribute_tensor
from autoshard.core._compat import pytree

from autoshard.core import progress
from autoshard.core.errors import AutoshardError
from autoshard.runtime import commit, commit_files, commit_ranks, dcpio

MARKER = "checkpoint.json"
# each rank's buffers, saved under this name and its rank at world sizes above 1 (and named
# once in the marker's contents): a resume at that world size gives each rank its own
RANK_BUFFERS = "buffers_of_rank"
FORMAT = "autoshard-checkpoint"
VERSION = 2  # 2: each file's SHA-256 beside its size
READS = (1, 2)
_FIELDS = {"format": str, "version": int, "torch": str, "autoshard": str, "world_size": int,
           "contents": list, "files": dict, "data": str}

_HOW = (
    "A per-rank state dict (torch.save(sharded.state_dict())) loads only on the rank and world "
    "size that saved it; to change either, save with autoshard.save(path, sharded, optimizer) "
    "and load with autoshard.load_checkpoint(path, sharded, optimizer) (torch.distributed."
    "checkpoint underneath), or load full tensors (sharded.full_state_dict())."
)


def save(path, model: torch.nn.Module, agreement, optimizer=None) -> None:
    """``autoshard.save`` (``autoshard/front/files.py``, whose docstring is the contract) over
    ``agreement``'s ranks (``runtime.dist.Agreement``), committed whole."""
    with progress.phase("saving a checkpoint"):
        _save(path, model, agreement, optimizer)


def _save(path, model: torch.nn.Module, agreement, optimizer) -> None:
    state = _state(model, optimizer)
    contents = sorted(state)
    buffers = _rank_buffers(model) if agreement.world > 1 else {}
    if buffers:  # each rank's own copy beside rank 0's in "model"
        state[f"{RANK_BUFFERS}{agreement.rank}"] = buffers
        contents.append(RANK_BUFFERS)

    def document(folder, files):
        return {"format": FORMAT, "version": VERSION, "torch": torch.__version__,
                "autoshard": commit_files.version(), "world_size": agreement.world,
                "contents": contents, "files": files,
                "written": time.strftime("%Y-%m-%dT%H:%M:%S%z")}

    commit.write(path, "checkpoint", MARKER, agreement,
                 lambda folder: dcpio.save(state, folder, agreement.group),
                 document, other_markers=("manifest.json",))


def load(path, model: torch.nn.Module, agreement, optimizer=None, *,
         strict: bool = True) -> dcpio.IncompatibleKeys:
    """``autoshard.load_checkpoint`` (``autoshard/front/files.py``, whose docstring is the contract)
    over ``agreement``'s ranks, read under ``commit.reading`` so a save to the path meanwhile
    does not disturb it."""
    with progress.phase("loading a checkpoint"), commit.reading(
            path, MARKER, agreement, "load of a checkpoint"):
        return _load(path, model, agreement, optimizer, strict)


def _load(path, model: torch.nn.Module, agreement, optimizer,
          strict: bool) -> dcpio.IncompatibleKeys:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_optimizer_state_dict,
    )

    path = os.path.abspath(os.fspath(path))
    folder, doc = _folder(path)
    if doc is not None and optimizer is not None and "optim" not in doc["contents"]:
        raise AutoshardError(f"{path} holds no optimizer state (it was saved without an "
                             "optimizer); load it without one, or save with the optimizer")
    agreement("load of a checkpoint", f"{path}: {doc['data'] if doc else 'plain DCP'}",
              explain=lambda seen: commit_ranks.differ("load of a checkpoint", seen))
    if doc is not None:  # each file hashed by one rank
        commit_files.verify(folder, doc["files"], doc["world_size"], "checkpoint", agreement)
    state = _state(model, optimizer)
    own = f"{RANK_BUFFERS}{agreement.rank}"
    if doc is not None and RANK_BUFFERS in doc["contents"]:
        if doc["world_size"] == agreement.world:
            state[own] = _rank_buffers(model)
        elif agreement.rank == 0:
            warnings.warn(
                f"{path} was saved at world size {doc['world_size']} with each rank's own "
                f"buffers; at world size {agreement.world} every rank loads rank 0's copy "
                f"(of {', '.join(sorted(_rank_buffers(model))[:4])}...). Training continues "
                "exactly only at the world size that saved it.", stacklevel=4)
    state = pytree.tree_map_only(torch.Tensor, lambda t: t.detach().clone(), state)
    if optimizer is not None:
        _without_unsaved_state(state["optim"], folder)
    skipped = []
    files = None if doc is None else set(doc["files"])
    outcome = commit_ranks.attempt(lambda: skipped.append(dcpio.load(
        state, folder, agreement.group, files=files, strict=strict, where=path)),
        agreement.rank)
    commit_ranks.settle(agreement, outcome, f"load of the checkpoint {path}",
                  "the model and the optimizer are as they were")
    with torch.no_grad():
        for fqn, t in module_state(model).items():
            t.copy_(state.get(own, state["model"]).get(fqn, state["model"][fqn]))
    if optimizer is not None:  # a parameter without state (never stepped) gets none
        set_optimizer_state_dict(model, optimizer, state["optim"],
                                 options=StateDictOptions(strict=False))
    return skipped[0]


def _without_unsaved_state(optim: dict, folder: str) -> None:
    """Drop from ``optim`` (the optimizer state to read) the state of each parameter that the
    checkpoint holds (``model.<fqn>``) but holds no optimizer state for: one that never got
    a gradient, whose optimizer had no state for it, as eager ``torch.optim`` state dicts
    hold none (a fresh optimizer's template, which DCP's helper fills for every parameter,
    would otherwise ask for it). A parameter the checkpoint does not hold stays asked for,
    so a strict load still refuses another model's checkpoint."""
    where = os.path.join(folder, dcpio.METADATA)
    if not os.path.isfile(where):
        return
    held = dcpio.read_metadata(where).state_dict_metadata
    stated = {k[len("optim.state."):] for k in held if k.startswith("optim.state.")}
    for fqn in [f for f in optim.get("state", {}) if f"model.{f}" in held]:
        if not any(k.startswith(fqn + ".") for k in stated):
            del optim["state"][fqn]


def _folder(path: str):
    """The DCP folder to read and the marker (None for a plain DCP checkpoint), its fields
    checked (not yet its files: ``commit_files.verify``)."""
    if os.path.isfile(os.path.join(path, ".metadata")) and not os.path.exists(
            os.path.join(path, MARKER)):
        return path, None
    doc = commit.read_marker(path, MARKER, "checkpoint", _FIELDS)
    commit_files.check_format(doc, os.path.join(path, MARKER), FORMAT, READS, "checkpoint")
    folder = os.path.join(path, doc["data"])
    if not all(isinstance(e, int) if doc["version"] == 1 else (
            isinstance(e, dict) and isinstance(e.get("bytes"), int)
            and isinstance(e.get("sha256"), str)) for e in doc["files"].values()):
        raise AutoshardError(f"{os.path.join(path, MARKER)}: an entry of 'files' is not a size "
                             "and a SHA-256: the file was changed. Save the checkpoint again.")
    return folder, doc


def _state(model, optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    state = {"model": module_state(model)}
    if optimizer is not None:  # keyed by module path, as DCP's helper keys it
        state["optim"] = get_optimizer_state_dict(model, optimizer)
    return state


def _rank_buffers(model) -> dict:
    """The model's persistent buffers that are plain tensors (each rank's own copy: a
    BatchNorm's running statistics, an EMA each rank updates from its own batch)."""
    params = {id(p) for p in model.parameters()}
    return {fqn: t for fqn, t in module_state(model).items()
            if id(t) not in params and not isinstance(t, DTensor)}


def module_state(model: torch.nn.Module, every_buffer: bool = False) -> dict:
    """The model's parameters and persistent buffers (``every_buffer``: all buffers) by
    module path, tied names included, read from the modules. For a model without state-dict
    hooks these are its ``state_dict()`` keys, so DCP checkpoints of FSDP2 and autoshard
    load into each other; hooks that rename or fuse keys (torchtitan's fused QKV, whose
    hooks split ``wqkv`` into ``wq``, ``wk``, ``wv``) are not run, so such a model saves its
    modules' own tensors (``wqkv``) and loads them back whole."""
    out = dict(model.named_parameters(remove_duplicate=False))
    for fqn, b in model.named_buffers(remove_duplicate=False):
        owner, _, name = fqn.rpartition(".")
        if every_buffer or name not in model.get_submodule(owner)._non_persistent_buffers_set:
            out[fqn] = b
    return out


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

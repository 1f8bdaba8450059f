"""The device mesh: the default one, and where a rank's tensors live."""

from __future__ import annotations

import hashlib
import os
import warnings

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from autoshard.errors import AutoshardError

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_said_single = False


def default_mesh() -> DeviceMesh:
    """A 1-D mesh over the default process group, initialising one if needed.

    With no process group but a torchrun environment, the group is initialised (NCCL when
    CUDA is available, gloo otherwise); with neither, a one-rank group is made and autoshard
    says once that it runs as world size 1.
    """
    global _said_single
    cuda = torch.cuda.is_available()
    if not dist.is_initialized():
        present = [v for v in _TORCHRUN_VARS if v in os.environ]
        if present and len(present) < len(_TORCHRUN_VARS):
            missing = [v for v in _TORCHRUN_VARS if v not in os.environ]
            raise AutoshardError(
                f"the distributed environment is incomplete: {', '.join(present)} set but "
                f"{', '.join(missing)} missing. Launch with torchrun --nproc-per-node N "
                "script.py, or call torch.distributed.init_process_group() yourself before "
                "autoshard()."
            )
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        backend = "nccl" if cuda else "gloo"
        if present:
            dist.init_process_group(backend)
        else:
            if not _said_single:
                warnings.warn(
                    "autoshard: no process group and no torchrun environment; running as world "
                    "size 1. Launch with torchrun --nproc-per-node N to shard across N ranks.",
                    stacklevel=3,
                )
                _said_single = True
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    device_type = "cuda" if cuda and "nccl" in str(dist.get_backend()) else "cpu"
    return init_device_mesh(device_type, (dist.get_world_size(),))


def mesh_device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def group_name(mesh: DeviceMesh) -> str:
    return mesh.get_group().group_name


def same_on_all_ranks(mesh: DeviceMesh, value: str) -> bool:
    """Whether ``value`` (a string) is the same on every rank of ``mesh``: one all-gather of
    its 32-byte SHA-256 digest (a tensor collective: no pickling, no NumPy)."""
    if mesh.size() == 1:
        return True
    return len(set(all_gather_digests(mesh, value))) == 1


def all_gather_digests(mesh: DeviceMesh, value: str) -> list:
    """Every rank's SHA-256 digest of ``value``, in rank order."""
    digest = hashlib.sha256(value.encode()).digest()
    mine = torch.tensor(list(digest), dtype=torch.uint8, device=mesh_device(mesh))
    out = torch.empty(mesh.size() * len(digest), dtype=torch.uint8, device=mine.device)
    dist.all_gather_into_tensor(out, mine, group=mesh.get_group())
    return [bytes(chunk.tolist()) for chunk in out.cpu().split(len(digest))]

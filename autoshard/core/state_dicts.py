"""The dict ``sharded.state_dict()`` returns: torch's OrderedDict of this rank's DTensor
shards, which says so when it is pickled (``torch.save``), since the file then holds this
rank's rows of each sharded tensor and nothing of the other ranks'."""

from __future__ import annotations

import collections
import copy
import os
import sys
import warnings

import torch
from torch.distributed.tensor import DTensor

_TORCH = os.path.dirname(torch.__file__) + os.sep


class ShardStateDict(collections.OrderedDict):
    """``nn.Module.state_dict()``'s OrderedDict (``_metadata`` included), read as a mapping as
    any other (``load_state_dict``, DCP's ``get_model_state_dict``, accelerate). Pickled, it
    warns (a ``UserWarning``, once per pickling) when a value holds part of its tensor on
    this rank, naming the fix, and is written as the plain OrderedDict it was before, so
    the file loads with ``torch.load`` alone. Whole on every rank (world size 1, replicated
    parameters), it is a complete save and says nothing. Copies (``copy.copy``,
    ``copy.deepcopy``) are ShardStateDicts again, without a word."""

    def __reduce_ex__(self, protocol):
        partial = [(k, v) for k, v in self.items() if _partial(v)]
        if partial:
            # pointed at the caller's line, past torch.save's own frames
            level, frame = 2, sys._getframe(1)
            while frame is not None and frame.f_code.co_filename.startswith(_TORCH):
                level, frame = level + 1, frame.f_back
            warnings.warn(_saved_partially(partial, len(self)), UserWarning, stacklevel=level)
        plain = collections.OrderedDict(self)
        plain.__dict__.update(self.__dict__)
        return plain.__reduce_ex__(protocol)

    def __copy__(self):
        new = type(self)(self)
        new.__dict__.update(self.__dict__)
        return new

    def __deepcopy__(self, memo):
        new = type(self)()
        memo[id(self)] = new
        for k, v in self.items():
            new[k] = copy.deepcopy(v, memo)
        new.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return new


def new_state_dict() -> ShardStateDict:
    """An empty one, with the ``_metadata`` that ``nn.Module.state_dict`` gives its own."""
    out = ShardStateDict()
    out._metadata = collections.OrderedDict()
    return out


def _partial(value) -> bool:
    """A DTensor of which this rank holds less than the whole (a shard)."""
    return isinstance(value, DTensor) and value.to_local().shape != value.shape


def _saved_partially(partial: list, total: int) -> str:
    key, v = partial[0]
    mesh = v.device_mesh
    return (
        f"pickling (torch.save) a sharded model's state_dict() on rank {mesh.get_rank()} of "
        f"world size {mesh.size()}: {len(partial)} of its {total} tensors are this rank's "
        f"shards only (e.g. '{key}': {list(v.to_local().shape)} of its {list(v.shape)}), "
        "so the file loads back only into this sharded model on this rank at this world size. "
        "To save the whole model, call full = sharded.full_state_dict(rank0_only=True) on "
        "every rank and torch.save(full, path) on rank 0; to checkpoint and resume, "
        "autoshard.save(path, sharded, optimizer) and autoshard.load_checkpoint(path, "
        "sharded, optimizer) on every rank.")

"""What a sharded model writes and reads: ``autoshard.save`` and ``autoshard.load_checkpoint``
(checkpoints, ``autoshard.runtime.checkpoint``) and ``autoshard.load`` (exports,
``autoshard.runtime.export_load``; ``sharded.export`` writes them).

The front door's part: each takes the model ``autoshard()`` returned (or, for ``load``, builds
it with ``autoshard()``) and hands the runtime what it needs of the model's state: the
agreement of its ranks, its CallState. Nothing below this layer reads that state off the model.
"""

from __future__ import annotations

from typing import Optional

import torch

from autoshard.front.api import autoshard, state_of
from autoshard.core.config import Config
from autoshard.runtime import checkpoint, commit, dcpio, dist as _dist, export_load
from autoshard.runtime.export_format import MANIFEST, skeleton, zero_tensors

_NOT_SHARDED = "for another model use torch.distributed.checkpoint directly"


def save(path, model: torch.nn.Module, optimizer=None) -> None:
    """Save the model's (and the optimizer's) state under ``"model"`` (``"optim"``) with DCP,
    committed whole: every rank calls it; it returns once the checkpoint is complete on
    every rank, or raises ``AutoshardError`` on every rank naming the ranks that failed and
    why, leaving ``path`` as it was (an earlier checkpoint there stays loadable)."""
    st = state_of(model, "autoshard.save and load_checkpoint take", _NOT_SHARDED)
    checkpoint.save(path, model, st.agreement, optimizer)


def load_checkpoint(path, model: torch.nn.Module, optimizer=None, *,
                    strict: bool = True) -> dcpio.IncompatibleKeys:
    """Load what ``save`` wrote, at this or another world size, into the model's parameters
    (and the optimizer's state) in place; every rank calls it. A path that holds a plain DCP
    checkpoint (``dcp.save`` of ``{"model": ..., "optim": ...}``) loads too. Nothing changes
    unless every rank read its part. A save to the path meanwhile (another job's) does not
    disturb it: it loads the checkpoint the path held when it began, or the new one, whole.

    Loading runs no code and reads nothing outside ``path`` (``autoshard.runtime.dcpio``);
    every file is checked against the size and SHA-256 ``checkpoint.json`` records first.
    ``strict`` (the default): a key of the model (or optimizer) the checkpoint lacks, or one
    it holds that the model lacks, is an error naming them; ``strict=False`` loads the keys
    both hold and returns the others (``missing_keys``, ``unexpected_keys``)."""
    st = state_of(model, "autoshard.save and load_checkpoint take", _NOT_SHARDED)
    return checkpoint.load(path, model, st.agreement, optimizer, strict=strict)


def load(path, mesh=None, config: Optional[Config] = None, *, inference: bool = False,
         verify: bool = True):
    """The exported model on ``mesh`` (every rank calls it): a ShardedModule with the same
    parameter, buffer and state-dict names, DTensor parameters, and the stored programs.
    ``config``: plan with this instead of the export's Config (the passes then run again).
    ``inference``: load only the eval-mode, no-gradient programs (forward graphs only); the
    module is put in eval mode and runs every call without gradients. ``verify``: check
    every file's SHA-256.

    The module reads each program's files on its first call, so it holds the export's data
    folder while it lives (``commit.reading``): another export to ``path`` meanwhile
    replaces it for later loads and leaves this one's files until a sweep after the module
    is gone."""
    with commit.reading(path, MANIFEST) as held:
        opened = export_load.open_export(path, config, inference=inference, verify=verify)
        mesh = mesh if mesh is not None else _dist.default_mesh(opened.config.timeout)
        export_load.check_backend(mesh, opened.path)
        model = autoshard(skeleton(opened.model_doc), mesh=mesh, config=opened.config,
                          param_init_fn=zero_tensors)
        st = state_of(model, "autoshard.load builds")
        loaded = export_load.read_into(model, st, opened, inference=inference, verify=verify)
        loaded.held = held.kept()
        st.mark_loaded(loaded)
    if inference:
        model.eval()
    return model

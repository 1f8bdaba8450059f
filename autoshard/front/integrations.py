"""Where users already train: Hugging Face's Trainer, accelerate and Lightning take a sharded
model as it is (docs/integrations.md).

Most of it needs no code here. A ``ShardedModule`` carries accelerate's mark of a prepared
model, so ``accelerator.prepare`` (and the Trainer, which calls it) does not wrap it in
DistributedDataParallel; its ``no_sync`` is DDP's, which accelerate's ``accumulate`` and the
Trainer's gradient accumulation call; its ``forward`` has the model's own signature, which the
Trainer reads to keep the batch's columns. Lightning's ``ModelParallelStrategy`` calls
``autoshard`` from ``configure_model`` with the mesh it builds.

What the Trainer cannot do alone is checkpoint it: it writes the model and the optimizer
from rank 0, which holds one shard of each, and reads them back on every rank. The Trainer
here (``from autoshard.front.integrations import Trainer``, or ``ShardedTrainerMixin`` before
another Trainer class, such as TRL's) saves each checkpoint's model and optimizer with
``autoshard.save`` into the checkpoint's ``autoshard`` folder, every rank writing its shards,
and ``resume_from_checkpoint`` loads them with ``autoshard.load_checkpoint``; the full
weights still go to ``model.safetensors`` (gathered, written by rank 0), so the checkpoint
loads with ``from_pretrained`` as before. With a model autoshard did not shard it is the
Trainer it extends.
"""

from __future__ import annotations

import os

import torch

from autoshard.front.api import ShardedModule
from autoshard.front.files import load_checkpoint, save

# the folder, inside a Trainer checkpoint, of the sharded model and optimizer
FOLDER = "autoshard"
SCHEDULER = "scheduler.pt"  # the Trainer's name for the learning-rate scheduler's state


class ShardedTrainerMixin:
    """Put before a ``transformers.Trainer`` class: its checkpoints of an autoshard model hold
    every rank's shards of the model and the optimizer, and resume from them."""

    def _sharded(self) -> bool:
        return isinstance(self.model, ShardedModule)

    def save_model(self, output_dir=None, _internal_call: bool = False) -> None:
        """The full weights, gathered on every rank and written by the process that saves,
        as the Trainer writes them (``model.safetensors``, ``from_pretrained`` reads them)."""
        if not self._sharded():
            return super().save_model(output_dir, _internal_call)
        output_dir = self.args.output_dir if output_dir is None else output_dir
        full = self.model.full_state_dict(cpu_offload=True, rank0_only=True)
        if self.args.should_save:
            self._save(output_dir, state_dict=full)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if not self._sharded():
            return super()._save_optimizer_and_scheduler(output_dir)
        save(os.path.join(output_dir, FOLDER), self.model, self.optimizer)
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER))

    def _load_optimizer_and_scheduler(self, checkpoint) -> None:
        folder = None if checkpoint is None else os.path.join(checkpoint, FOLDER)
        if not self._sharded() or not os.path.isdir(folder):
            return super()._load_optimizer_and_scheduler(checkpoint)
        load_checkpoint(folder, self.model, self.optimizer)
        scheduler = os.path.join(checkpoint, SCHEDULER)
        if os.path.isfile(scheduler):
            self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))


def __getattr__(name: str):
    """``Trainer``: ``transformers.Trainer`` with ``ShardedTrainerMixin``, built on first use
    (importing transformers takes seconds, and only a Trainer user needs it)."""
    if name != "Trainer":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import transformers

    cls = type("Trainer", (ShardedTrainerMixin, transformers.Trainer), {
        "__module__": __name__,
        "__doc__": "``transformers.Trainer`` that checkpoints and resumes an autoshard model "
                   "(``ShardedTrainerMixin``); otherwise the Trainer itself."})
    globals()["Trainer"] = cls
    return cls

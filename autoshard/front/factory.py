"""``MODULE:FACTORY`` names of model builders, as the command line and ``check`` take them."""

from __future__ import annotations

import importlib
import os
import sys

import torch
from autoshard.front.api import autoshard


def load_factory(spec: str):
    """The callable ``spec`` names (``package.module:function``), imported with the current
    directory on the path. ``ValueError`` names what is wrong."""
    if ":" not in spec:
        raise ValueError("expected MODULE:FACTORY (e.g. "
                         f"autoshard.examples.gpt_shapes:gpt_175b), got {spec!r}")
    mod, _, name = spec.partition(":")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return getattr(importlib.import_module(mod), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot load {spec}: {e}") from e


def export_factory(rank: int, world: int, spec: str, opts: dict) -> None:
    """One rank of ``python -m autoshard export``: build the factory's model (the same seed
    on every rank), shard it, compile it for the factory's inputs, export."""
    factory = load_factory(spec)
    torch.manual_seed(0)
    model = factory()
    torch.manual_seed(1 + rank)
    inputs = default_inputs(model, factory, opts["batch"], opts["seq"])
    sharded = autoshard(model, config=opts["config"], example_inputs=inputs)
    sharded.export(opts["out"], inference=opts["inference"])


def default_inputs(model: torch.nn.Module, factory, batch: int, seq: int):
    """``factory.example_inputs(batch, seq)`` where the factory has it, else integer tokens
    (batch, seq) below the smallest embedding table's size (zeros with no embedding)."""
    make = getattr(factory, "example_inputs", None)
    if make is not None:
        return make(batch, seq)
    sizes = [m.num_embeddings for m in model.modules() if isinstance(m, torch.nn.Embedding)]
    if sizes:
        return (torch.randint(0, min(sizes), (batch, seq)),)
    return (torch.zeros(batch, seq, dtype=torch.long),)

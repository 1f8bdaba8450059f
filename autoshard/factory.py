"""``MODULE:FACTORY`` names of model builders, as the command line and ``check`` take them."""

from __future__ import annotations

import importlib
import os
import sys


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

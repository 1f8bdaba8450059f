"""A Config read against the model it is applied to: every name it gives must name something
of the model (``check_names``)."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Optional

from autoshard.core.config import Config
from autoshard.core.options import Module
from autoshard.passes.groupings import repeated_blocks

def check_names(config: Config, model) -> None:
    """Every name ``config`` gives must name something of ``model``: a module class in
    ``Module.classes``, a module path ``Module.pattern`` matches, each parameter FQN of
    ``units`` and each block path of a ``recompute`` dict. ``Config`` cannot check these
    alone; a name that matches nothing would otherwise be ignored silently. ValueError lists
    what the model has, and the close matches."""
    owner = type(model).__name__
    modules = [(p, m) for p, m in model.named_modules(remove_duplicate=False) if p]
    paths = [p for p, _ in modules]
    module = config.policy if isinstance(config.policy, Module) else Module()
    if module.classes:
        present = list(dict.fromkeys(type(m).__name__ for _, m in modules))
        for name in module.classes:
            if name not in present:
                raise ValueError(f"Config.policy.classes names {name!r}, but no submodule of "
                                 f"{owner} is of that class; "
                                 + _known(name, present, "its classes"))
    if module.pattern is not None:
        rx = re.compile(module.pattern)
        if not any(rx.fullmatch(p) for p in paths):
            raise ValueError(f"Config.policy.pattern={module.pattern!r} matches no "
                             f"module path of {owner} whole (re.fullmatch); "
                             + _known(module.pattern, paths, "its module paths"))
    if config.units is not None:
        fqns = [f for f, _ in model.named_parameters(remove_duplicate=False)]
        known = set(fqns)
        for i, unit in enumerate(config.units):
            for name in unit:
                if name not in known:
                    raise ValueError(f"Config.units[{i}] names {name!r}, which is not a "
                                     f"parameter of {owner}; "
                                     + _known(name, fqns, "its parameters"))
    if isinstance(config.recompute, Mapping):
        blocks = repeated_blocks(model)
        known = set(paths)
        for path in config.recompute:
            if path not in known and path != "*":  # "*": every saved activation (offload)
                raise ValueError(
                    f"Config.recompute names block {path!r}, which is not a module of "
                    f"{owner}; " + _known(path, paths, "its repeated blocks" if blocks
                                          else "its modules", shown=blocks or paths))


def for_submodule(config: Config, path: str) -> Config:
    """``config`` as the submodule at ``path`` (called directly, an entry of its own) reads
    it: its captured step names the submodule's parameters from the submodule, so each
    explicit unit keeps the parameters under ``path``, named from there (``blocks.0.weight``
    is ``weight`` to ``blocks.0``), and a unit naming none of them is dropped; the parameters
    left out form the root unit, as in the whole model's step. Every other field is the
    model's."""
    if config.units is None or not path:
        return config
    prefix = path + "."
    units = [[n[len(prefix):] for n in unit if n.startswith(prefix)] for unit in config.units]
    return dataclasses.replace(config, units=[u for u in units if u])


def _known(name: str, names: list, what: str, shown: Optional[list] = None,
           limit: int = 12) -> str:
    """``what: a, b, ...``: the first ``limit`` of ``shown`` (default ``names``), then the
    close matches to ``name`` among ``names``."""
    import difflib

    shown = names if shown is None else shown
    more = f", ... ({len(shown) - limit} more)" if len(shown) > limit else ""
    out = f"{what}: {', '.join(shown[:limit]) or 'none'}{more}"
    close = difflib.get_close_matches(name, names, n=3)
    return out + (f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else "")

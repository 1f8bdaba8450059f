"""The modules' names before 0.5, kept working with a FutureWarning until 0.6.

0.5 grouped the package by layer (docs/architecture.md): ``autoshard.config`` is
``autoshard.core.config``, ``autoshard.api`` is ``autoshard.front.api``, the planner is
``autoshard.planner``. An import of an old name (``import autoshard.config``, ``from
autoshard.errors import AutoshardError``) warns once, naming the new one, and hands back the
module itself, so a patch through either name reaches the same code. Only the package's
``__init__`` installs this; nothing in autoshard imports an old name.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

REMOVED_IN = "0.6"
# each moved module's own spec, by its name, to put back after an import through an old one
SPECS: dict = {}
# the name before 0.5 (below ``autoshard.``) -> its name since
OLD_NAMES = {
    "_compat": "core._compat",
    "_reference": "front._reference",
    "api": "front.api",
    "calls": "front.calls",
    "capture": "compiler.capture",
    "capture_errors": "compiler.capture_errors",
    "captured": "core.captured",
    "carried": "core.carried",
    "check_locate": "check.locate",
    "check_report": "check.report",
    "check_runs": "check.runs",
    "config": "core.config",
    "config_history": "core.config_history",
    "config_model": "front.config_model",
    "cost": "core.cost",
    "demo": "front.demo",
    "depth": "compiler.depth",
    "errors": "core.errors",
    "factory": "front.factory",
    "files": "front.files",
    "fuzz_model": "fuzz.model",
    "fuzz_spec": "fuzz.spec",
    "fuzz_train": "fuzz.train",
    "graph": "core.graph",
    "guards": "core.guards",
    "hooks": "core.hooks",
    "integrations": "front.integrations",
    "meta": "core.meta",
    "models": "core.models",
    "ops": "core.ops",
    "options": "core.options",
    "passes.candidates": "planner.candidates",
    "passes.planner": "planner",
    "passes.readout": "planner.readout",
    "passes.search": "planner.search",
    "plans": "core.plans",
    "progress": "core.progress",
    "simulate": "core.simulate",
    "spec": "core.spec",
    "state_dicts": "core.state_dicts",
    "version": "core.version",
    "writes": "core.writes",
}


class OldNames(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``autoshard.<old name>``; loading it imports the new module and aliases it."""

    def find_spec(self, fullname, path, target=None):
        if fullname.startswith("autoshard.") and fullname[len("autoshard."):] in OLD_NAMES:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        new = "autoshard." + OLD_NAMES[spec.name[len("autoshard."):]]
        warnings.warn(f"{spec.name} is {new} since autoshard 0.5 (the package is grouped by "
                      f"layer); the old name stops working in {REMOVED_IN}", FutureWarning,
                      stacklevel=2)
        module = importlib.import_module(new)
        SPECS[new] = module.__spec__  # the import machinery sets the alias's in its place
        return module

    def exec_module(self, module) -> None:
        """The module was imported under its new name already: only its own ``__spec__``,
        which the import machinery replaced by the old name's, is put back."""
        module.__spec__ = SPECS[module.__name__]


def install() -> None:
    if not any(isinstance(f, OldNames) for f in sys.meta_path):
        sys.meta_path.append(OldNames())

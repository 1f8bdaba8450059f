"""autoshard: fully sharded data parallel training, compiled.

``autoshard(model)`` shards a model's parameters as FSDP2 does (DTensor ``Shard(0)``), captures
its whole training step as one joint forward+backward graph, inserts every all-gather,
reduce-scatter and free as explicit graph nodes, and runs the result across ranks.
"""

import os as _os

# In a source checkout ``passes/``, ``runtime/`` and ``examples/`` sit beside this package and
# install as ``autoshard.passes``, ``autoshard.runtime`` and ``autoshard.examples``; let the
# checkout import them the same way.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if not _os.path.isdir(_os.path.join(_os.path.dirname(__file__), "passes")) and _os.path.isfile(
    _os.path.join(_root, "passes", "__init__.py")
):
    __path__.append(_root)  # type: ignore[name-defined]


def _version() -> str:
    """The installed distribution's version; in a source checkout that is not installed, the
    version its pyproject.toml declares (``autoshard.core.version``)."""
    return read_version(_root)


from autoshard.core.version import read_version  # noqa: E402

__version__ = _version()

from autoshard.core.errors import AutoshardError  # noqa: E402
from autoshard.core.config import Config  # noqa: E402
from autoshard.core.options import Bucket, Module, Offload, Prefetch, Size  # noqa: E402
from autoshard.core.plans import Plan  # noqa: E402
from autoshard.front.api import ShardedModule, autoshard, plan  # noqa: E402
from autoshard.check import CheckReport, check  # noqa: E402
from autoshard.front.files import load, load_checkpoint, save  # noqa: E402
from autoshard.runtime.deferred import deferred_init  # noqa: E402
from autoshard.core import old_names as _old_names  # noqa: E402

__all__ = ["autoshard", "plan", "check", "load", "save", "load_checkpoint", "deferred_init",
           "CheckReport", "ShardedModule", "Config", "Bucket", "Prefetch", "Offload", "Module",
           "Size", "Plan", "AutoshardError"]

# ``from autoshard import autoshard`` binds the function under the package's name; it carries
# the package's other public names too, so ``autoshard.load(path)``, ``autoshard.plan(...)``
# and ``autoshard.Config`` read the same after either import.
for _name in __all__:
    if _name != "autoshard":
        setattr(autoshard, _name, globals()[_name])
del _name

_old_names.install()  # the modules' names before 0.5, with a warning, until 0.6


def __getattr__(name: str):
    """``autoshard.errors`` and the other modules' names before 0.5, read as attributes of the
    package without an import: imported through their old name, which warns."""
    if name in _old_names.OLD_NAMES:
        import importlib
        return importlib.import_module(f"autoshard.{name}")
    raise AttributeError(f"module 'autoshard' has no attribute {name!r}")

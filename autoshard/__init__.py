"""autoshard: fully sharded data parallel training, compiled.

``autoshard(model)`` shards a model's parameters as FSDP2 does (DTensor ``Shard(0)``), captures
its whole training step as one joint forward+backward graph, inserts every all-gather,
reduce-scatter and free as explicit graph nodes, and runs the result across ranks.
"""

import os as _os

# In a source checkout ``passes/`` and ``runtime/`` sit beside this package and install as
# ``autoshard.passes`` and ``autoshard.runtime``; let the checkout import them the same way.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if not _os.path.isdir(_os.path.join(_os.path.dirname(__file__), "passes")) and _os.path.isfile(
    _os.path.join(_root, "passes", "__init__.py")
):
    __path__.append(_root)  # type: ignore[name-defined]


def _version() -> str:
    """The installed distribution's version; in a source checkout that is not installed, the
    version its pyproject.toml declares (``autoshard.version``)."""
    return read_version(_root)


from autoshard.version import read_version  # noqa: E402

__version__ = _version()

from autoshard.errors import AutoshardError  # noqa: E402
from autoshard.config import Config  # noqa: E402
from autoshard.options import Bucket, Module, Offload, Prefetch, Size  # noqa: E402
from autoshard.plans import Plan  # noqa: E402
from autoshard.api import ShardedModule, autoshard, plan  # noqa: E402
from autoshard.check import CheckReport, check  # noqa: E402
from autoshard.files import load, load_checkpoint, save  # noqa: E402
from autoshard.runtime.deferred import deferred_init  # noqa: E402

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

"""Graph passes and the one runner that applies them.

A pass is ``def <verb>_<object>_pass(gm, ctx, *, options)``. It reads the context, which is
frozen, and returns the graph, or ``(graph, {field: value})`` for what it decided (units,
the split program): the runner hands the next pass a context with those fields replaced.
Passes run in the declared ``ORDER``, checked by the runner. The runner applies an
ordered list, lints the graph after each, and runs the verifier when asked (``Config.verify``,
``AUTOSHARD_VERIFY=1`` as the tests set it, or ``AUTOSHARD_DEBUG``). ``AUTOSHARD_DEBUG=1``
prints per-pass time and op-count diff; ``=2`` also dumps the numbered graph after each pass.

The planner (``autoshard.planner``) is not a pass: a layer above them, it lowers each
candidate plan with the runner and chooses among them. It imports the passes; no pass imports
it.
"""

from autoshard.passes.pipeline import (  # noqa: F401  (the package is the passes' one door)
    NEEDS, ORDER, PROVIDER, PassContext, check_order, debug_level, default_passes, run_passes,
    unit_options,
)
from autoshard.passes.units import Unit, assign_units_pass  # noqa: F401
from autoshard.passes.collectives import insert_collectives_pass  # noqa: F401
from autoshard.passes.bucket import bucket_units_pass  # noqa: F401
from autoshard.passes.prefetch import prefetch_pass  # noqa: F401
from autoshard.passes.remat import recompute_activations_pass  # noqa: F401
from autoshard.passes.offload import offload_activations_pass  # noqa: F401
from autoshard.passes.split import split_pass  # noqa: F401
from autoshard.passes.verify import verify  # noqa: F401

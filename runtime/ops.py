"""Moved: the graph's own ops are ``autoshard.ops`` since autoshard 0.4. This name keeps
working, with a DeprecationWarning, until 0.5."""

import warnings

from autoshard.ops import (capture_decompositions, chunk_op, free_op,  # noqa: F401
                           grouped_mm_op, pack_op)

warnings.warn("autoshard.runtime.ops is autoshard.ops since autoshard 0.4; the old name goes "
              "in 0.5", DeprecationWarning, stacklevel=2)

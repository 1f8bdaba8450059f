"""What reading an artifact's file may cost, bounded before anything real runs.

Three bounds (``Bound``), each read from its environment variable at each use, so that a
caller (every rank of a launch) raises it to read a larger file it trusts:

- ``DOCUMENT_BYTES`` (``AUTOSHARD_MAX_DOCUMENT_BYTES``, 128 MiB): the size of one JSON
  document of an artifact (an export's graph, program or module tree; a checkpoint's or an
  export's marker), checked on the open file before a byte is read
  (``export_load.read_file``, ``commit_files.read_bytes``);
- ``NODE_BYTES`` (``AUTOSHARD_GRAPH_MAX_NODE_BYTES``, 64 GiB): the bytes of one graph node's
  output, a view counted at its full size (an ``expand`` to 2^36 elements is 2^36 of them);
- ``WORK`` (``AUTOSHARD_GRAPH_MAX_WORK``, 2^53): a graph's work, the elements its nodes read
  and write plus the floating-point operations torch's flop counter counts for matrix
  products, convolutions and attention (and n^3 per n x n matrix a linear-algebra op such as
  an inverse or a factorisation takes).

``graphio.load_graph`` counts each node (``Budget.count``) as its fake value is computed, so a
graph past a bound is refused at the node that crosses it, before the rest is computed even
on fake tensors and before any real tensor is touched.
"""

from __future__ import annotations

import dataclasses
import os
import re

import torch
from torch.utils.flop_counter import flop_registry

from autoshard.core import _compat
from autoshard.core.errors import AutoshardError


@dataclasses.dataclass(frozen=True)
class Bound:
    """A limit on what reading a file may cost: ``default``, unless the environment variable
    ``var`` says otherwise."""

    var: str
    default: int
    what: str  # what is limited, as the refusal names it

    def value(self) -> int:
        raw = os.environ.get(self.var)
        if raw is None:
            return self.default
        try:
            v = int(raw.replace("_", ""))
        except ValueError:
            v = 0
        if v <= 0:
            raise AutoshardError(f"{self.var}={raw!r} is not a positive whole number: set it to "
                                 f"the most {self.what} to admit (default {self.default})")
        return v

    def refusal(self, got: int, limit: int) -> str:
        """``got`` past ``limit``, and how to raise it."""
        return (f"{got:,} {self.what}, more than {self.var} ({limit:,}), a limit on what "
                "loading a file may cost. If the file is one you trust, raise it: "
                f"{self.var}={max(got, 2 * limit)} in the environment of every rank")


# a graph of MAX_NODES nodes writes some 40 MiB
DOCUMENT_BYTES = Bound("AUTOSHARD_MAX_DOCUMENT_BYTES", 2 ** 27, "bytes in one JSON document")
# more than any one device holds
NODE_BYTES = Bound("AUTOSHARD_GRAPH_MAX_NODE_BYTES", 2 ** 36, "bytes in one node's output")
# a training step of a 70B-parameter model over 8192 tokens a rank is some 2^52
WORK = Bound("AUTOSHARD_GRAPH_MAX_WORK", 2 ** 53,
             "units of work (elements read and written, floating-point operations)")

# linear algebra ops whose work is cubic in the matrix size
_CUBIC = re.compile(r"linalg|cholesky|triangular|lu_|svd|eig|qr|inverse|solve|det|lstsq")


class OverBound(Exception):
    """A node past a bound; ``message`` says which (fx's interpreter rewrites ``args``)."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


def tensors(v) -> list:
    """The tensors among the leaves of ``v``."""
    return [t for t in _compat.pytree.tree_leaves(v) if isinstance(t, torch.Tensor)]


def flops(op, args, kwargs, out) -> int:
    """The floating-point operations torch's flop counter counts for the op overload ``op``
    on these (fake) values; for a linear algebra op it has no formula for, n^3 per n x n
    matrix of each argument; else 0 (the op's work is the elements it reads and writes)."""
    if not isinstance(op, _compat.OpOverload):
        return 0
    formula = flop_registry.get(op.overloadpacket)
    if formula is None:
        if not _CUBIC.search(op._opname):
            return 0
        return sum(t.numel() * t.shape[-1] for t in tensors((args, kwargs)) if t.dim() >= 2)
    try:
        return int(formula(*args, **kwargs, out_val=out))
    except Exception:  # noqa: BLE001  (a formula that does not take these values: none)
        return 0


class Budget:
    """One graph's cost so far, against ``NODE_BYTES`` and ``WORK`` as they are set now."""

    def __init__(self):
        self.work = 0
        self.node_bytes, self.max_work = NODE_BYTES.value(), WORK.value()

    def count(self, n, target: str, args, kwargs, result) -> None:
        """Add node ``n`` (calling ``target``) that computed ``result`` from ``args`` and
        ``kwargs``; OverBound past either bound."""
        out = tensors(result)
        nbytes = sum(t.numel() * t.element_size() for t in out)
        if nbytes > self.node_bytes:
            raise OverBound(f"node {n.name} ({target}) computes "
                            f"{NODE_BYTES.refusal(nbytes, self.node_bytes)}")
        self.work += (sum(t.numel() for t in tensors((args, kwargs)))
                      + sum(t.numel() for t in out) + flops(n.target, args, kwargs, result))
        if self.work > self.max_work:
            raise OverBound(f"the graph up to node {n.name} ({target}) takes "
                            f"{WORK.refusal(self.work, self.max_work)}")

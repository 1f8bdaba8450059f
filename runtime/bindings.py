"""The graphs as they run: ATen op nodes called through torch's public Python bindings.

The passes write every op as its ATen overload (``torch.ops.aten.mm.default``), which is
what they reason about: schemas, aliasing, meta values. Called from Python, an overload costs
about a microsecond more than the public binding of the same op (``torch.mm``,
``Tensor.view``): the overload's call parses its arguments against the schema in Python's
stead, the binding's parser is generated for it. In the launch-bound regime (small ops, the
GPU waiting on the host) a step is its ops' host time, and the graphs of a step hold hundreds
of views, transposes and small matmuls, so the executor runs a copy of each graph in which
the ops below call their bindings (``runnable``). Each binding dispatches to the same ATen op
with the same arguments, so the values are the same bit for bit; a node whose keyword
arguments the binding does not take keeps its overload. The passes' graphs are not changed:
``Program.split`` and everything that reads it (the plan, ``check``, the export) see the
overloads.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from autoshard.core.graph import clone_graph

_A = torch.ops.aten

# overload -> (the Tensor method of the same name, keyword arguments it takes)
METHODS = {
    _A.view.default: ("view", ()),
    _A.t.default: ("t", ()),
    _A.detach.default: ("detach", ()),
    _A.transpose.int: ("transpose", ()),
    _A.permute.default: ("permute", ()),
    _A.expand.default: ("expand", ()),
    _A.unsqueeze.default: ("unsqueeze", ()),
    _A.squeeze.dim: ("squeeze", ()),
    _A.select.int: ("select", ()),
    _A.split_with_sizes.default: ("split_with_sizes", ("dim",)),
}

# overload -> (the torch function that dispatches to it, keyword arguments it takes)
FUNCTIONS = {
    _A.mm.default: (torch.mm, ()),
    _A.bmm.default: (torch.bmm, ()),
    _A.addmm.default: (torch.addmm, ("beta", "alpha")),
    _A.relu.default: (torch.relu, ()),
    _A.sum.dim_IntList: (torch.sum, ("dtype",)),
    _A.cat.default: (torch.cat, ("dim",)),
    _A.mul.Tensor: (torch.mul, ()),
    _A.add.Tensor: (torch.add, ("alpha",)),
    _A.sub.Tensor: (torch.sub, ("alpha",)),
    _A.div.Tensor: (torch.div, ()),
    _A.neg.default: (torch.neg, ()),
    _A.clone.default: (torch.clone, ("memory_format",)),
    _A.pow.Tensor_Scalar: (torch.pow, ()),
    _A.mean.dim: (torch.mean, ("dtype",)),
    _A.rsqrt.default: (torch.rsqrt, ()),
    _A.where.self: (torch.where, ()),
    _A.cos.default: (torch.cos, ()),
    _A.sin.default: (torch.sin, ()),
    _A.embedding.default: (torch.embedding, ()),
}


def runnable(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` whose ops in ``METHODS`` and ``FUNCTIONS`` call their public
    bindings; node names, tags and values stay those of ``gm`` (an error names the same
    node)."""
    out = clone_graph(gm)
    changed = False
    for n in out.graph.nodes:
        if n.op != "call_function":
            continue
        method, function = METHODS.get(n.target), FUNCTIONS.get(n.target)
        allowed = (method or function or (None, None))[1]
        if (method is None and function is None) or not set(n.kwargs) <= set(allowed):
            continue
        if method is not None:
            if not n.args or not isinstance(n.args[0], fx.Node):
                continue
            n.op, n.target = "call_method", method[0]
        else:
            n.target = function[0]
        changed = True
    if not changed:
        return gm
    out.recompile()
    return out

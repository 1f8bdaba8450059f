"""Node meta keys, roles and predicates shared by capture, passes and runtime.

Every tag autoshard puts on a node lives in ``node.meta[KEY]``, a dict. Analysis writes tags;
rewrites act on them.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.fx as fx

KEY = "autoshard"

# tag names inside node.meta[KEY]
ROLE = "role"  # placeholder role, see the ROLE_* values
FQN = "fqn"  # parameter or buffer FQN of a placeholder
INDEX = "index"  # input or tangent index of a placeholder
REGION = "region"  # "fwd" or "bwd"
MODULE = "module"  # module path of the forward code that produced the node
FWD_NODE = "fwd_node"  # for backward nodes: name of the forward node they differentiate
UNIT = "unit"  # unit index of a communication node or a parameter placeholder
COMM = "comm"  # communication step: see COMM_* values
OUTPUTS = "outputs"  # on the output node: the role of each returned value
CHECKPOINT = "checkpoint"  # forward node inside a torch.utils.checkpoint region: its id
RECOMPUTED = "recomputed"  # on a forward node copied into backward: the original's name
# on the copies and frees of an offloaded activation (passes/offload.py): the value's name
OFFLOADED = "offloaded"

ROLE_PARAM = "param"
ROLE_BUFFER = "buffer"
ROLE_INPUT = "input"
ROLE_TANGENT = "tangent"
# a backward input: the gradient a parameter accumulated over steps run without gradient
# sync, added before its reduction (PassContext.accumulated)
ROLE_GRAD_ACC = "grad_acc"

OUT_FWD = "output"  # a forward output leaf
OUT_GRAD = "grad"  # gradient of the parameter FQN
OUT_INPUT_GRAD = "input_grad"  # gradient of user input INDEX
OUT_BUFFER = "mutated_buffer"  # new value of the buffer FQN
# a gradient a module backward hook is given (autoshard.core.hooks): hook gradient INDEX
OUT_HOOK_GRAD = "hook_grad"

FWD = "fwd"
BWD = "bwd"

# communication steps; each is a node tagged with COMM and UNIT
AG_PACK = "ag_pack"  # local shards -> flat send buffer
AG_BUFFER = "ag_buffer"  # the gathered buffer's allocation
AG_ISSUE = "all_gather"  # async all_gather_into_tensor (into the buffer)
AG_WAIT = "ag_wait"
AG_UNPACK = "ag_unpack"  # gathered buffer -> full parameters
RS_PACK = "rs_pack"  # full gradients -> flat send buffer
RS_ISSUE = "reduce_scatter"
RS_WAIT = "rs_wait"
RS_UNPACK = "rs_unpack"
# a gradient averaged over the ranks that replicate it (DDP, and HSDP's replicas of a shard)
AR_ISSUE = "all_reduce"
AR_WAIT = "ar_wait"
GROUP = "group"  # on an all-reduce issue: its group size (the op names only the group)
# on a collective issue: the distance between consecutive ranks of its group (1: the shard
# dimension's consecutive ranks; a replicate dimension's: the shard size); absent means 1
STRIDE = "stride"
# hpZ (Config.reshard_after_forward=k): after a unit's last forward use, this rank's 1/k of
# its gathered buffer (autoshard::chunk), held to the backward, all-gathered within its group
AG_CHUNK = "ag_chunk"
FREE = "free"
# offloaded parameters (ParamSpec.device == "host"): the shard copied to the device before it
# is packed for its all-gather, and the gradient shard copied back to the host after unpacking
H2D = "h2d"
D2H = "d2h"
# offloaded activations (passes/offload.py): a saved forward value copied to the host after
# its last forward read, and back to the device before its first backward read
ACT_D2H = "act_d2h"
ACT_H2D = "act_h2d"
# every kind whose node copies a tensor between host and device memory (offloaded shards
# and gradient shards, offloaded activations): on a GPU the executor runs each on a copy
# stream of its own direction (``autoshard.runtime.streams``)
COPIES = (H2D, D2H, ACT_D2H, ACT_H2D)

COLLECTIVE_ISSUES = (AG_ISSUE, RS_ISSUE, AR_ISSUE)
WAITS = (AG_WAIT, RS_WAIT, AR_WAIT)
GATHERED = (AG_BUFFER, AG_ISSUE, AG_WAIT, AG_UNPACK)  # what holds or views a gathered buffer


def tags(node: fx.Node) -> dict:
    """The autoshard tag dict of a node (created on first access)."""
    return node.meta.setdefault(KEY, {})


def tag(node: fx.Node, name: str, default: Any = None) -> Any:
    tags = node.meta.get(KEY)
    return default if tags is None else tags.get(name, default)


def role(node: fx.Node) -> Optional[str]:
    return tag(node, ROLE)


def is_param(node: fx.Node) -> bool:
    return node.op == "placeholder" and role(node) == ROLE_PARAM


def is_buffer(node: fx.Node) -> bool:
    return node.op == "placeholder" and role(node) == ROLE_BUFFER


def is_tangent(node: fx.Node) -> bool:
    return node.op == "placeholder" and role(node) == ROLE_TANGENT


def is_grad_acc(node: fx.Node) -> bool:
    return node.op == "placeholder" and role(node) == ROLE_GRAD_ACC


def is_comm(node: fx.Node) -> bool:
    return tag(node, COMM) is not None


def is_free(node: fx.Node) -> bool:
    return tag(node, COMM) == FREE


def is_collective_issue(node: fx.Node) -> bool:
    return tag(node, COMM) in COLLECTIVE_ISSUES


def group_size(issue: fx.Node) -> int:
    """The ranks a collective issue runs over, as its c10d op says
    (``all_gather_into_tensor_out(x, group_size, group_name)``,
    ``reduce_scatter_tensor(x, op, group_size, group_name)``), or an all-reduce's tag."""
    kind = tag(issue, COMM)
    if kind == AR_ISSUE:
        return tag(issue, GROUP)
    return issue.args[1] if kind == AG_ISSUE else issue.args[2]


# tensor parallelism's collectives, traced from the styles' redistributions (not tagged:
# no pass rewrites them), by kind
_c10d = torch.ops._c10d_functional
TP_COLLECTIVES = {_c10d.all_reduce.default: "all_reduce",
                  _c10d.all_gather_into_tensor.default: "all_gather",
                  _c10d.reduce_scatter_tensor.default: "reduce_scatter",
                  _c10d.wait_tensor.default: "wait"}


def tp_group_size(node: fx.Node) -> Optional[int]:
    """The ranks a tensor-parallel collective runs over: its op's ``group_size`` argument,
    or for an all-reduce (which names its group only) the size of the process group of that
    name; None where no such group exists (a graph planned without one)."""
    kind = TP_COLLECTIVES.get(node.target)
    if kind == "all_gather":
        return node.args[1]
    if kind == "reduce_scatter":
        return node.args[2]
    if kind != "all_reduce":
        return None
    from torch.distributed import distributed_c10d

    try:
        return distributed_c10d._resolve_process_group(node.args[2]).size()
    except (ValueError, RuntimeError, KeyError):
        return None


def is_wait(node: fx.Node) -> bool:
    return tag(node, COMM) in WAITS


def is_backward(node: fx.Node) -> bool:
    return tag(node, REGION) == BWD


def is_forward(node: fx.Node) -> bool:
    return tag(node, REGION) == FWD


def output_roles(gm: fx.GraphModule) -> list:
    return tags(output_node(gm))[OUTPUTS]


def output_node(gm: fx.GraphModule) -> fx.Node:
    return next(iter(reversed(gm.graph.nodes)))


def val_bytes(node: fx.Node) -> int:
    v = node.meta.get("val")
    if isinstance(v, torch.Tensor):
        return v.numel() * v.element_size()
    return 0

"""What capture hands on: the ``Captured`` joint graph and how its flat inputs and outputs map
to the user's call (``TENSOR`` for a tensor leaf, ``StateIn``/``StateOut``/``NewState`` for
objects holding state); and what the split pass hands the runtime, ``SplitProgram``.

Plain data, apart from the tracer in ``capture.py``, so that the planner, the runtime and
export read a capture without importing how it is made.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch.fx as fx


@dataclasses.dataclass
class Captured:
    """A captured joint graph and how its flat inputs/outputs map to the user's call."""

    gm: fx.GraphModule
    params: list  # ParamSpec per parameter placeholder, in placeholder order
    buffer_fqns: list
    in_spec: Any  # pytree spec of (args, kwargs)
    in_consts: list  # per input leaf: TENSOR for a tensor leaf, else the constant value
    out_spec: Any  # pytree spec of the forward output
    out_consts: list  # per output leaf: TENSOR for a tensor leaf, else the constant value
    diff_outputs: list  # indices (among tensor output leaves) that get a tangent
    input_grads: list  # indices (among tensor input leaves) whose gradient is returned
    mutated_buffers: list  # FQNs of buffers the forward updates in place
    has_backward: bool
    # per gradient output, (OUT_GRAD, fqn) or (OUT_INPUT_GRAD, index): the tangents it depends
    # on; when none of them is given (no loss reads those outputs) eager's gradient is None
    grad_tangents: dict = dataclasses.field(default_factory=dict)
    pristine: Any = None  # the joint graph as traced, before any pass (autoshard.check)
    # what the forward read of the Python world (autoshard.core.guards): checked before each reuse
    guards: Any = None
    # hooked module calls (autoshard.core.hooks.Tap): their tensors are the last ``n_taps``
    # tensor outputs of the forward, for the hooks run after it
    taps: list = dataclasses.field(default_factory=list)
    n_taps: int = 0
    # (module, attribute) of float attributes read as graph inputs, after the tensor inputs
    lifted: list = dataclasses.field(default_factory=list)
    traced_hooks: frozenset = frozenset()  # hooks traced into the graph (hooks.Replaces)
    # objects among the inputs the forward updates (autoshard.core.carried): (input object number,
    # its description after the forward); their new tensors are the last ``n_state``
    # tensor outputs of the forward
    state_in: list = dataclasses.field(default_factory=list)
    n_state: int = 0
    # what the forward wrote to modules and the objects they hold (autoshard.core.writes.Write),
    # replayed after each run; the tensors written are the ``n_written`` tensor outputs
    # after the user's (``written``)
    writes: list = dataclasses.field(default_factory=list)
    n_written: int = 0
    # module calls whose backward hooks run after the backward graph (hooks.BackwardTap),
    # fed by its hook-gradient outputs
    backward_taps: list = dataclasses.field(default_factory=list)
    # the grad mode the forward was traced in (its backward ran with grad off, as autograd
    # runs every backward formula without create_graph). Some kernels read it at run time
    # and not only their arguments: the CPU LSTM/GRU kernel (oneDNN's) returns the workspace
    # its backward needs only with grad on. So the forward graph runs in this mode.
    grad_enabled: bool = False

    def written(self, outputs: list) -> list:
        """The tensors the forward wrote (``writes``) among a run's forward outputs."""
        start = sum(c is TENSOR for c in self.out_consts)
        return outputs[start:start + self.n_written]


@dataclasses.dataclass(frozen=True)
class StateIn:
    """An input leaf that is an object holding state: the ``index``-th such object of the
    call; its ``n`` tensors are graph inputs at its place."""

    index: int
    n: int


@dataclasses.dataclass(frozen=True)
class StateOut:
    """An output leaf that is the call's ``index``-th input object, updated."""

    index: int


@dataclasses.dataclass(frozen=True, eq=False)
class NewState:
    """An output leaf that is an object the forward created (``carried.describe``)."""

    description: Any


class _TensorSlot:
    """Marks a tensor leaf in ``in_consts``/``out_consts`` (None is a real constant there)."""

    def __repr__(self) -> str:
        return "TENSOR"

    def __reduce__(self):
        return "TENSOR"


TENSOR = _TensorSlot()


@dataclasses.dataclass
class SplitProgram:
    """Forward: (param shards, buffers, inputs) -> (outputs, mutated buffers, saved).
    Backward: (saved, tangents, accumulated gradients) -> (gradient shards, input
    gradients)."""

    fwd: fx.GraphModule
    bwd: fx.GraphModule | None
    fwd_roles: list  # role of each forward output before the saved tensors
    bwd_roles: list  # role of each backward output
    saved: list  # names of the joint-graph nodes saved across
    n_tangents: int
    # backward inputs after the tangents: the FQN of each accumulated gradient (grad_acc)
    acc_fqns: list = dataclasses.field(default_factory=list)

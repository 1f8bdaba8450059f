"""``autoshard(model)`` and the ShardedModule it returns."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import inspect
import warnings
from typing import Any, Optional

import torch

from autoshard.capture import flat_inputs
from autoshard import compiler
from autoshard.config import Config
from autoshard.errors import AutoshardError
from autoshard import _compat, hooks, state
from autoshard._compat import tree_flatten
from autoshard.config import offloads
from autoshard.config_model import check_names
from autoshard.plans import Plan
from autoshard.runtime import dist as _dist
from autoshard.runtime import optim
from autoshard.runtime.executor import Program
from autoshard.runtime.replicas import refresh_replicas
from autoshard.runtime.storage import (check_shardable, fqn_aliases, full_state_dict, place,
                                       stage_shards)
from autoshard.spec import param_specs


@dataclasses.dataclass
class _State:
    mesh: Any
    device: torch.device
    config: Config
    orig_forward: Any
    aliases: dict
    param_refs: list = dataclasses.field(default_factory=list)  # (module, name), capture order
    buffer_refs: list = dataclasses.field(default_factory=list)
    programs: dict = dataclasses.field(default_factory=dict)
    last: Optional[Program] = None
    agreement: Any = None  # runtime.dist.Agreement: ranks agree before each program runs
    exported: Any = None  # runtime.export.Loaded, for a module loaded from an export
    grad_sync: bool = True  # set_requires_gradient_sync
    # FQN -> full local gradient accumulated by steps without gradient sync
    pending: dict = dataclasses.field(default_factory=dict)
    # FQN -> (full replica in the compute dtype, what it was gathered from: runtime.replicas)
    replicas: dict = dataclasses.field(default_factory=dict)
    # signature -> every program captured for it, one per guarded state (autoshard.guards)
    variants: dict = dataclasses.field(default_factory=dict)
    # forward hooks traced into the step: those that return a value (hooks.Replaces) and
    # those the forward registered while captured
    traced_hooks: frozenset = frozenset()
    lifted: dict = dataclasses.field(default_factory=dict)  # (id, name) -> float attributes
    recaptures: dict = dataclasses.field(default_factory=dict)  # guard -> captures it caused
    entry: str = "forward"  # what this state's programs run, for messages
    # (module, attribute) of every entry installed (submodules' forwards, methods), and the
    # path of each submodule by id
    entries: list = dataclasses.field(default_factory=list)
    entry_names: dict = dataclasses.field(default_factory=dict)
    # where the shards are stored, shared by every entry: {"offload": the fraction of the
    # state in host memory once the first plan placed it (None before); later plans keep it}
    placed: dict = dataclasses.field(default_factory=lambda: {"offload": None})

    def __post_init__(self):
        # autoshard's optimizer hooks are in place while a sharded module's state lives
        optim.hold(self)

    # --- what autoshard.check and runtime.export ask of a sharded module's state ------------

    def run_instrumented(self, args, kwargs, tangents: dict, on_node, *, graphs="compiled",
                         params: Optional[dict] = None, buffers: Optional[dict] = None):
        """The last program run again on ``args`` and ``kwargs``, node by node, on this
        state's parameters (gathered whole for the joint graph), buffers, replicas and
        pending gradients (``Program.run_instrumented``: ``tangents``, ``on_node``,
        ``graphs``); ``params`` and ``buffers`` (FQN -> value) stand in for some of them
        (eager's values, the buffers as they were before the step). Every rank calls it
        with the same FQNs: the graphs, and the gathers, are collectives."""
        prog = self.last
        if prog is None:
            raise AutoshardError("nothing ran yet: call the model once before instrumenting "
                                 "its step")
        sharded = [mod._parameters[name] for mod, name in self.param_refs]
        given = params or {}
        own = {f: given[f] if f in given else p.full_tensor() if graphs == "joint" else p
               for f, p in zip(prog.fqns, sharded)}
        bufs = {f: mod._buffers[name]
                for f, (mod, name) in zip(prog.captured.buffer_fqns, self.buffer_refs)}
        bufs.update(buffers or {})
        lifted = [torch.tensor(m.__dict__[n], dtype=torch.float64)
                  for m, n in prog.captured.lifted]
        inputs = flat_inputs(tree_flatten((args, kwargs))[0]) + lifted
        replicas = (refresh_replicas(self.replicas, self.mesh, self.agreement, prog, sharded)
                    if graphs == "compiled" else {})
        return prog.run_instrumented(own, bufs, inputs, tangents, on_node, graphs=graphs,
                                     replicas=replicas, pending=self.pending)

    def placement(self) -> tuple:
        """(mesh, device, config): where and how this state's module is sharded and run."""
        return self.mesh, self.device, self.config

    def ranks(self):
        """The ``runtime.dist.Agreement`` through which this module's ranks agree."""
        return self.agreement

    def compiled_programs(self) -> dict:
        """Input signature -> Program, for each signature compiled in this process."""
        return dict(self.programs)

    def every_program(self, model) -> dict:
        """repr(signature) -> Program: the compiled ones, and for a module loaded from an
        export, the stored ones not called yet (read now)."""
        out = {}
        if self.exported is not None:
            out = {key: self.exported.program(key, model) for key in self.exported.entries}
        out.update((repr(key), prog) for key, prog in self.programs.items())
        return out

    def is_loaded(self) -> bool:
        """Whether the module was loaded from an export (it runs the stored programs)."""
        return self.exported is not None

    def mark_loaded(self, loaded) -> None:
        """From now on the module runs the export ``loaded`` (``runtime.export.Loaded``)."""
        self.orig_forward = None
        self.exported = loaded

    def program_of(self, cap, split, plan) -> Program:
        """A runnable program of a step captured, split and planned elsewhere (an export's
        stored graphs), on this state's mesh and device."""
        return Program(cap, split, plan, self.mesh.size(), _dist.shard_rank(self.mesh),
                       self.device.type, agreement=self.agreement,
                       compiled=self.config.compile)

    def plan_program(self, cap, model) -> Program:
        """A runnable program of the captured step ``cap``, planned for this state's mesh and
        Config (the passes run again: an export's joint graph at another world size)."""
        ctx, plan = compiler.plan_captured(cap, model, group_name=_dist.group_name(self.mesh),
                                           device=self.device, config=self.config,
                                           aliases=self.aliases,
                                           reshard_groups=_reshard_groups(self))
        return _program(self, cap, ctx, plan)


# torch.compile's keyword arguments, which torch.nn.Module.compile passes on
_TORCH_COMPILE_ARGS = frozenset({"fullgraph", "dynamic", "backend", "mode", "options",
                                 "disable"})


class ShardedModule(torch.nn.Module):
    """A model sharded by autoshard. It is the user's model (same object, same attributes,
    same state-dict keys) whose parameters are DTensor shards and whose calls run the compiled
    program. Created by ``autoshard()``; not instantiated directly."""

    _autoshard: _State

    @property
    def _is_accelerate_prepared(self) -> bool:
        """accelerate's mark of a model it has prepared: ``accelerator.prepare`` (and so the
        Trainer) hands this model back as it is instead of wrapping it in
        DistributedDataParallel, which cannot hold DTensor parameters; the model gathers and
        reduces its own. accelerate's autocast is not put around it then, so an accelerate
        configured for mixed precision is refused here, naming autoshard's own setting."""
        _refuse_accelerate_autocast()
        return True

    @_is_accelerate_prepared.setter
    def _is_accelerate_prepared(self, value) -> None:
        pass  # accelerate marks what it prepared; this model is marked from the start

    # Under torch.compile the step is opaque to TorchDynamo: it is a compiled graph already
    # (Config(compile=True) hands it to inductor), and its Python around the graph (guards,
    # agreement, hooks) is what Dynamo must not specialise on. One graph break at the call.
    @torch.compiler.disable
    def forward(self, *args, **kwargs):
        from autoshard.capture import tracing

        if tracing():  # called from a registered method being captured: traced with it
            return self._autoshard.orig_forward(self, *args, **kwargs)
        return _call(self, self._autoshard, args, kwargs)

    # --- compile -------------------------------------------------------------------------

    def precompile(self, *args, **kwargs) -> "ShardedModule":
        """Capture and compile the step for these example inputs (called as the model would
        be) now instead of on the first call with them."""
        st = self._autoshard
        key = _signature(self, st, args, kwargs)
        if key not in st.programs:
            _compile_for(self, st, args, kwargs, key, sharded=True)
        return self

    def compile(self, *args, **kwargs):
        """``torch.nn.Module.compile``: ``torch.compile`` this module's calls, with
        torch.compile's arguments (``backend``, ``mode``, ``fullgraph``, ...). The sharded
        step stays opaque to TorchDynamo (``Config(compile=True)`` compiles the step itself
        with inductor); the code around it is compiled.

        Deprecated: called with example inputs (a tensor among the arguments, or a keyword
        torch.compile does not take) it captures the step now, as ``precompile`` does,
        with a ``DeprecationWarning``; that meaning goes in autoshard 0.3."""
        leaves, _ = tree_flatten((args, kwargs))
        if set(kwargs) - _TORCH_COMPILE_ARGS or any(
                isinstance(x, torch.Tensor) or state.is_state(x) for x in leaves):
            warnings.warn(
                "ShardedModule.compile(*example_inputs) is deprecated and will be removed in "
                "autoshard 0.3: use sharded.precompile(*example_inputs) to capture the step "
                "now. sharded.compile(...) takes torch.compile's arguments, as "
                "torch.nn.Module.compile does.", DeprecationWarning, stacklevel=2)
            return self.precompile(*args, **kwargs)
        return torch.nn.Module.compile(self, *args, **kwargs)

    def register_forward_method(self, name: str) -> None:
        """Run the method ``name`` (``encode``, ``get_text_features``: code that reads the
        parameters outside ``forward``) as a captured step of its own, with its gathers and
        reductions, as FSDP2's ``register_fsdp_forward_method`` does. A submodule's own
        ``forward`` needs no registration: calling ``sharded.lm_head(h)`` directly works."""
        fn = getattr(type(self), name, None)
        if not callable(fn) or name == "forward":
            raise ValueError(f"{_user_class_name(self)} has no method {name!r} to register "
                             "(forward is always captured)")
        _install_entry(self, self._autoshard, name, fn)

    def export(self, path, *, inference: bool = True) -> None:
        """Write the compiled programs, the plan and the parameters to the directory ``path``
        (every rank calls it); ``autoshard.load(path)`` runs them without the model's source,
        at this or another world size. ``inference``: also compile and store each training
        signature's eval-mode, no-gradient program. See ``autoshard.runtime.export``."""
        from autoshard.runtime.export import export

        export(self, path, inference=inference)

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        """FSDP2's switch for gradient accumulation without communication. False: the
        following backward passes reduce no gradient; each parameter's full gradient is
        accumulated locally (every flavour holds one full gradient per parameter for it,
        which the plan of those steps counts). True again: the next backward adds that
        accumulation to its own gradients and reduces the sum, once, as the strategy does,
        so the step equals one over the whole accumulated batch."""
        if not isinstance(requires_gradient_sync, bool):
            raise TypeError("set_requires_gradient_sync takes True or False, got "
                            f"{requires_gradient_sync!r}")
        self._autoshard.grad_sync = requires_gradient_sync

    @contextlib.contextmanager
    def no_sync(self):
        """DistributedDataParallel's context manager of the same name: the backward passes run
        inside it reduce no gradient (``set_requires_gradient_sync(False)``); the first one
        after it reduces them all. accelerate's ``no_sync`` and ``accumulate`` and the
        Trainer's gradient accumulation call it."""
        before = self._autoshard.grad_sync
        self.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.set_requires_gradient_sync(before)

    def set_gradient_divide_factor(self, factor: float) -> None:
        """FSDP2's ``set_gradient_divide_factor``: from the next call, each reduced gradient
        is the sum over the ranks divided by ``factor`` (1.0: their sum, for a loss summed
        rather than averaged over the global batch) instead of their mean; on one rank, the
        gradient divided by it. Applies to every parameter (FSDP2 sets it per module: the
        same factor on every module is this). The division is a node of the step's graphs,
        so a new factor compiles the step once more (``Config.gradient_divide_factor``)."""
        st = self._autoshard
        st.config = dataclasses.replace(st.config, gradient_divide_factor=factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """FSDP2's switch of the same name: from the next call, the gradient collectives
        sum, and the division (by the factor, or by the ranks for the mean) is a step of its
        own (``Config.force_sum_reduction_for_comms``)."""
        st = self._autoshard
        st.config = dataclasses.replace(st.config, force_sum_reduction_for_comms=enable)

    # --- inspection ------------------------------------------------------------------------

    @property
    def plan(self) -> Plan:
        """The plan of the most recently run (or compiled) program."""
        prog = self._autoshard.last
        if prog is None:
            raise AutoshardError(
                "nothing is compiled yet: call the model once or sharded.precompile(*inputs)"
            )
        return prog.plan

    @property
    def units(self) -> list:
        return self.plan.units

    def schedule(self, frees: bool = False) -> str:
        """The ordered collectives of the compiled program as a table; ``frees``: with the
        rows that free gathered parameters (folded into a count otherwise)."""
        return self.plan.schedule_table(frees=frees)

    def record(self, optimizer=None, *inputs):
        """Context manager recording one step run inside it: the communication events in
        order and this rank's live bytes (``autoshard.runtime.record``). Pass the optimizer
        and the step's input tensors so the baseline counts their bytes."""
        from autoshard.runtime.record import record

        extra = sum(x.numel() * x.element_size() for x in inputs if isinstance(x, torch.Tensor))
        return record(self, optimizer, extra_bytes=extra)

    def full_state_dict(self, *, cpu_offload: bool = False, rank0_only: bool = False) -> dict:
        """Full (gathered) tensors under the original keys. Every rank calls it (one
        all-gather per sharded tensor); each gets them, or with ``rank0_only`` rank 0 only
        (the others an empty dict). ``cpu_offload`` returns them in host memory, moved there
        one by one as they are gathered."""
        return full_state_dict(self, cpu_offload=cpu_offload, rank0_only=rank0_only)

    # --- checkpoints ---------------------------------------------------------------------

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """``nn.Module.load_state_dict`` into this rank's shards. Values may be DTensor shards
        of this rank at this world size (``sharded.state_dict()``, DCP's
        ``set_model_state_dict``) or full tensors (an unsharded model's ``state_dict()``,
        ``sharded.full_state_dict()``), of which each rank keeps its own rows. A shard written
        by another rank or at another world size is refused with a ValueError (use DCP to
        change world size). Values are always copied into the existing parameters, whatever
        ``assign`` says, so the optimizer, tied references and compiled programs keep them."""
        return super().load_state_dict(state_dict, strict=strict, assign=False)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # runs before any submodule loads: every key of the model is checked and localized
        # here, so a refused shard leaves the whole model untouched
        from autoshard.runtime.checkpoint import localize_state_dict

        localize_state_dict(self, state_dict, prefix)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        optim.note_update(list(self.parameters()))


def _refuse_accelerate_autocast() -> None:
    """ValueError where accelerate (imported) is set up for mixed precision: it would not
    apply to a sharded model, which would silently train in its parameters' dtype."""
    import sys

    state = sys.modules.get("accelerate.state")
    shared = getattr(getattr(state, "AcceleratorState", None), "_shared_state", {})
    precision = str(shared.get("_mixed_precision", "no"))
    if precision not in ("no", "None"):
        dtype = {"bf16": "bfloat16", "fp16": "float16"}.get(precision, precision)
        raise ValueError(
            f"accelerate's mixed_precision={precision!r} cannot reach a model autoshard "
            "compiled (accelerate would put its autocast around the model, and leaves this "
            "one as it is): set it in the model's Config instead, "
            f"autoshard(model, config=Config(mp_policy=MixedPrecisionPolicy(param_dtype="
            f"torch.{dtype}))) (from torch.distributed.fsdp import MixedPrecisionPolicy), "
            "and leave accelerate's (the Trainer's bf16/fp16) off")


def _call(module, st: _State, args, kwargs):
    """One call of an entry (a sharded model's forward, a submodule called directly, a
    registered method): its program for these inputs, run on the current parameters."""
    if st.exported is not None and st.exported.inference and torch.is_grad_enabled():
        with torch.no_grad():  # an inference load holds forward-only programs
            return _call(module, st, args, kwargs)
    leaves, _ = tree_flatten((args, kwargs))
    key = _signature(module, st, args, kwargs)
    # the step counts only once every rank agreed to it: after a refusal the ranks are at the
    # same count again, so the next matching call trains
    step = st.agreement.step + 1
    # a rank whose Python changed (a config that rank 0 alone saved) captures again, and then
    # every rank does, so that all run the same collectives
    found = _cached(st, key)
    again = st.agreement(f"step {step}: {st.entry}", _describe(args, kwargs, key),
                         exact=repr(key), flag=found is None)
    st.agreement.step = step
    tensors = flat_inputs(leaves)
    objects = [x for x in leaves if state.is_state(x)]
    for attempt in range(2):  # again only if a hook turned out to change values
        if attempt:
            found, again = _cached(st, key), False
        prog = _program_for(module, st, args, kwargs, key, None if again else found)
        st.last = prog
        params = [mod._parameters[name] for mod, name in st.param_refs]
        buffers = [mod._buffers[name] for mod, name in st.buffer_refs]
        replicas = refresh_replicas(st.replicas, st.mesh, st.agreement, prog, params)
        lifted = [torch.tensor(m.__dict__[n], dtype=torch.float64)
                  for m, n in prog.captured.lifted]
        user, new_bufs = prog.run(params, buffers, tensors + lifted, replicas, st.pending)
        cap = prog.captured
        if not cap.taps:
            break
        try:
            end = len(user) - cap.n_state
            hooks.replay(cap.taps, user[end - cap.n_taps:end], st.traced_hooks)
            break
        except hooks.Replaces as r:  # trace it into the step and run the call again
            st.traced_hooks = st.traced_hooks | {r.key}
            hooks.warn_traced(r.what)
    if new_bufs:
        with torch.no_grad():
            for i, new in zip(prog.mutated_slots, new_bufs):
                buffers[i].copy_(new)
    written = user[len(user) - prog.captured.n_state:] if prog.captured.n_state else []
    for k, description in prog.captured.state_in:  # the objects, left as eager leaves them
        state.apply(objects[k], description, state.tensors(objects[k]), written)
    return prog.unflatten(user, objects, written)


def _cached(st: _State, key):
    """The program for ``key`` whose guards all hold on this rank, or None."""
    prog = st.programs.get(key)
    if prog is not None and _holds(st, prog):
        return prog
    for other in st.variants.get(key, ()):
        if other is not prog and _holds(st, other):
            st.programs[key] = other
            return other
    return None


def _program_for(module, st: _State, args, kwargs, key, found) -> Program:
    """The program for this call: ``found`` (``_cached``'s, where every rank found one), or
    a new capture. A float attribute that changed is read as an input from then on; a change
    that cannot be followed (a new unsharded parameter, a device move), or a signature
    captured ``RECAPTURE_LIMIT`` times, is refused naming it."""
    if found is not None:
        return found
    prog = st.programs.get(key)
    if prog is not None and prog.captured.traced_hooks == st.traced_hooks \
            and not _holds(st, prog):
        _follow(module, st, prog.captured.guards)
    return _compile_for(module, st, args, kwargs, key, sharded=True)


def _signature(module, st: _State, args, kwargs):
    parts = []
    leaves, spec = tree_flatten((args, kwargs))
    for x in leaves:
        if isinstance(x, torch.Tensor):
            if x.device != st.device:
                _refuse_device(args, kwargs, st.device)
            parts.append((tuple(x.shape), x.dtype, x.requires_grad, tuple(x.stride())))
        elif state.is_state(x):
            parts.append(("state", state.signature(x)))
        else:
            parts.append(("const", type(x).__name__, repr(x)))
    params = [mod._parameters[name] for mod, name in st.param_refs]
    grads = tuple(p.requires_grad for p in params)
    # the parameters' dtypes: a cast on one rank only (.double()) is then named as such
    dtypes = tuple(sorted({str(p.dtype).replace("torch.", "") for p in params}))
    # gradients: reduced, kept local, or reduced with what earlier steps kept
    sync = ((("sync" if not st.pending else "sync+accumulated") if st.grad_sync
             else "local") if torch.is_grad_enabled() else "-")
    sync += _divides(st.config) if sync.startswith("sync") else ""
    return (str(spec), tuple(parts), module.training, torch.is_grad_enabled(), grads,
            _compat.autocast_state(st.device.type), sync, dtypes)


def _refuse_device(args, kwargs, device) -> None:
    """Name the first input tensor not on this rank's mesh ``device``; on the meta device,
    say that it holds no values."""
    from autoshard.capture import input_names

    name, x = next((n, x) for n, x in input_names(args, kwargs)
                   if isinstance(x, torch.Tensor) and x.device != device)
    what = f"input {name} ({str(x.dtype).replace('torch.', '')}{list(x.shape)})"
    if x.device.type == "meta":
        raise AutoshardError(
            f"{what} is on the meta device: a meta tensor has a shape but no values, so no "
            f"step can run on it. Pass a tensor with values on this rank's mesh device "
            f"({device}) (a meta-device model is materialised by autoshard(); its inputs "
            "are not)")
    raise AutoshardError(
        f"{what} is on {x.device} but this rank's mesh device is {device}; move inputs "
        f"with .to({str(device)!r}) before calling the model")


def _compile_for(module, st: _State, args, kwargs, key, *, sharded: bool) -> Program:
    if st.exported is not None:
        return _stored(module, st, args, kwargs, key)
    try:
        prog = _compile(module, st, args, kwargs)
    except AutoshardError as e:
        if sharded:
            raise AutoshardError(
                f"{e}\nThe parameters are already sharded; call sharded.full_state_dict() "
                "to get the full tensors back (for example to load into an unsharded "
                "copy), or pass example_inputs= to autoshard() so capture runs before "
                "anything is sharded."
            ) from e.__cause__
        raise
    prog.described = (_describe(args, kwargs, key), key[2], key[3])
    st.programs[key] = prog
    kept = st.variants.setdefault(key, [])
    kept.append(prog)
    del kept[:-VARIANTS_KEPT]  # the oldest go: a state long left is captured again if seen
    return prog


def _stored(module, st: _State, args, kwargs, key) -> Program:
    """A loaded module's program for this call: one of the export's, or an error."""
    prog = st.exported.program(repr(key), module)
    for autocast in _compat.legacy_autocast_states(key[5]) if prog is None else ():
        # an export written before 0.3 named the autocast state by device type
        prog = st.exported.program(repr((*key[:5], autocast, *key[6:])), module)
        if prog is not None:
            break
    if prog is None:
        calls = "\n".join(f"  {c}" for c in st.exported.calls)
        raise AutoshardError(
            f"this model was loaded from the export {st.exported.path}, which holds no "
            f"program for this call:\n  {_describe(args, kwargs, key)}\nIt holds:\n"
            f"{calls}\nCall it as one of those (the model's source, which could capture "
            "another, is not part of an export), or export again after compiling this "
            "call (sharded.precompile(*inputs)).")
    st.programs[key] = prog
    return prog


def _entry_state(root_st: _State, module, name: str, fn) -> _State:
    """The state of an entry other than the root's forward: the root's mesh, config and
    agreement, its own programs over ``module``'s parameters."""
    st = _State(root_st.mesh, root_st.device, root_st.config, fn, fqn_aliases(module),
                agreement=root_st.agreement, entry=name, placed=root_st.placed)
    st.param_refs = _refs(module, "_parameters", module.named_parameters())
    st.buffer_refs = _refs(module, "_buffers", module.named_buffers())
    return st


def _install_entry(module, root_st: _State, name: str, fn) -> None:
    """Make ``module.<name>`` run as its own captured step when called from outside a
    capture; inside one (the root's forward calling it) the original runs, to be traced.
    The entry is a method bound to ``module``: a copy of the module (``copy.deepcopy``)
    gets one bound to the copy, which refuses to run another module's programs."""
    import functools
    import types

    from autoshard.capture import tracing

    label = f"{_user_class_name(module)}.{name}" if name != "forward" else \
        f"{root_st.entry_names.get(id(module), '?')} (called directly)"
    state: list = []

    @torch.compiler.disable  # opaque to TorchDynamo, as the root's forward
    @functools.wraps(fn)
    def entry(self, *args, **kwargs):
        if tracing():
            return fn(self, *args, **kwargs)
        if self is not module:
            raise AutoshardError(
                f"{label}: this module is a copy of one of a sharded model's (copy.deepcopy), "
                "whose parameters are that model's shards. Copy the model before autoshard(), "
                "or take sharded.full_state_dict() into an unsharded copy.")
        if not state:
            state.append(_entry_state(root_st, module, label, fn))
        st = state[0]
        st.grad_sync, st.config = root_st.grad_sync, root_st.config  # the root's setters
        return _call(module, st, args, kwargs)

    entry._autoshard_entry = True
    module.__dict__[name] = types.MethodType(entry, module)
    root_st.entries.append((module, name))


def _user_class_name(module) -> str:
    from autoshard.capture import class_name as _class_name

    return _class_name(module)


def _reshard_groups(st: _State) -> dict:
    """This rank's hpZ group of each size a plan of ``st.config`` may use, by size."""
    sizes = compiler.reshard_sizes(st.config, tuple(st.mesh.shape), st.device)
    return _dist.reshard_groups(st.mesh, sizes)


def _compile(model: torch.nn.Module, st: _State, args, kwargs) -> Program:
    cap, ctx, plan = compiler.compile_step(
        model, st.orig_forward, args, kwargs, world_size=tuple(st.mesh.shape),
        group_name=_dist.group_name(st.mesh), device=st.device, config=st.config,
        reshard_groups=_reshard_groups(st), aliases=st.aliases, grad_sync=st.grad_sync,
        accumulated=bool(st.pending) and st.grad_sync, traced_hooks=st.traced_hooks,
        placed=st.placed["offload"],
        lifted=tuple((m, n) for m, n in st.lifted.values() if type(m.__dict__.get(n)) is float),
    )
    st.traced_hooks = st.traced_hooks | cap.traced_hooks  # with those the forward installed
    return _program(st, cap, ctx, plan, model)


def _holds(st: _State, prog: Program) -> bool:
    """Whether ``prog`` is what eager would run now (a loaded export's programs carry no
    guards: their model has no Python to change)."""
    cap = prog.captured
    return cap.guards is None or (cap.traced_hooks == st.traced_hooks
                                  and cap.guards.failure() is None)


RECAPTURE_LIMIT = 8  # captures one changing value may cause, as TorchDynamo's limit
VARIANTS_KEPT = 16  # programs kept per call signature, one per state of what forward read


def _follow(model, st: _State, guards) -> None:
    """Make what changed since ``guards`` were taken capturable, or refuse it by name: a
    value that has made the step be captured ``RECAPTURE_LIMIT`` times already."""
    from autoshard.runtime import optim as _optim

    g = guards.failure()
    change = guards.change(g)
    if g.kind == "tree":
        for fqn, p in model.named_parameters():
            if not _optim.is_marked(p):
                raise AutoshardError(
                    f"the model changed after autoshard() ({change}): parameter '{fqn}' is "
                    "not sharded, so no step can train it. Change the model's modules and "
                    "parameters before autoshard(), or build a new model and autoshard() it.")
        st.param_refs = _refs(model, "_parameters", model.named_parameters())
        st.buffer_refs = _refs(model, "_buffers", model.named_buffers())
    elif g.kind == "dtype":
        for fqn, p in model.named_parameters():
            if p.device != st.device:
                raise AutoshardError(
                    f"parameter '{fqn}' was moved to {p.device} after autoshard(), but this "
                    f"rank's mesh device is {st.device}: the shards stay on the mesh's device. "
                    "Move the model before autoshard(), or pass a mesh on the device you "
                    "want.")
    elif g.kind == "attr" and isinstance(g.key[0].__dict__.get(g.key[1]), float) \
            and g.expected[0] is float:
        mod, name = g.key  # a float that changes (annealed): read it as an input from now on
        st.lifted[(id(mod), name)] = (mod, name)
    st.recaptures[g.what] = st.recaptures.get(g.what, 0) + 1
    if st.recaptures[g.what] >= RECAPTURE_LIMIT:
        raise AutoshardError(
            f"the model's step was captured {RECAPTURE_LIMIT} times because the same value "
            f"its forward reads keeps changing; the latest change: {change}. Make the value "
            "a tensor (register_buffer) or an input of forward, so one captured step reads "
            "it on every call.")


def _program(st: _State, cap, ctx, plan, model=None) -> Program:
    """The runnable program of a planned step, once every rank has the same schedule; the
    plan's placement (the shards it keeps in host memory) applied to ``model``'s parameters
    (``storage.place``) when it is the first plan, so later plans keep it."""
    # the same signature can still compile differently (a rank-dependent model): compare
    st.agreement(f"step {st.agreement.step}: compiled program",
                 f"{len(plan.units)} units, {len(plan.schedule)} communication steps",
                 exact=repr([(e.region, e.unit, e.op, e.bytes) for e in plan.schedule]))
    if model is not None:
        pin = getattr(st.config.offload_policy, "pin_memory", True)
        place(model, cap.params, st.device, pin=pin)
        st.placed["offload"] = plan.offload
    prog = Program(cap, ctx.split, plan, st.mesh.size(), _dist.shard_rank(st.mesh),
                   st.device.type, agreement=st.agreement,
                   compiled=st.config.compile)
    prog.hook_owner = st
    st.last = prog
    return prog


def _divides(config: Config) -> str:
    """How the gradient reduction divides, for the input signature: "" for the default
    mean, so the programs compiled, and exported, without a setting keep their keys."""
    f, forced = config.gradient_divide_factor, config.force_sum_reduction_for_comms
    return (f" / {f!r}" if f is not None else "") + (" (sum)" if forced else "")


def _describe(args, kwargs, key) -> str:
    """A rank's call as a person reads it: each input's dtype and shape, and the mode."""
    from autoshard._compat import keystr, tree_flatten_with_path

    parts = []
    for path, x in tree_flatten_with_path((args, kwargs))[0]:
        rest = keystr(path[1:])  # path[0] says args or kwargs
        name = f"args{rest}" if path[0].idx == 0 else rest[2:].replace("']", "", 1)
        if isinstance(x, torch.Tensor):
            parts.append(f"{name} {str(x.dtype).replace('torch.', '')}{list(x.shape)}")
        else:
            parts.append(f"{name}={x!r}"[:60])
    training, grad, autocast = key[2], key[3], key[5]
    casts = [f"{t} {str(d).replace('torch.', '')}" for t, on, d in autocast if on]
    mode = ("train" if training else "eval") + (", grad" if grad else ", no grad")
    if len(key) > 7 and key[7] != ("float32",):
        mode += f", parameters {' and '.join(key[7])}"
    mode += f", autocast {', '.join(casts)}" if casts else ""
    return f"{', '.join(parts)} ({mode})"


def plan(model: torch.nn.Module, example_inputs=None, *, world_size: int, config=None,
         device="cpu", make_inputs=None, batch: Optional[int] = None,
         seq: Optional[int] = None, progress=None) -> Plan:
    """The plan autoshard would run for ``model`` on ``world_size`` ranks, computed in this
    process on fake tensors: no process group, no parameter memory (the model may live on the
    meta device). A stack of 12 or more identical blocks is traced 5 and 6 blocks deep and
    the full graph built from those (``autoshard.depth``, which checks itself and otherwise
    traces the whole model).

    make_inputs: ``fn(batch, seq) -> inputs``; with it (and ``batch``, ``seq``) the plan also
    gets memory and time as sympy expressions in batch and seq, fitted from traces at
    (batch, seq), (2 batch, seq) and (batch, 2 seq) with the units held fixed:
    ``a + batch * (b * seq + c * seq**2)``, exact for transformer activations (linear in the
    batch, linear plus attention-quadratic in the sequence). ``plan.max_batch_size(budget)``
    then answers without running.
    """
    if isinstance(model, ShardedModule):
        raise ValueError("plan() takes the unsharded model; a ShardedModule has .plan")
    shape = world_size if isinstance(world_size, tuple) else (world_size,)
    if len(shape) not in (1, 2) or not all(isinstance(n, int) and n >= 1 for n in shape):
        raise ValueError(f"world_size must be a positive int, or (replicate, shard) for "
                         f"hybrid sharding, got {world_size!r}")
    if make_inputs is not None:
        if batch is None or seq is None:
            raise ValueError("plan(make_inputs=...) needs batch= and seq= to start from")
        example_inputs = make_inputs(batch, seq)
    if example_inputs is None:
        raise ValueError("plan() needs example_inputs, or make_inputs with batch and seq")
    config = config if config is not None else Config()
    if not isinstance(config, Config):
        raise TypeError(f"config must be an autoshard.Config, got {type(config).__name__}")
    check_names(config, model)
    device = torch.device(device)

    def one(inputs, cfg):
        args, kwargs = _split_inputs(inputs)
        return compiler.compile_step(model, type(model).forward, args, kwargs,
                                     world_size=world_size, group_name="plan", device=device,
                                     config=cfg, progress=progress, from_shallow=True)[2]

    p = one(example_inputs, config)
    if make_inputs is not None:
        # the recomputation pinned names each block's choice, offloading included
        pinned = dataclasses.replace(config, units=p.pinned_units(),
                                     recompute=p.pinned_recompute(), offload_activations=None)
        if progress:
            progress("fitting memory and time in batch and seq (two more traces)")
        p2 = one(make_inputs(2 * batch, seq), pinned)
        p3 = one(make_inputs(batch, 2 * seq), pinned)
        p.symbolic = compiler.fit_symbolic(p, p2, p3, batch, seq)
    return p


def _split_inputs(example_inputs):
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    return (example_inputs,), {}


def _refs(model, attr: str, named) -> list:
    """(owning module, attribute) for each named tensor, so a call reads them cheaply."""
    out = []
    for fqn, _ in named:
        mod_path, _, name = fqn.rpartition(".")
        out.append((model.get_submodule(mod_path), name))
    return out


def _install_submodule_entries(model, st: _State) -> None:
    """Every submodule holding parameters can be called directly (a chunked loss calling
    ``lm_head``, one block run alone): its forward becomes an entry of its own."""
    for path, mod in model.named_modules():
        if mod is model or "forward" in mod.__dict__ or next(mod.parameters(), None) is None:
            continue
        st.entry_names[id(mod)] = path
        _install_entry(mod, st, "forward", type(mod).forward)


def _sharded_class(cls: type) -> type:
    """The class a sharded ``cls`` becomes: ShardedModule's calls, ``cls``'s everything else,
    and ``forward`` with ``cls.forward``'s signature and docstring, so a library that reads
    the signature (the Trainer keeps only the batch columns forward names) sees the model's
    own arguments."""
    if issubclass(cls, ShardedModule):
        return cls

    def forward(self, *args, **kwargs):
        return ShardedModule.forward(self, *args, **kwargs)

    forward.__doc__ = cls.forward.__doc__
    try:
        forward.__signature__ = inspect.signature(cls.forward)
    except (TypeError, ValueError):  # a forward inspect cannot read: (*args, **kwargs)
        pass
    return type(f"Sharded{cls.__name__}", (ShardedModule, cls),
                {"__module__": cls.__module__, "forward": forward})


_AT_START = "autoshard() (the Config and the model's parameters)"


def _agree_on_model(agreement, model, config: Config) -> None:
    """The first collective of ``autoshard()``: every rank has the same Config and the same
    parameters (names, shapes, dtypes), compared as one digest. On a difference every rank
    raises naming the first Config field that differs, else the first parameter, with each
    rank's value; a few more notes are exchanged to find them (``Agreement.notes``)."""
    # each field as the user spells it (Prefetch(depth=3), not its record's dict)
    fields = [(f.name, repr(getattr(config, f.name))) for f in dataclasses.fields(config)]
    named = {f: _param_line(f, p) for f, p in model.named_parameters()}
    params = list(named.values())

    def explain(counts) -> str:
        kept = ("; nothing was sharded, and the process group is intact (rank "
                f"{agreement.rank} reports this)")
        digests = agreement.notes(_AT_START, ",".join(
            hashlib.sha256(v.encode()).hexdigest()[:16] for _, v in fields))
        for i, (name, _) in enumerate(fields):
            if len({tuple(d.split(",")[i:i + 1]) for d in digests}) > 1:
                values = agreement.notes(_AT_START, fields[i][1])
                ranks = ", ".join(f"rank {r}: {v[:200]}" for r, v in enumerate(values))
                return (f"Config.{name} differs between ranks: {ranks}. Every rank must pass "
                        f"autoshard() the same Config: the ranks plan and run one schedule "
                        f"together{kept}.")
        i = agreement.first_difference(_AT_START, params)
        if i is None:
            return f"the ranks' Config or parameters differ{kept}."
        at = agreement.notes(_AT_START, params[i] if i < len(params) else "")
        fqn = next(n.split("'")[1] for n in at if n)
        by_name = agreement.notes(_AT_START, named.get(fqn) or _no_parameter(model, fqn))
        lines, what = by_name, f"parameter '{fqn}'"
        if len(set(by_name)) == 1:  # the same parameter everywhere, in another place
            lines = [n or f"(none: it has {c})" for n, c in zip(at, counts)]
            what = f"the {_ordinal(i + 1)} parameter (the ranks list them in another order)"
        ranks = "\n".join(f"  rank {r}: {n}" for r, n in enumerate(lines))
        return (f"the model differs between ranks at {what}:\n{ranks}\n("
                f"{', '.join(f'rank {r}: {n}' for r, n in enumerate(counts))}.) Every rank "
                "must build the same model (the same code, arguments and config) before "
                f"autoshard(): the ranks shard and gather each parameter together{kept}.")

    agreement(_AT_START, f"{len(params)} parameters", exact=repr((fields, params)),
              explain=explain)


def _param_line(fqn: str, p) -> str:
    return f"'{fqn}' {str(p.dtype).replace('torch.', '')}{list(p.shape)}"


def _no_parameter(model, fqn: str) -> str:
    """What a rank without parameter ``fqn`` has at its place, for a message."""
    parts = fqn.split(".")
    for k in range(len(parts) - 1, -1, -1):
        path = ".".join(parts[:k])
        try:
            mod = model.get_submodule(path)
        except AttributeError:
            continue
        where = f"module '{path}'" if path else "the model"
        cls = type(mod).__name__
        if isinstance(mod, (torch.nn.ModuleList, torch.nn.Sequential, torch.nn.ModuleDict)):
            return f"(no such parameter; {where} ({cls}) holds {len(mod)} modules)"
        return f"(no such parameter; {where} ({cls}) has no '{parts[k]}')"
    return "(no such parameter)"


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def autoshard(model: torch.nn.Module, *, mesh=None, config: Optional[Config] = None,
              example_inputs=None, param_init_fn=None) -> ShardedModule:
    """Shard ``model``'s parameters over ``mesh`` and compile its training step.

    mesh: a 1-D DeviceMesh, or a 2-D one with dimensions ("replicate", "shard") for hybrid
        sharding (HSDP: sharded within each group of the "shard" dimension, replicated across
        the groups, gradients reduce-scattered within and all-reduced across); defaults to
        a 1-D mesh over the default process group (initialised from a torchrun environment
        if needed; world size 1 if there is none). A 1-D mesh over some of the ranks is
        refused unless ``Config(partial_mesh=True)``.
    config: an ``autoshard.Config``.
    example_inputs: a tuple of positional inputs (or a dict of keyword inputs). With it, the
        step is captured and compiled now; without it, the first call captures.
    param_init_fn: for a model on the meta device, ``fn(module)`` initialising the module's
        own parameters and buffers in place; it runs on every module, children first, after
        the layers' own initialisation (see below), like code run after building the model.
        Ignored when no tensor is on the meta device.

    A meta-device model is materialised one module at a time: the module's own tensors are
    allocated full size on the mesh device, initialised, cut to this rank's rows and freed
    before the next, so memory peaks near this rank's shards plus the largest module. The
    initialisation replays what building the model on the device does, in its order: for a
    model built under ``autoshard.deferred_init()``, every op its constructor ran on its
    tensors; otherwise every layer's ``reset_parameters()`` (children first, in registration
    order) and a Hugging Face model's ``_init_weights`` (its post_init, rotary ``inv_freq``
    included); then ``param_init_fn``. With the same seed the shards are bitwise the rows of
    the model built on the device. A tensor nothing initialises, and one the constructor wrote
    beyond what can be replayed (an ``nn.init`` call in ``__init__`` of a model built under
    plain ``torch.device("meta")``) that ``param_init_fn`` does not initialise, raise
    ``ValueError`` naming it.

    Before anything else collective, the ranks compare their Configs and their models'
    parameters (names, shapes, dtypes); on a difference every rank raises ``AutoshardError``
    naming the first field or parameter that differs and each rank's value.

    All or nothing: if anything fails (a model another wrapper such as FSDP2's
    ``fully_shard`` already distributes, an initialisation error, a capture error with
    ``example_inputs``), the model is left exactly as it was: the same parameter and buffer
    objects with the same values on the same device, the same class. Returns the same model
    object, now a ``ShardedModule``.
    """
    config = _checked(model, config, param_init_fn)
    mesh = mesh if mesh is not None else _dist.default_mesh(config.timeout)
    _dist.check_mesh(mesh, config.partial_mesh)
    device = _dist.mesh_device(mesh)
    st = _State(mesh, device, config, type(model).forward, fqn_aliases(model),
                agreement=_dist.Agreement(mesh, config.timeout))
    _agree_on_model(st.agreement, model, config)
    example = _example(example_inputs, device)
    # each parameter's placement, decided once; every new tensor is built before anything
    # changes, then swapped in, and undone on failure
    specs = param_specs(model, mesh_shape=tuple(mesh.shape), offload=offloads(config),
                        strategy="zero3" if config.strategy == "auto" else config.strategy)
    staged = stage_shards(model, mesh, device, specs, param_init_fn=param_init_fn,
                          pin_memory=getattr(config.offload_policy, "pin_memory", True))
    cls = type(model)
    undo = staged.commit()
    try:
        model.__class__ = _sharded_class(cls)
        model._autoshard = st
        st.param_refs = _refs(model, "_parameters", model.named_parameters())
        st.buffer_refs = _refs(model, "_buffers", model.named_buffers())
        _install_submodule_entries(model, st)
        if example is not None:
            args, kwargs = example
            _compile_for(model, st, args, kwargs, _signature(model, st, args, kwargs),
                         sharded=False)
    except BaseException:
        for mod, name in st.entries:
            mod.__dict__.pop(name, None)
        undo()
        model.__class__ = cls
        model.__dict__.pop("_autoshard", None)
        raise
    return model


def _example(example_inputs, device):
    """``autoshard(example_inputs=)`` as ``(args, kwargs)`` (None without), every tensor on
    the mesh's ``device``."""
    if example_inputs is None:
        return None
    args, kwargs = _split_inputs(example_inputs)
    for x in tree_flatten((args, kwargs))[0]:
        if isinstance(x, torch.Tensor) and x.device != device:
            raise AutoshardError(
                f"example input on {x.device} but this rank's mesh device is {device}; "
                f"move it with .to({str(device)!r})")
    return args, kwargs


def _checked(model, config, param_init_fn) -> Config:
    """``autoshard()``'s arguments checked; the Config (the default one for None)."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"autoshard() takes an nn.Module, got {type(model).__name__}")
    if isinstance(model, ShardedModule):
        raise ValueError(f"{type(model).__name__} is already sharded by autoshard")
    if param_init_fn is not None and not callable(param_init_fn):
        raise TypeError("param_init_fn must be a callable taking a module, got "
                        f"{type(param_init_fn).__name__}")
    check_shardable(model)
    config = config if config is not None else Config()
    if not isinstance(config, Config):
        raise TypeError(f"config must be an autoshard.Config, got {type(config).__name__}")
    check_names(config, model)
    return config

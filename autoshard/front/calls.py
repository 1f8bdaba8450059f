"""One call of a sharded model, and the state it keeps between calls: the program for these
inputs (guarded, captured again where what forward reads changed, on every rank where any
rank's changed), agreed on by the ranks, run on the current shards; the entries that make a
submodule or a registered method a call of its own."""

from __future__ import annotations

import dataclasses
import operator
from typing import Any, Mapping, Optional

import torch

from autoshard import compiler
from autoshard.core import _compat, carried, hooks, writes
from autoshard.front import config_model
from autoshard.core._compat import keystr, tree_flatten, tree_flatten_with_path
from autoshard.compiler.capture import flat_inputs, input_names, tracing
from autoshard.core.config import Config
from autoshard.core.errors import AutoshardError
from autoshard.core.guards import user_class_name
from autoshard.runtime import dist as _dist, optim, optim as _optim, tensor_parallel
from autoshard.runtime.executor import Program
from autoshard.runtime.replicas import refresh_replicas
from autoshard.runtime.storage import fqn_aliases, move_to_host


@dataclasses.dataclass
class CallState:
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
    # signature -> every program captured for it, one per guarded state (autoshard.core.guards)
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
    offload_stored: dict = dataclasses.field(default_factory=lambda: {"offload": None})

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

    def sharding(self) -> tuple:
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
            out = {key: self.exported.program(key, model, self) for key in self.exported.entries}
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
                                           reshard_groups=reshard_groups(self))
        return make_program(self, cap, ctx, plan)


def refuse_accelerate_autocast() -> None:
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


def call(module, st: CallState, args, kwargs):
    """One call of an entry (a sharded model's forward, a submodule called directly, a
    registered method): its program for these inputs, run on the current parameters."""
    if _compat.functorch_active():
        raise AutoshardError(
            "a torch.func transform (grad, vjp, jvp, vmap, functional per-sample gradients) "
            f"around a call of {user_class_name(module)}, sharded by autoshard: its step is a "
            "captured graph of gathers and reductions that the transforms cannot see "
            "through. Call the model under plain autograd (loss.backward(), "
            "torch.autograd.grad), or apply the transform to an unsharded model.")
    if st.exported is not None and st.exported.inference and torch.is_grad_enabled():
        with torch.no_grad():  # an inference load holds forward-only programs
            return call(module, st, args, kwargs)
    leaves, _ = tree_flatten((args, kwargs))
    key = call_key(module, st, args, kwargs)
    # the step counts only once every rank agreed to it: after a refusal the ranks are at the
    # same count again, so the next matching call trains
    step = st.agreement.step + 1
    # a rank whose Python changed (a config that rank 0 alone saved) captures again, and then
    # every rank does, so that all run the same collectives
    found = cached(st, key)
    again = st.agreement(f"step {step}: {st.entry}", lambda: describe_call(args, kwargs, key),
                         exact=lambda: repr(key), flag=found is None)
    st.agreement.step = step
    tensors = flat_inputs(leaves)
    if again and isinstance(st.config.tensor_parallel, Mapping):
        tensor_parallel.check_same_inputs(st.agreement, tensors, st.agreement.mesh.shape[-1],
                                          f"step {step}: the inputs on the 'tp' ranks")
    objects = [x for x in leaves if carried.is_carried(x)]
    for attempt in range(2):  # again only if a hook turned out to change values
        if attempt:
            found, again = cached(st, key), False
        prog = program_for(module, st, args, kwargs, key, None if again else found)
        st.last = prog
        params = [mod._parameters[name] for mod, name in st.param_refs]
        buffers = [mod._buffers[name] for mod, name in st.buffer_refs]
        replicas = refresh_replicas(st.replicas, st.mesh, st.agreement, prog, params)
        lifted = [torch.tensor(m.__dict__[n], dtype=torch.float64)
                  for m, n in prog.captured.lifted]
        user, new_bufs = prog.run(params, buffers, tensors + lifted, replicas, st.pending)
        cap = prog.captured
        if cap.writes:  # what the forward wrote, as eager leaves it, before the hooks run
            writes.apply(cap.writes, cap.written(user))
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
        carried.apply(objects[k], description, carried.tensors(objects[k]), written)
    return prog.unflatten(user, objects, written)


def cached(st: CallState, key):
    """The program for ``key`` whose guards all hold on this rank, or None."""
    prog = st.programs.get(key)
    if prog is not None and holds(st, prog):
        return prog
    for other in st.variants.get(key, ()):
        if other is not prog and holds(st, other):
            st.programs[key] = other
            return other
    return None


def program_for(module, st: CallState, args, kwargs, key, found) -> Program:
    """The program for this call: ``found`` (``cached``'s, where every rank found one), or
    a new capture. A float attribute that changed is read as an input from then on; a change
    that cannot be followed (a new unsharded parameter, a device move), or a signature
    captured ``RECAPTURE_LIMIT`` times, is refused naming it."""
    if found is not None:
        return found
    prog = st.programs.get(key)
    if prog is not None and prog.captured.traced_hooks == st.traced_hooks \
            and not holds(st, prog):
        follow(module, st, prog.captured.guards)
    return compile_for(module, st, args, kwargs, key, sharded=True)


_REQUIRES_GRAD, _DTYPE = operator.attrgetter("requires_grad"), operator.attrgetter("dtype")


def call_key(module, st: CallState, args, kwargs):
    parts = []
    leaves, spec = tree_flatten((args, kwargs))
    for x in leaves:
        if isinstance(x, torch.Tensor):
            if x.device != st.device:
                refuse_device(args, kwargs, st.device)
            parts.append((tuple(x.shape), x.dtype, x.requires_grad, tuple(x.stride())))
        elif carried.is_carried(x):
            parts.append(("state", carried.signature(x)))
        else:
            parts.append(("const", type(x).__name__, repr(x)))
    params = [mod._parameters[name] for mod, name in st.param_refs]
    grads = tuple(map(_REQUIRES_GRAD, params))
    # the parameters' dtypes: a cast on one rank only (.double()) is then named as such
    dtypes = tuple(sorted(str(d).replace("torch.", "") for d in set(map(_DTYPE, params))))
    # gradients: reduced, kept local, or reduced with what earlier steps kept
    sync = ((("sync" if not st.pending else "sync+accumulated") if st.grad_sync
             else "local") if torch.is_grad_enabled() else "-")
    sync += divide_label(st.config) if sync.startswith("sync") else ""
    return (str(spec), tuple(parts), module.training, torch.is_grad_enabled(), grads,
            _compat.autocast_state(st.device.type), sync, dtypes)


def refuse_device(args, kwargs, device) -> None:
    """Name the first input tensor not on this rank's mesh ``device``; on the meta device,
    say that it holds no values."""
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


def compile_for(module, st: CallState, args, kwargs, key, *, sharded: bool) -> Program:
    if st.exported is not None:
        return stored_program(module, st, args, kwargs, key)
    try:
        prog = capture_and_compile(module, st, args, kwargs)
    except AutoshardError as e:
        if sharded:
            raise AutoshardError(
                f"{e}\nThe parameters are already sharded; call sharded.full_state_dict() "
                "to get the full tensors back (for example to load into an unsharded "
                "copy), or pass example_inputs= to autoshard() so capture runs before "
                "anything is sharded."
            ) from e.__cause__
        raise
    prog.described = (describe_call(args, kwargs, key), key[2], key[3])
    st.programs[key] = prog
    kept = st.variants.setdefault(key, [])
    kept.append(prog)
    del kept[:-VARIANTS_KEPT]  # the oldest go: a state long left is captured again if seen
    return prog


def stored_program(module, st: CallState, args, kwargs, key) -> Program:
    """A loaded module's program for this call: one of the export's, or an error."""
    prog = st.exported.program(repr(key), module, st)
    for autocast in _compat.legacy_autocast_states(key[5]) if prog is None else ():
        # an export written before 0.3 named the autocast state by device type
        prog = st.exported.program(repr((*key[:5], autocast, *key[6:])), module, st)
        if prog is not None:
            break
    if prog is None:
        calls = "\n".join(f"  {c}" for c in st.exported.calls)
        raise AutoshardError(
            f"this model was loaded from the export {st.exported.path}, which holds no "
            f"program for this call:\n  {describe_call(args, kwargs, key)}\nIt holds:\n"
            f"{calls}\nCall it as one of those (the model's source, which could capture "
            "another, is not part of an export), or export again after compiling this "
            "call (sharded.precompile(*inputs)).")
    st.programs[key] = prog
    return prog


def entry_state(root_st: CallState, module, name: str, fn) -> CallState:
    """The state of an entry other than the root's forward: the root's mesh, config and
    agreement, its own programs over ``module``'s parameters."""
    st = CallState(root_st.mesh, root_st.device, root_st.config, fn, fqn_aliases(module),
                agreement=root_st.agreement, entry=name, offload_stored=root_st.offload_stored)
    st.param_refs = tensor_refs(module, "_parameters", module.named_parameters())
    st.buffer_refs = tensor_refs(module, "_buffers", module.named_buffers())
    return st


def install_entry(module, root_st: CallState, name: str, fn) -> None:
    """Make ``module.<name>`` run as its own captured step when called from outside a
    capture; inside one (the root's forward calling it) the original runs, to be traced.
    The entry is a method bound to ``module``: a copy of the module (``copy.deepcopy``)
    gets one bound to the copy, which refuses to run another module's programs."""
    import functools
    import types

    path = root_st.entry_names.get(id(module), "")
    label = f"{user_class_name(module)}.{name}" if name != "forward" else \
        f"{path or '?'} (called directly)"
    state: list = []
    configs: dict = {}  # id of the root's config -> (it, as this module reads it)

    def config():
        root = root_st.config
        seen = configs.get(id(root))
        if seen is None or seen[0] is not root:
            configs.clear()
            seen = configs[id(root)] = (root, config_model.for_submodule(root, path))
        return seen[1]

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
            state.append(entry_state(root_st, module, label, fn))
        st = state[0]
        st.grad_sync, st.config = root_st.grad_sync, config()  # the root's setters
        return call(module, st, args, kwargs)

    entry._autoshard_entry = True
    module.__dict__[name] = types.MethodType(entry, module)
    root_st.entries.append((module, name))


def reshard_groups(st: CallState) -> dict:
    """This rank's hpZ group of each size a plan of ``st.config`` may use, by size."""
    sizes = compiler.reshard_sizes(st.config, tuple(st.mesh.shape), st.device)
    return _dist.reshard_groups(st.mesh, sizes)


def capture_and_compile(model: torch.nn.Module, st: CallState, args, kwargs) -> Program:
    cap, ctx, plan = compiler.compile_step(
        model, st.orig_forward, args, kwargs, world_size=tuple(st.mesh.shape),
        group_name=_dist.group_name(st.mesh), device=st.device, config=st.config,
        reshard_groups=reshard_groups(st), aliases=st.aliases, grad_sync=st.grad_sync,
        accumulated=bool(st.pending) and st.grad_sync, traced_hooks=st.traced_hooks,
        offload_stored=st.offload_stored["offload"],
        lifted=tuple((m, n) for m, n in st.lifted.values() if type(m.__dict__.get(n)) is float),
    )
    st.traced_hooks = st.traced_hooks | cap.traced_hooks  # with those the forward installed
    return make_program(st, cap, ctx, plan, model)


def holds(st: CallState, prog: Program) -> bool:
    """Whether ``prog`` is what eager would run now (a loaded export's programs carry no
    guards: their model has no Python to change)."""
    cap = prog.captured
    return cap.guards is None or (cap.traced_hooks == st.traced_hooks
                                  and cap.guards.failure() is None)


RECAPTURE_LIMIT = 8  # captures one changing value may cause, as TorchDynamo's limit


VARIANTS_KEPT = 16  # programs kept per call signature, one per state of what forward read


def follow(model, st: CallState, guards) -> None:
    """Make what changed since ``guards`` were taken capturable, or refuse it by name: a
    value that has made the step be captured ``RECAPTURE_LIMIT`` times already."""
    g = guards.failure()
    change = guards.change(g)
    if g.kind == "tree":
        for fqn, p in model.named_parameters():
            if not _optim.is_marked(p):
                raise AutoshardError(
                    f"the model changed after autoshard() ({change}): parameter '{fqn}' is "
                    "not sharded, so no step can train it. Change the model's modules and "
                    "parameters before autoshard(), or build a new model and autoshard() it.")
        st.param_refs = tensor_refs(model, "_parameters", model.named_parameters())
        st.buffer_refs = tensor_refs(model, "_buffers", model.named_buffers())
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


def make_program(st: CallState, cap, ctx, plan, model=None) -> Program:
    """The runnable program of a planned step, once every rank has the same schedule; the
    plan's hosting (the shards it keeps in host memory) applied to ``model``'s parameters
    (``storage.place``) when it is the first plan, so later plans keep it."""
    # the same signature can still compile differently (a rank-dependent model): compare
    st.agreement(f"step {st.agreement.step}: compiled program",
                 f"{len(plan.units)} units, {len(plan.schedule)} communication steps",
                 exact=repr([(e.region, e.unit, e.op, e.bytes) for e in plan.schedule]))
    if model is not None:
        pin = getattr(st.config.offload_policy, "pin_memory", True)
        move_to_host(model, cap.params, st.device, pin=pin)
        st.offload_stored["offload"] = plan.offload
    prog = Program(cap, ctx.split, plan, st.mesh.size(), _dist.shard_rank(st.mesh),
                   st.device.type, agreement=st.agreement,
                   compiled=st.config.compile)
    prog.hook_owner = st
    st.last = prog
    return prog


def divide_label(config: Config) -> str:
    """How the gradient reduction divides, for the input signature: "" for the default
    mean, so the programs compiled, and exported, without a setting keep their keys."""
    f, forced = config.gradient_divide_factor, config.force_sum_reduction_for_comms
    return (f" / {f!r}" if f is not None else "") + (" (sum)" if forced else "")


def describe_call(args, kwargs, key) -> str:
    """A rank's call as a person reads it: each input's dtype and shape, and the mode."""
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


def tensor_refs(model, attr: str, named) -> list:
    """(owning module, attribute) for each named tensor, so a call reads them cheaply."""
    out = []
    for fqn, _ in named:
        mod_path, _, name = fqn.rpartition(".")
        out.append((model.get_submodule(mod_path), name))
    return out


def install_submodule_entries(model, st: CallState) -> None:
    """Every submodule holding parameters can be called directly (a chunked loss calling
    ``lm_head``, one block run alone): its forward becomes an entry of its own."""
    for path, mod in model.named_modules():
        if mod is model or "forward" in mod.__dict__ or next(mod.parameters(), None) is None:
            continue
        st.entry_names[id(mod)] = path
        install_entry(mod, st, "forward", type(mod).forward)


def split_inputs(example_inputs):
    """Example inputs as ``(args, kwargs)``: a dict is keyword inputs, a tuple or list the
    positional ones, anything else the one positional input."""
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    return (example_inputs,), {}

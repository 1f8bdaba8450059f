"""``autoshard(model)`` and the ShardedModule it returns."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import inspect
import warnings
from typing import Callable, Mapping, Optional

import torch

from autoshard import compiler
from autoshard.core._compat import tree_flatten
from autoshard.front.calls import (CallState, call, call_key, compile_for, install_entry,
                                   install_submodule_entries, refuse_accelerate_autocast,
                                   split_inputs, tensor_refs)
from autoshard.compiler.capture import tracing
from autoshard.core.config import Config, offloads
from autoshard.front.config_model import check_names
from autoshard.core.errors import AutoshardError
from autoshard.core.guards import user_class_name
from autoshard.core.plans import Plan
from autoshard.runtime import dist as _dist, export as exporting, optim, record as recording
from autoshard.runtime import tensor_parallel
from autoshard.runtime.checkpoint import localize_state_dict
from autoshard.runtime.storage import check_shardable, fqn_aliases, full_state_dict, stage_shards
from autoshard.core.spec import param_specs
from autoshard.core.state_dicts import new_state_dict


# torch.compile's keyword arguments (``ShardedModule.compile`` passes them on)
_TORCH_COMPILE_ARGS = frozenset({"fullgraph", "dynamic", "backend", "mode", "options",
                                 "disable"})


class ShardedModule(torch.nn.Module):
    """A model sharded by autoshard. It is the user's model (same object, same attributes,
    same state-dict keys) whose parameters are DTensor shards and whose calls run the compiled
    program. Created by ``autoshard()``; not instantiated directly."""

    _autoshard: CallState

    @property
    def _is_accelerate_prepared(self) -> bool:
        """accelerate's mark of a model it has prepared: ``accelerator.prepare`` (and so the
        Trainer) hands this model back as it is instead of wrapping it in
        DistributedDataParallel, which cannot hold DTensor parameters; the model gathers and
        reduces its own. accelerate's autocast is not put around it then, so an accelerate
        configured for mixed precision is refused here, naming autoshard's own setting."""
        refuse_accelerate_autocast()
        return True

    @_is_accelerate_prepared.setter
    def _is_accelerate_prepared(self, value) -> None:
        pass  # accelerate marks what it prepared; this model is marked from the start

    # Under torch.compile the step is opaque to TorchDynamo: it is a compiled graph already
    # (Config(compile=True) hands it to inductor), and its Python around the graph (guards,
    # agreement, hooks) is what Dynamo must not specialise on. One graph break at the call.
    @torch.compiler.disable
    def forward(self, *args, **kwargs):
        if tracing():  # called from a registered method being captured: traced with it
            return self._autoshard.orig_forward(self, *args, **kwargs)
        return call(self, self._autoshard, args, kwargs)

    # --- compile -------------------------------------------------------------------------

    def precompile(self, *args, **kwargs) -> "ShardedModule":
        """Capture and compile the step for these example inputs (called as the model would
        be) now instead of on the first call with them."""
        st = self._autoshard
        key = call_key(self, st, args, kwargs)
        if key not in st.programs:
            compile_for(self, st, args, kwargs, key, sharded=True)
        return self

    def compile(self, *args, **kwargs):
        """``torch.nn.Module.compile``: compiles the module's calls with torch.compile's
        keyword arguments (``sharded.compile(mode=...)``). Example inputs, as 0.3 took them
        (``sharded.compile(x)``), are ``precompile``'s since 0.4; that spelling was kept, with
        a warning, until 0.5 and is refused now, naming the fix."""
        if args or set(kwargs) - _TORCH_COMPILE_ARGS:
            raise AutoshardError(
                "ShardedModule.compile takes torch.compile's keyword arguments "
                f"({', '.join(sorted(_TORCH_COMPILE_ARGS))}); example inputs are "
                "precompile's: call sharded.precompile(*example_inputs) (sharded.compile(x) "
                "was 0.3's spelling of it, kept with a warning until 0.5)")
        return super().compile(**kwargs)

    def register_forward_method(self, name: str) -> None:
        """Run the method ``name`` (``encode``, ``get_text_features``: code that reads the
        parameters outside ``forward``) as a captured step of its own, with its gathers and
        reductions, as FSDP2's ``register_fsdp_forward_method`` does. A submodule's own
        ``forward`` needs no registration: calling ``sharded.lm_head(h)`` directly works."""
        fn = getattr(type(self), name, None)
        if not callable(fn) or name == "forward":
            raise ValueError(f"{user_class_name(self)} has no method {name!r} to register "
                             "(forward is always captured)")
        install_entry(self, self._autoshard, name, fn)

    def export(self, path, *, inference: bool = True) -> None:
        """Write the compiled programs, the plan and the parameters to the directory ``path``
        (every rank calls it); ``autoshard.load(path)`` runs them without the model's source,
        at this or another world size. ``inference``: also compile and store each training
        signature's eval-mode, no-gradient program. See ``autoshard.runtime.export``."""
        st = self._autoshard
        if isinstance(st.config.tensor_parallel, Mapping):
            raise AutoshardError(
                "export of a model with a tensor-parallel plan is not built in this version "
                "(its graphs hold the 'tp' group's collectives); save its state with "
                "autoshard.save(path, model), which loads on any mesh, or export the model "
                "sharded with Config(tensor_parallel='off')")
        exporting.export(self, st, path,
                         add_programs=(lambda: _precompile_eval(self, st)) if inference else None)

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
        extra = sum(x.numel() * x.element_size() for x in inputs if isinstance(x, torch.Tensor))
        return recording.record(self, optimizer, extra_bytes=extra, device=self._autoshard.device)

    def full_state_dict(self, *, cpu_offload: bool = False, rank0_only: bool = False) -> dict:
        """Full (gathered) tensors under the original keys. Every rank calls it (one
        all-gather per sharded tensor); each gets them, or with ``rank0_only`` rank 0 only
        (the others an empty dict). ``cpu_offload`` returns them in host memory, moved there
        one by one as they are gathered."""
        return full_state_dict(self, cpu_offload=cpu_offload, rank0_only=rank0_only)

    # --- checkpoints ---------------------------------------------------------------------

    def state_dict(self, *args, destination=None, prefix="", keep_vars=False):
        """``nn.Module.state_dict``: this rank's DTensor shards under the model's keys (as
        FSDP2's), in a dict that warns when ``torch.save`` pickles it with rows of other
        ranks missing (``autoshard.core.state_dicts``), and is saved as a plain OrderedDict."""
        if destination is None and not args:
            destination = new_state_dict()
        return super().state_dict(*args, destination=destination, prefix=prefix,
                                  keep_vars=keep_vars)

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

        localize_state_dict(self, state_dict, prefix)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        optim.note_update(list(self.parameters()))


def plan(model: torch.nn.Module, example_inputs=None, *, world_size: int, config=None,
         device="cpu", make_inputs=None, batch: Optional[int] = None,
         seq: Optional[int] = None, progress=None) -> Plan:
    """The plan autoshard would run for ``model`` on ``world_size`` ranks, computed in this
    process on fake tensors: no process group, no parameter memory (the model may live on the
    meta device). A stack of 12 or more identical blocks is traced 5 and 6 blocks deep and
    the full graph built from those (``autoshard.compiler.depth``, which checks itself and otherwise
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
        args, kwargs = split_inputs(inputs)
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




def state_of(model, what: str, otherwise: str = "") -> CallState:
    """The CallState of a model ``autoshard()`` returned, which only the front door reads
    (the layers below are handed what they need of it); for any other object a TypeError:
    ``what`` (``"autoshard.save takes"``) the model autoshard() returned, and ``otherwise``,
    what to do instead."""
    st = model.__dict__.get("_autoshard") if isinstance(model, ShardedModule) else None
    if st is None:
        raise TypeError(f"{what} the model autoshard() returned, not a "
                        f"{type(model).__name__}" + (f"; {otherwise}" if otherwise else ""))
    return st

def _precompile_eval(model: ShardedModule, st: CallState) -> None:
    """For each training signature, compile the same call in eval mode without gradients
    (the graph an inference-only load runs), unless it is compiled already."""
    if st.is_loaded():
        return  # loaded from an export: it holds what it holds
    device = st.sharding()[1]
    training = model.training
    try:
        for key, prog in st.compiled_programs().items():
            if not (key[2] and key[3]):
                continue
            args, kwargs = exporting.example_inputs(prog, device)
            model.eval()
            with torch.no_grad():
                model.precompile(*args, **kwargs)
    finally:
        model.train(training)

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
    methods = {"__module__": cls.__module__, "forward": forward, "_autoshard_user_class": cls}
    if callable(getattr(cls, "save_pretrained", None)):  # a Hugging Face model
        methods["save_pretrained"] = _save_pretrained(cls.save_pretrained)
    return type(f"Sharded{cls.__name__}", (ShardedModule, cls), methods)


def _save_pretrained(save):
    """A Hugging Face model's ``save_pretrained``, refused without ``state_dict``: the
    model's own state holds this rank's shards, which safetensors cannot write (it fails
    deep inside, "invalid python storage"), and rank 0 alone calls it."""

    def save_pretrained(self, *args, state_dict=None, **kwargs):
        if state_dict is None:
            raise AutoshardError(
                f"{type(self).__name__}.save_pretrained: this model holds one shard of each "
                "weight on each rank. Gather them on every rank, full = "
                "sharded.full_state_dict(rank0_only=True), and on rank 0 call "
                "save_pretrained(path, state_dict=full); for a Trainer's checkpoints use "
                "`from autoshard.front.integrations import Trainer`, which does it.")
        return save(self, *args, state_dict=state_dict, **kwargs)

    save_pretrained.__doc__ = save.__doc__
    return save_pretrained


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
        the groups, gradients reduce-scattered within and all-reduced across; torchtitan's
        ("dp_replicate", "dp_shard") too), or one with a "tp" dimension last (docs/api.md
        lists them), whose "tp" dimension ``Config.tensor_parallel`` says what to do with
        (this version: "off", sharding over it as FSDP does); defaults to
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
    whole = mesh if mesh is not None else _dist.default_mesh(config.timeout)
    _dist.check_mesh(whole, config.partial_mesh)
    mesh = _dist.data_parallel_mesh(whole, config.tensor_parallel)
    _dist.forget_earlier_meshes()
    device = _dist.mesh_device(mesh)
    st = CallState(mesh, device, config, type(model).forward, fqn_aliases(model),
                agreement=_dist.Agreement(whole, config.timeout))  # every rank, "tp" too
    _agree_on_model(st.agreement, model, config)
    example = _example(example_inputs, device)
    cls = type(model)
    undo = _stage(model, st, whole, param_init_fn)
    try:
        model.__class__ = _sharded_class(cls)
        model._autoshard = st
        st.param_refs = tensor_refs(model, "_parameters", model.named_parameters())
        st.buffer_refs = tensor_refs(model, "_buffers", model.named_buffers())
        install_submodule_entries(model, st)
        if example is not None:
            args, kwargs = example
            compile_for(model, st, args, kwargs, call_key(model, st, args, kwargs),
                         sharded=False)
    except BaseException:
        for mod, name in st.entries:
            mod.__dict__.pop(name, None)
        undo()
        model.__class__ = cls
        model.__dict__.pop("_autoshard", None)
        raise
    return model


def _stage(model, st, whole, param_init_fn) -> Callable[[], None]:
    """Place the model's parameters: tensor parallelism's plan applied over ``whole``'s "tp"
    dimension (``Config.tensor_parallel`` as a dict), then each parameter's shard built
    (its placement decided once) and swapped in. Everything is built before the shards
    change the model; returns ``undo()``, which puts back what was there."""
    config, mesh = st.config, st.mesh
    plan = config.tensor_parallel
    undo_tp = (tensor_parallel.apply(model, whole, plan) if isinstance(plan, Mapping)
               else lambda: None)
    try:
        specs = param_specs(model, mesh_shape=tuple(mesh.shape), offload=offloads(config),
                            strategy="zero3" if config.strategy == "auto" else config.strategy)
        staged = stage_shards(model, mesh, st.device, specs, param_init_fn=param_init_fn,
                              pin_memory=getattr(config.offload_policy, "pin_memory", True),
                              whole=whole if isinstance(plan, Mapping) else None)
        undo = staged.commit()
    except BaseException:
        undo_tp()
        raise

    def undo_all():
        undo()
        undo_tp()
    return undo_all


def _example(example_inputs, device):
    """``autoshard(example_inputs=)`` as ``(args, kwargs)`` (None without), every tensor on
    the mesh's ``device``."""
    if example_inputs is None:
        return None
    args, kwargs = split_inputs(example_inputs)
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
    for name, mod in model.named_modules():
        if isinstance(mod, ShardedModule):
            raise ValueError(
                f"module '{name}' ({type(mod).__name__}) is already sharded by autoshard; "
                "autoshard the whole model once, on the unsharded model (autoshard chooses "
                "the units itself)")
    if param_init_fn is not None and not callable(param_init_fn):
        raise TypeError("param_init_fn must be a callable taking a module, got "
                        f"{type(param_init_fn).__name__}")
    check_shardable(model)
    config = config if config is not None else Config()
    if not isinstance(config, Config):
        raise TypeError(f"config must be an autoshard.Config, got {type(config).__name__}")
    check_names(config, model)
    return config

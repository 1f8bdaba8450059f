"""Meta-device models: materialised module by module, as building them on the device would."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import inspect
import sys
import threading
import weakref
from typing import Callable, Optional

import torch
from autoshard._compat import pytree as _pytree
import torch.utils.weak as weakref_utils
from torch.multiprocessing.reductions import StorageWeakRef
from autoshard._compat import tree_map_only

from autoshard import _compat
from autoshard.errors import AutoshardError

# --- meta-device models: materialise module by module, as building on the device would --------
#
# Building a model on a device initialises its tensors in a fixed order: each layer's
# constructor calls reset_parameters() (children before their parent, in registration order),
# a Hugging Face model then runs its post_init (_init_weights over its modules, children
# first) before tying weights, and code after construction does the rest. A meta-device model
# replays that order as a list of steps; each step runs on full-size tensors of one module at
# a time, and the random number generator is rewound to where the step starts, so that every
# tensor gets bitwise the values building on the device gives it with the same seed.


@dataclasses.dataclass(eq=False)
class _Slot:
    """One parameter or buffer of the model (a tied tensor once, under its first owner)."""

    fqn: str
    module: torch.nn.Module
    name: str
    is_param: bool
    tensor: torch.Tensor

    @property
    def meta(self) -> bool:
        return self.tensor.device.type == "meta"

    def describe(self) -> str:
        kind = "parameter" if self.is_param else "buffer"
        return f"{kind} '{self.fqn}' ({type(self.module).__name__})"


@dataclasses.dataclass(eq=False)
class _Step:
    """One initialisation call on one module, in the order building on the device makes it."""

    module: torch.nn.Module
    path: str
    label: str
    fn: Callable
    # construction-time steps run before weights are tied: through a module that is not a
    # tied tensor's first owner they initialise that module's own (later replaced) tensor
    before_ties: bool
    # a deep copy of another module at construction (nn.TransformerEncoder's layers): it
    # draws what that step drew, from the same generator state, and advances nothing
    same_draws_as: Optional[int] = None
    # a step replaying one op recorded by deferred_init(): its tape and the op's index there
    tape: Optional["_Tape"] = None
    entry: Optional[int] = None


def _slots(model: torch.nn.Module) -> dict:
    """id(tensor) -> _Slot for every parameter and buffer, in ``named_modules`` order."""
    out = {}
    for mod_name, mod in model.named_modules():
        for is_param, table in ((True, mod._parameters), (False, mod._buffers)):
            for name, t in table.items():
                if t is not None and id(t) not in out:
                    fqn = f"{mod_name}.{name}" if mod_name else name
                    out[id(t)] = _Slot(fqn, mod, name, is_param, t)
    return out


def _post_order(root: torch.nn.Module) -> list:
    """Modules children first, in registration order (``nn.Module.apply``'s order), once."""
    out, seen = [], set()

    def go(m):
        if id(m) in seen:
            return
        seen.add(id(m))
        for c in m.children():
            go(c)
        out.append(m)

    go(root)
    return out


def _own_tensors(m: torch.nn.Module) -> bool:
    return any(t is not None for t in m._parameters.values()) or any(
        t is not None for t in m._buffers.values())


def _reset_method(m: torch.nn.Module):
    """What the module's constructor calls to initialise its own tensors, if anything:
    ``reset_parameters()``, or for torch's own layers that use it (MultiheadAttention,
    Transformer) ``_reset_parameters()``."""
    fn = getattr(m, "reset_parameters", None)
    if callable(fn) and _own_tensors(m):
        return fn, "reset_parameters()"
    fn = getattr(m, "_reset_parameters", None)
    if callable(fn) and type(m).__module__.startswith("torch.nn."):
        return fn, "_reset_parameters()"
    known = _CONSTRUCTOR_INITS.get((type(m).__module__, type(m).__qualname__))
    return (functools.partial(known, m), "__init__") if known is not None else None


def _hf_conv1d_init(m: torch.nn.Module) -> None:
    """What transformers' ``Conv1D.__init__`` (GPT-2's linear layer) draws: it has no
    reset_parameters()."""
    torch.nn.init.normal_(m.weight, std=0.02)
    torch.nn.init.zeros_(m.bias)


# layers whose constructor initialises their tensors without a reset method to call again
_CONSTRUCTOR_INITS = {("transformers.pytorch_utils", "Conv1D"): _hf_conv1d_init}


def _hf_pretrained(m: torch.nn.Module) -> bool:
    mu = sys.modules.get("transformers.modeling_utils")
    return mu is not None and isinstance(m, mu.PreTrainedModel)


def _hf_init_weights(top: torch.nn.Module, module: torch.nn.Module) -> None:
    """Hugging Face's post_init for one module: ``top._init_weights(module)`` with torch's init
    functions guarded as ``PreTrainedModel.initialize_weights`` guards them."""
    init = sys.modules.get("transformers.initialization")
    guard = getattr(init, "guard_torch_init_functions", None)
    with guard() if guard is not None else contextlib.nullcontext():
        top._init_weights(module)


def _construction_copies(model: torch.nn.Module) -> dict:
    """id(module) -> the module it is a deep copy of since construction: the layers of
    ``nn.TransformerEncoder``/``nn.TransformerDecoder`` (copies of the layer passed in, which
    ``layers[0]`` stands for)."""
    out = {}
    for m in model.modules():
        if isinstance(m, (torch.nn.TransformerEncoder, torch.nn.TransformerDecoder)):
            first = list(m.layers[0].modules())
            for layer in list(m.layers)[1:]:
                for a, b in zip(layer.modules(), first):
                    out[id(a)] = b
    return out


# --- recording what a constructor initialises: deferred_init() ----------------------------------
#
# A model built under plain ``torch.device("meta")`` has lost what its constructor wrote beyond
# its layers' reset_parameters() (nanoGPT's ``self.apply(self._init_weights)``, a ViT's
# ``nn.Parameter(torch.randn(...))``, a rotary table): meta tensors hold no values. Built under
# ``deferred_init()``, every op the constructor runs on meta tensors is recorded in order; a
# step per op that writes a model tensor replays it on the device, the ops it reads from
# (intermediates, other tensors' values at that point) recomputed with the random number
# generator rewound to where each of them drew, so the values are those building on the device
# gives, whatever order the module-by-module materialisation runs them in.


@dataclasses.dataclass(frozen=True, eq=False)
class _Ref:
    """A recorded meta tensor: which storage, and how it views it."""

    key: StorageWeakRef
    shape: tuple
    stride: tuple
    offset: int
    dtype: torch.dtype
    size: int  # elements of dtype in the storage

    @classmethod
    def of(cls, t: torch.Tensor) -> "_Ref":
        st = t.untyped_storage()
        return cls(StorageWeakRef(st), tuple(t.shape), tuple(t.stride()), t.storage_offset(),
                   t.dtype, st.nbytes() // max(t.element_size(), 1))


@dataclasses.dataclass(eq=False)
class _Entry:
    """One op the constructor ran, with its meta tensors as ``_Ref``s."""

    index: int
    func: Callable
    args: tuple
    kwargs: dict
    writes: list  # storage keys written in place
    fresh: list  # (position in the flat outputs, _Ref) of outputs with storage of their own
    reads: list  # storage keys of every meta tensor argument
    random: bool  # draws from the random number generator
    overwrites: set  # storage keys it gives every element of without reading them
    name: str = ""  # what it is called in messages
    wrefs: list = dataclasses.field(default_factory=list)  # _Ref of each tensor written
    vreads: list = dataclasses.field(default_factory=list)  # _Ref of each tensor whose
    #                                                         values it reads
    generator: bool = False  # draws from a torch.Generator it was given

    @property
    def empty(self) -> bool:
        schema = getattr(self.func, "_schema", None)  # a recorded call has none
        return schema is not None and schema.name in _EMPTY_OPS

    def created(self) -> list:
        return [] if self.empty else [r.key for _, r in self.fresh]


_SERIALS = itertools.count()


class _Record(_compat.TorchDispatchMode):
    """Records every op on meta tensors while a model is built (see ``deferred_init``)."""

    def __init__(self):
        super().__init__()
        self.serial = next(_SERIALS)  # records in the order they were made
        self.entries = []
        self.storages = []  # keeps every recorded storage alive: its key stays unique
        self.marks = {}  # id(module) -> (weakref, number of entries when a tensor or child
        #                  was last registered on it)
        self.tensors = []  # parameters, buffers and modules registered while recording
        self.created = set()  # storage keys of every tensor the recorded ops made
        self.paused = 0  # inside a call recorded whole: its ops are not recorded again

    def _ref(self, t: torch.Tensor):
        if t.device.type != "meta":
            return t  # a real tensor: its value is there
        self.storages.append(t.untyped_storage())
        return _Ref.of(t)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.paused:
            return out
        flat = [t for t in _pytree.tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
        if not any(t.device.type == "meta" for t in flat):
            return out
        schema = func._schema
        view = bool(schema.returns) and all(
            r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)
        written, read = [], []  # (meta tensor, whether the op gives it values without reading)
        for i, a in enumerate(schema.arguments):
            val = args[i] if i < len(args) else kwargs.get(a.name)
            ts = [t for t in _tensors(val) if t.device.type == "meta"]
            if a.alias_info is not None and a.alias_info.is_write:
                blind = schema.name in _OVERWRITE_OPS or a.is_out
                written.extend((t, blind) for t in ts)
            else:
                read.extend(ts)
        writes = [_swr(t) for t, _ in written]
        outs = _pytree.tree_leaves(out)
        fresh = [(i, _Ref.of(o)) for i, (o, r) in enumerate(zip(outs, _returns(schema, outs)))
                 if isinstance(o, torch.Tensor) and o.device.type == "meta" and r is None]
        self.created.update(r.key for _, r in fresh)
        rargs, rkwargs = tree_map_only(torch.Tensor, self._ref, (args, kwargs))
        for o in outs:
            if isinstance(o, torch.Tensor) and o.device.type == "meta":
                self.storages.append(o.untyped_storage())
        reads = [r.key for r in _pytree.tree_leaves((rargs, rkwargs)) if isinstance(r, _Ref)]
        # what the op's result does not depend on: its own new outputs, and a tensor an
        # overwriting op (fill_, copy_, normal_, an out= argument) writes whole without
        # reading its storage through another argument. An in-place op returns the tensor it
        # updates (mul_, erfinv_, clamp_): that output is its input, read, never an overwrite.
        overwrites = set()
        if schema.name not in _EMPTY_OPS:
            overwrites.update(r.key for pos, r in fresh if _whole(outs[pos]))
        read_keys = {_swr(t) for t in read}
        overwrites.update(_swr(t) for t, blind in written
                          if blind and _whole(t) and _swr(t) not in read_keys)
        vreads = [] if view else [_Ref.of(t) for t in read] + [
            _Ref.of(t) for t, blind in written if not blind]
        gen = any(isinstance(x, torch.Generator) for x in _pytree.tree_leaves((args, kwargs)))
        self.entries.append(_Entry(len(self.entries), func, rargs, rkwargs, writes, fresh, reads,
                                   torch.Tag.nondeterministic_seeded in func.tags, overwrites,
                                   str(func), [_Ref.of(t) for t, _ in written], vreads, gen))
        return out

    def record_call(self, name: str, fn: Callable, random: bool, tensor: torch.Tensor,
                    args: tuple, kwargs: dict, generator: bool) -> None:
        """Record ``fn(tensor, *args, **kwargs)``, an init function that gives every element
        of ``tensor`` a value without reading it, as one op (replayed by calling ``fn`` on the
        device)."""
        rargs, rkwargs = tree_map_only(torch.Tensor, self._ref, ((tensor,) + tuple(args), kwargs))
        ref = rargs[0]
        self.entries.append(_Entry(len(self.entries), fn, rargs, rkwargs, [ref.key], [],
                                   [ref.key], random, {ref.key} if _whole(tensor) else set(),
                                   name, [ref], [], generator))

    def _registered(self, module, name, value):
        self.marks[id(module)] = (weakref.ref(module), len(self.entries))
        self.tensors.append(value)

    def recorded(self) -> list:
        """The meta tensors registered while recording that the recorded ops made, those of
        registered modules too (layers deep-copied in a constructor register nothing)."""
        out, seen = [], set()
        for v in self.tensors:
            ts = ([v] if isinstance(v, torch.Tensor) else
                  list(v.parameters()) + list(v.buffers()) if isinstance(v, torch.nn.Module)
                  else [])
            for t in ts:
                if (id(t) not in seen and t.device.type == "meta"
                        and _swr(t) in self.created):
                    seen.add(id(t))
                    out.append(t)
        return out

    def mark(self, module: torch.nn.Module):
        """Where ``module``'s construction ended on the tape (its last registration)."""
        ref, pos = self.marks.get(id(module), (None, None))
        return pos if ref is not None and ref() is module else None


def _whole(t: torch.Tensor) -> bool:
    """``t`` covers all of its storage."""
    size = t.untyped_storage().nbytes() // max(t.element_size(), 1)
    return t.storage_offset() == 0 and t.is_contiguous() and t.numel() == size


def _returns(schema, outs) -> list:
    """The alias info of each flat output (a tensor list returns as many as it holds)."""
    infos = [r.alias_info for r in schema.returns]
    if len(infos) == len(outs):
        return infos
    return [infos[0] if infos else None] * len(outs)


# recorded tensor -> (its _Record, its version counter when recording ended); filled only
# inside deferred_init(), an entry goes when its tensor does
_RECORDED = weakref_utils.WeakIdKeyDictionary()

# the torch.nn.init functions that write nothing on the meta device are wrapped while any
# deferred_init() block is open (and only then), so that a call on a meta tensor is recorded
_OPEN = {}  # thread id -> the records open in that thread, innermost last
_WRAPPED = []  # (module, attribute, original function) while wrapped
_WRAP_LOCK = threading.Lock()


def _recorded_init(fn: Callable, name: str, random: bool) -> Callable:
    """``fn`` (an init function that returns at once on a meta tensor) recording each call on
    a meta tensor made inside this thread's innermost open deferred_init() block."""
    sig = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(tensor, *args, **kwargs):
        stack = _OPEN.get(threading.get_ident())
        rec = stack[-1] if stack else None
        if (rec is None or rec.paused or not isinstance(tensor, torch.Tensor)
                or tensor.device.type != "meta"):
            return fn(tensor, *args, **kwargs)
        rec.paused += 1
        try:
            out = fn(tensor, *args, **kwargs)  # checks its arguments; writes nothing on meta
        finally:
            rec.paused -= 1
        try:
            gen = sig.bind(tensor, *args, **kwargs).arguments.get("generator") is not None
        except TypeError:
            gen = False
        rec.record_call(name, fn, random, tensor, args, kwargs, gen)
        return out

    return wrapper


@contextlib.contextmanager
def _recording_init_calls(rec: _Record):
    tid = threading.get_ident()
    with _WRAP_LOCK:
        if not _OPEN:
            for mod, attr, name, random in _compat.meta_skipping_inits():
                fn = getattr(mod, attr)
                _WRAPPED.append((mod, attr, fn))
                setattr(mod, attr, _recorded_init(fn, name, random))
        _OPEN.setdefault(tid, []).append(rec)
    try:
        yield
    finally:
        with _WRAP_LOCK:
            stack = _OPEN[tid]
            stack.remove(rec)
            if not stack:
                del _OPEN[tid]
            if not _OPEN:
                for mod, attr, fn in reversed(_WRAPPED):
                    setattr(mod, attr, fn)
                _WRAPPED.clear()


@contextlib.contextmanager
def deferred_init():
    """Build a model on the meta device and record how its constructor initialises it, so that
    ``autoshard()`` gives each tensor exactly the values building it on the device gives::

        with autoshard.deferred_init():
            model = GPT(config)          # on the meta device: no memory
        torch.manual_seed(0)             # the seed the device build would use
        model = autoshard(model)         # each rank: its rows of what GPT(config) draws

    Everything the constructor does to the tensors is recorded (``torch.nn.init`` calls, in-place
    ops, ``nn.Parameter(torch.randn(...))``, tables computed from ``torch.arange``, deep copies of
    layers) and replayed by ``autoshard()`` module by module; a Hugging Face model's
    ``_init_weights`` (which transformers skips on the meta device) runs where its post_init
    ran. Outside this context a constructor's own initialisation is lost on the meta device;
    ``autoshard()`` then refuses a tensor whose constructor wrote it beyond its layer's
    ``reset_parameters()``. Values the recording cannot see are not replayed: the data of
    ``torch.tensor(...)`` on the meta device (a tensor initialised only that way is named as
    uninitialised), and writes through ``.data`` made after the context ends; a tensor whose
    replay would read values no recorded op wrote is named, never given other values.

    ``torch.nn.init``'s ``trunc_normal_``, ``orthogonal_``, ``dirac_`` and ``sparse_`` return
    without writing on the meta device; while the context is open they are wrapped (for the
    whole process, restored when the last open context ends) so that each call on a meta
    tensor is recorded whole and replayed by calling the function on the device. Draws from
    a ``torch.Generator`` passed to an op cannot be replayed (autoshard rewinds the default
    generators): a tensor whose values depend on one is named.

    The recording is kept, for each parameter and buffer registered inside the context, while
    that tensor lives; nothing is recorded outside the context.
    """
    from torch.nn.modules import module as nn_module

    rec = _Record()
    hooks = [nn_module.register_module_parameter_registration_hook(rec._registered),
             nn_module.register_module_buffer_registration_hook(rec._registered),
             nn_module.register_module_module_registration_hook(rec._registered)]
    try:
        with torch.device("meta"), rec, _recording_init_calls(rec):
            yield
    finally:
        for h in hooks:
            h.remove()
    for t in rec.recorded():
        _RECORDED[t] = (rec, t._version)
    rec.tensors = []


class _Tape:
    """One record's ops as init steps of a model: a step for each op that writes a model
    tensor (``run``), and one for each other op that draws random numbers (only to draw them,
    as building on the device does)."""

    def __init__(self, rec: _Record, lookup: dict):
        self.rec, self.entries = rec, rec.entries
        self.lookup = lookup  # storage key -> _Slot of the model's meta tensors
        self.writers = {}  # storage key -> indices of the entries that write it, in order
        self.creator = {}  # storage key -> the entry that made it (an empty one too)
        for e in self.entries:
            for k in dict.fromkeys(e.writes + e.created()):
                self.writers.setdefault(k, []).append(e.index)
            for _, r in e.fresh:
                self.creator.setdefault(r.key, e.index)
        self.step_of = {}  # entry index -> its step's index (set by init_steps)
        self.mat = None  # the _Materializer running the steps

    def step(self, e: _Entry, names: dict, root: torch.nn.Module) -> Optional[_Step]:
        written = [self.lookup[k] for k in e.writes + e.created() if k in self.lookup]
        if not written and not e.random:
            return None  # an intermediate: computed where a step reads it
        m = written[0].module if written else root
        label = f"{e.name or e.func} (recorded by deferred_init)"
        return _Step(m, names[id(m)], label, functools.partial(self.run, e.index), True,
                     tape=self, entry=e.index)

    def _program(self, e: _Entry, own: set, names: str) -> list:
        """The entries to run before ``e`` so that what it reads (but ``own``) has its value:
        for each storage, its writes back to the last one that overwrites all of it, each
        once, in the order they ran. ``ValueError`` naming ``names`` (what ``e`` writes) if a
        value read was never written by a recorded op."""
        need, done = set(), set()
        stack = [(k, e.index) for k in dict.fromkeys(r.key for r in e.vreads) if k not in own]
        while stack:
            key, before = stack.pop()
            if (key, before) in done:
                continue
            done.add((key, before))
            for i in reversed(self.writers.get(key, ())):
                if i >= before:
                    continue
                w = self.entries[i]
                if i not in need:
                    need.add(i)
                    stack.extend((k, i) for k in dict.fromkeys(r.key for r in w.vreads))
                if key in w.overwrites:
                    break
            else:  # no op gave all of it a value: what is read must have been written
                self._check_written(key, before, names)
        return sorted(need)

    def _check_written(self, key, before: int, names: str) -> None:
        """Entry ``before`` reads storage ``key``, made uninitialised (``torch.empty``,
        ``new_empty``) and written only in parts since: every element it reads must have been
        written by a recorded op before it, or its value is not on the tape."""
        made = self.creator.get(key)
        if made is None or not self.entries[made].empty:
            return
        ref = next(r for _, r in self.entries[made].fresh if r.key == key)
        mask = torch.zeros(ref.size, dtype=torch.bool)
        for i in self.writers.get(key, ()):
            if i < before:
                w = self.entries[i]
                for r in w.wrefs + [r for _, r in w.fresh]:
                    if r.key == key:
                        mask.as_strided(r.shape, r.stride, r.offset).fill_(True)
        reader = self.entries[before]
        for r in reader.vreads:
            if r.key == key and not bool(mask.as_strided(r.shape, r.stride, r.offset).all()):
                slot = self.lookup.get(key)
                what = (slot.describe() if slot is not None else
                        f"a tensor of shape {tuple(ref.shape)} made by {self.entries[made].name}")
                raise ValueError(
                    f"{names} is computed (by {reader.name}, op {before} of the recording) from "
                    f"values of {what} that no op recorded by deferred_init() wrote: they were "
                    "never written on the meta device (uninitialised memory, or an init function "
                    "that skips meta tensors, such as one returning early on `tensor.is_meta`), "
                    "so autoshard cannot give what building on the device gives. Write them with "
                    "torch ops inside the deferred_init() block, or pass param_init_fn.")

    def _no_generator(self, w: _Entry, names: str) -> None:
        if w.generator:
            raise ValueError(
                f"{names} is computed from what {w.name} (op {w.index} of the recording) drew "
                "from a torch.Generator passed to it; autoshard replays draws by rewinding the "
                "default generator only, so it cannot give what building on the device gives. "
                "Draw from the default generator (seeded with torch.manual_seed), or pass "
                "param_init_fn.")

    def run(self, index: int) -> None:
        """Replay entry ``index`` on the device (inside a step: model tensors it writes are the
        step's stand-ins); what it reads is recomputed first, each op that draws random
        numbers from where it drew them when the model was built."""
        mat, e = self.mat, self.entries[index]
        device = mat.device
        own = {k for k in e.writes + e.created() if k in self.lookup}
        env = {}

        def local(r: _Ref) -> torch.Tensor:
            base = env.get(r.key)
            if base is None:
                base = env[r.key] = torch.empty(r.size, dtype=r.dtype, device=device)
            return base.as_strided(r.shape, r.stride, r.offset)

        def target(r: _Ref) -> torch.Tensor:
            if r.key in own:  # through the step's mode: its stand-in for the model tensor
                return self.lookup[r.key].tensor.as_strided(r.shape, r.stride, r.offset)
            return local(r)

        start = _rng_state(device)
        if own:  # (a step that only draws needs no values)
            names = " and ".join(dict.fromkeys(self.lookup[k].describe() for k in own))
            self._no_generator(e, names)
            program = self._program(e, own, names)
            for i in program:
                self._no_generator(self.entries[i], names)
            for i in program:
                w = self.entries[i]
                if w.random:
                    _set_rng_state(device, mat.states[self.step_of[i]])
                self._exec(w, local, device)
            _set_rng_state(device, start)
        self._exec(e, target, device)

    @staticmethod
    def _exec(e: _Entry, resolve: Callable, device: torch.device) -> None:
        if e.empty:
            return  # uninitialised memory: nothing to compute
        args, kwargs = tree_map_only(_Ref, resolve, (e.args, e.kwargs))
        args, kwargs = tree_map_only(
            torch.device, lambda d: device if d.type == "meta" else d, (args, kwargs))
        outs = _pytree.tree_leaves(e.func(*args, **kwargs))
        for pos, r in e.fresh:
            resolve(r).copy_(outs[pos])


def init_steps(model: torch.nn.Module, param_init_fn=None) -> list:
    """The initialisation calls building ``model`` on a device makes, in their order:

    1. for tensors built under ``deferred_init()``: every op their constructor ran on them,
       in the order it ran (a Hugging Face model's post_init where it ran);
    2. every other module's ``reset_parameters()`` (modules with parameters or buffers of
       their own), children before their parent, in registration order (the layers of an
       ``nn.TransformerEncoder``/``Decoder``, deep copies of one layer, draw its values);
    3. for a Hugging Face ``PreTrainedModel`` (also one nested inside, e.g. ``LlamaModel``
       inside ``LlamaForCausalLM``), right after its own modules: its post_init, which calls
       ``_init_weights`` on each of its modules not initialised yet, children first;
    4. ``param_init_fn(module)`` on every module, children first (``model.apply``'s order),
       as code run after the model is built (after weights are tied).
    """
    names = {id(m): n for n, m in model.named_modules()}
    copies = _construction_copies(model)
    slots = _slots(model)
    records = {}
    for s in slots.values():
        if s.meta and s.tensor in _RECORDED:
            rec = _RECORDED[s.tensor][0]
            records[id(rec)] = rec
    records = sorted(records.values(), key=lambda r: r.serial)
    steps, hf_done, reset_step, hf_at = [], set(), {}, {}
    for m in _post_order(model):
        reset = _reset_method(m)
        if reset is not None and not _built_recorded(m, names):
            source = copies.get(id(m))
            reset_step[id(m)] = len(steps)
            steps.append(_Step(m, names[id(m)], f"{type(m).__name__}.{reset[1]}", reset[0],
                               True, reset_step.get(id(source)) if source else None))
        if _hf_pretrained(m):
            post_init = []
            for x in _post_order(m):
                if id(x) in hf_done or getattr(x, "_is_hf_initialized", False):
                    continue
                hf_done.add(id(x))
                post_init.append(_Step(x, names[id(x)], f"{type(m).__name__}._init_weights",
                                       functools.partial(_hf_init_weights, m, x), True))
            # built under deferred_init(): where its constructor ended on the tape
            at = next(((r, pos) for r in records if (pos := r.mark(m)) is not None), None)
            if at is None:
                steps.extend(post_init)
            else:
                hf_at.setdefault((id(at[0]), at[1]), []).extend(post_init)
    recorded = []
    if records:
        lookup = {_swr(s.tensor): s for s in slots.values() if s.meta}
        for rec in records:
            tape = _Tape(rec, lookup)
            for e in rec.entries:
                recorded.extend(hf_at.pop((id(rec), e.index), []))
                step = tape.step(e, names, model)
                if step is not None:
                    recorded.append(step)
            recorded.extend(hf_at.pop((id(rec), len(rec.entries)), []))
        for s in steps:
            if s.same_draws_as is not None:
                s.same_draws_as += len(recorded)
    steps = recorded + steps
    for i, s in enumerate(steps):
        if s.tape is not None:
            s.tape.step_of[s.entry] = i
    if param_init_fn is not None:
        for m in _post_order(model):
            steps.append(_Step(m, names[id(m)], "param_init_fn",
                               functools.partial(param_init_fn, m), False))
    return steps


def _built_recorded(m: torch.nn.Module, names: dict) -> bool:
    """Whether ``m``'s own meta tensors were built under ``deferred_init()`` (so its
    reset_parameters() is on the tape); ``ValueError`` if only some of them were."""
    own = [(n, t, kind) for kind, table in (("parameter", m._parameters),
                                              ("buffer", m._buffers))
           for n, t in table.items() if t is not None and t.device.type == "meta"]
    flags = [t in _RECORDED for _, t, _ in own]
    if all(flags) or not any(flags):
        return bool(own) and all(flags)
    n, _, kind = own[flags.index(False)]
    path = names[id(m)]
    raise ValueError(
        f"{kind} '{path + '.' if path else ''}{n}' ({type(m).__name__}) belongs to a module "
        "built under deferred_init() but was not made by an op it recorded (it was created "
        "outside the block, or by torch.tensor(...), whose data the meta device drops), so "
        "autoshard cannot tell how building on the device initialises it. Create it inside "
        "the block from torch factory functions (torch.full, torch.zeros, ...), or pass "
        "param_init_fn. The model is unchanged.")


_EMPTY_OPS = frozenset({"aten::empty", "aten::empty_like", "aten::empty_strided",
                        "aten::new_empty", "aten::new_empty_strided"})
# in-place ops that give every element of their output a value without reading it
_OVERWRITE_OPS = frozenset({
    "aten::normal_", "aten::uniform_", "aten::fill_", "aten::zero_", "aten::copy_",
    "aten::bernoulli_", "aten::random_", "aten::exponential_", "aten::geometric_",
    "aten::cauchy_", "aten::log_normal_"})
_CLEAN, _DIRTY = "overwritten", "read"


def _swr(t: torch.Tensor):
    """A key for ``t``'s storage (the same for every view of it); None if it has none."""
    try:
        return StorageWeakRef(t.untyped_storage())
    except (RuntimeError, NotImplementedError):  # sparse, nested, ... tensors
        return None


def _tensors(v) -> list:
    if isinstance(v, torch.Tensor):
        return [v]
    if isinstance(v, (list, tuple)):
        return [x for x in v if isinstance(x, torch.Tensor)]
    return []


@dataclasses.dataclass(eq=False)
class _Use:
    """A full-size tensor standing in for a model tensor during one step."""

    slot: _Slot
    counts: bool  # its writes are the slot's initialisation
    valid: bool  # holds the slot's true value at this point (reading it is fine)


class _StepMode(_compat.TorchDispatchMode):
    """Runs one step's ops. Model tensors the step reaches by reference (a parent initialising
    its child's weight) are replaced by full-size stand-ins from ``resolve``; records which
    slots the step writes, storages allocated but never written, and reads of stand-ins whose
    values are not there (another module's tensor)."""

    def __init__(self, lookup: dict, resolve: Callable):
        super().__init__()
        self.lookup = lookup  # StorageWeakRef of a model tensor -> _Slot
        self.resolve = resolve  # _Slot -> (tensor, _Use) for a model tensor reached by an op
        self.uses = {}  # StorageWeakRef of a stand-in -> _Use
        self.subs = {}  # id(slot) -> stand-in reached through ops (one per step)
        self.written = set()  # id(slot)
        self.empties = set()  # StorageWeakRef allocated uninitialised, not written since
        self.bad_reads = []  # slots whose absent values the step read
        # id(slot) -> how the step first used its values: _CLEAN (overwrote all of it, so the
        # result does not depend on earlier values) or _DIRTY (read it, or wrote part of it)
        self.first = {}

    def use(self, t: torch.Tensor, use: _Use) -> None:
        self.uses[_swr(t)] = use

    def _swap(self, t: torch.Tensor) -> torch.Tensor:
        key = _swr(t)
        if key in self.uses:
            return t
        slot = self.lookup.get(key)
        if slot is None:
            return t
        full = self.subs.get(id(slot))
        if full is None:
            full, use = self.resolve(slot)
            self.subs[id(slot)] = full
            self.uses[_swr(full)] = use
        if t.shape == full.shape and t.stride() == full.stride() and t.storage_offset() == 0:
            return full
        return full.as_strided(t.shape, t.stride(), t.storage_offset())

    def _touch(self, t: torch.Tensor, kind: str) -> None:
        use = self.uses.get(_swr(t))
        if use is not None:
            self.first.setdefault(id(use.slot), kind)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        args, kwargs = tree_map_only(torch.Tensor, self._swap, (args, kwargs))
        schema = func._schema
        view = bool(schema.returns) and all(
            r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)
        written, read = [], []
        for i, a in enumerate(schema.arguments):
            val = args[i] if i < len(args) else kwargs.get(a.name)
            ts = _tensors(val)
            if a.alias_info is not None and a.alias_info.is_write:
                written.extend((t, a.name) for t in ts)
            elif not view:
                read.extend(ts)  # a value read (a view reads only the geometry)
        if not view:
            read_keys = set()
            for t in read:
                key = _swr(t)
                read_keys.add(key)
                use = self.uses.get(key)
                if use is not None and not use.valid:
                    self.bad_reads.append(use.slot)  # fine unless the values are not there
                self._touch(t, _DIRTY)
            for t, name in written:
                use = self.uses.get(_swr(t))
                whole = (use is not None and t.numel() == use.slot.tensor.numel()
                         and t.storage_offset() == 0 and t.is_contiguous())
                overwrite = ((schema.name in _OVERWRITE_OPS or name == "out") and whole
                             and _swr(t) not in read_keys)
                self._touch(t, _CLEAN if overwrite else _DIRTY)
        out = func(*args, **kwargs)
        for t, _ in written:
            key = _swr(t)
            self.empties.discard(key)
            use = self.uses.get(key)
            if use is not None and use.counts:
                self.written.add(id(use.slot))
        if schema.name in _EMPTY_OPS:
            for t in _tensors(out):
                self.empties.add(_swr(t))
        return out


class _Materializer:
    """Runs the init steps of a model with meta-device tensors; see ``stage_shards``."""

    def __init__(self, model, slots: dict, steps: list, device: torch.device, local: Callable):
        self.model, self.slots, self.steps, self.device = model, slots, steps, device
        self.local = local  # (_Slot, full tensor) -> what this rank keeps
        self.lookup = {k: s for s in slots.values() if (k := _swr(s.tensor)) is not None}
        self.tensors = {}  # id(slot) -> kept tensor (local shard of a parameter, or buffer)
        self.states = []  # step index -> generator state before it (pass 1)
        self.writes = None  # id(slot) -> in-place writes of construction steps (pass 1)
        for step in steps:
            if step.tape is not None:
                step.tape.mat = self

    # -- running one step -------------------------------------------------------------------

    def _stand_in(self, slot: _Slot) -> torch.Tensor:
        t = slot.tensor
        if slot.meta:
            return torch.empty(t.shape, dtype=t.dtype, device=self.device)
        return t.detach().to(self.device, copy=True)  # a real tensor: its own value, a copy

    def _run(self, step: _Step, live: dict):
        """Run ``step`` with ``live`` (id(slot) -> full tensor) for the slots whose values
        matter now, fresh stand-ins for the others. Returns the mode (what it recorded) and,
        for the step module's own tensors whose writes count, id(slot) -> (slot, tensor
        afterwards, whether the step initialised it)."""
        m = step.module
        params, buffers = dict(m._parameters), dict(m._buffers)

        def counts(slot):
            return slot.meta and (slot.module is m or not step.before_ties)

        def resolve(slot):
            if id(slot) in live:
                return live[id(slot)], _Use(slot, True, True)
            return self._stand_in(slot), _Use(slot, slot.meta, not slot.meta)

        mode = _StepMode(self.lookup, resolve)
        installed = {}
        try:
            for table, saved, is_param in ((m._parameters, params, True),
                                           (m._buffers, buffers, False)):
                for name, t in saved.items():
                    if t is None:
                        continue
                    slot = self.slots[id(t)]
                    if counts(slot) and id(slot) in live:
                        full, valid = live[id(slot)], True
                    else:
                        full, valid = self._stand_in(slot), not slot.meta
                    mode.use(full, _Use(slot, counts(slot), valid))
                    if counts(slot):  # the same stand-in however the step reaches it
                        mode.subs[id(slot)] = full
                    installed[(is_param, name)] = (slot, full)
                    table[name] = (torch.nn.Parameter(full, requires_grad=t.requires_grad)
                                   if is_param else full)
            try:
                with torch.no_grad(), mode:
                    step.fn()
            except Exception as e:
                raise AutoshardError(
                    f"initialising the meta-device model failed in {step.label} on module "
                    f"'{step.path}' ({type(m).__name__}): {type(e).__name__}: {e}") from e
            if self.writes is not None and step.before_ties:
                self._count_writes(m, mode, installed)
            after = {}
            for (is_param, name), (slot, full) in installed.items():
                table = m._parameters if is_param else m._buffers
                now = table.get(name)
                if not counts(slot):
                    continue
                if not isinstance(now, torch.Tensor):
                    raise AutoshardError(
                        f"{step.label} on module '{step.path}' removed {slot.describe()}")
                now = now.detach()
                if _swr(now) == _swr(full):
                    after[id(slot)] = (slot, full, id(slot) in mode.written)
                    continue
                if now.shape != slot.tensor.shape or now.dtype != slot.tensor.dtype:
                    raise AutoshardError(
                        f"{step.label} on module '{step.path}' replaced {slot.describe()} of "
                        f"shape {tuple(slot.tensor.shape)} {slot.tensor.dtype} by one of shape "
                        f"{tuple(now.shape)} {now.dtype}")
                done = _swr(now) not in mode.empties
                after[id(slot)] = (slot, now.to(self.device), done)
                if done:
                    mode.written.add(id(slot))
        finally:
            m._parameters.clear()
            m._parameters.update(params)
            m._buffers.clear()
            m._buffers.update(buffers)
        self._check_untouched(step)
        return mode, after

    def _count_writes(self, m, mode: _StepMode, installed: dict) -> None:
        """Add the in-place writes a construction step made to each model tensor (its
        version counter's count) to ``self.writes``: what building on the meta device counted
        on the tensor, if the constructor did nothing else to it."""
        seen = {}
        for (is_param, name), (slot, full) in installed.items():
            now = (m._parameters if is_param else m._buffers).get(name)
            if mode.uses[_swr(full)].counts:
                seen[id(slot)] = now if isinstance(now, torch.Tensor) else full
        for sid, full in mode.subs.items():
            if mode.uses[_swr(full)].counts:
                seen.setdefault(sid, full)
        for sid, t in seen.items():
            self.writes[sid] = self.writes.get(sid, 0) + t._version

    def _check_lost_writes(self, history: dict) -> None:
        """A meta tensor the constructor wrote more often than the steps replayed (an
        ``nn.init`` call in ``__init__`` beyond its layer's reset_parameters(), or a write
        after a deferred_init() block) would get other values than building on the device:
        refused, naming it, unless param_init_fn initialises it."""
        lost = []
        meta = [s for s in self.slots.values() if s.meta]
        for s, version in zip(meta, self.versions):
            rec = _RECORDED.get(s.tensor)
            # a step reaching a tensor of another module writes through its meta tensor
            expected = rec[1] if rec is not None else (
                self.writes.get(id(s), 0) + s.tensor._version - version)
            if version > expected and not any(
                    self.steps[i].label == "param_init_fn" for i in history.get(id(s), ())):
                lost.append(s)
        if not lost:
            return
        names = ", ".join(s.describe() for s in lost[:8])
        more = f" and {len(lost) - 8} more" if len(lost) > 8 else ""
        after = any(_RECORDED.get(s.tensor) is not None for s in lost)
        raise ValueError(
            f"the model is on the meta device and {names}{more} "
            + ("was" if len(lost) == 1 else "were")
            + (" written after its deferred_init() block ended"
               if after else " written while the model was built (an nn.init call or an "
               "in-place op in a constructor, beyond its layer's reset_parameters())")
            + ": those values are not on the meta device, so autoshard cannot give them as "
            "building the model on the device does. Build the model under "
            "`with autoshard.deferred_init():` (every init its constructor makes is then "
            "recorded and replayed), or pass autoshard(model, param_init_fn=fn) where fn(module) "
            "initialises these tensors. The model is unchanged.")

    def _check_untouched(self, step: _Step) -> None:
        """A step may only change tensors through autoshard's stand-ins: the model itself (its
        meta tensors, which module holds which) must be as before."""
        for mod in step.module.modules():
            for table in (mod._parameters, mod._buffers):
                for name, t in table.items():
                    slot = self.slots.get(id(t)) if t is not None else None
                    if t is not None and (slot is None or _swr(t) != self.storages[id(slot)]):
                        raise AutoshardError(
                            f"{step.label} on module '{step.path}' ({type(step.module).__name__})"
                            f" replaced '{name}' of a submodule ({type(mod).__name__}) instead "
                            "of initialising it in place (e.g. to_empty(recurse=True) or a "
                            "new nn.Parameter): an init function may replace only the module's "
                            "own tensors (use to_empty(device=..., recurse=False))")

    # -- the two passes -----------------------------------------------------------------------

    def run(self) -> None:
        """Pass 1 runs every step in order, each on fresh full-size tensors of its module,
        recording where the random number generator stands before it and which tensors it
        writes. A tensor's value is kept (as this rank's rows) from the last step that writes
        it when that step overwrites all of it before reading it (reset_parameters(), the
        usual _init_weights and param_init_fn): the earlier values do not matter then. Pass 2
        recomputes the modules for which that does not hold (an init that scales what
        reset_parameters() drew, a parent that initialises its child's weight), one module
        at a time: every step that writes them again, the generator rewound to its start."""
        self.storages = {id(s): _swr(s.tensor) for s in self.slots.values()}
        reachable = set()  # meta tensors some step could initialise: in a stepped subtree
        for m in {id(s.module): s.module for s in self.steps}.values():
            for sub in m.modules():
                reachable.update(id(t) for t in sub._parameters.values())
                reachable.update(id(t) for t in sub._buffers.values())
        missing = [s for s in self.slots.values() if s.meta and id(s.tensor) not in reachable]
        if missing:  # say so before running anything
            _raise_uninitialised(missing, self.steps)
        start = _rng_state(self.device)
        meta = [s.tensor for s in self.slots.values() if s.meta]
        self.versions = [t._version for t in meta]  # steps reaching them bump them
        tables = [(m, dict(m._parameters), dict(m._buffers)) for m in self.model.modules()]
        data = {id(s): s.tensor.data for s in self.slots.values()}
        ok = False
        try:
            self._passes()
            ok = True
        except BaseException:
            _set_rng_state(self.device, start)  # as before the call: a retry draws the same
            raise
        finally:
            changed = self._restore(tables, data)
            _compat.set_versions(meta, self.versions)
        if ok and changed:
            raise AutoshardError(
                f"initialising the meta-device model replaced {changed[0]} instead of "
                "writing the tensors autoshard gave it (e.g. with to_empty(recurse=True) or "
                "a new nn.Parameter on another module); an init function may replace only its "
                "module's own tensors. The model is unchanged.")

    def _restore(self, tables: list, data: dict) -> list:
        """Put back any tensor (or module entry) an init function replaced behind autoshard's
        back, so the model is as it was; returns what had changed."""
        changed = []
        def same(table, saved):
            return table.keys() == saved.keys() and all(table[k] is saved[k] for k in saved)

        for m, params, buffers in tables:
            if not same(m._parameters, params) or not same(m._buffers, buffers):
                changed.append(f"a tensor of {type(m).__name__}")
                m._parameters.clear()
                m._parameters.update(params)
                m._buffers.clear()
                m._buffers.update(buffers)
        for s in self.slots.values():
            if _swr(s.tensor) != self.storages[id(s)]:
                changed.append(s.describe())
                s.tensor.data = data[id(s)]
        return changed

    def _passes(self) -> None:
        states, kept, history = self.states, {}, {}  # history: id(slot) -> steps writing it
        self.writes = {}
        sources = {s.same_draws_as for s in self.steps}
        # a recorded op that draws: ops reading what it drew rewind to where it drew
        sources.update(i for i, s in enumerate(self.steps)
                       if s.tape is not None and s.tape.entries[s.entry].random)
        for i, step in enumerate(self.steps):
            resume = None
            if step.same_draws_as is not None:
                resume = _rng_state(self.device)
                _set_rng_state(self.device, states[step.same_draws_as])
            states.append(_rng_state(self.device))
            m, fresh = step.module, {}
            for t in list(m._parameters.values()) + list(m._buffers.values()):
                slot = self.slots.get(id(t)) if t is not None else None
                if slot is not None and slot.meta and (slot.module is m or not step.before_ties):
                    fresh[id(slot)] = torch.empty(slot.tensor.shape, dtype=slot.tensor.dtype,
                                                  device=self.device)
            mode, after = self._run(step, fresh)
            if mode.bad_reads and mode.written:
                self._bad_read(step, mode)
            for sid, (slot, value, done) in after.items():
                if not done:
                    continue  # not written here: the value an earlier step left stands
                kept.pop(sid, None)  # superseded (dropped first: memory holds one copy)
                if sid not in history or mode.first.get(sid) != _DIRTY:
                    kept[sid] = (i, self.local(slot, value))  # exact without earlier values
                # else it read or kept part of earlier values: pass 2 recomputes it
            for sid in mode.written:
                history.setdefault(sid, []).append(i)
                if sid not in after:
                    kept.pop(sid, None)  # written through another module (a parent's init)
            if not mode.written and i not in sources:
                states[i] = None  # pass 2 replays only steps that write
            if resume is not None:
                _set_rng_state(self.device, resume)
            del fresh, after, mode
        end = _rng_state(self.device)

        missing = [s for s in self.slots.values() if s.meta and id(s) not in history]
        if missing:
            _raise_uninitialised(missing, self.steps)
        self._check_lost_writes(history)
        self.writes = None

        groups = {}
        for s in self.slots.values():
            if s.meta:
                groups.setdefault(id(s.module), []).append(s)
        for group in groups.values():
            if all(kept.get(id(s), (None,))[0] == history[id(s)][-1] for s in group):
                for s in group:
                    self.tensors[id(s)] = kept.pop(id(s))[1]
                continue
            for s in group:
                kept.pop(id(s), None)
            live = {id(s): torch.empty(s.tensor.shape, dtype=s.tensor.dtype, device=self.device)
                    for s in group}
            for i in sorted({i for s in group for i in history[id(s)]}):
                _set_rng_state(self.device, states[i])
                mode, after = self._run(self.steps[i], live)
                if mode.bad_reads:
                    self._bad_read(self.steps[i], mode)
                for sid, (slot, value, _) in after.items():
                    if sid in live:
                        live[sid] = value
            for s in group:
                self.tensors[id(s)] = self.local(s, live.pop(id(s)))
            del live
        _set_rng_state(self.device, end)  # where building the model would leave it

    @staticmethod
    def _bad_read(step: _Step, mode) -> None:
        raise AutoshardError(
            f"{step.label} on module '{step.path}' ({type(step.module).__name__}) reads the "
            f"values of {mode.bad_reads[0].describe()}, which belongs to another module; "
            "autoshard materialises a meta-device model one module at a time, so an init "
            "step can read only the tensors of the module it initialises (and write its "
            "submodules'). Initialise each module from its own tensors in param_init_fn.")


def _raise_uninitialised(missing: list, steps: list) -> None:
    names = ", ".join(s.describe() for s in missing[:8])
    more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
    custom = any(s.label == "param_init_fn" for s in steps)
    raise ValueError(
        f"the model is on the meta device and nothing initialises {names}{more}: "
        + ("neither the module's reset_parameters() nor param_init_fn writes it. "
           if custom else "its module has no reset_parameters() that writes it. ")
        + "Pass autoshard(model, param_init_fn=fn), where fn(module) initialises the "
        "module's own parameters and buffers in place (module.named_parameters(recurse=False),"
        " module.named_buffers(recurse=False); a buffer computed in __init__, such as a "
        "rotary-embedding table, is computed again there); it runs after the layers' own "
        "reset_parameters(), children first. Or build the model on a real device. The model "
        "is unchanged.")


def _rng_state(device: torch.device) -> list:
    states = [torch.get_rng_state()]
    if device.type != "cpu":
        states.append(getattr(torch, device.type).get_rng_state(device))
    return states


def _set_rng_state(device: torch.device, states: list) -> None:
    torch.set_rng_state(states[0])
    if device.type != "cpu":
        getattr(torch, device.type).set_rng_state(states[1], device)

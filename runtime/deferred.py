"""Recording what a model's constructor does on the meta device: ``deferred_init()``.

Every op a constructor runs on meta tensors inside the block is kept (``Record``), with the
storages it reads and writes, so that ``init_order`` can replay the ones that give a model
tensor its values. The op tables and the storage key here are shared with the step runner
in ``materialize``, which watches the same kinds of reads and writes on the device.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import inspect
import threading
import weakref
from typing import Callable

import torch
from autoshard.core._compat import pytree as _pytree
import torch.utils.weak as weakref_utils
from torch.multiprocessing.reductions import StorageWeakRef
from autoshard.core._compat import tree_map_only

from autoshard.core import _compat


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
class Ref:
    """A recorded meta tensor: which storage, and how it views it."""

    key: StorageWeakRef
    shape: tuple
    stride: tuple
    offset: int
    dtype: torch.dtype
    size: int  # elements of dtype in the storage

    @classmethod
    def of(cls, t: torch.Tensor) -> "Ref":
        st = t.untyped_storage()
        return cls(StorageWeakRef(st), tuple(t.shape), tuple(t.stride()), t.storage_offset(),
                   t.dtype, st.nbytes() // max(t.element_size(), 1))


@dataclasses.dataclass(eq=False)
class Entry:
    """One op the constructor ran, with its meta tensors as ``Ref``s."""

    index: int
    func: Callable
    args: tuple
    kwargs: dict
    writes: list  # storage keys written in place
    fresh: list  # (position in the flat outputs, Ref) of outputs with storage of their own
    reads: list  # storage keys of every meta tensor argument
    random: bool  # draws from the random number generator
    overwrites: set  # storage keys it gives every element of without reading them
    name: str = ""  # what it is called in messages
    wrefs: list = dataclasses.field(default_factory=list)  # Ref of each tensor written
    vreads: list = dataclasses.field(default_factory=list)  # Ref of each tensor whose
    #                                                         values it reads
    generator: bool = False  # draws from a torch.Generator it was given

    @property
    def empty(self) -> bool:
        schema = getattr(self.func, "_schema", None)  # a recorded call has none
        return schema is not None and schema.name in EMPTY_OPS

    def created(self) -> list:
        return [] if self.empty else [r.key for _, r in self.fresh]


_SERIALS = itertools.count()


class Record(_compat.TorchDispatchMode):
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
        return Ref.of(t)

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
            ts = [t for t in tensors_in(val) if t.device.type == "meta"]
            if a.alias_info is not None and a.alias_info.is_write:
                blind = schema.name in OVERWRITE_OPS or a.is_out
                written.extend((t, blind) for t in ts)
            else:
                read.extend(ts)
        writes = [storage_key(t) for t, _ in written]
        outs = _pytree.tree_leaves(out)
        fresh = [(i, Ref.of(o)) for i, (o, r) in enumerate(zip(outs, _returns(schema, outs)))
                 if isinstance(o, torch.Tensor) and o.device.type == "meta" and r is None]
        self.created.update(r.key for _, r in fresh)
        rargs, rkwargs = tree_map_only(torch.Tensor, self._ref, (args, kwargs))
        for o in outs:
            if isinstance(o, torch.Tensor) and o.device.type == "meta":
                self.storages.append(o.untyped_storage())
        reads = [r.key for r in _pytree.tree_leaves((rargs, rkwargs)) if isinstance(r, Ref)]
        # what the op's result does not depend on: its own new outputs, and a tensor an
        # overwriting op (fill_, copy_, normal_, an out= argument) writes whole without
        # reading its storage through another argument. An in-place op returns the tensor it
        # updates (mul_, erfinv_, clamp_): that output is its input, read, never an overwrite.
        overwrites = set()
        if schema.name not in EMPTY_OPS:
            overwrites.update(r.key for pos, r in fresh if _whole(outs[pos]))
        read_keys = {storage_key(t) for t in read}
        overwrites.update(storage_key(t) for t, blind in written
                          if blind and _whole(t) and storage_key(t) not in read_keys)
        vreads = [] if view else [Ref.of(t) for t in read] + [
            Ref.of(t) for t, blind in written if not blind]
        gen = any(isinstance(x, torch.Generator) for x in _pytree.tree_leaves((args, kwargs)))
        self.entries.append(Entry(len(self.entries), func, rargs, rkwargs, writes, fresh, reads,
                                   torch.Tag.nondeterministic_seeded in func.tags, overwrites,
                                   str(func), [Ref.of(t) for t, _ in written], vreads, gen))
        return out

    def record_call(self, name: str, fn: Callable, random: bool, tensor: torch.Tensor,
                    args: tuple, kwargs: dict, generator: bool) -> None:
        """Record ``fn(tensor, *args, **kwargs)``, an init function that gives every element
        of ``tensor`` a value without reading it, as one op (replayed by calling ``fn`` on the
        device)."""
        rargs, rkwargs = tree_map_only(torch.Tensor, self._ref, ((tensor,) + tuple(args), kwargs))
        ref = rargs[0]
        self.entries.append(Entry(len(self.entries), fn, rargs, rkwargs, [ref.key], [],
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
                        and storage_key(t) in self.created):
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


# recorded tensor -> (its Record, its version counter when recording ended); filled only
# inside deferred_init(), an entry goes when its tensor does
RECORDED = weakref_utils.WeakIdKeyDictionary()

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
def _recording_init_calls(rec: Record):
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

    rec = Record()
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
        RECORDED[t] = (rec, t._version)
    rec.tensors = []


EMPTY_OPS = frozenset({"aten::empty", "aten::empty_like", "aten::empty_strided",
                        "aten::new_empty", "aten::new_empty_strided"})
# in-place ops that give every element of their output a value without reading it
OVERWRITE_OPS = frozenset({
    "aten::normal_", "aten::uniform_", "aten::fill_", "aten::zero_", "aten::copy_",
    "aten::bernoulli_", "aten::random_", "aten::exponential_", "aten::geometric_",
    "aten::cauchy_", "aten::log_normal_"})


def storage_key(t: torch.Tensor):
    """A key for ``t``'s storage (the same for every view of it); None if it has none."""
    try:
        return StorageWeakRef(t.untyped_storage())
    except (RuntimeError, NotImplementedError):  # sparse, nested, ... tensors
        return None


def tensors_in(v) -> list:
    if isinstance(v, torch.Tensor):
        return [v]
    if isinstance(v, (list, tuple)):
        return [x for x in v if isinstance(x, torch.Tensor)]
    return []

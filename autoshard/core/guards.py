"""Guards: what a captured step read from the Python world, checked before each reuse.

Capture runs the model's forward once, on fake tensors, and keeps the graph. Every
Python-level value that forward read is recorded while it runs (``recording``) and becomes a
guard: module attributes it read (numbers, flags, strings, enums, plain tensors, configs),
the module tree with its parameters, buffers and hooks, the parameters' dtypes and devices,
and the globals and closure cells of the code it ran. Before a program is reused every guard
is compared with the value now (``Guards.failure``); the caller then picks the program
captured for the new values or captures again. What a captured program can never follow is
refused at capture, naming the call: Python's and NumPy's random numbers and the clock read
in forward. ``print`` in forward runs at capture only, and says so once.

How reads are seen: each module's class is swapped, for the length of the trace, for a
subclass whose ``__getattribute__`` notes the instance attributes read; a profile function
(``sys.setprofile``) sees every function the forward enters outside torch and the standard
library, whose global names and closure cells are then guarded, and every call of a random
or clock function from such code.
"""

from __future__ import annotations

import contextlib
import enum
import gc
import itertools
import operator
import os
import sys
import sysconfig
import types
import warnings
import weakref
from typing import Any, Callable, Optional

import torch

from autoshard.core.errors import AutoshardError

_MISSING = object()
_SCALARS = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device,
            torch.layout, torch.memory_format, enum.Enum)
_IDENTITY = (types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType,
             type, torch.nn.Module)
# nn.Module's own bookkeeping: the tree and hook guards cover these
MODULE_INTERNALS = frozenset({
    "_parameters", "_buffers", "_modules", "_non_persistent_buffers_set", "_backward_pre_hooks",
    "_backward_hooks", "_is_full_backward_hook", "_forward_hooks", "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called", "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs",
    "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks", "_autoshard", "__dict__", "__class__"})
_CONTAINER_LIMIT = 16
# the methods that change a list, dict or set in place (autoshard.core.writes refuses that)
_MUTATORS = frozenset({"append", "extend", "insert", "pop", "remove", "clear", "sort",
                       "reverse", "update", "setdefault", "popitem", "add", "discard",
                       "__setitem__", "__delitem__", "__iadd__"})


_EXACT = frozenset({type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device})


def freeze(value: Any, depth: int = 0) -> Any:
    """A comparable snapshot of ``value``: scalars by value, tensors by identity and version
    (an in-place write advances it), containers by their items, anything else by identity
    (``fields`` snapshots an object's own plain fields)."""
    cls = type(value)  # not value.__class__: a config may compute its attributes
    if cls in _EXACT or issubclass(cls, _SCALARS):
        if cls is float and value != value:
            return (float, "nan")
        return (cls, value)
    if issubclass(cls, torch.Tensor):
        return ("tensor", id(value), value._version)
    if depth < 2 and cls in (tuple, list, set, frozenset, dict) and \
            len(value) <= _CONTAINER_LIMIT:
        if cls is dict:
            return (cls, tuple((k, freeze(v, depth + 1)) for k, v in value.items()))
        items = sorted(value, key=repr) if cls in (set, frozenset) else value
        return (cls, tuple(freeze(v, depth + 1) for v in items))
    return ("id", id(value))


def is_plain_object(value: Any) -> bool:
    """An object whose own fields a forward may read (a config): not a scalar, tensor,
    container, function, class or module."""
    return (not issubclass(type(value), _SCALARS + _IDENTITY + (
        torch.Tensor, tuple, list, set, frozenset, dict))
        and isinstance(getattr(value, "__dict__", None), dict))


def fields(obj: Any) -> tuple:
    """An object's own fields, as a comparable value: scalars by value, small containers by
    their items (a config's ``rope_scaling`` dict), tensors, nested objects and anything
    else by identity."""
    return tuple((k, freeze(v, 1)) for k, v in vars(obj).items())


def show(frozen: Any) -> str:
    """A frozen value as a person reads it."""
    if frozen is _MISSING:
        return "(absent)"
    if isinstance(frozen, tuple) and len(frozen) == 2 and isinstance(frozen[0], type) \
            and issubclass(frozen[0], _SCALARS):
        return repr(frozen[1])
    if isinstance(frozen, tuple) and frozen and frozen[0] == "tensor":
        return f"tensor object {frozen[1]:#x} at version {frozen[2]}"
    if isinstance(frozen, tuple) and frozen and frozen[0] in ("id", "obj"):
        return f"object {frozen[1]:#x}"
    return repr(frozen)[:80]


class Guard:
    """One recorded value: where it lives (``what``), how to read it now (``get``, frozen),
    and the value the program was captured with. ``held``: (a dict, a key, the object
    captured) where the value is one object read from a dict whose identity decides the
    guard (an object guarded by identity) or implies it (a scalar: the same object has the
    same value); such guards are checked together, in C (``Guards.failure``)."""

    __slots__ = ("what", "get", "expected", "kind", "key", "held")

    def __init__(self, what: str, get: Callable[[], Any], kind: str = "value", key=None,
                 held=None):
        self.what, self.get, self.kind, self.key, self.held = what, get, kind, key, held
        self.expected = get()


class _Keys:
    """The keys of many dicts, in order, and (``values``) the identity of their values: the
    module tree's or its hooks' state, compared without a Python call per dict."""

    def __init__(self, dicts: list, values: bool):
        self.dicts = dicts
        self.lens, self.keys = self._shape()
        self.values = list(itertools.chain.from_iterable(map(dict.values, dicts))) \
            if values else None

    def _shape(self) -> tuple:
        return list(map(len, self.dicts)), list(itertools.chain.from_iterable(self.dicts))

    def holds(self) -> bool:
        if self._shape() != (self.lens, self.keys):
            return False
        return self.values is None or all(map(
            operator.is_, itertools.chain.from_iterable(map(dict.values, self.dicts)),
            self.values))


class Guards:
    """The guards of one captured program, checked in order before each reuse.

    A step checks hundreds of guards (four per module, one per attribute and global its
    forward read); one Python call each would cost about as much as the step's small ops.
    So the tree and hook guards are also taken as two ``_Keys`` and the identity guards as
    one list, each compared in C; only the rest (tensors, containers, configs) run their own
    ``get``. When anything differs the guards are scanned in order for the first that changed,
    so ``failure`` answers as the plain scan would."""

    def __init__(self, guards: list, pins: list, batches: tuple = ()):
        self.guards = guards
        self._pins = pins  # objects guarded by identity stay alive, so their ids stay theirs
        self._batches = batches
        held = [g for g in guards if g.held is not None]
        self._held = held
        self._dicts = [g.held[0] for g in held]
        self._keys = [g.held[1] for g in held]
        self._objects = [g.held[2] for g in held]
        self._rest = [g for g in guards if g.held is None and g.kind not in _BATCHED]

    def __len__(self) -> int:
        return len(self.guards)

    def failure(self) -> Optional[Guard]:
        """The first guard whose value changed, or None when the program still holds."""
        if self._hold():
            return None
        for g in self.guards:
            if g.get() != g.expected:
                return g
        return None

    def _hold(self) -> bool:
        if not all(b.holds() for b in self._batches):
            return False
        now = list(map(dict.get, self._dicts, self._keys, itertools.repeat(_MISSING)))
        if not all(map(operator.is_, now, self._objects)):  # a scalar may be an equal copy
            if any(v is not g.held[2] and g.get() != g.expected
                   for g, v in zip(self._held, now)):
                return False
        return all(g.get() == g.expected for g in self._rest)

    def change(self, g: Guard) -> str:
        now = g.get()
        if g.kind == "tree":
            (names0, ids0), (names1, ids1) = g.expected, now
            was, new = dict(zip(names0, ids0)), dict(zip(names1, ids1))
            parts = [f"'{n}' added" for n in new if n not in was]
            parts += [f"'{n}' removed" for n in was if n not in new]
            parts += [f"'{n}' replaced" for n in new if n in was and new[n] != was[n]]
            return f"{g.what}: {', '.join(parts) or 'reordered'}"
        if g.kind == "dtype":
            changed = [f"{d0} on {v0} -> {d1} on {v1}"
                       for (d0, v0), (d1, v1) in zip(zip(*g.expected), zip(*now))
                       if (d0, v0) != (d1, v1)]
            return f"{g.what}: {changed[0] if changed else 'changed'}"
        return f"{g.what}: {show(g.expected)} -> {show(now)}"


# --- what the forward reads -------------------------------------------------------------------

_STDLIB = tuple(os.path.realpath(p) + os.sep for p in
                {sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["platstdlib"]})
_TORCH = os.path.realpath(os.path.dirname(torch.__file__)) + os.sep
# autoshard's own code: the package, and in a checkout the passes and runtime beside it
# (examples/, beside it too, is models as a user writes them)
_PACKAGE = os.path.realpath(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_OWN = tuple(os.path.join(d, "") for d in (_PACKAGE, *(
    os.path.join(os.path.dirname(_PACKAGE), d) for d in ("passes", "runtime"))))
_SITE = ("site-packages", "dist-packages")
# libraries torch itself calls while tracing: not the model's code
_INFRA = ("sympy", "mpmath", "typing_extensions", "numpy", "networkx", "optree", "filelock",
          "fsspec", "jinja2", "tabulate", "packaging")


def own_file(filename: str) -> bool:
    """Whether ``filename`` is autoshard's own code (its examples are the user's)."""
    path = os.path.realpath(filename)
    return path.startswith(_OWN) and not path.startswith(os.path.join(_PACKAGE, "examples", ""))


def _is_user_file(filename: str) -> bool:
    """Code whose Python-level reads a capture must guard: anything but torch, autoshard and
    the standard library (libraries such as transformers are the user's code here)."""
    if filename.startswith("<"):
        return filename.startswith("<string") or filename.startswith("<ipython")
    path = os.path.realpath(filename)
    if path.startswith(_TORCH) or own_file(path):
        return False
    for site in _SITE:
        at = path.find(os.sep + site + os.sep)
        if at >= 0:
            top = path[at + len(site) + 2:].split(os.sep, 1)[0]
            return top.split(".", 1)[0] not in _INFRA
    return not path.startswith(_STDLIB)


def _nondeterministic() -> dict:
    """Builtins a captured step cannot follow, by object: Python's and NumPy's random
    numbers and the clock."""
    import random
    import time

    found = {}
    for name in ("random", "getrandbits", "randbytes"):
        fn = getattr(random._inst, name, None)
        if fn is not None:
            found[fn] = f"random.{name}"
    for name in ("time", "time_ns", "perf_counter", "perf_counter_ns", "monotonic",
                 "monotonic_ns", "process_time", "process_time_ns"):
        found[getattr(time, name)] = f"time.{name}"
    found[os.urandom] = "os.urandom"
    return found


def _numpy_random_call(fn) -> Optional[str]:
    owner = getattr(fn, "__self__", None)
    np = sys.modules.get("numpy")
    if np is None or owner is None:
        return None
    kinds = (np.random.RandomState, np.random.Generator, np.random.BitGenerator)
    if isinstance(owner, kinds):
        return f"numpy.random {getattr(fn, '__name__', '?')}"
    return None


class _Reads:
    """What one trace read: module attributes, code run outside torch, refused calls."""

    def __init__(self):
        self.attrs: dict = {}  # (id(module), name) -> module
        self.codes: dict = {}  # code -> frame globals, for code run outside torch
        self.closures: set = set()  # codes with free variables
        self.refused: list = []  # (call, where)
        self.printed: list = []  # where print ran
        # what the forward wrote (autoshard.core.writes): (id(object), name) -> where, for
        # attributes it set; id(container) -> where, for a container the user's code changed
        # in place; the attributes torch's own code set (reparametrizing, RNN weight lists)
        self.written: dict = {}
        self.mutated: dict = {}
        self.internal: set = set()
        self._torch: dict = {}  # code -> whether it is torch's
        self.unseen = False  # another profiler was running: the code run went unseen
        self._user: dict = {}  # code -> bool
        self._bad = _nondeterministic()
        import random

        self._random_file = os.path.realpath(random.__file__)

    def kind(self, code) -> int:
        """1: user code, 2: the random module, 0: anything else."""
        known = self._user.get(code)
        if known is None:
            if os.path.realpath(code.co_filename) == self._random_file:
                known = 2
            else:
                known = int(_is_user_file(code.co_filename))
            self._user[code] = known
        return known

    def user(self, code) -> bool:
        return self.kind(code) == 1

    def torch_code(self, code) -> bool:
        known = self._torch.get(code)
        if known is None:
            known = self._torch[code] = os.path.realpath(code.co_filename).startswith(_TORCH)
        return known

    def profile(self, frame, event, arg):
        if event == "call":
            code = frame.f_code
            kind = self.kind(code)
            if kind == 1:
                if code not in self.codes:
                    self.codes[code] = frame.f_globals
                    if code.co_freevars:
                        self.closures.add(code)
            elif kind == 2:  # the random module: its global generator, or an unseeded one
                caller = frame.f_back
                if caller is not None and self.user(caller.f_code) and _draws(frame):
                    self.refused.append((f"random.{code.co_name}", _where(caller)))
        elif event == "c_call" and self.user(frame.f_code):
            try:
                bad = self._bad.get(arg)
            except TypeError:  # an unhashable callable
                bad = None
            bad = bad or _numpy_random_call(arg)
            if bad is not None:
                self.refused.append((bad, _where(frame)))
            elif arg is print:
                self.printed.append(_where(frame))
            elif getattr(arg, "__name__", None) in _MUTATORS:  # lst.append(x): whose list?
                owner = getattr(arg, "__self__", None)
                if type(owner) in (list, dict, set):
                    self.mutated.setdefault(id(owner), _where(frame))


def _draws(frame) -> bool:
    """Whether a call into the random module draws from state a captured step cannot
    repeat: the module's global generator (``random.randint`` is its bound method), or a
    generator seeded from the operating system (``random.Random()``). A generator the
    forward seeds itself (``random.Random(self.seed)``) gives the same draws on every call."""
    import random

    local = frame.f_locals
    owner = local.get("self")
    if owner is random._inst or owner is None:
        return True
    return frame.f_code.co_name in ("__init__", "seed") and local.get("x", 0) is None


def _where(frame) -> str:
    return f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"


_recorders: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_active: list = []  # the _Reads of the trace in progress


def _reading_getattribute(self, name, _get=object.__getattribute__):
    value = _get(self, name)
    if _active and name not in MODULE_INTERNALS and name in _get(self, "__dict__") and \
            (id(self), name) not in _active[-1].written:  # not what this forward wrote
        _active[-1].attrs[(id(self), name)] = self
    return value


def _writing_setattr(self, name, value):
    if _active and name not in MODULE_INTERNALS:
        reads, caller = _active[-1], sys._getframe(1)
        if reads.torch_code(caller.f_code):  # torch's own bookkeeping is not the forward's
            reads.internal.add((id(self), name))
        else:
            reads.written.setdefault((id(self), name), _where(caller))
    user_class(self).__setattr__(self, name, value)


def _recorder(cls: type) -> type:
    """``cls`` with attribute reads noted, under the same names."""
    sub = _recorders.get(cls)
    if sub is None:
        sub = type(cls.__name__, (cls,), {"__getattribute__": _reading_getattribute,
                                          "__setattr__": _writing_setattr,
                                          "__module__": cls.__module__,
                                          "__qualname__": cls.__qualname__,
                                          "_autoshard_recorder": True})
        _recorders[cls] = sub
    return sub


def user_class(mod: torch.nn.Module) -> type:
    """The class of ``mod`` as its user wrote it, while a trace swaps it for a recorder."""
    cls = type(mod)
    return cls.__mro__[1] if cls.__dict__.get("_autoshard_recorder") else cls


@contextlib.contextmanager
def recording(model: torch.nn.Module):
    """Note what the forward run inside reads; yields the ``_Reads``."""
    reads = _Reads()
    mods = list(dict.fromkeys(model.modules()))
    classes = [type(m) for m in mods]
    swapped = []
    try:
        for m, cls in zip(mods, classes):
            try:
                m.__class__ = _recorder(cls)
                swapped.append((m, cls))
            except TypeError:  # a class whose layout forbids it: its reads go unseen
                pass
        _active.append(reads)
        states = _random_states()
        # a profiler already running (cProfile, a debugger) keeps its place: the code the
        # forward runs then goes unseen (its globals unguarded), random draws are still
        # seen by the state they advance
        profiling = sys.getprofile() is None
        if profiling:
            sys.setprofile(reads.profile)
        else:
            reads.unseen = True
        try:
            yield reads
        finally:
            if profiling:
                sys.setprofile(None)
            _active.pop()
        if not reads.refused:  # drawn where the profile cannot see (a compiled function)
            for name, (get, before) in states.items():
                if not _same_state(get(), before):
                    reads.refused.append((name, "a call the trace could not place"))
    finally:
        for m, cls in swapped:
            m.__class__ = cls


def user_class_name(mod: torch.nn.Module) -> str:
    """The user's class name, also for a model autoshard has wrapped (ShardedX -> X, which
    the sharded class names as ``_autoshard_user_class``)."""
    cls = user_class(mod)
    return cls.__dict__.get("_autoshard_user_class", cls).__qualname__


def _random_states() -> dict:
    import random

    states = {"random (Python's global random state advanced)": (random.getstate,
                                                                  random.getstate())}
    np = sys.modules.get("numpy")
    if np is not None:
        states["numpy.random (NumPy's global random state advanced)"] = (
            np.random.get_state, np.random.get_state())
    return states


def _same_state(a, b) -> bool:
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_same_state(x, y) for x, y in zip(a, b))
    np = sys.modules.get("numpy")
    if np is not None and isinstance(a, np.ndarray):
        return bool(np.array_equal(a, b))
    return a == b


def refuse_unfollowable(reads: _Reads, model_name: str) -> None:
    """Refuse a capture that called what its graph cannot repeat; say once that print ran at
    capture only."""
    if reads.refused:
        call, where = reads.refused[0]
        raise AutoshardError(
            f"{model_name}.forward calls {call} at {where}; a captured step would keep the "
            "value it drew at capture on every call (and ranks with other seeds would run "
            "different programs). Draw it with torch (torch.rand, torch.randint, "
            "torch.bernoulli: traced, fresh on every call), or draw it outside the model and "
            "pass it in as an input.")
    if reads.unseen:
        warnings.warn("a profiler was running while the step was captured, so autoshard did "
                      "not see the code its forward ran: the globals and closure variables "
                      "that code read are not guarded (a change to them would not be "
                      "followed). Capture outside the profiler (sharded.precompile(*inputs) "
                      "first) to guard them.", stacklevel=2)
    for where in dict.fromkeys(reads.printed):
        warnings.warn(f"print() in the model's forward ({where}) ran once, while the step "
                      "was captured, on fake tensors; the captured step does not run it. "
                      "Print from a forward hook (it runs on every call with real tensors) "
                      "or from the training loop.", stacklevel=2)


_BATCHED = frozenset({"tree", "hooks"})  # the kinds ``_Keys`` check
_DTYPE, _DEVICE = operator.attrgetter("dtype"), operator.attrgetter("device")


def _held(value: Any) -> bool:
    """Whether the same object read again means the guard holds: a scalar (the same object,
    the same value) or an object ``freeze`` guards by identity; not a tensor (its version)
    nor a container (its items)."""
    frozen = freeze(value)
    return frozen[0] == "id" or (isinstance(frozen[0], type)
                                 and issubclass(frozen[0], _SCALARS))


def build(model: torch.nn.Module, reads: _Reads, names: dict, hook_dicts: Callable,
          lifted=()) -> Guards:
    """The guards of a program whose forward read ``reads``: ``names`` maps a module's id to
    its path; ``hook_dicts(module)`` the dicts of the module's hooks, ``hook_dicts(None)``
    the global ones (a change to their keys recaptures); ``lifted``: (module, attribute) of
    floats the graph takes as inputs, guarded only to stay floats."""
    lifted = {(id(m), n) for m, n in lifted}
    objects: dict = {}
    guards, pins = [], []
    mods = list(dict.fromkeys(model.modules()))
    trees, hooked = [], [*hook_dicts(None)]
    for m in mods:
        path = names.get(id(m), "?") or "(root)"
        for attr in ("_modules", "_parameters", "_buffers"):
            d = getattr(m, attr)
            trees.append(d)
            guards.append(Guard(f"module '{path}' {attr[1:]}",
                                lambda d=d: (tuple(d), tuple(map(id, d.values()))), "tree"))
        own = hook_dicts(m)
        hooked.extend(own)
        guards.append(Guard(f"hooks of module '{path}'", lambda o=own: tuple(map(tuple, o)),
                            "hooks"))
        pins.extend(m._parameters.values())
        pins.extend(m._buffers.values())
        pins.extend(m._modules.values())
    glob = hook_dicts(None)
    guards.append(Guard("global module hooks", lambda: tuple(map(tuple, glob)), "hooks"))
    params = [p for m in mods for p in m._parameters.values() if p is not None]
    guards.append(Guard("the parameters' dtype and device",
                        lambda ps=params: (tuple(map(_DTYPE, ps)), tuple(map(_DEVICE, ps))),
                        "dtype"))
    for (_, name), m in reads.attrs.items():
        d = m.__dict__
        path = names.get(id(m), "?") or "(root)"
        what = f"attribute '{name}' of module '{path}' ({user_class(m).__name__})"
        if (id(m), name) in lifted:
            guards.append(Guard(what, lambda d=d, n=name: type(d.get(n)) is float, "lifted",
                                key=(m, name)))
            continue
        value = d.get(name, _MISSING)
        guards.append(Guard(what, lambda d=d, n=name: freeze(d.get(n, _MISSING)), "attr",
                            key=(m, name), held=(d, name, value) if _held(value) else None))
        pins.append(value)
        if is_plain_object(value) and id(value) not in objects:
            objects[id(value)] = value  # a config many modules share: its fields, once
            guards.append(Guard(f"fields of {type(value).__name__} object read as "
                                f"'{path}.{name}'", lambda o=value: fields(o), "fields"))
    seen = set()
    for code, glb in reads.codes.items():
        for name in code.co_names:
            if (id(glb), name) in seen or name not in glb:
                continue
            seen.add((id(glb), name))
            mod, value = glb.get("__name__", "?"), glb[name]
            if issubclass(type(value), _IDENTITY):  # a function, class or module: the same one
                guards.append(Guard(f"global '{name}' of {mod} (replaced)",
                                    lambda g=glb, n=name, v=value: g.get(n) is v, "global",
                                    held=(glb, name, value)))
            else:
                guards.append(Guard(f"global '{name}' of {mod}",
                                    lambda g=glb, n=name: freeze(g.get(n, _MISSING)), "global",
                                    held=(glb, name, value) if _held(value) else None))
            pins.append(value)
    if reads.closures:
        for fn in gc.get_referrers(*reads.closures):
            if not isinstance(fn, types.FunctionType) or fn.__closure__ is None:
                continue
            for var, cell in zip(fn.__code__.co_freevars, fn.__closure__):
                try:
                    value = cell.cell_contents
                except ValueError:
                    continue
                if isinstance(value, _IDENTITY):
                    continue  # the wrapped function of a decorator, a module
                guards.append(Guard(f"closure variable '{var}' of {fn.__qualname__}",
                                    lambda c=cell: freeze(_cell(c)), "closure"))
                pins.append(value)
    return Guards(guards, pins, (_Keys(trees, values=True), _Keys(hooked, values=False)))


def _cell(cell):
    try:
        return cell.cell_contents
    except ValueError:
        return _MISSING

"""The initialisation steps of a meta-device model, in the order building it on the device
makes them: ``init_steps``.

A step is one init call on one module (a layer's reset_parameters(), a Hugging Face
model's ``_init_weights``, an op recorded by ``deferred_init()``, ``param_init_fn``). This
module decides which steps there are and their order; ``materialize`` runs them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
from typing import Callable, Optional

import torch
from autoshard.core._compat import pytree as _pytree
from autoshard.core._compat import tree_map_only

from autoshard.runtime.deferred import Entry, RECORDED, Record, Ref, storage_key


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
class Slot:
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
class Step:
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


def slots_of(model: torch.nn.Module) -> dict:
    """id(tensor) -> Slot for every parameter and buffer, in ``named_modules`` order."""
    out = {}
    for mod_name, mod in model.named_modules():
        for is_param, table in ((True, mod._parameters), (False, mod._buffers)):
            for name, t in table.items():
                if t is not None and id(t) not in out:
                    fqn = f"{mod_name}.{name}" if mod_name else name
                    out[id(t)] = Slot(fqn, mod, name, is_param, t)
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


class _Tape:
    """One record's ops as init steps of a model: a step for each op that writes a model
    tensor (``run``), and one for each other op that draws random numbers (only to draw them,
    as building on the device does)."""

    def __init__(self, rec: Record, lookup: dict):
        self.rec, self.entries = rec, rec.entries
        self.lookup = lookup  # storage key -> Slot of the model's meta tensors
        self.writers = {}  # storage key -> indices of the entries that write it, in order
        self.creator = {}  # storage key -> the entry that made it (an empty one too)
        for e in self.entries:
            for k in dict.fromkeys(e.writes + e.created()):
                self.writers.setdefault(k, []).append(e.index)
            for _, r in e.fresh:
                self.creator.setdefault(r.key, e.index)
        self.step_of = {}  # entry index -> its step's index (set by init_steps)
        self.mat = None  # what runs the steps (materialize.py), set when it starts

    def step(self, e: Entry, names: dict, root: torch.nn.Module) -> Optional[Step]:
        written = [self.lookup[k] for k in e.writes + e.created() if k in self.lookup]
        if not written and not e.random:
            return None  # an intermediate: computed where a step reads it
        m = written[0].module if written else root
        label = f"{e.name or e.func} (recorded by deferred_init)"
        return Step(m, names[id(m)], label, functools.partial(self.run, e.index), True,
                     tape=self, entry=e.index)

    def _program(self, e: Entry, own: set, names: str) -> list:
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

    def _no_generator(self, w: Entry, names: str) -> None:
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

        def local(r: Ref) -> torch.Tensor:
            base = env.get(r.key)
            if base is None:
                base = env[r.key] = torch.empty(r.size, dtype=r.dtype, device=device)
            return base.as_strided(r.shape, r.stride, r.offset)

        def target(r: Ref) -> torch.Tensor:
            if r.key in own:  # through the step's mode: its stand-in for the model tensor
                return self.lookup[r.key].tensor.as_strided(r.shape, r.stride, r.offset)
            return local(r)

        start = rng_state(device)
        if own:  # (a step that only draws needs no values)
            names = " and ".join(dict.fromkeys(self.lookup[k].describe() for k in own))
            self._no_generator(e, names)
            program = self._program(e, own, names)
            for i in program:
                self._no_generator(self.entries[i], names)
            for i in program:
                w = self.entries[i]
                if w.random:
                    set_rng_state(device, mat.states[self.step_of[i]])
                self._exec(w, local, device)
            set_rng_state(device, start)
        self._exec(e, target, device)

    @staticmethod
    def _exec(e: Entry, resolve: Callable, device: torch.device) -> None:
        if e.empty:
            return  # uninitialised memory: nothing to compute
        args, kwargs = tree_map_only(Ref, resolve, (e.args, e.kwargs))
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
    slots = slots_of(model)
    records = {}
    for s in slots.values():
        if s.meta and s.tensor in RECORDED:
            rec = RECORDED[s.tensor][0]
            records[id(rec)] = rec
    records = sorted(records.values(), key=lambda r: r.serial)
    steps, hf_done, reset_step, hf_at = [], set(), {}, {}
    for m in _post_order(model):
        reset = _reset_method(m)
        if reset is not None and not _built_recorded(m, names):
            source = copies.get(id(m))
            reset_step[id(m)] = len(steps)
            steps.append(Step(m, names[id(m)], f"{type(m).__name__}.{reset[1]}", reset[0],
                               True, reset_step.get(id(source)) if source else None))
        if _hf_pretrained(m):
            post_init = []
            for x in _post_order(m):
                if id(x) in hf_done or getattr(x, "_is_hf_initialized", False):
                    continue
                hf_done.add(id(x))
                post_init.append(Step(x, names[id(x)], f"{type(m).__name__}._init_weights",
                                       functools.partial(_hf_init_weights, m, x), True))
            # built under deferred_init(): where its constructor ended on the tape
            at = next(((r, pos) for r in records if (pos := r.mark(m)) is not None), None)
            if at is None:
                steps.extend(post_init)
            else:
                hf_at.setdefault((id(at[0]), at[1]), []).extend(post_init)
    recorded = []
    if records:
        lookup = {storage_key(s.tensor): s for s in slots.values() if s.meta}
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
            steps.append(Step(m, names[id(m)], "param_init_fn",
                               functools.partial(param_init_fn, m), False))
    return steps


def _built_recorded(m: torch.nn.Module, names: dict) -> bool:
    """Whether ``m``'s own meta tensors were built under ``deferred_init()`` (so its
    reset_parameters() is on the tape); ``ValueError`` if only some of them were."""
    own = [(n, t, kind) for kind, table in (("parameter", m._parameters),
                                              ("buffer", m._buffers))
           for n, t in table.items() if t is not None and t.device.type == "meta"]
    flags = [t in RECORDED for _, t, _ in own]
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


def rng_state(device: torch.device) -> list:
    states = [torch.get_rng_state()]
    if device.type != "cpu":
        states.append(getattr(torch, device.type).get_rng_state(device))
    return states


def set_rng_state(device: torch.device, states: list) -> None:
    torch.set_rng_state(states[0])
    if device.type != "cpu":
        getattr(torch, device.type).set_rng_state(states[1], device)

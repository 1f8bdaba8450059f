"""Meta-device models: materialised module by module, as building them on the device would."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
from typing import Callable, Optional

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_map_only

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


def init_steps(model: torch.nn.Module, param_init_fn=None) -> list:
    """The initialisation calls building ``model`` on a device makes, in their order:

    1. every module's ``reset_parameters()`` (modules with parameters or buffers of their
       own), children before their parent, in registration order (the layers of an
       ``nn.TransformerEncoder``/``Decoder``, deep copies of one layer, draw its values);
    2. for a Hugging Face ``PreTrainedModel`` (also one nested inside, e.g. ``LlamaModel``
       inside ``LlamaForCausalLM``), right after its own modules: its post_init, which calls
       ``_init_weights`` on each of its modules not initialised yet, children first;
    3. ``param_init_fn(module)`` on every module, children first (``model.apply``'s order),
       as code run after the model is built (after weights are tied).
    """
    names = {id(m): n for n, m in model.named_modules()}
    copies = _construction_copies(model)
    steps, hf_done, reset_step = [], set(), {}
    for m in _post_order(model):
        reset = _reset_method(m)
        if reset is not None:
            source = copies.get(id(m))
            reset_step[id(m)] = len(steps)
            steps.append(_Step(m, names[id(m)], f"{type(m).__name__}.{reset[1]}", reset[0],
                               True, reset_step.get(id(source)) if source else None))
        if _hf_pretrained(m):
            for x in _post_order(m):
                if id(x) in hf_done or getattr(x, "_is_hf_initialized", False):
                    continue
                hf_done.add(id(x))
                steps.append(_Step(x, names[id(x)], f"{type(m).__name__}._init_weights",
                                   functools.partial(_hf_init_weights, m, x), True))
    if param_init_fn is not None:
        for m in _post_order(model):
            steps.append(_Step(m, names[id(m)], "param_init_fn",
                               functools.partial(param_init_fn, m), False))
    return steps


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
        states, kept, history = [], {}, {}  # history: id(slot) -> steps that wrote it
        sources = {s.same_draws_as for s in self.steps}
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

"""Meta-device models: materialised module by module, as building them on the device would.

One public function, ``materialize``: it takes the steps ``init_order.init_steps`` lists
(``deferred.py`` records what a constructor ran) and runs them on full-size tensors of one
module at a time, keeping only what this rank stores of each.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
from autoshard.core._compat import tree_map_only

from autoshard.core import _compat
from autoshard.core.errors import AutoshardError
from autoshard.runtime.deferred import (EMPTY_OPS, OVERWRITE_OPS, RECORDED, storage_key,
                                        tensors_in)
from autoshard.runtime.init_order import Slot, Step, init_steps, rng_state, set_rng_state


_CLEAN, _DIRTY = "overwritten", "read"


def materialize(model: torch.nn.Module, slots: dict, device: torch.device, local: Callable,
                param_init_fn=None) -> tuple:
    """Give ``model``'s meta tensors their values module by module, as building the model on
    ``device`` would (see ``stage_shards``): the steps are ``init_steps(model, param_init_fn)``,
    run on full-size tensors of one module at a time. ``slots`` is ``slots_of(model)``;
    ``local(slot, full)`` is what this rank keeps of a tensor. Returns id(tensor) -> that kept
    value, for each tensor the steps initialised, and the steps run."""
    steps = init_steps(model, param_init_fn)
    mat = _Materializer(model, slots, steps, device, local)
    mat.run()
    values = {tid: mat.tensors[id(s)] for tid, s in slots.items() if id(s) in mat.tensors}
    return values, steps


@dataclasses.dataclass(eq=False)
class _Use:
    """A full-size tensor standing in for a model tensor during one step."""

    slot: Slot
    counts: bool  # its writes are the slot's initialisation
    valid: bool  # holds the slot's true value at this point (reading it is fine)


class _StepMode(_compat.TorchDispatchMode):
    """Runs one step's ops. Model tensors the step reaches by reference (a parent initialising
    its child's weight) are replaced by full-size stand-ins from ``resolve``; records which
    slots the step writes, storages allocated but never written, and reads of stand-ins whose
    values are not there (another module's tensor)."""

    def __init__(self, lookup: dict, resolve: Callable):
        super().__init__()
        self.lookup = lookup  # StorageWeakRef of a model tensor -> Slot
        self.resolve = resolve  # Slot -> (tensor, _Use) for a model tensor reached by an op
        self.uses = {}  # StorageWeakRef of a stand-in -> _Use
        self.subs = {}  # id(slot) -> stand-in reached through ops (one per step)
        self.written = set()  # id(slot)
        self.empties = set()  # StorageWeakRef allocated uninitialised, not written since
        self.bad_reads = []  # slots whose absent values the step read
        # id(slot) -> how the step first used its values: _CLEAN (overwrote all of it, so the
        # result does not depend on earlier values) or _DIRTY (read it, or wrote part of it)
        self.first = {}

    def use(self, t: torch.Tensor, use: _Use) -> None:
        self.uses[storage_key(t)] = use

    def _swap(self, t: torch.Tensor) -> torch.Tensor:
        key = storage_key(t)
        if key in self.uses:
            return t
        slot = self.lookup.get(key)
        if slot is None:
            return t
        full = self.subs.get(id(slot))
        if full is None:
            full, use = self.resolve(slot)
            self.subs[id(slot)] = full
            self.uses[storage_key(full)] = use
        if t.shape == full.shape and t.stride() == full.stride() and t.storage_offset() == 0:
            return full
        return full.as_strided(t.shape, t.stride(), t.storage_offset())

    def _touch(self, t: torch.Tensor, kind: str) -> None:
        use = self.uses.get(storage_key(t))
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
            ts = tensors_in(val)
            if a.alias_info is not None and a.alias_info.is_write:
                written.extend((t, a.name) for t in ts)
            elif not view:
                read.extend(ts)  # a value read (a view reads only the geometry)
        if not view:
            read_keys = set()
            for t in read:
                key = storage_key(t)
                read_keys.add(key)
                use = self.uses.get(key)
                if use is not None and not use.valid:
                    self.bad_reads.append(use.slot)  # fine unless the values are not there
                self._touch(t, _DIRTY)
            for t, name in written:
                use = self.uses.get(storage_key(t))
                whole = (use is not None and t.numel() == use.slot.tensor.numel()
                         and t.storage_offset() == 0 and t.is_contiguous())
                overwrite = ((schema.name in OVERWRITE_OPS or name == "out") and whole
                             and storage_key(t) not in read_keys)
                self._touch(t, _CLEAN if overwrite else _DIRTY)
        out = func(*args, **kwargs)
        for t, _ in written:
            key = storage_key(t)
            self.empties.discard(key)
            use = self.uses.get(key)
            if use is not None and use.counts:
                self.written.add(id(use.slot))
        if schema.name in EMPTY_OPS:
            for t in tensors_in(out):
                self.empties.add(storage_key(t))
        return out


class _Materializer:
    """Runs the init steps of a model with meta-device tensors; see ``stage_shards``."""

    def __init__(self, model, slots: dict, steps: list, device: torch.device, local: Callable):
        self.model, self.slots, self.steps, self.device = model, slots, steps, device
        self.local = local  # (Slot, full tensor) -> what this rank keeps
        self.lookup = {k: s for s in slots.values() if (k := storage_key(s.tensor)) is not None}
        self.tensors = {}  # id(slot) -> kept tensor (local shard of a parameter, or buffer)
        self.states = []  # step index -> generator state before it (pass 1)
        self.writes = None  # id(slot) -> in-place writes of construction steps (pass 1)
        for step in steps:
            if step.tape is not None:
                step.tape.mat = self

    # -- running one step -------------------------------------------------------------------

    def _stand_in(self, slot: Slot) -> torch.Tensor:
        t = slot.tensor
        if slot.meta:
            return torch.empty(t.shape, dtype=t.dtype, device=self.device)
        return t.detach().to(self.device, copy=True)  # a real tensor: its own value, a copy

    def _run(self, step: Step, live: dict):
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
                if storage_key(now) == storage_key(full):
                    after[id(slot)] = (slot, full, id(slot) in mode.written)
                    continue
                if now.shape != slot.tensor.shape or now.dtype != slot.tensor.dtype:
                    raise AutoshardError(
                        f"{step.label} on module '{step.path}' replaced {slot.describe()} of "
                        f"shape {tuple(slot.tensor.shape)} {slot.tensor.dtype} by one of shape "
                        f"{tuple(now.shape)} {now.dtype}")
                done = storage_key(now) not in mode.empties
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
            if mode.uses[storage_key(full)].counts:
                seen[id(slot)] = now if isinstance(now, torch.Tensor) else full
        for sid, full in mode.subs.items():
            if mode.uses[storage_key(full)].counts:
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
            rec = RECORDED.get(s.tensor)
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
        after = any(RECORDED.get(s.tensor) is not None for s in lost)
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

    def _check_untouched(self, step: Step) -> None:
        """A step may only change tensors through autoshard's stand-ins: the model itself (its
        meta tensors, which module holds which) must be as before."""
        for mod in step.module.modules():
            for table in (mod._parameters, mod._buffers):
                for name, t in table.items():
                    slot = self.slots.get(id(t)) if t is not None else None
                    if t is not None and (slot is None
                                          or storage_key(t) != self.storages[id(slot)]):
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
        self.storages = {id(s): storage_key(s.tensor) for s in self.slots.values()}
        reachable = set()  # meta tensors some step could initialise: in a stepped subtree
        for m in {id(s.module): s.module for s in self.steps}.values():
            for sub in m.modules():
                reachable.update(id(t) for t in sub._parameters.values())
                reachable.update(id(t) for t in sub._buffers.values())
        missing = [s for s in self.slots.values() if s.meta and id(s.tensor) not in reachable]
        if missing:  # say so before running anything
            _raise_uninitialised(missing, self.steps)
        start = rng_state(self.device)
        meta = [s.tensor for s in self.slots.values() if s.meta]
        self.versions = [t._version for t in meta]  # steps reaching them bump them
        tables = [(m, dict(m._parameters), dict(m._buffers)) for m in self.model.modules()]
        data = {id(s): s.tensor.data for s in self.slots.values()}
        ok = False
        try:
            self._passes()
            ok = True
        except BaseException:
            set_rng_state(self.device, start)  # as before the call: a retry draws the same
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
            if storage_key(s.tensor) != self.storages[id(s)]:
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
                resume = rng_state(self.device)
                set_rng_state(self.device, states[step.same_draws_as])
            states.append(rng_state(self.device))
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
                set_rng_state(self.device, resume)
            del fresh, after, mode
        end = rng_state(self.device)

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
                set_rng_state(self.device, states[i])
                mode, after = self._run(self.steps[i], live)
                if mode.bad_reads:
                    self._bad_read(self.steps[i], mode)
                for sid, (slot, value, _) in after.items():
                    if sid in live:
                        live[sid] = value
            for s in group:
                self.tensors[id(s)] = self.local(s, live.pop(id(s)))
            del live
        set_rng_state(self.device, end)  # where building the model would leave it

    @staticmethod
    def _bad_read(step: Step, mode) -> None:
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

"""What a forward writes to the Python world, replayed after every run of the captured step.

Eager runs a forward's Python on every call; a captured step ran it once, at capture, on fake
tensors. So capture watches what the forward writes, undoes it when the trace ends (no fake
tensor is left in the user's objects, and a ``precompile`` changes nothing), and the caller
replays it after each run (``apply``), as eager would leave it:

- an attribute the forward sets on a module, or on a plain object a module holds (a config),
  to a plain value: that value (``self.mode = "warm"``). A value the forward computed from
  what it read (``self.calls += 1``) is right because what it read is guarded
  (``autoshard.core.guards``): a new value read captures the step again;
- to a tensor the step computed (``self.aux_loss = y.pow(2).mean()``,
  ``self.last_hidden = h.detach()``), or a list, tuple or dict holding such tensors: the
  tensors are outputs of the step, set real, with their autograd graph where eager has one
  (an auxiliary loss read by the loop trains as in eager);
- a list, dict or set the forward changes in place (``self.stats.append(x)``) grows with every
  eager call, which one captured step cannot follow: the first call is refused, naming the
  attribute and the line, and the fix (a forward hook, which runs on every call).

A write is seen by the recorder class ``autoshard.core.guards`` swaps in for the trace (its
``__setattr__``: any code's but torch's own, whose modules keep their bookkeeping there, as
an RNN its weight list), and by comparing what each module, and each plain object a module
holds, held before and after the trace.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from autoshard.core import _compat
from autoshard.core.carried import Slot, build, is_carried
from autoshard.core.errors import AutoshardError
from autoshard.core.guards import is_plain_object, user_class_name

_DEPTH = 6
_CONTAINERS = (list, dict, set)


@dataclasses.dataclass
class Write:
    """``owner.name`` set to ``value`` (plain values as they are, the step's tensors as
    ``Slot``s of the written outputs; ``_DELETED``: removed) by the forward at ``where``."""

    owner: Any
    name: str
    what: str  # "attribute 'aux_loss' of module 'block' (Block)", for messages
    value: Any
    where: str


_DELETED = object()


def _content(value):
    """A container's items by identity, to see an in-place change."""
    if isinstance(value, list):
        return ("list", tuple(map(id, value)))
    if isinstance(value, dict):
        return ("dict", tuple((k, id(v)) for k, v in value.items()))
    return ("set", frozenset(map(id, value)))


class Watch:
    """What the objects a forward may write held before it ran (``start``), compared with
    what they hold after it (``finish``), then put back (``undo``)."""

    def __init__(self, owners: list):
        self.owners = owners  # (object, "module 'block' (Block)" or "... object ...")
        self.before = [dict(vars(o)) for o, _ in owners]
        self.contents = [{k: _content(v) for k, v in d.items() if type(v) in _CONTAINERS}
                         for d in self.before]
        self.kept = [{k: (list(v) if type(v) is list else dict(v) if type(v) is dict
                          else set(v)) for k, v in d.items() if type(v) in _CONTAINERS}
                     for d in self.before]

    def finish(self, reads, internal: frozenset) -> tuple:
        """(the writes, the tensors they hold, in order: the step's extra outputs). A
        container changed in place is refused (after ``undo``, by the caller's context)."""
        writes, outs = [], []
        for (obj, label), before, contents in zip(self.owners, self.before, self.contents):
            now = vars(obj)
            for name in dict.fromkeys([*before, *now]):
                if name in internal or name.startswith("__"):
                    continue
                old, new = before.get(name, _DELETED), now.get(name, _DELETED)
                what = f"attribute '{name}' of {label}"
                seen = reads.written.get((id(obj), name))
                if new is old and name in contents and _content(new) != contents[name]:
                    where = reads.mutated.get(id(new), "in the forward")
                    raise AutoshardError(
                        f"the forward changes the {type(new).__name__} in {what} in place "
                        f"({where}): eager does so on every call, which one captured step "
                        "cannot repeat. Collect such values in a forward hook "
                        "(module.register_forward_hook runs after every call on the real "
                        "output), return them from forward, or assign a new value "
                        f"(self.{name} = ...), which is replayed after each call.")
                if seen is None and (new is old or (id(obj), name) in reads.internal):
                    continue  # unchanged, or torch's own module bookkeeping
                writes.append(Write(obj, name, what, _describe(new, outs, what, 0),
                                    seen or "in the forward"))
        return writes, outs

    def undo(self) -> None:
        """Put back what every watched object held before the forward."""
        for (obj, _), before, kept in zip(self.owners, self.before, self.kept):
            d = vars(obj)
            for name in [n for n in d if n not in before]:
                del d[name]
            for name, value in before.items():
                if d.get(name, _DELETED) is not value:
                    d[name] = value
            for name, items in kept.items():
                value = before[name]
                if type(value) is list:
                    value[:] = items
                else:
                    value.clear()
                    value.update(items)


def _describe(x, outs: list, what: str, depth: int):
    """``x`` with each tensor the step computed a ``Slot`` of ``outs`` (appended there)."""
    if isinstance(x, torch.Tensor):
        if _compat.is_fake(x):
            outs.append(x)
            return Slot("out", len(outs) - 1)
        return x  # a tensor from outside the step: held as it is
    if depth < _DEPTH:
        if type(x) in (list, tuple):
            return (type(x), [(i, _describe(v, outs, what, depth + 1)) for i, v in enumerate(x)])
        if type(x) is dict:
            return (dict, [(k, _describe(v, outs, what, depth + 1)) for k, v in x.items()])
        if is_carried(x) and _holds_fake(x, depth):
            return (type(x), [(k, _describe(v, outs, what, depth + 1))
                              for k, v in vars(x).items()])
    if _holds_fake(x, depth):
        raise AutoshardError(
            f"the forward sets {what} to a {type(x).__name__} holding tensors the step "
            "computes, nested deeper than autoshard replays; set the tensors themselves, or "
            "lists, tuples and dicts of them, or return them from forward.")
    return x


def _holds_fake(x, depth: int) -> bool:
    if isinstance(x, torch.Tensor):
        return _compat.is_fake(x)
    if depth >= _DEPTH:
        return False
    if type(x) in (list, tuple, set):
        return any(_holds_fake(v, depth + 1) for v in x)
    if type(x) is dict:
        return any(_holds_fake(v, depth + 1) for v in x.values())
    if is_carried(x):
        return any(_holds_fake(v, depth + 1) for v in vars(x).values())
    return False


def owners(model: torch.nn.Module) -> list:
    """The objects a forward may write: every module of ``model``, and the plain objects
    (a config) its modules hold, each with its label for messages."""
    names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    out, seen = [], set()
    for m in dict.fromkeys(model.modules()):
        label = f"module '{names.get(id(m), '?') or '(root)'}' ({user_class_name(m)})"
        out.append((m, label))
        for k, v in list(vars(m).items()):
            if is_plain_object(v) and id(v) not in seen:
                seen.add(id(v))
                out.append((v, f"{type(v).__name__} object '{k}' of {label}"))
    return out


def apply(writes: list, outs: list) -> None:
    """Replay ``writes`` after a run of the step whose written outputs are ``outs``."""
    for w in writes:
        if w.value is _DELETED:
            w.owner.__dict__.pop(w.name, None)
        else:
            setattr(w.owner, w.name, build(w.value, outs))

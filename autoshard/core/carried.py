"""Objects a forward reads and writes: a Hugging Face ``DynamicCache`` passed in, updated in
place and returned, or one the forward creates and returns.

An input leaf that is neither a tensor nor a plain value is walked (its ``__dict__``, lists,
tuples and dicts, a few levels deep): its tensors become graph inputs and everything else
part of the call's signature (``signature``). Capture gives the forward a shadow of the
object holding fake tensors (``Shadow``) and, after the forward, describes what the shadow
(or a new object the forward returned) holds: each tensor as the graph output that computed
it, or as the input it still is; every other value as it is (``describe``). After each run
``apply`` writes that description into the caller's object in place, so code holding the
object (``generate``'s loop) sees it updated, exactly as eager would leave it; a returned new
object is built from its description (``build``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

_DEPTH = 6
_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device,
          torch.Size)


def is_carried(x: Any) -> bool:
    """An input or output leaf that is an object holding state (not a tensor, a plain value,
    a function or a module)."""
    return (not isinstance(x, (torch.Tensor, torch.nn.Module, type) + _PLAIN)
            and not callable(x) and isinstance(getattr(x, "__dict__", None), dict))


def _children(x):
    if isinstance(x, (list, tuple)):
        return list(enumerate(x))
    if isinstance(x, dict):
        return list(x.items())
    if is_carried(x):
        return list(vars(x).items())
    return None


def tensors(x, depth: int = 0) -> list:
    """The tensors an object holds, in a fixed walk order."""
    if isinstance(x, torch.Tensor):
        return [x]
    kids = _children(x) if depth < _DEPTH else None
    return [t for _, v in kids or () for t in tensors(v, depth + 1)]


def signature(x, depth: int = 0):
    """What a program depends on in an object: its structure, every tensor's shape, dtype
    and stride, every other value."""
    if isinstance(x, torch.Tensor):
        return ("T", tuple(x.shape), x.dtype, tuple(x.stride()))
    kids = _children(x) if depth < _DEPTH else None
    if kids is None:
        return x if isinstance(x, _PLAIN) else ("id", type(x).__qualname__, id(x))
    return (type(x).__qualname__, tuple((k, signature(v, depth + 1)) for k, v in kids))


def shadow(x, fakes, depth: int = 0):
    """A copy of ``x`` whose tensors are the next of ``fakes``, in ``tensors``' order."""
    if isinstance(x, torch.Tensor):
        return next(fakes)
    kids = _children(x) if depth < _DEPTH else None
    if kids is None:
        return x
    vals = {k: shadow(v, fakes, depth + 1) for k, v in kids}
    if isinstance(x, (list, tuple)):
        return type(x)(vals[i] for i in range(len(x))) if type(x) in (list, tuple) \
            else type(x)(*vals.values())
    if isinstance(x, dict):
        out = type(x)()
        out.update(vals)
        return out
    new = object.__new__(type(x))
    new.__dict__.update(vals)
    return new


@dataclasses.dataclass
class Slot:
    """A tensor in a description: graph output ``index`` (``source == "out"``) or the
    object's input tensor ``index`` (``"in"``)."""

    source: str
    index: int


def describe(x, inputs: dict, outputs: list, depth: int = 0):
    """``x`` after the forward, with each tensor a ``Slot``: ``inputs`` maps id(fake input)
    -> its index; a tensor the forward computed is appended to ``outputs``."""
    if isinstance(x, torch.Tensor):
        if id(x) in inputs:
            return Slot("in", inputs[id(x)])
        outputs.append(x)
        return Slot("out", len(outputs) - 1)
    kids = _children(x) if depth < _DEPTH else None
    if kids is None:
        return x
    return (type(x), [(k, describe(v, inputs, outputs, depth + 1)) for k, v in kids])


def _value(d, ins: list, outs: list, into=None):
    if isinstance(d, Slot):
        return ins[d.index] if d.source == "in" else outs[d.index]
    if not (isinstance(d, tuple) and len(d) == 2 and isinstance(d[0], type)
            and isinstance(d[1], list)):
        return d
    cls, kids = d
    if issubclass(cls, (list, tuple)):
        old = into if type(into) is cls else None
        vals = [_value(v, ins, outs, old[k] if old is not None and k < len(old) else None)
                for k, v in kids]
        if old is not None and cls is list:
            old[:] = vals
            return old
        return cls(vals) if cls in (list, tuple) else cls(*vals)
    if issubclass(cls, dict):
        old = into if type(into) is cls else None
        target = old if old is not None else cls()
        vals = {k: _value(v, ins, outs, target.get(k)) for k, v in kids}
        target.clear()
        target.update(vals)
        return target
    target = into if type(into) is cls else object.__new__(cls)
    current = vars(target)
    vals = {k: _value(v, ins, outs, current.get(k)) for k, v in kids}
    current.clear()
    current.update(vals)
    return target


def apply(obj, description, ins: list, outs: list) -> None:
    """Write ``description`` into ``obj`` in place (same object, same nested objects where
    their classes match): ``ins`` are the tensors ``obj`` held before the run, ``outs`` the
    graph's state outputs."""
    _value(description, ins, outs, obj)


def build(description, outs: list):
    """A new object from its description (the forward created it)."""
    return _value(description, [], outs)

"""Module hooks around a captured step: forward and forward-pre hooks run on every call with
the step's real tensors, as in eager.

A hook that only looks (returns None: logging, feature extraction, activation statistics)
is kept out of the trace. Capture records, where the hooked module is called, the tensors
the hook would be given (its inputs, keyword inputs and output) and makes them extra
outputs of the forward graph ("taps"); after the graph runs, ``replay`` calls every hook,
in eager's order, with the real tensors. A hook that returns a value changes what the model
computes: the first time one does, ``replay`` raises ``Replaces`` and the caller captures
again with that hook traced into the step (its tensor work then runs inside the graph on
every call; its Python side effects ran at that capture only).

Backward hooks of a module are refused at capture, naming the module: the captured
backward is one graph and does not stop at module boundaries. A parameter's
``register_post_accumulate_grad_hook`` runs in the runtime, once per backward, on the
sharded gradient (see ``runtime.executor``).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import torch
import torch.nn.modules.module as _mm
from torch.utils._pytree import tree_flatten, tree_unflatten

from autoshard.errors import AutoshardError

_PRE, _FWD = "pre", "fwd"
_SLOT = object()  # a tensor's place among a tap's leaves


class Replaces(Exception):
    """A hook kept out of the trace returned a value: capture again with it traced."""

    def __init__(self, key):
        super().__init__(key)
        self.key = key


@dataclasses.dataclass
class Tap:
    """One hooked module call: which module, before (pre) or after (fwd) its forward, and
    the structure of what its hooks are given; ``n`` tensors of the forward's taps."""

    module: Any
    kind: str
    spec: Any
    consts: list
    n: int


def _user_hooks(mod, kind: str, traced: frozenset) -> list:
    """(hook id, hook, with kwargs) of the hooks ``replay`` runs for ``mod``: global ones
    first, as ``nn.Module.__call__`` runs them."""
    if kind == _PRE:
        glob, own, kw = _mm._global_forward_pre_hooks, mod._forward_pre_hooks, \
            mod._forward_pre_hooks_with_kwargs
        gkw = {}
    else:
        glob, own, kw = _mm._global_forward_hooks, mod._forward_hooks, \
            mod._forward_hooks_with_kwargs
        gkw = _mm._global_forward_hooks_with_kwargs
    out = [(hid, hook, hid in gkw, ("global", hid)) for hid, hook in glob.items()]
    out += [(hid, hook, hid in kw, (id(mod), kind, hid)) for hid, hook in own.items()]
    return [h for h in out if h[3] not in traced]


def signature(mod) -> tuple:
    """The hooks of ``mod`` (and the global ones) as a comparable value: a guard."""
    return (tuple(mod._forward_pre_hooks), tuple(mod._forward_hooks),
            tuple(mod._backward_pre_hooks), tuple(mod._backward_hooks),
            tuple(_mm._global_forward_pre_hooks), tuple(_mm._global_forward_hooks),
            tuple(_mm._global_backward_pre_hooks), tuple(_mm._global_backward_hooks))


def refuse_backward_hooks(model, names: dict) -> None:
    if _mm._global_backward_hooks or _mm._global_backward_pre_hooks:
        raise AutoshardError(
            "a global module backward hook is registered "
            "(torch.nn.modules.module.register_module_full_backward_hook); autoshard's captured "
            "backward is one graph and runs no module backward hooks. Remove it, or use "
            "register_post_accumulate_grad_hook on the parameters.")
    for m in model.modules():
        hooks = {**m._backward_hooks, **m._backward_pre_hooks}
        if hooks:
            fn = next(iter(hooks.values()))
            raise AutoshardError(
                f"module '{names.get(id(m), '?') or '(root)'}' ({type(m).__name__}) has a "
                f"backward hook ({getattr(fn, '__qualname__', fn)!r}); autoshard's captured "
                "backward is one graph and runs no module backward hooks. Remove it before "
                "autoshard(), or watch gradients with register_post_accumulate_grad_hook on "
                "the parameters (it runs once per backward on the sharded gradient).")


@contextlib.contextmanager
def tapping(model, traced: frozenset, taps: list, tensors: list):
    """Keep the user's forward hooks out of the trace (except ``traced`` ones) and record,
    for each hooked module call, a ``Tap`` in ``taps`` and its tensors (detached) in
    ``tensors``."""
    saved_global = [(d, dict(d)) for d in (_mm._global_forward_pre_hooks,
                                          _mm._global_forward_hooks)]
    moved, handles = [], []
    has_global = any(saved for _, saved in saved_global)

    def note(mod, kind, tree):
        leaves, spec = tree_flatten(tree)
        ts = [x for x in leaves if isinstance(x, torch.Tensor)]
        consts = [_SLOT if isinstance(x, torch.Tensor) else x for x in leaves]
        taps.append(Tap(mod, kind, spec, consts, len(ts)))
        tensors.extend(t.detach() for t in ts)

    try:
        for d, saved in saved_global:  # ours (capture's module tracking) come after
            for hid in saved:
                if ("global", hid) not in traced:
                    del d[hid]
        for m in model.modules():
            pre = _user_hooks(m, _PRE, traced) if (m._forward_pre_hooks or has_global) else []
            fwd = _user_hooks(m, _FWD, traced) if (m._forward_hooks or has_global) else []
            for d, hooks in ((m._forward_pre_hooks, pre), (m._forward_hooks, fwd)):
                if hooks:
                    moved.append((d, dict(d)))
                    for hid, _, _, _ in hooks:
                        d.pop(hid, None)
            if pre:
                handles.append(m.register_forward_pre_hook(
                    lambda mod, a, kw: note(mod, _PRE, (a, kw)), with_kwargs=True))
            if fwd:
                handles.append(m.register_forward_hook(
                    lambda mod, a, kw, out: note(mod, _FWD, (a, kw, out)), with_kwargs=True))
        yield
    finally:
        for h in handles:
            h.remove()
        for d, original in moved:  # in their order, traced ones among them
            d.clear()
            d.update(original)
        for d, saved in saved_global:
            d.clear()
            d.update(saved)


def replay(taps: list, tensors: list, traced: frozenset) -> None:
    """Run the hooks kept out of the trace, in eager's order, on the real tensors."""
    it = iter(tensors)
    for tap in taps:
        ts = [next(it) for _ in range(tap.n)]
        hooks = _user_hooks(tap.module, tap.kind, traced)
        if not hooks:
            continue
        tt = iter(ts)
        tree = tree_unflatten([next(tt) if c is _SLOT else c for c in tap.consts], tap.spec)
        for _, hook, with_kwargs, key in hooks:
            if tap.kind == _PRE:
                args, kwargs = tree
                out = hook(tap.module, args, kwargs) if with_kwargs else hook(tap.module, args)
            else:
                args, kwargs, result = tree
                out = (hook(tap.module, args, kwargs, result) if with_kwargs
                       else hook(tap.module, args, result))
            if out is not None:
                raise Replaces(key)

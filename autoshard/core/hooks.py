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

A hook that belongs to the model rather than to the user is traced with the step from the
start: the forward reads what it records, so run after the graph it would record into
nothing (Hugging Face's output recorders, which ``output_hidden_states`` and
``output_router_logits`` read; pruning and spectral norm's pre-hooks, which set the weight
the forward reads). Such a hook is one the model's forward registered while it was traced
(a lazily installed recorder; ``tapping`` reports it, and later captures trace it too), or
one whose code is in the installed library that defines the hooked module's class
(``is_model_hook``: a library's hook on its own module, registered by an eager call before
``autoshard()`` as well). A user's hook (the user's code, or a library's on another's
module) stays out of the trace.

A module's full backward hooks (and backward pre-hooks) are kept out of the trace the same
way: the module's tensor inputs and outputs pass through a view of their own while tracing,
whose gradients (the module's share, as torch's BackwardHook gives) become extra outputs of
the backward graph; after it runs, and before any gradient is accumulated, each hook is
called with the real gradients, latest module first (``replay_backward``). A backward hook
that returns replacement gradients cannot be honoured by a backward already run: that
backward raises, its gradients are not accumulated, and from the next call the hook is
traced into the step. The deprecated ``register_backward_hook`` is refused. A parameter's
``register_post_accumulate_grad_hook`` runs in the runtime, once per backward, on the
sharded gradient (see ``runtime.executor``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from typing import Any

import torch
import torch.nn.modules.module as _mm
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle as _RemovableHandle

from autoshard.core._compat import dtensor_spec, new_dtensor, tree_flatten, tree_unflatten
from autoshard.core.errors import AutoshardError

_PRE, _FWD = "pre", "fwd"
_SLOT = object()  # a tensor's place among a tap's leaves


@dataclasses.dataclass(frozen=True)
class _DTensorSlot:
    """A DTensor's place among a tap's leaves (a tensor-parallel module's input, as its
    style's pre-hook made it): the step outputs its local tensor, and ``replay`` hands the
    hook a DTensor of it laid out as ``spec`` says, as eager would."""

    spec: Any


class Replaces(Exception):
    """A hook kept out of the trace returned a value: capture again with it traced."""

    def __init__(self, key, what: str = ""):
        super().__init__(key)
        self.key, self.what = key, what  # what: the hook and its module, for messages


def warn_traced(what: str) -> None:
    """Say, once per hook, that a forward hook which returned a value is now part of the
    step: its tensor work runs in the step on every call, but its Python (a counter, a log
    line, a list it appends to) runs only when a step is captured, so not once per call as in
    eager."""
    import warnings

    warnings.warn(
        f"autoshard: the forward hook {what} returned a value, "
        "so it is traced into the step: what it computes on tensors runs on every call, but "
        "its Python side effects (counters, logging, appending to a list) run only when the "
        "step is captured, not once per call as in eager. For side effects on every call, "
        "register a hook that returns None (it runs after the step on the real tensors).",
        UserWarning, stacklevel=4)


@dataclasses.dataclass
class Tap:
    """One hooked module call: which module, before (pre) or after (fwd) its forward, and
    the structure of what its hooks are given; ``n`` tensors of the forward's taps."""

    module: Any
    kind: str
    spec: Any
    consts: list
    n: int


_SITE = tuple(os.sep + d + os.sep for d in ("site-packages", "dist-packages"))


def _library(obj) -> str | None:
    """The installed library whose code ``obj`` (a function, a callable object, a class) is:
    its top-level package, if that is torch or lives in site-packages; else None (a script,
    a source tree, the standard library)."""
    name = getattr(obj, "__module__", None)
    if not isinstance(name, str):
        name = getattr(type(obj), "__module__", None)
    if not isinstance(name, str):
        return None
    top = name.split(".", 1)[0]
    if top == "torch":
        return top
    path = getattr(sys.modules.get(top), "__file__", None) or ""
    return top if any(site in path for site in _SITE) else None


def is_model_hook(mod, hook) -> bool:
    """Whether ``hook`` on ``mod`` is part of the model: code of the installed library that
    defines ``mod``'s class (its forward may read what the hook records), or a tensor
    parallel style's input or output redistribution (``parallelize_module``'s)."""
    if getattr(hook, "__module__", "").startswith("torch.distributed.tensor"):
        return True
    lib = _library(hook)
    return lib is not None and lib == _library(type(mod))


def _user_hooks(mod, kind: str, traced: frozenset) -> list:
    """(hook id, hook, with kwargs) of the hooks ``replay`` runs for ``mod``: global ones
    first, as ``nn.Module.__call__`` runs them; neither ``traced`` ones nor the model's own
    (``is_model_hook``), which run inside the step."""
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
    return [h for h in out if h[3] not in traced and not is_model_hook(mod, h[1])]


def hook_dicts(mod=None) -> tuple:
    """The dicts whose keys say which hooks run around ``mod``'s call (the global ones
    where ``mod`` is None): a change to their keys recaptures (a guard)."""
    if mod is None:
        return (_mm._global_forward_pre_hooks, _mm._global_forward_hooks,
                _mm._global_backward_pre_hooks, _mm._global_backward_hooks)
    return (mod._forward_pre_hooks, mod._forward_hooks, mod._backward_pre_hooks,
            mod._backward_hooks)


def _backward_hooks(mod, kind: str, traced: frozenset) -> list:
    """(hook, key) of the backward hooks ``replay_backward`` runs for ``mod``: "pre"
    (``register_full_backward_pre_hook``) or "full", global ones first."""
    if kind == _PRE:
        pairs = [(h, ("global", hid)) for hid, h in _mm._global_backward_pre_hooks.items()]
        pairs += [(h, (id(mod), "bwd_pre", hid)) for hid, h in mod._backward_pre_hooks.items()]
    else:
        pairs = [(h, ("global", hid)) for hid, h in _mm._global_backward_hooks.items()]
        pairs += [(h, (id(mod), "bwd", hid)) for hid, h in mod._backward_hooks.items()]
    return [p for p in pairs if p[1] not in traced]


def refuse_backward_hooks(model, names: dict) -> None:
    """Only full backward hooks can be run from the captured backward: the deprecated
    ``register_backward_hook`` (on a module's last op) is refused, naming the module."""
    if _mm._global_backward_hooks and not _mm._global_is_full_backward_hook:
        raise AutoshardError(
            "a global module backward hook registered without full=True is set; autoshard "
            "runs full backward hooks only (register_module_full_backward_hook).")
    for m in model.modules():
        if m._backward_hooks and m._is_full_backward_hook is False:
            fn = next(iter(m._backward_hooks.values()))
            raise AutoshardError(
                f"module '{names.get(id(m), '?') or '(root)'}' ({type(m).__name__}) has a "
                f"backward hook registered with register_backward_hook "
                f"({getattr(fn, '__qualname__', fn)!r}), which torch deprecates and autoshard "
                "cannot run; use register_full_backward_hook (it runs on every backward, "
                "with the module's real gradients).")


@dataclasses.dataclass
class BackwardTap:
    """One call of a module with backward hooks: the gradients its hooks are given are
    hook gradient outputs of the backward graph; ``inputs``/``outputs``: per tensor
    positional input / tensor output, that output's number among them, or None (no
    gradient: eager gives None there too)."""

    module: Any
    inputs: list
    outputs: list


@contextlib.contextmanager
def tapping(model, traced: frozenset, taps: list, tensors: list, backward_taps: list,
            grads: list, installed: set | None = None):
    """Keep the user's forward and backward hooks out of the trace (except ``traced`` ones)
    and record, for each hooked module call, a ``Tap`` in ``taps`` and its tensors
    (detached) in ``tensors``; for each call of a module with backward hooks a
    ``BackwardTap`` in ``backward_taps``, whose gradients the traced backward appends to
    ``grads``. The keys of the forward hooks the model registered while traced (they ran
    in the trace) are added to ``installed``."""
    saved_global = [(d, dict(d)) for d in (_mm._global_forward_pre_hooks,
                                          _mm._global_forward_hooks)]
    moved, handles = [], []
    has_global = any(saved for _, saved in saved_global)
    saved_bwd = [(d, dict(d)) for d in (_mm._global_backward_pre_hooks,
                                       _mm._global_backward_hooks)]
    has_global_bwd = any(saved for _, saved in saved_bwd)

    def note(mod, kind, tree):
        leaves, spec = tree_flatten(tree)
        ts = [x for x in leaves if isinstance(x, torch.Tensor)]
        consts = [(_DTensorSlot(dtensor_spec(x)) if isinstance(x, DTensor) else _SLOT)
                  if isinstance(x, torch.Tensor) else x for x in leaves]
        taps.append(Tap(mod, kind, spec, consts, len(ts)))
        tensors.extend((t.to_local() if isinstance(t, DTensor) else t).detach() for t in ts)

    first_id = _RemovableHandle.next_id
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
            bwd = (_backward_hooks(m, _PRE, traced) + _backward_hooks(m, "full", traced)
                   if (m._backward_hooks or m._backward_pre_hooks or has_global_bwd) else [])
            if bwd:
                for d in (m._backward_pre_hooks, m._backward_hooks):
                    moved.append((d, dict(d)))
                    for _, key in bwd:
                        if key[0] == id(m):
                            d.pop(key[2], None)
                handles.extend(_grad_taps(m, backward_taps, grads))
        for d, saved in saved_bwd:
            for hid in saved:
                if ("global", hid) not in traced:
                    del d[hid]
        yield
        if installed is not None:
            ours = {h.id for h in handles}
            for m in model.modules():
                for kind, d in ((_PRE, m._forward_pre_hooks), (_FWD, m._forward_hooks)):
                    installed.update((id(m), kind, hid) for hid in d
                                     if hid >= first_id and hid not in ours)
    finally:
        for h in handles:
            h.remove()
        for d, original in moved:  # in their order, traced ones among them
            d.clear()
            d.update(original)
        for d, saved in saved_global + saved_bwd:
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
        tree = tree_unflatten([next(tt) if c is _SLOT else new_dtensor(next(tt), c.spec)
                               if isinstance(c, _DTensorSlot) else c for c in tap.consts],
                              tap.spec)
        for _, hook, with_kwargs, key in hooks:
            if tap.kind == _PRE:
                args, kwargs = tree
                out = hook(tap.module, args, kwargs) if with_kwargs else hook(tap.module, args)
            else:
                args, kwargs, result = tree
                out = (hook(tap.module, args, kwargs, result) if with_kwargs
                       else hook(tap.module, args, result))
            if out is not None:
                raise Replaces(key, f"{getattr(hook, '__qualname__', repr(hook))} on "
                                    f"{type(tap.module).__name__}")


def _grad_taps(mod, backward_taps: list, grads: list) -> list:
    """Hooks that route, while tracing, the gradients a module's backward hooks would be
    given into ``grads``: the module's tensor inputs and outputs pass through a view of
    their own, whose gradient is the module's share alone (as torch's BackwardHook does)."""
    calls: list = []

    def watch(t, slots, i):
        if not (isinstance(t, torch.Tensor) and t.requires_grad):
            return t
        t = t.view_as(t)

        def keep(g):
            slots[i] = len(grads)
            grads.append(g)
        t.register_hook(keep)
        return t

    def pre(m, args):
        tap = BackwardTap(m, [None] * sum(isinstance(a, torch.Tensor) for a in args), [])
        backward_taps.append(tap)
        calls.append(tap)
        k = iter(range(len(args)))
        return tuple(watch(a, tap.inputs, next(k)) if isinstance(a, torch.Tensor) else a
                     for a in args)

    def post(m, args, out):
        tap = calls.pop()
        leaves, spec = tree_flatten(out)
        n = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        tap.outputs = [None] * len(n)
        for j, i in enumerate(n):
            leaves[i] = watch(leaves[i], tap.outputs, j)
        return tree_unflatten(leaves, spec)

    return [mod.register_forward_pre_hook(pre, prepend=True),
            mod.register_forward_hook(post)]


def replay_backward(backward_taps: list, grads: list, traced: frozenset) -> None:
    """Run the backward hooks kept out of the trace, latest module call first as eager's
    backward reaches them, on the real gradients; a hook that returns a replacement raises
    ``Replaces`` (the step's gradients are not accumulated)."""
    for tap in reversed(backward_taps):
        pre, full = (_backward_hooks(tap.module, k, traced) for k in (_PRE, "full"))
        if not (pre or full):
            continue
        gout = tuple(None if i is None else grads[i] for i in tap.outputs)
        gin = tuple(None if i is None else grads[i] for i in tap.inputs)
        for hook, key in pre:
            if hook(tap.module, gout) is not None:
                raise Replaces(key)
        for hook, key in full:
            if hook(tap.module, gin, gout) is not None:
                raise Replaces(key)

"""The user's optimizer over autoshard's parameters on CPU: one DTensor dispatch per op for a
whole parameter group instead of one per parameter.

An optimizer built with default flags picks its implementation per step: on CUDA, DTensor
parameters get the ``foreach`` path (DTensor is among torch's foreach-supported types); on
CPU every tensor gets the per-parameter loop, and over DTensors that loop pays the DTensor
dispatch some ten times per parameter (about three times the step of plain tensors). For the
optimizers whose CPU ``foreach`` path runs the very same per-tensor kernels, so that results
are bitwise equal, a global step pre-hook selects ``foreach`` for the groups holding
autoshard's CPU parameters, and the post-hook puts the group back as the user left it
(``foreach=None``: ``state_dict()`` and ``param_groups`` never show the change). A group the
user configured (``foreach`` or ``fused`` set, ``differentiable``, a tensor learning rate) is
left alone, as is every other optimizer class.

While an optimizer holding autoshard's parameters steps (on any device, with any flags),
its pointwise foreach ops over DTensors run on the local tensors (``runtime.foreach``: the
same kernels DTensor's dispatch would run, without its walk over every list element in
Python); the pre-hook installs that handler and the post-hook removes it, so no other
optimizer's step meets it.

The post-hook also notes, for every optimizer, that its autoshard parameters changed
(``note_update``), so that a ZeRO-1 replica is gathered again before the next step reads it.

The pre-hook refuses an optimizer holding a parameter ``autoshard()`` replaced (one built
before the call, from the model's old parameters, which nothing reads any more): its first
step raises ``AutoshardError`` naming the parameter. Each optimizer is looked through once,
and again only when its param groups change, so a step pays a dictionary look-up.

While the hooks are in place, an infinity norm over DTensors (``clip_grad_norm_(...,
norm_type=inf)``, foreach or not) skips a local shard that is empty (a parameter with fewer
rows than ranks): the maximum over the other shards, 0 where all are empty, where torch
(FSDP2's parameters alike) raises for a maximum over nothing (``runtime.foreach.NORMS``).

The two hooks are torch's process-wide optimizer hooks (no other way sees an optimizer built
before ``autoshard()``). They are registered when the first sharded module is made and
removed when the last one is freed (``hold``), so a process with no sharded module left runs
no autoshard code in any optimizer step. The off switch: the environment variable
``AUTOSHARD_OPTIMIZER_HOOKS=0`` (or ``enable_hooks(False)``) registers none and removes any
in place. Without them, an infinity norm over an empty shard raises as in torch, steps keep
the per-parameter loop on CPU, an optimizer built before ``autoshard()`` is not refused, and
since optimizer steps are no longer noted, a ZeRO-1 replica is gathered again before every
call (correct, one all-gather per unit a call).
"""

from __future__ import annotations

import itertools
import os
import weakref
from typing import Optional

import torch
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from autoshard.core.errors import AutoshardError
from autoshard.runtime import foreach

# their foreach update on CPU equals the per-parameter loop bit for bit (NAdam's and RAdam's
# foreach arithmetic differs, so they keep the loop)
BITWISE_FOREACH = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.RMSprop,
                   torch.optim.Adagrad, torch.optim.Adamax, torch.optim.Adadelta)

_MARK = "_autoshard_sharded"
_UPDATED = "_autoshard_updated"  # the last update's number (see ``updated``)
_REPLACED = "_autoshard_replaced"  # on a parameter autoshard() replaced: where it was
_updates = itertools.count(1)
# optimizer -> (its param groups when last looked at, whether they hold autoshard's)
_checked = weakref.WeakKeyDictionary()
_switched = weakref.WeakKeyDictionary()  # optimizer -> indices of groups switched this step
_hooks = []  # the handles of the hooks in place
_live = 0  # sharded modules' states not yet freed
_enabled: Optional[bool] = None  # None: read AUTOSHARD_OPTIMIZER_HOOKS
ENV = "AUTOSHARD_OPTIMIZER_HOOKS"


def hooks_enabled() -> bool:
    """Whether the optimizer hooks may be in place: ``enable_hooks``'s setting, else the
    environment variable ``AUTOSHARD_OPTIMIZER_HOOKS`` (on unless 0, off, false or no)."""
    if _enabled is not None:
        return _enabled
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "off", "false", "no")


def enable_hooks(on: bool = True) -> None:
    """Allow the optimizer hooks (``True``, registered while any sharded module is alive) or
    not (``False``: removed now), overriding ``AUTOSHARD_OPTIMIZER_HOOKS``."""
    global _enabled
    _enabled = bool(on)
    _sync_hooks()


def hooks_installed() -> bool:
    """Whether the optimizer hooks are registered now."""
    return bool(_hooks)


def _sync_hooks() -> None:
    """Register the hooks when they are allowed and a sharded module is alive; remove them
    otherwise."""
    want = _live > 0 and hooks_enabled()
    if want and not _hooks:
        _hooks.extend((register_optimizer_step_pre_hook(_pre),
                       register_optimizer_step_post_hook(_post)))
        foreach.install_norms()
    elif not want:
        while _hooks:
            _hooks.pop().remove()
        foreach.remove()
        foreach.remove_norms()
        foreach.forget()


def _freed() -> None:
    global _live
    _live -= 1
    if _live == 0:
        _sync_hooks()


def hold(owner) -> None:
    """Have the hooks in place (if enabled) while ``owner``, a sharded module's state, lives.
    (Not the parameters: a weak reference to one would stop ``swap_tensors`` from replacing
    it, as ``module.double()`` does.)"""
    global _live
    _live += 1
    weakref.finalize(owner, _freed).atexit = False
    _sync_hooks()


def mark(param: torch.nn.Parameter) -> None:
    """Note ``param`` as one of autoshard's parameters."""
    setattr(param, _MARK, True)


def is_marked(param) -> bool:
    """Whether ``param`` is one of autoshard's parameters (``mark``)."""
    return getattr(param, _MARK, False)


def mark_replaced(old: torch.nn.Parameter, where: str) -> None:
    """Note that autoshard() replaced ``old`` (``where``: its FQN and the model's class), so
    that an optimizer still holding it is refused at its first step."""
    setattr(old, _REPLACED, where)


def unmark_replaced(old: torch.nn.Parameter) -> None:
    """``old`` is the model's again (autoshard() failed and put it back)."""
    if hasattr(old, _REPLACED):
        delattr(old, _REPLACED)


def _look(optimizer) -> bool:
    """Whether ``optimizer`` holds any of autoshard's parameters. Refuses one holding a
    parameter autoshard() replaced. Looks through its groups again only when they change."""
    groups = optimizer.param_groups
    seen = tuple((id(g["params"]), len(g["params"])) for g in groups)
    last = _checked.get(optimizer)
    if last is not None and last[0] == seen:
        return last[1]
    stale = [getattr(p, _REPLACED) for g in groups for p in g["params"]
             if hasattr(p, _REPLACED)]
    if stale:
        more = f" (and {len(stale) - 1} more)" if len(stale) > 1 else ""
        raise AutoshardError(
            f"{type(optimizer).__name__} holds parameter {stale[0]}{more} as it was before "
            "autoshard() replaced it by a DTensor shard: the model no longer reads it, so "
            "stepping it would train nothing. Build the optimizer after autoshard(model), "
            "from sharded.parameters() (nothing was stepped).")
    holds = any(is_marked(p) for g in groups for p in g["params"])
    _checked[optimizer] = (seen, holds)
    return holds


def _eligible(group: dict) -> bool:
    return (group.get("foreach", False) is None and not group.get("fused")
            and not group.get("differentiable") and not isinstance(group.get("lr"), torch.Tensor)
            and any(is_marked(p) and p.device.type == "cpu"
                    for p in group["params"]))


def _pre(optimizer, args, kwargs) -> None:
    if not _look(optimizer):
        foreach.remove()  # left by a step of ours that raised
        return
    foreach.install()
    if type(optimizer) not in BITWISE_FOREACH:
        return
    groups = [i for i, g in enumerate(optimizer.param_groups) if _eligible(g)]
    for i in groups:
        optimizer.param_groups[i]["foreach"] = True
    if groups:
        _switched[optimizer] = groups


def _post(optimizer, args, kwargs) -> None:
    foreach.remove()
    for i in _switched.pop(optimizer, ()):
        optimizer.param_groups[i]["foreach"] = None
    note_update([p for g in optimizer.param_groups for p in g["params"]
                 if is_marked(p)])


def note_update(params) -> None:
    """Note that ``params`` changed in place (an optimizer step, a state-dict load): what is
    derived from their values (a ZeRO-1 replica) is gathered again before it is read. An
    optimizer's foreach updates advance neither the DTensor's version counter nor its local
    tensor's (torch's foreach ops on tensor subclasses), so this is how they are seen; the
    other in-place writes advance one of the two (``autoshard.runtime.replicas._stamp``)."""
    n = next(_updates)
    for p in params:
        setattr(p, _UPDATED, n)


def updated(param) -> int:
    """The number of ``param``'s last noted update (0: none since it was made). With the
    hooks off no optimizer step is noted: a new number on every call, so that whatever is
    derived from the parameter is taken as stale and gathered again."""
    if not _hooks:
        return next(_updates)
    return getattr(param, _UPDATED, 0)

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

The post-hook also notes, for every optimizer, that its autoshard parameters changed
(``note_update``), so that a ZeRO-1 replica is gathered again before the next step reads it.

The pre-hook refuses an optimizer holding a parameter ``autoshard()`` replaced (one built
before the call, from the model's old parameters, which nothing reads any more): its first
step raises ``AutoshardError`` naming the parameter. Each optimizer is looked through once,
and again only when its param groups change, so a step pays a dictionary look-up.
"""

from __future__ import annotations

import itertools
import weakref

import torch
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from autoshard.errors import AutoshardError

# their foreach update on CPU equals the per-parameter loop bit for bit (NAdam's and RAdam's
# foreach arithmetic differs, so they keep the loop)
BITWISE_FOREACH = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.RMSprop,
                   torch.optim.Adagrad, torch.optim.Adamax, torch.optim.Adadelta)

_MARK = "_autoshard_sharded"
_UPDATED = "_autoshard_updated"  # the last update's number (see ``updated``)
_REPLACED = "_autoshard_replaced"  # on a parameter autoshard() replaced: where it was
_updates = itertools.count(1)
_checked = weakref.WeakKeyDictionary()  # optimizer -> its param groups when last looked at
_switched = weakref.WeakKeyDictionary()  # optimizer -> indices of groups switched this step
_hooks = []


def mark(param: torch.nn.Parameter) -> None:
    """Note ``param`` as one of autoshard's parameters and make sure the hooks are in place."""
    setattr(param, _MARK, True)
    if not _hooks:
        _hooks.extend((register_optimizer_step_pre_hook(_pre),
                       register_optimizer_step_post_hook(_post)))


def mark_replaced(old: torch.nn.Parameter, where: str) -> None:
    """Note that autoshard() replaced ``old`` (``where``: its FQN and the model's class), so
    that an optimizer still holding it is refused at its first step."""
    setattr(old, _REPLACED, where)


def unmark_replaced(old: torch.nn.Parameter) -> None:
    """``old`` is the model's again (autoshard() failed and put it back)."""
    if hasattr(old, _REPLACED):
        delattr(old, _REPLACED)


def _check_replaced(optimizer) -> None:
    groups = optimizer.param_groups
    seen = tuple((id(g["params"]), len(g["params"])) for g in groups)
    if _checked.get(optimizer) == seen:
        return
    stale = [getattr(p, _REPLACED) for g in groups for p in g["params"]
             if hasattr(p, _REPLACED)]
    if stale:
        more = f" (and {len(stale) - 1} more)" if len(stale) > 1 else ""
        raise AutoshardError(
            f"{type(optimizer).__name__} holds parameter {stale[0]}{more} as it was before "
            "autoshard() replaced it by a DTensor shard: the model no longer reads it, so "
            "stepping it would train nothing. Build the optimizer after autoshard(model), "
            "from sharded.parameters() (nothing was stepped).")
    _checked[optimizer] = seen


def _eligible(group: dict) -> bool:
    return (group.get("foreach", False) is None and not group.get("fused")
            and not group.get("differentiable") and not isinstance(group.get("lr"), torch.Tensor)
            and any(getattr(p, _MARK, False) and p.device.type == "cpu"
                    for p in group["params"]))


def _pre(optimizer, args, kwargs) -> None:
    _check_replaced(optimizer)
    if type(optimizer) not in BITWISE_FOREACH:
        return
    groups = [i for i, g in enumerate(optimizer.param_groups) if _eligible(g)]
    for i in groups:
        optimizer.param_groups[i]["foreach"] = True
    if groups:
        _switched[optimizer] = groups


def _post(optimizer, args, kwargs) -> None:
    for i in _switched.pop(optimizer, ()):
        optimizer.param_groups[i]["foreach"] = None
    note_update([p for g in optimizer.param_groups for p in g["params"]
                 if getattr(p, _MARK, False)])


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
    """The number of ``param``'s last noted update (0: none since it was made)."""
    return getattr(param, _UPDATED, 0)

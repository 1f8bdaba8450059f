"""The Config spellings of earlier versions, still read: the flat fields of 0.2 and before
(``prefetch_depth=3`` is ``prefetch=Prefetch(depth=3)`` now), passed to ``Config(...)`` with a
DeprecationWarning until 0.5, or found in a stored record (``Config.from_dict``)."""

from __future__ import annotations

import dataclasses
import os
import sys
import warnings

from torch.distributed.fsdp import CPUOffloadPolicy

from autoshard.core.options import Bucket, Module, Offload, Prefetch, Size

# the flat Config fields of 0.2 and before, each as (field, class, option) of its new spelling:
# still read, with a DeprecationWarning naming it, until 0.5 (``_moved``)
MOVED = {
    "module_classes": ("policy", "Module", "classes"),
    "module_pattern": ("policy", "Module", "pattern"),
    "min_unit_numel": ("policy", "Size", "min_numel"),
    "bucket_bytes": ("bucket", "Bucket", "bytes"),
    "prefetch_depth": ("prefetch", "Prefetch", "depth"),
    "prefetch_bytes": ("prefetch", "Prefetch", "bytes"),
    "offload_state": ("offload_policy", "Offload", "state"),
    "offload_params": ("offload_policy", "Offload", "params"),
}


# what those versions defaulted the fields to (a flat name of an option that is off did nothing)
_OLD_DEFAULTS = {"policy": "auto", "bucket": False, "prefetch": True, "offload_policy": None}


def moved_kwargs(kwargs: dict) -> dict:
    """``Config(**kwargs)``'s arguments with the flat names of 0.2 and before (``MOVED``) put
    into the option that turns them on, as those versions read them, and a DeprecationWarning
    naming the new spelling: ``Config(prefetch_depth=3)`` is ``Config(prefetch=
    Prefetch(depth=3))``. A flat name whose option is off (``bucket_bytes`` without
    ``bucket=True``) did nothing then and does nothing now; the warning says so."""
    flat = {k: v for k, v in kwargs.items() if k in MOVED}
    if not flat:
        return kwargs
    kwargs = {k: v for k, v in kwargs.items() if k not in MOVED}
    joined: dict = {}
    for k in flat:
        field, option, _ = MOVED[k]
        joined.setdefault((field, option), []).append(k)
    now, idle = [], []
    for (field, option), old in joined.items():
        current = kwargs.get(field, _OLD_DEFAULTS[field])
        names = {MOVED[k][2]: flat[k] for k in old}
        value = _joined(current, option, names)
        if value is None:
            idle.append(f"{', '.join(old)} ({field}={current!r})")
            continue
        kwargs[field] = value
        if not isinstance(current, type(value)):  # built here: spelled as the user would
            value = f"{option}({', '.join(f'{k}={v!r}' for k, v in names.items())}" + (
                f", pin_memory={value.pin_memory!r})" if option == "Offload" else ")")
        now.append(f"{field}={value!s}")
    options = ", ".join(dict.fromkeys(option for _, option in joined))
    given = ", ".join(f"{k}={v!r}" for k, v in flat.items())
    said = f"Config({given}) is deprecated and will be removed in autoshard 0.5"
    if now:
        said += f": write Config({', '.join(now)}) (from autoshard import {options})"
    if idle:
        said += f"; these do nothing while their option is off: {'; '.join(idle)}"
    warnings.warn(said, DeprecationWarning, stacklevel=_outside())
    return kwargs


# the files of the frames between the user's call and the warning
_INSIDE = (__file__, os.path.join(os.path.dirname(__file__), "config.py"), dataclasses.__file__)


def _outside() -> int:
    """The ``stacklevel`` of the first caller outside these modules and ``dataclasses``
    (``Config(...)`` or ``dataclasses.replace(config, ...)`` in the user's code), counted
    from the function that calls this one."""
    frame, level = sys._getframe(2), 2
    while frame is not None and frame.f_code.co_filename in _INSIDE:
        frame, level = frame.f_back, level + 1
    return level


def _joined(current, option: str, names: dict):
    """The value of a field that was ``current`` with the flat options ``names`` of the
    class ``option`` joined to it; None where the option is off or another one is chosen."""
    cls = {"Module": Module, "Size": Size, "Bucket": Bucket, "Prefetch": Prefetch,
           "Offload": Offload}[option]
    if isinstance(current, cls):
        return dataclasses.replace(current, **names)
    on = {"Module": current == "module", "Size": current == "size", "Bucket": current is True,
          "Prefetch": current is True,
          "Offload": isinstance(current, CPUOffloadPolicy)}[option]
    if not on:
        return None
    if option == "Offload":
        names = dict(names, pin_memory=current.pin_memory)
    return cls(**names)


def regrouped(d: dict) -> dict:
    """A copy of a ``to_dict`` record in the current shape: the flat fields an earlier
    version wrote (``MOVED``) go into the option that turns them on, and a bucket decided by
    the policy is None again (those versions stored the decision)."""
    d = dict(d)
    old = {k: d.pop(k) for k in MOVED if k in d}
    if not old:
        return d
    policy, units = d.get("policy", "auto"), d.get("units")
    if policy == "module" and (old.get("module_classes") or old.get("module_pattern")):
        d["policy"] = {"name": "module", "classes": old.get("module_classes"),
                       "pattern": old.get("module_pattern")}
    if policy == "size" and old.get("min_unit_numel", Size.min_numel) != Size.min_numel:
        d["policy"] = {"name": "size", "min_numel": old["min_unit_numel"]}
    bucket = d.get("bucket")
    if bucket and old.get("bucket_bytes") is not None:
        d["bucket"] = {"bytes": old["bucket_bytes"]}
    elif bucket == (units is None and policy == "per-parameter"):
        d["bucket"] = None
    depth, cap = old.get("prefetch_depth", 2), old.get("prefetch_bytes")
    if d.get("prefetch", True) and (depth != 2 or cap is not None):
        d["prefetch"] = {"depth": depth, "bytes": cap}
    off = d.get("offload_policy")
    state, params = old.get("offload_state"), old.get("offload_params")
    if off is not None and off.get("cpu") and (state is not None or params is not None):
        d["offload_policy"] = dict(off, state=state, params=params)
    return d


def offload_from_dict(off: dict):
    from torch.distributed.fsdp import OffloadPolicy

    if "state" in off or "params" in off:
        return Offload(state=off.get("state"), params=off.get("params"),
                       pin_memory=off["pin_memory"])
    return CPUOffloadPolicy(pin_memory=off["pin_memory"]) if off["cpu"] else OffloadPolicy()

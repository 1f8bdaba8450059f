"""The options of a Config that matter only when another option turns them on, which live
inside the value that does: ``Config(prefetch=Prefetch(depth=3))``,
``Config(policy=Size(min_numel=...))``. Each checks its values when built and cannot change
after. And what reads their sizes: ``parse_bytes``."""

from __future__ import annotations

import dataclasses
import numbers
import re
from typing import Optional, Sequence, Union

from torch.distributed.fsdp import CPUOffloadPolicy  # Offload is one

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


INT64_MAX = 2**63 - 1  # the largest size or count torch (and C++) can hold: 8 EiB as bytes


def parse_bytes(value: Union[int, float, str, None], name: str = "size") -> Optional[int]:
    """``80GiB``, ``1.5e9``, ``512MB`` or an int -> bytes (None stays None). A size is
    positive, finite and at most ``INT64_MAX`` bytes; ``name`` (e.g. "Config.memory_budget") is
    what an error calls the value."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise TypeError(f"{name} must be a size such as 512MiB or 1e9, got {value!r}")
    if isinstance(value, numbers.Real):
        number = value
    else:
        m = re.fullmatch(r"\s*((?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)\s*([a-zA-Z]*)\s*",
                         str(value))
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(f"{name}: cannot read {value!r} as a size; write e.g. 80GiB, "
                             "512MB or 1e9")
        number = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if not 1 <= number <= INT64_MAX:  # NaN compares False, infinity too large
        raise ValueError(f"{name}={value!r} must be positive and finite, from 1 byte to "
                         f"2**63 - 1 bytes (8 EiB): a size such as 512MiB")
    return int(number)


@dataclasses.dataclass(frozen=True)
class Bucket:
    """``Config(bucket=Bucket(bytes=...))``: merge adjacent units smaller than ``bytes`` into
    one collective. ``bytes``: a size, as ``Config.memory_budget``; None (default): the size
    below which a collective is latency-bound under the cost model."""

    bytes: Union[int, str, None] = None

    def __post_init__(self):
        object.__setattr__(self, "bytes", check_size("bucket.bytes", self.bytes))


@dataclasses.dataclass(frozen=True)
class Prefetch:
    """``Config(prefetch=Prefetch(depth=2, bytes=None))``: issue each unit's all-gather up to
    ``depth`` units ahead, with at most ``bytes`` gathered bytes in flight (a size, as
    ``Config.memory_budget``; None: no byte bound). ``prefetch=True`` is ``Prefetch()``."""

    depth: int = 2
    bytes: Union[int, str, None] = None

    def __post_init__(self):
        check_count("prefetch.depth", self.depth, "(how many units ahead an all-gather may be "
               "issued; use prefetch=False for none)")
        object.__setattr__(self, "bytes", check_size("prefetch.bytes", self.bytes))


@dataclasses.dataclass(frozen=True)
class Module:
    """``Config(policy=Module(classes=None, pattern=None))``: the "module" policy. ``classes``:
    the class names (or classes) whose modules are units; ``pattern``: a regular expression,
    and every module whose path it matches whole (``re.fullmatch``) is a unit. Neither (the
    default, and ``policy="module"``): each repeated block of a ModuleList/Sequential."""

    classes: Optional[Sequence[Union[str, type]]] = None
    pattern: Optional[str] = None

    def __post_init__(self):
        classes = self.classes
        if classes is not None:
            if isinstance(classes, (str, type)):
                classes = [classes]
            if not isinstance(classes, (list, tuple)) or not all(
                    isinstance(c, (str, type)) for c in classes):
                raise TypeError("Config.policy.classes must be a list of class names or "
                                f"classes, got {self.classes!r}")
            # names, in a tuple: what check_names and an export's record compare
            object.__setattr__(self, "classes", tuple(c if isinstance(c, str) else c.__name__
                                                      for c in classes))
        if self.pattern is not None:
            if not isinstance(self.pattern, str):
                raise TypeError("Config.policy.pattern must be a regular expression string, "
                                f"got {self.pattern!r}")
            try:
                re.compile(self.pattern)
            except re.error as e:
                raise ValueError(f"Config.policy.pattern={self.pattern!r} is not a valid "
                                 f"regular expression: {e}") from None


@dataclasses.dataclass(frozen=True)
class Size:
    """``Config(policy=Size(min_numel=10**8))``: the "size" policy, parameters in first-use
    order grouped until a unit holds ``min_numel`` elements (the last unit may hold fewer).
    ``policy="size"`` is ``Size()``."""

    min_numel: int = 10**8

    def __post_init__(self):
        check_count("policy.min_numel", self.min_numel, "(elements per unit of the size policy)")


@dataclasses.dataclass(init=False, repr=False)
class Offload(CPUOffloadPolicy):
    """``Config(offload_policy=Offload(state=None, params=None, pin_memory=True))``: torch's
    ``CPUOffloadPolicy`` (the sharded state in host memory), with two fractions:

    ``state``: of the sharded state kept in host memory, by elements, the last parameters in
    the model's order first; the rest, with its optimizer step, stays on the device, as
    ZeRO-Offload's partial offload does. None: all of it, as FSDP2.

    ``params``: of the units resharded after the forward (the first in forward order), those
    whose shards are copied to the device again for the backward's all-gather; the others
    hold the forward's copy on the device until then. 1.0: every all-gather copies its shards
    in, as FSDP2 does; 0.0: none again; rounded to whole units. None: the planner's choice.

    Like a Config it cannot change once built: ``dataclasses.replace`` makes a changed copy."""

    state: Optional[float] = None
    params: Optional[float] = None

    def __init__(self, state: Optional[float] = None, params: Optional[float] = None,
                 pin_memory: bool = True):
        check_flag("offload_policy.pin_memory", pin_memory)
        if state is not None and (isinstance(state, bool) or not isinstance(state, (int, float))
                                  or not 0 < state <= 1):
            raise ValueError(f"Config.offload_policy.state must be a fraction above 0 and at "
                             f"most 1 (of the sharded state kept in host memory) or None, got "
                             f"{state!r}")
        if params is not None and (isinstance(params, bool)
                                   or not isinstance(params, (int, float))
                                   or not 0 <= params <= 1):
            raise ValueError(f"Config.offload_policy.params must be a fraction from 0 to 1 (of "
                             f"the offloaded units whose shards are copied in again for the "
                             f"backward) or None, got {params!r}")
        for name, value in (("pin_memory", pin_memory), ("state", state), ("params", params)):
            object.__setattr__(self, name, value)

    def __repr__(self) -> str:
        return (f"Offload(state={self.state!r}, params={self.params!r}, "
                f"pin_memory={self.pin_memory!r})")

    def __setattr__(self, name: str, value) -> None:
        raise dataclasses.FrozenInstanceError(
            f"Offload is frozen: Offload.{name} cannot change after Offload(...) checked it; "
            f"make a changed copy with dataclasses.replace(offload, {name}=...)")

    def __delattr__(self, name: str) -> None:
        self.__setattr__(name, None)


# the checks of one value, which Config and the options share


def check_one_of(name: str, value, accepted: tuple, more: str = "") -> None:
    # same type and value: True must not pass for 1, nor 1 for True
    if not any(type(value) is type(a) and value == a for a in accepted):
        raise ValueError(f"Config.{name}={value!r} is not accepted; use one of "
                         f"{', '.join(repr(a) for a in accepted)}{more}")


def check_flag(name: str, value, more: str = "") -> None:
    if not isinstance(value, bool):
        raise TypeError(f"Config.{name} must be True or False{' ' + more if more else ''}, "
                        f"got {value!r}")


def check_count(name: str, value, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= INT64_MAX:
        raise ValueError(f"Config.{name} must be a positive int {what}, at most 2**63 - 1, "
                         f"got {value!r}")


def check_size(name: str, value) -> Optional[int]:
    """A byte size: positive, or None for the default."""
    if isinstance(value, bool):
        raise TypeError(f"Config.{name} must be a size such as 512MiB or 1e9, or None for "
                        f"the default, got {value!r}")
    try:
        return parse_bytes(value, f"Config.{name}")
    except ValueError as e:
        raise ValueError(f"{e}, or None for the default") from None

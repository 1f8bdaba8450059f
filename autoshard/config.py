"""User-facing configuration of a sharded model."""

from __future__ import annotations

import dataclasses
import re
from typing import Optional, Sequence, Union

POLICIES = ("auto", "module", "size", "per-parameter", "whole-model")
OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 1, "none": 0}  # state tensors per parameter

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value: Union[int, float, str, None]) -> Optional[int]:
    """``80GiB``, ``1.5e9``, ``512MB`` or an int -> bytes."""
    if value is None or isinstance(value, int):
        return value
    if isinstance(value, float):
        return int(value)
    m = re.fullmatch(r"\s*([\d.]+(?:e\d+)?)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read {value!r} as a size; write e.g. 80GiB, 512MB or 1e9")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


@dataclasses.dataclass
class Config:
    """How autoshard shards and schedules a model.

    policy: how units are chosen when ``units`` is None —
        "auto": minimise predicted step time within ``memory_budget`` (the default);
        "module": each repeated block of a ModuleList/Sequential (or each module whose class
            name is in ``module_classes`` / whose FQN matches ``module_pattern``) is a unit;
        "size": parameters in first-use order, grouped until a unit holds ``min_unit_numel``;
        "per-parameter": one unit per parameter; "whole-model": one unit.
    units: explicit (pinned) units, each a list of parameter FQNs; the rest form a root unit.
    memory_budget: bytes per rank the plan may use ("80GiB" accepted); default: the device's.
    device_profile: cost-model profile name ("h100", "a100", "cpu") or a DeviceProfile;
        default: "h100" on CUDA, "cpu" otherwise.
    optimizer: whose state the memory model counts ("adamw", "adam", "sgd", "none").
    reshard_after_forward: free gathered parameters after their forward use and gather them
        again in backward (ZeRO-3): ``True`` for every unit; ``False`` keeps every unit
        gathered from forward to backward; "auto" (default) keeps only the unit gathered last
        in forward, whose backward gather would come right after its forward use (FSDP2
        keeps its root the same way).
    bucket: merge adjacent units smaller than ``bucket_bytes`` (default: the size below which
        a collective is latency-bound under the cost model) into one collective. Default: on
        for the "per-parameter" policy only ("auto" already sizes units for time within the
        memory budget; other policies are the user's choice of units).
    prefetch: issue each unit's all-gather up to ``prefetch_depth`` units ahead (as deep as
        the cost model says hiding it takes), with at most ``prefetch_bytes`` gathered bytes
        in flight (default: no byte bound), and defer reduce-scatter waits (default: on).
    recompute: save fewer activation bytes from forward to backward: a minimum cut over the
        forward graph picks what to save, and cheap ops (pointwise, views, normalisations)
        between it and the backward run again there (default: on).
    verify: run the verifier after every pass (always on in tests and under AUTOSHARD_DEBUG).
    """

    policy: str = "auto"
    units: Optional[Sequence[Sequence[str]]] = None
    memory_budget: Union[int, str, None] = None
    device_profile: object = None
    optimizer: str = "adamw"
    module_classes: Optional[Sequence[str]] = None
    module_pattern: Optional[str] = None
    min_unit_numel: int = 10**8
    reshard_after_forward: Union[bool, str] = "auto"
    bucket: Optional[bool] = None
    bucket_bytes: Union[int, str, None] = None
    prefetch: bool = True
    recompute: bool = True
    prefetch_bytes: Union[int, str, None] = None
    prefetch_depth: int = 2
    verify: bool = False

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(
                f"Config.policy={self.policy!r} is not known; use one of {', '.join(POLICIES)}"
                " or pass explicit units=[[fqn, ...], ...]"
            )
        if self.optimizer not in OPTIMIZER_STATES:
            raise ValueError(f"Config.optimizer={self.optimizer!r} is not known; use one of "
                             f"{', '.join(OPTIMIZER_STATES)}")
        if self.reshard_after_forward not in (True, False, "auto"):
            raise ValueError(f"Config.reshard_after_forward={self.reshard_after_forward!r}: use "
                             "True, False or \"auto\"")
        self.memory_budget = parse_bytes(self.memory_budget)
        self.prefetch_bytes = parse_bytes(self.prefetch_bytes)
        self.bucket_bytes = parse_bytes(self.bucket_bytes)
        if self.bucket is None:
            self.bucket = self.units is None and self.policy == "per-parameter"
        if self.units is not None:
            if isinstance(self.units, (str, bytes)) or not all(
                isinstance(u, (list, tuple)) and all(isinstance(f, str) for f in u)
                for u in self.units
            ):
                raise TypeError(
                    "Config.units must be a list of lists of parameter FQNs, e.g. "
                    "[['layers.0.weight', 'layers.0.bias'], ['layers.1.weight']]"
                )
            self.units = [list(u) for u in self.units]
        if self.module_classes is not None:
            self.module_classes = [c if isinstance(c, str) else c.__name__
                                   for c in self.module_classes]

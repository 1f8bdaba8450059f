"""User-facing configuration of a sharded model."""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence


@dataclasses.dataclass
class Config:
    """How autoshard shards and schedules a model.

    units: explicit wrapping units, each a list of parameter FQNs; parameters not named go to
        a root unit. ``None`` lets the ``policy`` decide.
    policy: how units are chosen when ``units`` is None. ``"module"``: each repeated block of a
        ``ModuleList``/``Sequential`` is a unit, the rest is the root unit.
    reshard_after_forward: free gathered parameters after their forward use and gather them
        again in backward (ZeRO-3). ``False`` keeps them gathered from forward to backward.
    verify: run the verifier after every pass (always on in tests and under AUTOSHARD_DEBUG).
    """

    units: Optional[Sequence[Sequence[str]]] = None
    policy: str = "module"
    reshard_after_forward: bool = True
    verify: bool = False

    def __post_init__(self):
        if self.policy not in ("module",):
            raise ValueError(
                f"Config.policy={self.policy!r} is not known; use 'module' or pass explicit "
                "units=[[fqn, ...], ...]"
            )
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

"""The Plan: units and the ordered communication schedule, as plain data.

A Plan round-trips through JSON and renders as tables (tabulate). It is read off a compiled
program's forward and backward graphs, so what it shows is what runs.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Optional

from tabulate import tabulate

from autoshard import meta

_SHOWN = {
    meta.AG_ISSUE: "all_gather",
    meta.AG_WAIT: "wait",
    meta.RS_ISSUE: "reduce_scatter",
    meta.RS_WAIT: "wait",
    meta.FREE: "free",
}


@dataclasses.dataclass
class UnitInfo:
    index: int
    name: str
    fqns: list
    numel: int
    bytes: int


@dataclasses.dataclass
class ScheduleEntry:
    """One communication step: ``op`` of ``unit`` placed right after compute node ``after``
    (in module ``module``) of the ``region`` graph. ``bytes``: the gathered buffer for an
    all-gather, the reduced buffer for a reduce-scatter, the storage released for a free."""

    region: str
    unit: int
    op: str
    bytes: int
    after: str
    module: str


@dataclasses.dataclass
class Plan:
    world_size: int
    units: list  # list[UnitInfo]
    schedule: list  # list[ScheduleEntry]

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        d = json.loads(text)
        return cls(
            world_size=d["world_size"],
            units=[UnitInfo(**u) for u in d["units"]],
            schedule=[ScheduleEntry(**e) for e in d["schedule"]],
        )

    def units_table(self) -> str:
        rows = [(u.index, u.name, len(u.fqns), u.numel, _fmt_bytes(u.bytes)) for u in self.units]
        return tabulate(rows, headers=["unit", "name", "params", "numel", "bytes"])

    def schedule_table(self, ops: Optional[set] = None) -> str:
        names = {u.index: u.name for u in self.units}
        rows = [
            (i, e.region, f"{e.unit}:{names.get(e.unit, '?')}", e.op, _fmt_bytes(e.bytes),
             e.after, e.module or "-")
            for i, e in enumerate(self.schedule)
            if ops is None or e.op in ops
        ]
        return tabulate(
            rows, headers=["#", "pass", "unit", "op", "bytes", "placed after", "module"]
        )

    def comm_bytes(self) -> int:
        return sum(e.bytes for e in self.schedule if e.op in ("all_gather", "reduce_scatter"))

    def __str__(self) -> str:
        return (
            f"autoshard plan: world size {self.world_size}, {len(self.units)} units\n\n"
            f"{self.units_table()}\n\n{self.schedule_table()}"
        )


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def read_schedule(graphs) -> list:
    """ScheduleEntry per communication node of ``graphs`` (forward first, then backward)."""
    entries = []
    for gm in graphs:
        if gm is None:
            continue
        prev = None
        for n in gm.graph.nodes:
            kind = meta.tag(n, meta.COMM)
            if kind in _SHOWN:
                if kind == meta.FREE:
                    size = sum(meta.val_bytes(t) for t in n.args[0])
                elif kind == meta.RS_ISSUE:
                    size = meta.val_bytes(n.args[0])
                else:
                    size = meta.val_bytes(n)
                entries.append(
                    ScheduleEntry(
                        region=meta.tag(n, meta.REGION),
                        unit=meta.tag(n, meta.UNIT),
                        op=_SHOWN[kind],
                        bytes=size,
                        after=prev.name if prev is not None else "(start)",
                        module=(meta.tag(prev, meta.MODULE) or "") if prev is not None else "",
                    )
                )
            elif n.op == "call_function" and not meta.is_comm(n):
                prev = n
    return entries


def make_plan(world_size: int, units, specs: dict, graphs) -> Plan:
    infos = []
    for u in units:
        numel = sum(_numel(specs[f].shape) for f in u.fqns)
        nbytes = sum(_numel(specs[f].shape) * specs[f].dtype.itemsize for f in u.fqns)
        infos.append(UnitInfo(u.index, u.name, list(u.fqns), numel, nbytes))
    return Plan(world_size, infos, read_schedule(graphs))


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n

"""The Plan: units and the ordered communication schedule, as plain data.

A Plan round-trips through JSON and renders as tables (tabulate). It is read off a compiled
program's forward and backward graphs, so what it shows is what runs.
"""

from __future__ import annotations

import dataclasses
import json
import math
import textwrap
from fractions import Fraction
from typing import Optional

from tabulate import tabulate

from autoshard.core import meta
from autoshard.core.options import parse_bytes


WIDTH = 100  # columns every table fits

# before each forward and each backward the ranks all-gather a digest of what they run, and
# before a ZeRO-1 call which replicas any rank's writes made stale
# (autoshard.runtime.dist.Agreement): the only collectives outside the compiled graphs,
# with one more, once, in autoshard() (the Config and the parameters)
AGREEMENT_BYTES = 32


@dataclasses.dataclass
class UnitInfo:
    index: int
    name: str
    fqns: list
    numel: int
    bytes: int  # as gathered: padded to a multiple of the ranks, in the compute dtype
    kept: bool = False  # gathered from forward to backward, not resharded after forward
    # resharded, its shards (in host memory) copied in once and held from forward to backward
    held: bool = False
    # the fraction of its elements whose shards, gradient shards and optimizer state are in
    # host memory (Plan.offload)
    hosted: float = 0.0
    # hpZ: resharded after the forward to groups of this many ranks (0: to the whole shard
    # dimension, or kept)
    group: int = 0


@dataclasses.dataclass
class ScheduleEntry:
    """One communication step: ``op`` of ``unit`` placed right after compute node ``after``
    (in module ``module``) of the ``region`` graph. ``bytes``: the gathered buffer for an
    all-gather, the reduced buffer for a reduce-scatter, the storage released for a free.
    ``serves``: the module of the op it is for (an all-gather's and its wait's: the first op
    reading the unit's parameters; a reduce-scatter's or all-reduce's and its wait's: the last
    op making a gradient it reduces); "" for a free."""

    region: str
    unit: int
    op: str
    bytes: int
    after: str
    module: str
    serves: str = ""
    # the ranks of the collective's group where it is not the shard dimension (an hpZ
    # all-gather's group of k); 0: the shard dimension's (or, for an all-reduce, its own)
    ranks: int = 0


# the unit of a tensor-parallel collective (of activations over "tp", in no unit)
TP_UNIT = -1


@dataclasses.dataclass
class Plan:
    """What autoshard will run and what it predicts, as plain data (JSON round trip)."""

    world_size: int
    units: list  # list[UnitInfo]
    schedule: list  # list[ScheduleEntry]
    policy: str = ""
    device: dict = dataclasses.field(default_factory=dict)  # the DeviceProfile used
    memory_budget: int = 0
    predicted: dict = dataclasses.field(default_factory=dict)  # see summary_table()
    # [seconds, bytes, graph, module path of the node]
    memory_timeline: list = dataclasses.field(default_factory=list)
    events: list = dataclasses.field(default_factory=list)  # [lane, name, start, dur, unit]
    symbolic: dict = dataclasses.field(default_factory=dict)  # {"memory": expr, "time": expr}
    recompute: str = ""  # the recomputation chosen: "none", "min-cut", "blocks k/L", ...
    # {block path: "keep" | "min-cut" | "block" | "offload"} of that choice; None: nothing
    # recomputed
    recompute_blocks: Optional[dict] = None
    # {block (or module) path: bytes} of the saved activations copied to host memory between
    # forward and backward (autoshard.passes.offload); {}: none
    offloaded_activations: dict = dataclasses.field(default_factory=dict)
    # every plan the planner predicted: recompute, offload, units, step_s, peak_bytes, fits,
    # chosen
    candidates: list = dataclasses.field(default_factory=list)
    # the fraction of the sharded state (parameter shards, gradient shards, optimizer state)
    # in host memory, the last parameters' (autoshard.core.spec.hosted): 0.0 none, 1.0 all
    offload: float = 0.0
    # with offload: the fraction of resharded units whose shards are copied in again for the
    # backward (PassContext.offload_params; the others hold the forward's copy)
    offload_params: Optional[float] = None
    # which units free their gathered parameters after the forward: "every unit", "all but
    # the last" (gathered last in forward), "none"
    reshard: str = ""
    strategy: str = "zero3"  # Config.strategy as planned ("auto" resolved)
    mesh_shape: list = dataclasses.field(default_factory=list)  # (replicate, shard) for HSDP
    grad_sync: bool = True  # False: gradients stay local (set_requires_gradient_sync)
    # how the ranks' gradients become one (ParamSpec.scaling): "mean", or "sum / f" where
    # set_gradient_divide_factor(f), with ", sum collectives" where forced to sum
    reduction: str = "mean"
    # why nothing fits the budget, and what would (the planner's; None when a plan fits or
    # the user fixed every choice)
    unfit: Optional[str] = None
    # why the planner did not take the fastest plan that fits (Config(prefer="memory"): its
    # peak is over 0.85x FSDP2's predicted peak), or took it though it is; None otherwise
    choice: Optional[str] = None

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        d = json.loads(text)
        d["units"] = [UnitInfo(**u) for u in d["units"]]
        d["schedule"] = [ScheduleEntry(**e) for e in d["schedule"]]
        return cls(**d)

    def pinned_units(self) -> list:
        """The units as lists of FQNs, for ``Config(units=...)``: pins this plan's grouping."""
        return [list(u.fqns) for u in self.units]

    def pinned_recompute(self):
        """This plan's recomputation for ``Config(recompute=...)``."""
        return False if self.recompute_blocks is None else dict(self.recompute_blocks)

    def candidates_table(self) -> str:
        """One row per plan predicted; a column whose value every row shares is said above
        the table instead (offload, resharded)."""
        yes_no = {True: "yes", False: "no"}
        rows = [[c["recompute"], offload_label(c.get("offload"), c.get("offload_params")),
                 c["units"] if c["units"] is not None else "-", c.get("reshard", "-"),
                 f"{c['step_s'] * 1e3:.3f} ms" if c["step_s"] is not None else "-",
                 fmt_bytes(c["peak_bytes"]) if c["peak_bytes"] is not None else "-",
                 yes_no.get(c["fits"], "-"),
                 "chosen" if c.get("chosen") else c.get("note", "")]
                for c in self.candidates]
        headers = ["recompute", "offload", "units", "resharded", "step", "peak", "fits", ""]
        shared = []
        for col in (3, 1):  # resharded, offload: only where plans differ
            values = {r[col] for r in rows} - {"-"}
            if len(values) == 1 and len(rows) > 1:
                shared.append(f"{headers[col]}: {values.pop()}")
                for r in rows:
                    del r[col]
                del headers[col]
        table = _fit(rows, headers, wrap={len(headers) - 1})
        return (f"every plan: {', '.join(reversed(shared))}\n" if shared else "") + table

    def units_table(self) -> str:
        rows = [(u.index, u.name, len(u.fqns), u.numel, fmt_bytes(u.bytes),
                 "kept" if u.kept else "resharded, shards held" if u.held
                 else f"resharded to groups of {u.group}" if u.group else "resharded")
                + ((_home(u.hosted),) if self.offload else ())
                for u in self.units]
        return _fit(rows, ["unit", "name", "params", "numel", "bytes", "after forward"]
                    + (["state"] if self.offload else []), wrap={1})

    def schedule_table(self, ops: Optional[set] = None, frees: bool = False) -> str:
        """The communication steps in order, numbered as in ``schedule``: the unit, the op,
        its bytes, the module of the compute op it is placed after, and the module of the op
        it serves (``ScheduleEntry.serves``). Free rows are counted below the table, not
        shown, unless ``frees`` or ``ops`` (the ops to show) names "free"."""
        names = {u.index: u.name for u in self.units}
        if ops is None:
            ops = {e.op for e in self.schedule} - (set() if frees else {"free"})
        rows = [(i, e.region, "-" if e.unit == TP_UNIT else f"{e.unit}:{names.get(e.unit, '?')}",
                 f"{e.op} ({e.ranks} ranks)" if e.ranks else e.op, fmt_bytes(e.bytes),
                 _where(e),
                 e.serves or "-")
                for i, e in enumerate(self.schedule) if e.op in ops]
        table = _fit(rows, ["#", "pass", "unit", "op", "bytes", "placed after", "serves"],
                     shorten={2, 5, 6})
        folded = 0 if "free" in ops else sum(e.op == "free" for e in self.schedule)
        return table + (f"\n({folded} free rows not shown: frees=True shows them)"
                        if folded else "")

    def summary_table(self) -> str:
        p = self.predicted
        if not p:
            return "(no prediction)"
        rows = [
            ("device profile", self.device.get("name", "?")),
            ("world size", self.world_size if len(self.mesh_shape) < 2 else
             f"{self.world_size} (replicate {self.mesh_shape[0]} x shard {self.mesh_shape[1]})"),
            ("strategy", self.strategy + ("" if self.grad_sync else
                                          ", gradients accumulated locally (no sync)")),
            ("policy", self.policy),
            ("gradient reduction", self.reduction),
            ("units", len(self.units)),
            ("activation recomputation", self.recompute or "-"),
            *([("activations offloaded to host memory",
                f"{fmt_bytes(sum(self.offloaded_activations.values()))} from "
                f"{len(self.offloaded_activations)} blocks")] if self.offloaded_activations
              else []),
            ("resharded after forward", self.reshard or "-"),
            *([("gradients accumulated locally (no sync)",
                fmt_bytes(p["local_grad_bytes"]))] if p.get("local_grad_bytes") else []),
            ("predicted step time", f"{p['step_s'] * 1e3:.3f} ms"),
            ("  compute", f"{p['compute_s'] * 1e3:.3f} ms"),
            ("  exposed communication", f"{p['exposed_comm_s'] * 1e3:.3f} ms"),
            ("communication per step (buffers)", fmt_bytes(p["comm_bytes"])),
            ("sent per rank per step", fmt_bytes(p["sent_bytes"])),
            ("  ranks' agreement (outside the graphs)",
             f"{2 + (self.strategy == 'zero1')} all-gathers of {AGREEMENT_BYTES} B per rank"
             if self.world_size > 1 else "none (one rank)"),
            ("peak memory per rank", f"{fmt_bytes(p['peak_bytes'])} at {p['peak_at']}"),
            ("  model state (params + grads + optimizer)", fmt_bytes(p["model_state_bytes"])),
            *([("FSDP2's plan (predicted)",
                f"{p['fsdp2_step_s'] * 1e3:.3f} ms, peak {fmt_bytes(p['fsdp2_peak_bytes'])}: "
                f"this plan's {p['step_s'] / p['fsdp2_step_s']:.2f}x, "
                f"{p['peak_bytes'] / p['fsdp2_peak_bytes']:.2f}x")]
              if p.get("fsdp2_peak_bytes") else []),
            *([("  offloaded to host memory", fmt_bytes(p["host_state_bytes"])),
               ("  offload", offload_label(self.offload, self.offload_params))]
              if p.get("host_state_bytes") else []),
            *([("host memory peak per rank", fmt_bytes(p["host_peak_bytes"]))]
              if self.offloaded_activations and p.get("host_peak_bytes") else []),
            ("  memory budget", fmt_bytes(self.memory_budget)),
        ]
        for k, v in self.symbolic.items():
            rows.append((f"{k} (symbolic)", v))
        return _fit(rows, (), wrap={1}, tablefmt="plain")

    def comm_bytes(self) -> int:
        return sum(e.bytes for e in self.schedule if e.op in ("all_gather", "reduce_scatter"))

    def to_chrome_trace(self, path) -> None:
        """Write a Chrome/Perfetto trace: compute and communication lanes and a memory
        counter track, from the predicted timeline. A compute slice is named by its module
        (``"blocks.0.fc (backward)"``), a collective by its op, unit and bytes
        (``"all_gather blocks.0 (194.50 KiB)"``, with ``unit``, ``unit_name`` and ``bytes`` in
        its args)."""
        us = 1e6
        ev = [{"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "rank (predicted)"}},
              {"ph": "M", "name": "thread_name", "pid": 0, "tid": 0, "args": {"name": "compute"}},
              {"ph": "M", "name": "thread_name", "pid": 0, "tid": 1,
               "args": {"name": "communication"}}]
        for lane, name, start, dur, unit, args in self._trace_events():
            ev.append({"ph": "X", "pid": 0, "tid": 0 if lane == "compute" else 1, "name": name,
                       "ts": start * us, "dur": max(dur * us, 0.001), "args": args})
        last = None
        for t, b, _, _ in self.memory_timeline:
            if b != last:
                ev.append({"ph": "C", "pid": 0, "name": "memory", "ts": t * us,
                           "args": {"MiB": b / 2**20}})
                last = b
        with open(path, "w") as f:
            json.dump({"traceEvents": ev, "displayTimeUnit": "ms"}, f)

    def _trace_events(self):
        """``self.events`` named for people: ``(lane, name, start, dur, unit, args)``. The
        collectives in the events are the schedule's issues in the graphs, in order."""
        names = {u.index: u.name for u in self.units}
        issues = iter([e for e in self.schedule if e.region in (meta.FWD, meta.BWD)
                       and e.op in ("all_gather", "reduce_scatter", "all_reduce")])
        for lane, name, start, dur, unit in self.events:
            args = {"unit": unit}
            if lane == "compute":
                region, _, path = name.partition(":")
                name = module_label("" if path == "-" else path, region)
            else:
                entry = next(issues, None)
                op = name.split(" ")[0]
                if entry is not None and (entry.op, entry.unit) == (op, unit):
                    args.update(unit_name=names.get(unit, "?"), bytes=entry.bytes)
                    name = f"{op} {names.get(unit, '?')} ({fmt_bytes(entry.bytes)})"
                else:
                    name = f"{op} {names.get(unit, '?')}"
                    args["unit_name"] = names.get(unit, "?")
            yield lane, name, start, dur, unit, args

    def memory_plot(self, path) -> None:
        """Draw the predicted per-rank memory over the step (needs matplotlib)."""
        import matplotlib.pyplot as plt

        fig = self.memory_figure()
        fig.savefig(path, dpi=120)
        plt.close(fig)

    def memory_figure(self):
        """The figure ``memory_plot`` draws: memory per rank over the graph nodes, in KiB, MiB
        or GiB by its peak, the peak marked with its value and module, the budget a labelled
        line (named in the legend when far above the peak, the axis kept to the curve)."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError as e:
            raise ImportError("memory_plot needs matplotlib: pip install 'autoshard[plot]'") from e
        line = self.memory_timeline
        peak = max(range(len(line)), key=lambda i: line[i][1], default=None)
        top = line[peak][1] if peak is not None else 0
        unit, scale = _scale(max(top, 1))
        fig, ax = plt.subplots(figsize=(10, 4))
        ax.plot(range(len(line)), [b / scale for _, b, _, _ in line], lw=1,
                label="predicted memory")
        n_fwd = sum(1 for _, _, g, _ in line if g == meta.FWD)
        ax.axvline(n_fwd, color="gray", ls="--", lw=0.8)
        ax.text(n_fwd, 0.02, " backward", va="bottom", fontsize=8,
                transform=ax.get_xaxis_transform())
        if peak is not None:
            where = module_label(line[peak][3], line[peak][2])
            ax.plot([peak], [top / scale], "o", color="black", ms=4, label="peak")
            ax.annotate(f"peak {fmt_bytes(top)} at {where}", (peak, top / scale),
                        xytext=(0, 8), textcoords="offset points", fontsize=8,
                        ha="right" if peak > len(line) / 2 else "left")
        if self.memory_budget:
            ax.axhline(self.memory_budget / scale, color="red", lw=0.8,
                       label=f"memory budget {fmt_bytes(self.memory_budget)}"
                       + (" (above the plot)" if self.memory_budget > 1.5 * top else ""))
            if self.memory_budget > 1.5 * top:
                ax.set_ylim(0, top / scale * 1.2)
        ax.legend(loc="lower right", fontsize=8)
        ax.set_xlabel("graph node (forward, then backward)")
        ax.set_ylabel(f"{unit} per rank")
        n = len(self.units)
        ax.set_title(f"predicted memory per rank: world size {self.world_size}, "
                     f"{n} unit{'s' if n != 1 else ''}")
        fig.tight_layout()
        return fig

    def max_batch_size(self, memory_budget=None, seq_len=None) -> int:
        """The largest batch whose predicted peak fits ``memory_budget`` (default: the plan's),
        from the symbolic memory expression."""
        import sympy

        if "memory" not in self.symbolic:
            raise ValueError("this plan has no symbolic memory; make it with "
                             "autoshard.plan(..., make_inputs=fn) to fit one")
        budget = parse_bytes(memory_budget, "memory_budget") or self.memory_budget
        batch, seq = sympy.symbols("batch seq", positive=True)
        expr = sympy.sympify(self.symbolic["memory"], locals={"batch": batch, "seq": seq})
        expr = expr.subs(seq, seq_len if seq_len is not None else self.symbolic["seq_at"])
        sol = sympy.solve(sympy.Eq(expr, budget), batch)
        if not sol:
            raise ValueError("the predicted memory does not grow with the batch size")
        return max(int(math.floor(float(sol[0]))), 0)

    def __str__(self) -> str:
        return self.render()

    def render(self, *, schedule: bool = True, frees: bool = False) -> str:
        """The plan as ``print(plan)`` shows it; ``schedule``: with the schedule table,
        ``frees``: with its free rows."""
        return (
            f"autoshard plan: world size {self.world_size}, {len(self.units)} "
            f"unit{'s' if len(self.units) != 1 else ''}\n\n"
            f"{self.summary_table()}\n\n{self.candidates_section()}{self.units_table()}"
            + (f"\n\n{self.schedule_table(frees=frees)}" if schedule else "")
        )

    def candidates_section(self) -> str:
        """The plans considered and, where the fastest was not simply taken, why."""
        if len(self.candidates) < 2:
            return ""
        why = f"{_wrap('chosen: ' + self.choice, WIDTH)}\n\n" if self.choice else ""
        return (f"plans considered (fastest that fits is chosen):\n{self.candidates_table()}"
                f"\n\n{why}")


def fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def module_label(path, region=None) -> str:
    """How the plan names the code a node runs: its module path (``"(root)"``: the root
    module's own code), with ``" (backward)"`` for a backward node."""
    return (path or "(root)") + (" (backward)" if region == meta.BWD else "")


def _where(e) -> str:
    """The schedule's "placed after" cell: the module of the op before the step."""
    if e.after in ("(start)", "(optimizer step)"):
        return e.after
    return e.module or "(root)"


def _scale(n: int) -> tuple:
    """The unit to draw ``n`` bytes in: ``(name, bytes)``, the largest not above ``n``."""
    for name, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return name, size
    return "B", 1


def _fit(rows, headers, *, shorten=(), wrap=(), width: int = WIDTH, **fmt) -> str:
    """``tabulate(rows, headers, **fmt)`` in at most ``width`` columns: the columns ``shorten``
    (module paths) lose their left ends to "...", the columns ``wrap`` (text) wrap; the widest
    narrows first, none below 12 columns or its header."""
    rows = [list(r) for r in rows]
    cols = set(shorten) | set(wrap)
    text = tabulate(rows, headers, **fmt)
    over = max(map(len, text.splitlines()), default=0) - width
    if over <= 0 or not rows or not cols:
        return text
    floor = {c: max(12, len(headers[c]) if headers else 0) for c in cols}
    have = {c: max(len(line) for r in rows for line in str(r[c]).splitlines()) for c in cols}
    limit = dict(have)
    while over > 0:
        c = max((c for c in cols if limit[c] > floor[c]), key=limit.get, default=None)
        if c is None:
            break
        second = max([limit[d] for d in cols if d != c] + [floor[c]])
        cut = min(over, limit[c] - max(second, floor[c]) or 1, limit[c] - floor[c])
        limit[c] -= cut
        over -= cut
    for r in rows:
        for c in cols:
            if limit[c] < have[c]:
                r[c] = (_shorten(str(r[c]), limit[c]) if c in shorten
                        else _wrap(str(r[c]), limit[c]))
    return tabulate(rows, headers, **fmt)


def _wrap(text: str, limit: int) -> str:
    """``text`` in lines of at most ``limit`` characters: words, or a unit's name split after
    its ".." and its paths shortened (``_shorten``)."""
    if " " in text or ".." not in text:
        return "\n".join(textwrap.wrap(text, limit))
    first, _, last = text.partition("..")
    return _shorten(first + "..", limit) + "\n" + _shorten(last, limit)


def _shorten(text: str, limit: int) -> str:
    """``text`` in at most ``limit`` characters: a module path loses its left end to "..."
    (whole names where they fit), keeping a trailing " (backward)" and a leading unit index
    ("3:")."""
    if len(text) <= limit:
        return text
    index, colon, rest = text.partition(":")
    if colon and index.isdigit():
        return index + colon + _shorten(rest, limit - len(index) - 1)
    if ".." in text:  # a unit's range: where it starts
        return _shorten(text.partition("..")[0], limit - 2) + ".."
    path, suffix = text, ""
    if text.endswith(")") and " (" in text:
        path, _, rest = text.rpartition(" (")
        suffix = " (" + rest
    room = limit - len(suffix) - 3
    if room < 4:
        return "..." + text[len(text) - (limit - 3):]
    parts = path.split(".")
    tails = [".".join(parts[k:]) for k in range(1, len(parts))]
    tail = next((t for t in tails if len(t) <= room and not t.startswith(".")), path[-room:])
    return "..." + tail + suffix


def _home(hosted: float) -> str:
    """Where a unit's sharded state is: "host", "device" or "host 40%" (of its elements)."""
    return "host" if hosted >= 1 else "device" if hosted <= 0 else f"host {hosted:.0%}"


def share(fraction: float) -> str:
    """A fraction as people write it: "1/4"."""
    return str(Fraction(fraction).limit_denominator(64))


def offload_label(state: float, params: Optional[float] = None) -> str:
    """The offload column: "no"; "state" (shards, gradient shards and optimizer state on the
    host, each shard copied in once per step), "state 1/2" (that fraction of it, the last
    parameters'); then "+ params" (copied in for every all-gather, as FSDP2's
    CPUOffloadPolicy) or "+ params 1/2" (for that fraction of the offloaded units); no
    "+ params" part either for a candidate ruled out before its units were chosen."""
    if not state:
        return "no"
    label = "state" if state >= 1 else f"state {share(state)}"
    if params is None or params <= 0:
        return label
    return label + (" + params" if params >= 1 else f" + params {share(params)}")

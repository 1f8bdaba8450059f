"""What ``autoshard.check`` reports and how it judges two values: the ``CheckReport`` with its
rows and first ``Difference``, and the tolerances (per dtype, or the caller's) a value
passes within.

Plain data and arithmetic on tensors, shared by the step comparison (``check.py``) and the
search for the first differing node (``check_locate.py``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch

from autoshard.core import _compat


# (atol, rtol) per dtype: a value passes when max|Δ| <= atol + rtol * max|reference|
DEFAULT_TOLERANCES = {
    torch.float64: (1e-10, 1e-7),
    torch.float32: (1e-5, 1e-4),
    torch.bfloat16: (1e-3, 2e-2),
    torch.float16: (1e-4, 2e-3),
}


# --- the report -------------------------------------------------------------------------------


@dataclasses.dataclass
class ParamRow:
    """One trainable parameter: eager's gradient against the compiled step's."""

    fqn: str
    dtype: str
    shape: tuple
    max_grad: float  # max |grad| of eager's gradient (averaged over ranks)
    max_delta: float  # max |Δgrad|; inf when one side has no gradient
    tolerance: float  # atol + rtol * max_grad
    status: str  # "ok", "differs", "no grad in compiled", "no grad in eager", "no grad"

    @property
    def ok(self) -> bool:
        return self.status in ("ok", "no grad")


@dataclasses.dataclass
class OutputRow:
    """One tensor leaf of the forward's output."""

    path: str  # e.g. "[0]", "['logits']", ".logits"
    dtype: str
    shape: tuple
    max_abs: float
    max_delta: float
    tolerance: float
    ok: bool


@dataclasses.dataclass
class Difference:
    """Where values first differ.

    stage: "capture" (the traced joint graph already differs from eager), "graph" (a node of
        the compiled graphs differs from the traced graph's same node), "runtime" (every
        graph node agrees; the difference arises outside the graphs).
    node, graph, op, module: the node (its name in the compiled ``graph``, "fwd" or "bwd"; or
        the captured output for stage "capture"), its op and the module path that produced it.
    """

    stage: str
    description: str
    node: Optional[str] = None
    graph: Optional[str] = None
    op: Optional[str] = None
    module: Optional[str] = None
    max_delta: float = 0.0
    max_abs: float = 0.0
    recomputed_from: Optional[str] = None
    rank: int = 0

    def __str__(self) -> str:
        return self.description


@dataclasses.dataclass
class CheckReport:
    """The result of ``autoshard.check``; ``str(report)`` renders it as tables."""

    ok: bool
    params: list  # ParamRow per trainable parameter, in the model's order
    outputs: list  # OutputRow per tensor output leaf
    outputs_delta: float  # max |Δ| over the forward outputs
    worst: Optional[tuple]  # (fqn, max |Δgrad|) of the parameter furthest out of tolerance
    first_difference: Optional[Difference]
    tolerances: dict  # dtype name -> (atol, rtol)
    world_size: int = 1
    rank: int = 0
    loss: str = ""
    nodes_compared: int = 0
    notes: list = dataclasses.field(default_factory=list)

    def __bool__(self) -> bool:
        return self.ok

    def __str__(self) -> str:
        from tabulate import tabulate

        n_bad = sum(not r.ok for r in self.params)
        head = (f"autoshard check: {'OK' if self.ok else 'DIFFERS'} — one training step, "
                f"eager vs compiled, world size {self.world_size}")
        tol = "; ".join(f"{d}: atol {a:g}, rtol {r:g}" for d, (a, r) in self.tolerances.items())
        lines = [head, f"tolerance: max|Δ| <= atol + rtol * max|eager|  ({tol})",
                 f"loss: {self.loss}"]
        if self.world_size > 1:
            lines.append(f"gradients: eager averaged over {self.world_size} ranks "
                         f"(this is rank {self.rank})")
        lines.append("")
        out_rows = [(o.path, o.dtype, "x".join(map(str, o.shape)) or "()", fmt_value(o.max_abs),
                     fmt_value(o.max_delta), fmt_value(o.tolerance), "ok" if o.ok else "DIFFERS")
                    for o in self.outputs]
        lines.append(tabulate(out_rows, headers=["output", "dtype", "shape", "max|out|",
                                                 "max|Δ|", "tol", ""]))
        lines.append("")
        rows = [(r.fqn, r.dtype, "x".join(map(str, r.shape)) or "()",
                 *((fmt_value(r.max_grad), fmt_value(r.max_delta), fmt_value(r.tolerance))
                   if r.status != "no grad" else ("-", "-", "-")),
                 r.status if r.ok else r.status.upper())
                for r in self.params]
        lines.append(tabulate(rows, headers=["parameter", "dtype", "shape", "max|grad|",
                                             "max|Δgrad|", "tol", ""]))
        lines.append("")
        lines.append(f"{len(self.params)} parameters, {n_bad} differ; "
                     f"outputs max|Δ| {fmt_value(self.outputs_delta)}")
        if self.worst is not None:
            row = next(r for r in self.params if r.fqn == self.worst[0])
            lines.append(f"worst parameter: {self.worst[0]} "
                         f"(max|Δgrad| {fmt_value(self.worst[1])}, "
                         f"{'within' if row.ok else 'beyond'} tolerance)")
        if self.first_difference is not None:
            lines.append(f"first difference: {self.first_difference}")
        elif not self.ok:
            lines.append("first difference: not localised")
        for note in self.notes:
            lines.append(f"note: {note}")
        return "\n".join(lines)


def fmt_value(x: float) -> str:
    if x is None:
        return "-"
    if math.isinf(x):
        return "inf"
    return f"{x:.3g}"


# --- comparisons ------------------------------------------------------------------------------


def tolerance_for(dtype: torch.dtype, atol, rtol) -> tuple:
    da, dr = DEFAULT_TOLERANCES.get(dtype, DEFAULT_TOLERANCES[torch.float32])
    return (da if atol is None else atol), (dr if rtol is None else rtol)


def max_abs(t: torch.Tensor) -> float:
    if t.numel() == 0:
        return 0.0
    t = t.detach()
    if t.is_complex():
        t = t.abs()
    v = t.double().abs()
    v = torch.where(torch.isnan(v), torch.zeros_like(v), v)
    return float(v.max())


def max_delta(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b|; NaN against NaN and inf against the same inf count as equal."""
    if a.shape != b.shape:
        return math.inf
    if a.numel() == 0:
        return 0.0
    a, b = a.detach(), b.detach()
    if a.is_complex() or b.is_complex():
        return float((a.to(torch.complex128) - b.to(torch.complex128)).abs().max())
    a64, b64 = a.double(), b.double()
    same = (a64 == b64) | (torch.isnan(a64) & torch.isnan(b64))
    d = (a64 - b64).abs()
    d = torch.where(same, torch.zeros_like(d), d)
    d = torch.where(torch.isnan(d), torch.full_like(d, math.inf), d)
    return float(d.max())


def within_tolerance(delta: float, ref: float, dtype: torch.dtype, atol, rtol) -> tuple:
    """(ok, tolerance); integer and bool values must match exactly."""
    if not (dtype.is_floating_point or dtype.is_complex):
        return delta == 0, 0.0
    a, r = tolerance_for(dtype, atol, rtol)
    tol = a + r * ref
    return delta <= tol, tol


def coarser_dtype(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    """Of two dtypes, the one whose tolerance applies: the less precise floating one (a value
    computed in bf16 and reduced in fp32 is as good as bf16)."""
    if not (a.is_floating_point and b.is_floating_point):
        return a
    return max(a, b, key=lambda d: torch.finfo(d).eps)


def cast_floating(tree, dtype: torch.dtype):
    """``tree`` with its floating tensors cast to ``dtype`` (differentiably)."""
    return _compat.tree_map_only(
        torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, tree)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")

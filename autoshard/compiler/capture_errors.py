"""What a capture refuses, and the error that says why: ``explain`` turns a failed trace into
a message naming the module, the op and the input at fault.

Also the checks made while tracing that raise those errors: ops given tensors of dtypes
their kernels do not mix (``CheckDtypes``), and value reads (``.item()``) that stand in
the graph only as a model's own checks (``assert_value_checks``).
"""

from __future__ import annotations

import ast
import linecache
import os
import re
import traceback

import torch
import torch.fx as fx

from autoshard.core import _compat
from autoshard.core.errors import AutoshardError
from autoshard.core.guards import own_file


# aten ops whose kernels take all their tensors in one dtype ("mat1 and mat2 must have the
# same dtype"); the fake kernels of some (mm, addmm) do not check it, so capture does
_ONE_DTYPE = frozenset({"mm", "addmm", "bmm", "baddbmm", "addbmm", "addmv", "mv", "dot", "vdot",
                        "addr", "convolution"})


class _DtypesDiffer(RuntimeError):
    """An op got tensors of dtypes its kernel does not mix; ``func`` names it, as in the
    fake tensor errors ``explain`` reads."""

    def __init__(self, func, operands: list):
        self.func, self.operands = func, operands  # [(argument name, dtype)]
        super().__init__(f"{func} got " + ", ".join(f"{n} {_dtype(d)}" for n, d in operands))


class CheckDtypes(_compat.TorchDispatchMode):
    """While the forward is traced: refuse an op of ``_ONE_DTYPE`` given tensors of more
    than one dtype, as its eager kernel would at run time, after the step's all-gathers."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket.__name__ in _ONE_DTYPE and func._overloadname == "default":
            operands = [(a.name, v.dtype) for a, v in zip(func._schema.arguments, args)
                        if isinstance(v, torch.Tensor)]
            if len({d for _, d in operands}) > 1:
                raise _DtypesDiffer(func, operands)
        return func(*args, **kwargs)


def _dtype(dtype) -> str:
    return str(dtype).replace("torch.", "")


def check_source() -> str:
    """The model's source statement making a check now: the innermost frame outside torch
    and autoshard, or, when that frame is a checking helper (transformers'
    ``torch_compilable_check``), the statement that called it; its whole text, all lines."""
    frames = [f for f in traceback.extract_stack()[:-1] if _is_user_frame(f)]
    if not frames:
        return "(no user frame)"
    frame = frames[-1]
    if "check" in frame.name and len(frames) > 1:
        frame = frames[-2]
    lines = []
    for k in range(frame.lineno, frame.lineno + 20):  # the statement: its lines up to where
        lines.append(linecache.getline(frame.filename, k).strip())  # they parse whole
        try:
            ast.parse(" ".join(lines))
            break
        except SyntaxError:
            continue
    else:
        lines = [frame.line or ""]
    return f"{frame.filename}:{frame.lineno}: {' '.join(lines)}"


def assert_value_checks(gm: fx.GraphModule, found: list, stack: list) -> None:
    """Each check the forward made on a tensor's value (``torch._check_tensor_all(t)``,
    ``torch._check(t.item())``), traced as the value read ``aten._local_scalar_dense`` and an
    assert deferred to run time (``found``: (expression, source) in order), becomes an
    ``aten._assert_scalar`` of that read, naming the check's source: it runs in the step,
    where eager runs it, and raises there when it fails. Any other use of a value read
    (a size, a number in arithmetic, an assert on more than the read itself) is refused as
    before, naming the module being traced (``stack``). Does nothing when the forward read
    no value."""
    reads = [n for n in gm.graph.nodes if n.op == "call_function"
             and n.target is torch.ops.aten._local_scalar_dense.default
             and _compat.value_read(n.meta.get("val")) is not None]
    if not reads and not found:
        return
    used = set()
    for n in reads:
        read = _compat.value_read(n.meta["val"])
        claims = [k for k, (expr, _) in enumerate(found) if read[0] in expr.free_symbols]
        if (n.users or not isinstance(n.meta["val"], torch.SymBool) or len(claims) != 1
                or not _compat.asserts_true(found[claims[0]][0], read)):
            _refuse_value_read(n, stack)
        used.add(claims[0])
        with gm.graph.inserting_after(n):
            check = gm.graph.call_function(torch.ops.aten._assert_scalar.default, (
                n, f"a check of the model failed in the captured step: {found[claims[0]][1]}"))
        check.meta.update({k: v for k, v in n.meta.items() if k != "val"})
        check.meta["val"] = None
    if len(used) != len(found):
        raise AutoshardError(
            "autoshard could not capture the training step: a check on a value depends on "
            "more than one value read, or on none the graph holds: "
            + "; ".join(src for k, (_, src) in enumerate(found) if k not in used))
    gm.graph.lint()
    gm.recompile()


def _refuse_value_read(node: fx.Node, stack: list) -> None:
    """The capture error for a value read (``.item()``) the forward uses beyond checking
    it: the same as when the trace stops at the read."""
    exc = _ValueRead(f"{node.name} = {node.target}", torch.ops.aten._local_scalar_dense.default)
    raise explain(exc, stack)


class _ValueRead(Exception):
    """A value read used beyond a check (``func``: the op, for ``explain``)."""

    def __init__(self, msg, func):
        super().__init__(msg)
        self.func = func


# --- errors -----------------------------------------------------------------------------------

_TORCH_DIR = os.path.dirname(torch.__file__)


def _user_frame(exc: BaseException):
    keep = [f for f in traceback.extract_tb(exc.__traceback__) if _is_user_frame(f)]
    return keep[-1] if keep else None


def _is_user_frame(f) -> bool:
    """Whether the frame ``f`` is the model's code: outside torch, autoshard and Python's
    own context managers."""
    return (not f.filename.startswith(_TORCH_DIR)
            and not f.filename.startswith("<")
            and not own_file(f.filename)
            and "/contextlib.py" not in f.filename)


def explain(exc: BaseException, stack: list, inputs=(), param_dtypes=()) -> AutoshardError:
    """The capture error for ``exc``, naming the module being traced (``stack``), the op and
    the user's source line; ``inputs``, (name, leaf) of the call, and the parameters'
    dtypes name the input of a dtype the model does not compute in."""
    module = stack[-1][0] if stack else ""
    module_desc = f"module '{module}' ({stack[-1][1]})" if stack else "the model"
    op = getattr(exc, "func", None)
    if op is None and type(exc).__name__ == "GuardOnDataDependentSymNode":
        # Python branched on a value read: shapes are static, so a value read made the symbol
        op = torch.ops.aten._local_scalar_dense.default
    if op is None:  # e.g. "no fake impl registered for <CustomOpDef(ns::name)>"
        found = re.search(r"\b([A-Za-z_]\w*::[A-Za-z_]\w*(?:\.\w+)?)", str(exc))
        op = found.group(1) if found else None
    frame = _user_frame(exc)
    where = f"{frame.filename}:{frame.lineno}: {frame.line}" if frame else "(no user frame)"
    dd = {"DataDependentOutputException", "GuardOnDataDependentSymNode"}
    kind = type(exc).__name__
    reads_value = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default)
    if isinstance(exc, _DtypesDiffer):
        got = ", ".join(f"{n} {_dtype(d)}" for n, d in exc.operands)
        odd = {d for _, d in exc.operands} - set(param_dtypes)
        named = [f"{n} {_dtype(x.dtype)}{list(x.shape)}" for n, x in inputs
                 if isinstance(x, torch.Tensor) and x.dtype in odd]
        what = (f"needs its tensors in one dtype but got {got}"
                + (f" (the call's input {', '.join(named)})" if named else ""))
        want = sorted(_dtype(d) for d in {d for _, d in exc.operands} - odd)
        fix = ("Cast the input to the dtype the model computes in"
               + (f" ({', '.join(want)}, e.g. x.to(torch.{want[0]}))" if want else "")
               + " before the call: eager PyTorch refuses these dtypes at this op too.")
    elif kind in dd or op in reads_value:
        what = "reads a tensor's value in Python (data-dependent control flow)"
        fix = (
            "Compute both branches and select with torch.where, use torch.cond, or move the "
            "value-dependent logic outside the model's forward."
        )
    elif kind == "DynamicOutputShapeException":
        what = "calls an op whose output shape depends on tensor values"
        fix = "Use a fixed-shape formulation (masking instead of nonzero/boolean indexing)."
    elif kind in ("UnsupportedOperatorException", "UnsupportedFakeTensorException") or (
        "fake" in str(exc).lower() and ("impl" in str(exc).lower() or "kernel" in str(exc).lower())
    ):
        what = "calls an op that has no fake (meta) kernel, so it cannot be traced without data"
        fix = (
            "Register one with torch.library.register_fake (or @torch.library.custom_op with "
            "a register_fake implementation)."
        )
    else:
        what = f"failed while being traced ({kind}: {str(exc).splitlines()[0][:300]})"
        fix = "See the chained exception above for the failing call."
    op_desc = f" op {op}" if op is not None else ""
    return AutoshardError(
        f"autoshard could not capture the training step: {module_desc}{op_desc} {what}.\n"
        f"  at {where}\n  {fix}"
    )

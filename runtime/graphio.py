"""Graph files: torch.fx GraphModules as plain JSON plus a dict of constant tensors.

``dump_graph(gm)`` returns ``(doc, constants)``. ``doc`` is JSON data (``json.dumps`` needs no
options); ``constants`` maps each ``get_attr`` target to a contiguous CPU tensor, meant for
``torch.save`` and ``torch.load(weights_only=True)``. Nothing is pickled and loading executes
no code from the file: targets resolve only to registered torch ops and a fixed set of Python
functions. ``load_graph(doc, constants)`` rebuilds the GraphModule and recomputes every
node's ``meta["val"]`` over fake tensors.

Document::

    {"format": "autoshard-graph", "version": 1, "calling": "plain", "nodes": [NODE, ...]}

``calling`` is ``"plain"`` (one argument per placeholder) or ``"boxed"`` (one list of them,
which the graph clears as it goes so each input is freed after its last use); ``nodes`` are in
graph order.

NODE fields:

- ``name``: the node's name, kept exactly (passes find nodes by name).
- ``op``: ``placeholder``, ``call_function``, ``get_attr`` or ``output``.
- ``target``: for ``call_function``, one of
  ``"namespace::name.overload"``, a registered op overload (``"aten::mm.default"``,
  ``"_c10d_functional::all_gather_into_tensor.default"``, ``"autoshard::free.default"``),
  looked up on ``torch.ops``; ``"operator.NAME"``, a function of Python's ``operator``
  module (``"operator.getitem"``); ``"builtins.NAME"``, one of the pure builtins in
  ``BUILTINS``. For the other ops the target is a string: the placeholder's name, the
  constant's key in ``constants`` (identifiers joined by dots), ``"output"``. fx writes
  placeholder and ``get_attr`` targets and keyword names into the Python source it generates
  and runs, so they must be identifiers.
- ``args`` (a JSON array) and ``kwargs`` (a JSON object), values encoded as below.
- ``meta``: ``{"autoshard": TAGS}`` (``node.meta["autoshard"]``, tuples written as lists) and,
  when it is plain data, ``"nn_module_stack"`` (``{path: [path, class name]}``).
- ``val`` (placeholders only): ``node.meta["val"]``; for a tensor ``{"shape": [...],
  "stride": [...], "storage_offset": int, "dtype": "float32", "device": "cpu",
  "requires_grad": bool}`` plus ``"storage": NAME`` when it shares its storage with the
  earlier placeholder ``NAME``; for anything else ``{"value": VALUE}``. Absent if unknown;
  then no node's ``meta["val"]`` is recomputed.

Values: ``null``, booleans, integers, strings and finite floats are themselves (a float
always carries a decimal point or exponent, as Python writes it). Everything else is a JSON
object with one key naming its kind: ``{"node": NAME}`` (another node's value), ``{"tuple":
[...]}`` (a JSON array is a list), ``{"dict": {...}}`` (string keys), ``{"float": "inf"}``
(also ``"-inf"``, ``"nan"``), ``{"dtype": "bfloat16"}``, ``{"device": "cuda:0"}``,
``{"layout": "strided"}``, ``{"memory_format": "channels_last"}`` (names as attributes of
``torch``), ``{"slice": [start, stop, step]}``, ``{"ellipsis": true}``.

Ops of other libraries must be registered (their library imported) before loading; this
module imports ``autoshard.runtime.ops`` for autoshard's own.
"""

from __future__ import annotations

import builtins
import functools
import keyword
import math
import operator
import re
import types

import torch
import torch.fx as fx
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from autoshard import _compat
import autoshard.runtime.ops  # noqa: F401  (registers autoshard::free, autoshard::grouped_mm)

FORMAT = "autoshard-graph"
VERSION = 1

# builtins a graph may call: pure functions of their arguments
BUILTINS = frozenset({"abs", "all", "any", "divmod", "len", "max", "min", "pow", "round",
                      "sum"})
# how the compiled function takes its inputs: one argument each, or one list it clears as it
# goes (AOTAutograd's boxed convention, which frees each input after its last use)
_CALLING = {"CodeGen": "plain", "_BoxedCodeGen": "boxed"}
_OPS = ("placeholder", "call_function", "get_attr", "output")
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_PUBLIC = re.compile(r"[A-Za-z][A-Za-z0-9_]*\Z")
_OP_NAME = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)::([A-Za-z_][A-Za-z0-9_]*)\.([A-Za-z_]\w*)\Z")
_TORCH_ENUMS = {"dtype": torch.dtype, "layout": torch.layout,
                "memory_format": torch.memory_format}


# --- writing ----------------------------------------------------------------------------------


def _target_name(n: fx.Node) -> str:
    t = n.target
    if n.op != "call_function":
        return t
    if isinstance(t, _compat.OpOverload):
        return f"{t.namespace}::{t._opname}.{t._overloadname}"
    name = getattr(t, "__name__", None)
    if isinstance(t, types.BuiltinFunctionType) and _PUBLIC.match(name):
        if getattr(operator, name, None) is t:
            return f"operator.{name}"
        if name in BUILTINS and getattr(builtins, name) is t:
            return f"builtins.{name}"
    raise ValueError(f"node {n.name}: target {t!r} cannot be exported: a graph file holds "
                     "registered torch ops (OpOverload), operator functions and pure builtins")


def _encode(v, n: fx.Node):
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else {"float": str(v)}
    if isinstance(v, fx.Node):
        return {"node": v.name}
    if isinstance(v, tuple):
        return {"tuple": [_encode(x, n) for x in v]}
    if isinstance(v, list):
        return [_encode(x, n) for x in v]
    if isinstance(v, dict) and all(isinstance(k, str) for k in v):
        return {"dict": {k: _encode(x, n) for k, x in v.items()}}
    if isinstance(v, torch.device):
        return {"device": str(v)}
    for kind, cls in _TORCH_ENUMS.items():
        if isinstance(v, cls):
            return {kind: str(v).removeprefix("torch.")}
    if isinstance(v, slice):
        return {"slice": [_encode(x, n) for x in (v.start, v.stop, v.step)]}
    if v is Ellipsis:
        return {"ellipsis": True}
    raise ValueError(f"node {n.name}: an argument of type {type(v).__qualname__} cannot be "
                     "exported")


def _plain(v):
    """``v`` as JSON data (tuples as lists); TypeError if it is not plain data."""
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        if not math.isfinite(v):
            raise TypeError("non-finite float")
        return v
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, dict) and all(isinstance(k, str) for k in v):
        return {k: _plain(x) for k, x in v.items()}
    raise TypeError(type(v).__qualname__)


def _val(n: fx.Node, storages: dict) -> dict:
    """A placeholder's ``meta["val"]``; ``storages`` maps each storage seen to the first
    placeholder on it."""
    v = n.meta["val"]
    if not isinstance(v, torch.Tensor):
        return {"value": _encode(v, n)}
    out = {"shape": list(v.shape), "stride": list(v.stride()),
           "storage_offset": v.storage_offset(), "dtype": str(v.dtype).removeprefix("torch."),
           "device": str(v.device), "requires_grad": v.requires_grad}
    first = storages.setdefault(v.untyped_storage()._cdata, n.name)
    if first != n.name:
        out["storage"] = first
    return out


def dump_graph(gm: fx.GraphModule) -> tuple[dict, dict]:
    """``(doc, constants)``: ``doc`` is plain JSON data, no pickling; ``constants`` maps each
    ``get_attr`` target to a tensor (a detached, contiguous CPU copy) to store with
    ``torch.save`` and read back with ``torch.load(weights_only=True)``."""
    calling = _CALLING.get(type(gm.graph._codegen).__name__)
    if calling is None:
        raise ValueError(f"graph with codegen {type(gm.graph._codegen).__name__} cannot be "
                         f"exported: only the {' and '.join(_CALLING.values())} calling "
                         "conventions are")
    nodes, constants, storages = [], {}, {}
    for n in gm.graph.nodes:
        if n.op not in _OPS:
            raise ValueError(f"node {n.name}: op {n.op} (target {n.target}) cannot be "
                             f"exported: a graph file holds {', '.join(_OPS)} nodes")
        d = {"name": n.name, "op": n.op, "target": _target_name(n),
             "args": [_encode(a, n) for a in n.args],
             "kwargs": {k: _encode(a, n) for k, a in n.kwargs.items()}}
        meta = {}
        if "autoshard" in n.meta:
            try:
                meta["autoshard"] = _plain(n.meta["autoshard"])
            except TypeError as e:
                raise ValueError(f"node {n.name}: meta['autoshard'] holds {e}, which cannot be "
                                 "exported") from None
        try:
            if "nn_module_stack" in n.meta:
                meta["nn_module_stack"] = _plain(n.meta["nn_module_stack"])
        except TypeError:
            pass  # optional: module classes rather than names
        d["meta"] = meta
        if n.op == "placeholder" and "val" in n.meta:
            d["val"] = _val(n, storages)
        elif n.op == "get_attr":
            t = functools.reduce(getattr, n.target.split("."), gm)
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"node {n.name}: get_attr of {type(t).__qualname__} "
                                 f"{n.target} cannot be exported: only tensor constants can")
            constants[n.target] = t.detach().to("cpu", copy=True,
                                                memory_format=torch.contiguous_format)
        nodes.append(d)
    return {"format": FORMAT, "version": VERSION, "calling": calling, "nodes": nodes}, constants


# --- reading ----------------------------------------------------------------------------------


def _resolve(name: str):
    if name.startswith(("operator.", "builtins.")):
        mod, _, attr = name.partition(".")
        ok = _PUBLIC.match(attr) and (mod == "operator" or attr in BUILTINS)
        fn = getattr(operator if mod == "operator" else builtins, attr, None) if ok else None
        if not isinstance(fn, types.BuiltinFunctionType):
            raise ValueError(f"target {name} is not a function this autoshard can load "
                             "(operator functions and the builtins in graphio.BUILTINS)")
        return fn
    m = _OP_NAME.match(name)
    if m is None:
        raise ValueError(f"target {name!r} is not an op name (namespace::name.overload)")
    ns, op, overload = m.groups()
    try:
        fn = getattr(getattr(getattr(torch.ops, ns), op), overload)
    except (AttributeError, RuntimeError):
        fn = None
    if not isinstance(fn, _compat.OpOverload):
        raise ValueError(f"op {name} is not registered: import the library that defines the "
                         f"'{ns}' ops before loading")
    return fn


def _name(s) -> bool:
    """Whether ``s`` is a name fx may write into the Python source it generates and runs."""
    return isinstance(s, str) and bool(_IDENT.match(s)) and not keyword.iskeyword(s)


def _enum(kind: str, name: str):
    v = getattr(torch, name, None) if _IDENT.match(name) else None
    if not isinstance(v, _TORCH_ENUMS[kind]):
        raise ValueError(f"unknown {kind} {name!r}")
    return v


def _decode(v, env: dict, device):
    if isinstance(v, list):
        return [_decode(x, env, device) for x in v]
    if not isinstance(v, dict):
        return v
    if len(v) != 1:
        raise ValueError(f"malformed value {v!r}: a tagged value has one key")
    (kind, x), = v.items()
    if kind == "node":
        if x not in env:
            raise ValueError(f"reference to node {x!r}, which no earlier node defines")
        return env[x]
    if kind == "tuple":
        return tuple(_decode(a, env, device) for a in x)
    if kind == "dict":
        return {k: _decode(a, env, device) for k, a in x.items()}
    if kind == "float":
        if x not in ("inf", "-inf", "nan"):
            raise ValueError(f"malformed float {x!r}")
        return float(x)
    if kind == "device":
        return device if device is not None else torch.device(x)
    if kind in _TORCH_ENUMS:
        return _enum(kind, x)
    if kind == "slice":
        return slice(*(_decode(a, env, device) for a in x))
    if kind == "ellipsis":
        return Ellipsis
    raise ValueError(f"unknown value kind {kind!r}")


def _fake_placeholders(phs: list, mode, device) -> list:
    """A fake value per placeholder from its recorded ``val``; placeholders recorded as sharing
    a storage share one here too."""
    groups = {}  # name of the first placeholder on a storage -> bytes the storage must hold
    for name, v in phs:
        if "shape" in v:
            size = _enum("dtype", v["dtype"]).itemsize
            end = v["storage_offset"] + 1 + sum((s - 1) * st for s, st in
                                                zip(v["shape"], v["stride"]))
            root = v.get("storage", name)
            groups[root] = max(groups.get(root, 0), end * size if 0 not in v["shape"] else 0)
    out, storages = [], {}
    with mode:
        for name, v in phs:
            if "value" in v:
                out.append(_decode(v["value"], {}, device))
                continue
            dev = device if device is not None else torch.device(v["device"])
            root = v.get("storage", name)
            if root not in storages:
                storages[root] = torch.empty(groups[root], dtype=torch.uint8,
                                             device=dev).untyped_storage()
            t = torch.empty(0, dtype=_enum("dtype", v["dtype"]), device=dev)
            t.set_(storages[root], v["storage_offset"], v["shape"], v["stride"])
            out.append(t.requires_grad_(v["requires_grad"]))
    return out


class _Prop(FakeTensorProp):
    def get_attr(self, target, args, kwargs):
        return self._mode.from_tensor(super().get_attr(target, args, kwargs), static_shapes=True)


def load_graph(doc: dict, constants: dict, *, device: torch.device | None = None,
               group_name: str | None = None) -> fx.GraphModule:
    """The GraphModule ``doc`` describes, with ``constants`` for its ``get_attr`` targets.

    ``device``: every device argument, placeholder device and constant goes there (a graph
    traced on CPU runs on CUDA and the reverse). ``group_name``: the process group every
    ``_c10d_functional`` op uses. ``meta["val"]`` of every node is recomputed over fake
    tensors, so analyses of shapes, dtypes and aliasing work as on the original graph.
    """
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ValueError(f"not an {FORMAT} document")
    if doc.get("version") != VERSION:
        raise ValueError(f"{FORMAT} version {doc.get('version')!r} cannot be read: this "
                         f"autoshard reads version {VERSION}")
    graph, env, phs, root = fx.Graph(), {}, [], {}
    for d in doc["nodes"]:
        name, op = d["name"], d["op"]
        if op not in _OPS:
            raise ValueError(f"node {name}: unknown op {op!r}")
        target = _resolve(d["target"]) if op == "call_function" else d["target"]
        # fx writes these into the Python source it generates and runs: identifiers only
        if op in ("placeholder", "get_attr") and not (
                isinstance(target, str) and all(_name(p) for p in target.split("."))
                and (op == "get_attr" or "." not in target)):
            raise ValueError(f"node {name}: {op} target {target!r:.80} is not a Python "
                             "identifier")
        if not all(_name(k) for k in d["kwargs"]):
            raise ValueError(f"node {name}: a keyword argument's name "
                             f"({sorted(d['kwargs'])!r:.80}) is not an identifier")
        args = _decode(d["args"], env, device)
        kwargs = {k: _decode(a, env, device) for k, a in d["kwargs"].items()}
        if (group_name is not None and isinstance(target, _compat.OpOverload)
                and target.namespace == "_c10d_functional"):
            names = [a.name for a in target._schema.arguments]
            if "group_name" in names and names.index("group_name") < len(args):
                args[names.index("group_name")] = group_name
            elif "group_name" in kwargs:
                kwargs["group_name"] = group_name
        if op == "get_attr":
            if target not in constants:
                raise ValueError(f"node {name}: constant {target} is missing")
            c = constants[target]
            root[target] = c.to(device) if device is not None else c
        n = graph.create_node(op, target, tuple(args), kwargs, name=name)
        if n.name != name:
            raise ValueError(f"node name {name!r} cannot be kept (fx named it {n.name!r})")
        meta = d.get("meta", {})
        if "autoshard" in meta:
            n.meta["autoshard"] = meta["autoshard"]
        if "nn_module_stack" in meta:
            n.meta["nn_module_stack"] = {k: tuple(p) if isinstance(p, list) else p
                                         for k, p in meta["nn_module_stack"].items()}
        if op == "placeholder":
            phs.append((name, d.get("val")))
        env[name] = n
    gm = fx.GraphModule(root, graph)
    if doc.get("calling", "plain") == "boxed":
        _compat.boxed(gm)
    if any(v is None for _, v in phs):
        return gm  # inputs of unknown type: no values to propagate
    mode = _compat.FakeTensorMode()
    fakes = _fake_placeholders(phs, mode, device)
    _Prop(gm, mode).propagate_dont_convert_inputs(*fakes)
    for n in graph.nodes:  # as make_fx records them: ops returning nothing hold None
        if n.op == "call_function":
            n.meta.setdefault("val", None)
    for (name, _), v in zip(phs, fakes):
        env[name].meta["val"] = v  # requires_grad as recorded (propagation detaches)
    graph.output_node().meta.pop("val", None)  # and the output node holds none
    return gm

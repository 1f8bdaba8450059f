"""Graph files: torch.fx GraphModules as plain JSON plus a dict of constant tensors.

``dump_graph(gm)`` returns ``(doc, constants)``. ``doc`` is JSON data (``json.dumps`` needs no
options); ``constants`` maps each ``get_attr`` target to a contiguous CPU tensor, meant for
``torch.save`` and ``torch.load(weights_only=True)``. ``load_graph(doc, constants)`` rebuilds
the GraphModule and recomputes every node's ``meta["val"]`` over fake tensors.

A graph file can only compute, and loading runs no code from it. Nothing is pickled. The
names fx writes into the Python source it generates and runs (placeholder and ``get_attr``
targets, keyword names) must be identifiers. ``call_function`` targets come from an allowlist:

- ops of the namespaces in ``NAMESPACES`` (``aten``, ``prims``, ``autoshard``,
  ``_c10d_functional``) but those a rule on the op's name and schema refuses: ops named for
  files (``aten::from_file``) or the random generators' state (``manual_seed``, ``seed``);
  ops with an argument or result that is an object of the process rather than data (a
  ``Storage``: ``set_.source_Storage`` aliases any memory; a ``Generator``, a ``Stream``, a
  ``Future``, an ``RRef``, a script class); ops that take a string and no tensor
  (``aten::save``); ops that write an argument that is not a tensor; ops that return nothing
  and write no tensor, whose only effect is outside the graph (``set_grad_enabled``), but
  checks and prints (``_assert*``, ``sym_constrain_range*``, ``_print``);
- every op of a namespace passed to ``allow_namespace(name)``: a custom op library the caller
  trusts (a custom op runs any code its library defines, so other namespaces are refused);
- the functions of Python's ``operator`` module but ``operator.call``, and the builtins in
  ``BUILTINS``.

Every placeholder carries its ``val``, from which every node's value is computed over fake
tensors before ``load_graph`` returns: each op has run on fake values before any real tensor
is touched. Loading is bounded: a graph of more than ``MAX_NODES`` nodes (100,000; the test
models' graphs hold up to about 700, some 300 per transformer layer), or a value (an
argument, a tag) nested more than ``MAX_DEPTH`` levels (64), is refused, and nothing recurses
deeper. To load a larger graph you trust, raise the module attribute before loading. What
the graph would compute is bounded too, from the fake values, node by node as they are
computed and before anything real runs (``autoshard.runtime.graphcost``; each bound read
from its environment variable at each load, to raise for a graph you trust): no node's output
may hold more than ``NODE_BYTES`` (64 GiB, a view counted at its full size), and the graph's
work (the elements its nodes read and write, plus the floating-point operations torch's flop
counter counts for matrix products, convolutions and attention) may not exceed ``WORK``
(2^53). Each refusal is
an ``AutoshardError`` naming the file (``load_graph``'s ``source``), the node, the op, and
what to do.

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
  earlier placeholder ``NAME``; for anything else ``{"value": VALUE}``. Required:
  ``dump_graph`` refuses a placeholder without ``meta["val"]``, ``load_graph`` one without
  ``val``.

Values: ``null``, booleans, integers, strings and finite floats are themselves (a float
always carries a decimal point or exponent, as Python writes it). Everything else is a JSON
object with one key naming its kind: ``{"node": NAME}`` (another node's value), ``{"tuple":
[...]}`` (a JSON array is a list), ``{"dict": {...}}`` (string keys), ``{"float": "inf"}``
(also ``"-inf"``, ``"nan"``), ``{"dtype": "bfloat16"}``, ``{"device": "cuda:0"}``,
``{"layout": "strided"}``, ``{"memory_format": "channels_last"}`` (names as attributes of
``torch``), ``{"slice": [start, stop, step]}``, ``{"ellipsis": true}``.

Ops of other libraries must be registered (their library imported) and their namespace
allowed (``allow_namespace``) before loading; this module imports ``autoshard.core.ops``
for autoshard's own.
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

from autoshard.core import _compat
from autoshard.core.errors import AutoshardError
from autoshard.runtime import graphcost
import autoshard.core.ops  # noqa: F401  (registers autoshard::free, autoshard::grouped_mm)

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
        if n.op == "placeholder":
            if "val" not in n.meta:
                raise ValueError(f"node {n.name}: a placeholder without meta['val'] cannot be "
                                 "exported: loading recomputes every node's value from the "
                                 "placeholders' before anything runs")
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


# --- what a graph file may hold --------------------------------------------------------------

# the op namespaces a graph file calls: torch's tensor ops and primitives, autoshard's own
# (autoshard.core.ops) and the functional collectives; each op still passes _refusal
NAMESPACES = ("aten", "prims", "autoshard", "_c10d_functional")
# namespaces allow_namespace() added: libraries the caller trusts, every op of them admitted
ALLOWED_NAMESPACES: set = set()
# what loading one graph may cost: its nodes, and how deeply one value (an argument, a tag)
# nests; raise them to load a larger graph you trust
MAX_NODES = 100_000
MAX_DEPTH = 64


# op names that say files or the random generators' state
_FILES, _RNG = re.compile(r"file"), re.compile(r"seed|rng_state")
# ops that only check (raise) or print: they return nothing and write nothing
_CHECKS = re.compile(r"_assert|sym_constrain_range|_print\Z|_validate_|_linalg_check_errors\Z")
# argument types that are objects of the process (memory, streams, generators), not data
_OBJECTS = re.compile(r"\b(Storage|Stream|Future|RRef|Generator|__torch__[\w.]*)")
_FIX = ("autoshard never writes such a node, so the file was changed or not written by it: "
        "export again from the model")


def allow_namespace(name: str) -> None:
    """Admit every op of the namespace ``name`` (a custom op library, imported before loading)
    into graph files. Custom ops run any code their library defines: allow only libraries you
    trust with the files you load."""
    if not isinstance(name, str) or not _IDENT.match(name):
        raise AutoshardError(f"{name!r} is not an op namespace (a Python identifier)")
    ALLOWED_NAMESPACES.add(name)


@functools.lru_cache(maxsize=None)
def _refusal(op) -> str | None:
    """Why the op overload ``op`` of a namespace in NAMESPACES may not run from a graph file, by
    its name and schema; None: it computes on tensors and values."""
    name, schema = op._opname, op._schema
    if _FILES.search(name):
        return "it reads or writes files"
    if _RNG.search(name):
        return "it reads or sets the random generators' state"
    if _CHECKS.match(name):
        return None
    args = list(schema.arguments)
    for what, a in [*((f"argument {a.name}", a) for a in args),
                    *(("result", r) for r in schema.returns)]:
        kind = str(a.type)
        m = _OBJECTS.search(kind)
        if m and kind != "Optional[Generator]":  # a file passes none: the default generator
            return f"its {what} is a {m.group(1)}, an object of the process rather than data"
    if (not any("Tensor" in str(a.type) for a in args)
            and any("str" in str(a.type) for a in args)):
        return "it takes a string and no tensor: a file name or a setting, not a computation"
    written = [a for a in args if a.alias_info is not None and a.alias_info.is_write]
    for a in written:
        if "Tensor" not in str(a.type):
            return f"it writes its argument {a.name}, which is not a tensor"
    if not schema.returns and not written:
        return "it returns nothing and writes no tensor: its only effect is outside the graph"
    return None


# --- reading ----------------------------------------------------------------------------------


class _Bad(ValueError):
    """A node the file describes wrongly; load_graph names the file and the node."""


def _resolve(name: str):
    if not isinstance(name, str):
        raise _Bad(f"target {name!r} is not a string")
    if name.startswith(("operator.", "builtins.")):
        mod, _, attr = name.partition(".")
        ok = _PUBLIC.match(attr) and ((mod == "operator" and attr != "call")
                                      or attr in BUILTINS)
        fn = getattr(operator if mod == "operator" else builtins, attr, None) if ok else None
        if not isinstance(fn, types.BuiltinFunctionType):
            raise _Bad(f"target {name} is not a function this autoshard can load (operator "
                       "functions but operator.call, and the builtins in graphio.BUILTINS)")
        return fn
    m = _OP_NAME.match(name)
    if m is None:
        raise _Bad(f"target {name!r} is not an op name (namespace::name.overload)")
    ns, op, overload = m.groups()
    if ns not in NAMESPACES and ns not in ALLOWED_NAMESPACES:
        raise _Bad(f"op {name} is refused: a graph file calls the ops of "
                   f"{', '.join(NAMESPACES)} only, since another library's custom ops "
                   f"run any code it defines. If you trust the library that defines the '{ns}' "
                   "ops, import it and call "
                   f"autoshard.runtime.graphio.allow_namespace({ns!r}) before loading")
    try:
        fn = getattr(getattr(getattr(torch.ops, ns), op), overload)
    except (AttributeError, RuntimeError):
        fn = None
    if not isinstance(fn, _compat.OpOverload):
        raise _Bad(f"op {name} is not registered: import the library that defines the "
                   f"'{ns}' ops before loading")
    why = _refusal(fn) if ns in NAMESPACES else None
    if why is not None:
        raise _Bad(f"op {name} is refused: {why}. A graph file may only compute; {_FIX}")
    return fn


def _name(s) -> bool:
    """Whether ``s`` is a name fx may write into the Python source it generates and runs."""
    return isinstance(s, str) and bool(_IDENT.match(s)) and not keyword.iskeyword(s)


def _enum(kind: str, name):
    v = getattr(torch, name, None) if isinstance(name, str) and _IDENT.match(name) else None
    if not isinstance(v, _TORCH_ENUMS[kind]):
        raise _Bad(f"unknown {kind} {name!r}")
    return v


def _too_deep() -> _Bad:
    return _Bad(f"a value nests deeper than graphio.MAX_DEPTH ({MAX_DEPTH}) levels, a limit on "
                "what loading a file may cost; if the file is one you trust, raise "
                "autoshard.runtime.graphio.MAX_DEPTH before loading")


def _decode(v, env: dict, device, depth: int = 0):
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if depth >= MAX_DEPTH:  # before going one level deeper
        raise _too_deep()
    if isinstance(v, list):
        return [_decode(x, env, device, depth + 1) for x in v]
    if not isinstance(v, dict) or len(v) != 1:
        raise _Bad(f"malformed value {v!r:.80}: a tagged value is an object of one key")
    (kind, x), = v.items()
    if kind == "node":
        if not isinstance(x, str) or x not in env:
            raise _Bad(f"reference to node {x!r}, which no earlier node defines")
        return env[x]
    if kind == "tuple" and isinstance(x, list):
        return tuple(_decode(a, env, device, depth + 1) for a in x)
    if kind == "dict" and isinstance(x, dict):
        return {k: _decode(a, env, device, depth + 1) for k, a in x.items()}
    if kind == "float" and x in ("inf", "-inf", "nan"):
        return float(x)
    if kind == "device" and isinstance(x, str):
        if device is not None:
            return device
        try:
            return torch.device(x)
        except RuntimeError:
            raise _Bad(f"unknown device {x!r}") from None
    if kind in _TORCH_ENUMS:
        return _enum(kind, x)
    if kind == "slice" and isinstance(x, list) and len(x) == 3:
        return slice(*(_decode(a, env, device, depth + 1) for a in x))
    if kind == "ellipsis" and x is True:
        return Ellipsis
    raise _Bad(f"malformed value {v!r:.80}: unknown kind {kind!r} or a malformed {kind}")


def _shallow(v, limit: int) -> bool:
    """Whether JSON data ``v`` nests at most ``limit`` levels (walked a level at a time)."""
    level = [v] if isinstance(v, (list, dict)) else []
    for _ in range(limit):
        if not level:
            return True
        level = [y for x in level for y in (x.values() if isinstance(x, dict) else x)
                 if isinstance(y, (list, dict))]
    return not level


def _check_val(v, earlier: list) -> None:
    """A placeholder's recorded ``val`` is one ``_fake_placeholders`` can build (``earlier``:
    the placeholders before, as (name, val))."""
    if not isinstance(v, dict):
        raise _Bad("its 'val' is not an object")
    if "value" in v:
        return
    shape, stride, offset = v.get("shape"), v.get("stride"), v.get("storage_offset")
    if not (isinstance(shape, list) and isinstance(stride, list) and len(shape) == len(stride)
            and all(type(n) is int and n >= 0 for n in [*shape, *stride, offset])):
        raise _Bad("its 'val' has no shape, stride and storage_offset of non-negative integers")
    _enum("dtype", v.get("dtype"))
    if not (isinstance(v.get("device"), str) and isinstance(v.get("requires_grad"), bool)):
        raise _Bad("its 'val' has no device (a string) or requires_grad (a boolean)")
    if "storage" in v and v["storage"] not in {p for p, w in earlier if "shape" in w}:
        raise _Bad(f"its 'val' shares the storage of {v['storage']!r}, no earlier placeholder "
                   "holding a tensor")


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
    """Fake values node by node, each node's cost counted (``graphcost.Budget``) before the
    next node runs."""

    def __init__(self, gm, mode):
        super().__init__(gm, mode)
        self.budget = graphcost.Budget()

    def run_node(self, n):
        result = super().run_node(n)
        if n.op == "call_function":
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            self.budget.count(n, _target_name(n), args, kwargs, result)
        if "val" in n.meta:
            n.meta["val"] = _compat.python_vals(result, n.meta["val"])
        return result

    def get_attr(self, target, args, kwargs):
        return self._mode.from_tensor(super().get_attr(target, args, kwargs), static_shapes=True)


def _check_doc(doc, where: str) -> list:
    """The nodes of ``doc``, after checking its format, version and size."""
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise AutoshardError(f"{where}not an {FORMAT} document")
    if doc.get("version") != VERSION:
        raise AutoshardError(f"{where}{FORMAT} version {doc.get('version')!r} cannot be read: "
                             f"this autoshard reads version {VERSION}")
    nodes = doc.get("nodes")
    if not isinstance(nodes, list) or doc.get("calling", "plain") not in _CALLING.values():
        raise AutoshardError(f"{where}malformed {FORMAT} document: no list of nodes, or an "
                             "unknown calling convention")
    if len(nodes) > MAX_NODES:
        raise AutoshardError(
            f"{where}the graph holds {len(nodes)} nodes, more than graphio.MAX_NODES "
            f"({MAX_NODES}), a limit on what loading a file may cost. If the file is one you "
            "trust (the export of a larger model), raise autoshard.runtime.graphio.MAX_NODES "
            "before loading.")
    return nodes


def _node(graph: fx.Graph, d, env: dict, root: dict, constants: dict, device, group_name):
    """The node ``d`` describes, added to ``graph``."""
    if not (isinstance(d, dict) and isinstance(d.get("args"), list)
            and isinstance(d.get("kwargs"), dict) and d.get("op") in _OPS):
        raise _Bad(f"malformed node: no op of {', '.join(_OPS)}, or no args list and kwargs "
                   "object")
    name, op, target = d["name"], d["op"], d.get("target")
    if op == "call_function":
        target = _resolve(target)
    elif op == "output":
        target = "output"
    elif not (isinstance(target, str) and all(_name(p) for p in target.split("."))
              and (op == "get_attr" or "." not in target)):
        # fx writes it into the Python source it runs: an identifier, nothing else
        raise _Bad(f"{op} target {target!r:.80} is not a Python identifier")
    args = _decode(d["args"], env, device)
    kwargs = {k: _decode(a, env, device, 1) for k, a in d["kwargs"].items()}
    if not all(_name(k) for k in kwargs):  # written into the source too
        raise _Bad(f"a keyword argument's name ({sorted(kwargs)!r:.80}) is not an identifier")
    if (group_name is not None and isinstance(target, _compat.OpOverload)
            and target.namespace == "_c10d_functional"):
        names = [a.name for a in target._schema.arguments]
        if "group_name" in names and names.index("group_name") < len(args):
            args[names.index("group_name")] = group_name
        elif "group_name" in kwargs:
            kwargs["group_name"] = group_name
    if op == "get_attr":
        if not isinstance(constants.get(target), torch.Tensor):
            raise _Bad(f"constant {target} is missing")
        c = constants[target]
        root[target] = c.to(device) if device is not None else c
    n = graph.create_node(op, target, tuple(args), kwargs, name=name)
    if n.name != name:
        raise _Bad(f"the name cannot be kept (fx named it {n.name!r})")
    meta = d.get("meta", {})
    if not (isinstance(meta, dict) and _shallow(meta, MAX_DEPTH)):
        raise _too_deep() if isinstance(meta, dict) else _Bad("its meta is not an object")
    if "autoshard" in meta:
        n.meta["autoshard"] = meta["autoshard"]
    if isinstance(meta.get("nn_module_stack"), dict):
        n.meta["nn_module_stack"] = {k: tuple(p) if isinstance(p, list) else p
                                     for k, p in meta["nn_module_stack"].items()}
    return n


def load_graph(doc: dict, constants: dict, *, device: torch.device | None = None,
               group_name: str | None = None, source: str | None = None) -> fx.GraphModule:
    """The GraphModule ``doc`` describes, with ``constants`` for its ``get_attr`` targets.

    ``device``: every device argument, placeholder device and constant goes there (a graph
    traced on CPU runs on CUDA and the reverse). ``group_name``: the process group every
    ``_c10d_functional`` op uses. ``source``: the file ``doc`` was read from, named in errors.
    ``meta["val"]`` of every node is recomputed over fake tensors, so analyses of shapes, dtypes
    and aliasing work as on the original graph, and every op has run on fake values before any
    real tensor is touched. A document this autoshard did not write (an op outside the
    allowlist, a placeholder without ``val``, more than MAX_NODES nodes, a value nested deeper
    than MAX_DEPTH), or one whose nodes would compute more than ``graphcost.NODE_BYTES`` in
    one output or ``graphcost.WORK`` in all, is refused with an AutoshardError naming the file
    and the node.
    """
    where = f"{source}: " if source else ""
    graph, env, phs, root = fx.Graph(), {}, [], {}
    for d in _check_doc(doc, where):
        name = d.get("name") if isinstance(d, dict) else None
        if not isinstance(name, str):
            raise AutoshardError(f"{where}a node without a name (a string): {str(d):.80}")
        try:
            n = _node(graph, d, env, root, constants, device, group_name)
            if n.op == "placeholder":
                if "val" not in d:
                    raise _Bad("placeholder without a 'val': a graph file records each input's "
                               "fake value, from which every node's is computed before "
                               f"anything runs; {_FIX}")
                _check_val(d["val"], phs)
                phs.append((name, d["val"]))
        except _Bad as e:
            raise AutoshardError(f"{where}node {name}: {e}") from None
        env[name] = n
    gm = fx.GraphModule(root, graph)
    if doc.get("calling", "plain") == "boxed":
        _compat.boxed(gm)
    mode = _compat.FakeTensorMode()
    try:
        fakes = _fake_placeholders(phs, mode, device)
    except (_Bad, RuntimeError, OverflowError) as e:
        raise AutoshardError(f"{where}the placeholders' values cannot be built: {e}") from None
    try:
        _Prop(gm, mode).propagate_dont_convert_inputs(*fakes)
    except graphcost.OverBound as e:
        raise AutoshardError(f"{where}{e.message}") from None
    except (RuntimeError, TypeError, ValueError) as e:
        raise AutoshardError(f"{where}the graph does not compute on its placeholders' "
                             f"recorded values: {e}") from e
    for n in graph.nodes:  # as make_fx records them: ops returning nothing hold None
        if n.op == "call_function":
            n.meta.setdefault("val", None)
    for (name, _), v in zip(phs, fakes):
        env[name].meta["val"] = v  # requires_grad as recorded (propagation detaches)
    graph.output_node().meta.pop("val", None)  # and the output node holds none
    return gm

"""The export format's documents: how a program's capture (``captured_doc``), the module tree
(``module_tree_doc``) and the values and pytree structures in them are written as JSON, and how
each is rebuilt from it, with the format's version and file names.

Shared by writing an export (``export.py``) and loading one (``export_load.py``), so that
the two read and write one format.
"""

from __future__ import annotations

import collections
import dataclasses
import importlib
from typing import Any

import torch

from autoshard.core._compat import pytree
from autoshard.core.captured import Captured, TENSOR
from autoshard.core.config import Config
from autoshard.core.errors import AutoshardError
from autoshard.core.guards import user_class_name
from autoshard.runtime import dist as _dist
from autoshard.runtime.checkpoint import module_state
from autoshard.core.spec import ParamSpec, placements_for, shards_over_mesh


FORMAT = "autoshard-export"
# 2: the files under a data folder the manifest names; state by module path. 3: every
# strategy and 2-D meshes: each ParamSpec whole (ParamSpec.to_dict, its replica included), the
# mesh's shape, and the process group each mesh dimension's collectives name. 4: a ParamSpec
# says what tensor parallelism placed (``tp``, ``tp_size``)
VERSION = 4
READS = (1, 2, 3, 4)
MANIFEST = "manifest.json"
CHECKPOINT = "checkpoint"
# output classes an export may name: rebuilt by importing them (a library, not the model's
# code); any other class registered with pytree comes back as a namedtuple of its fields
OUTPUT_LIBRARIES = ("transformers",)


# --- values and structures as JSON ----------------------------------------------------------


def _const(v):
    """A non-tensor leaf of the call (or TENSOR) as JSON."""
    if v is TENSOR:
        return {"tensor": True}
    if isinstance(v, torch.dtype):
        return {"dtype": str(v).replace("torch.", "")}
    if isinstance(v, torch.device):
        return {"device": str(v)}
    if v is None or isinstance(v, (bool, int, float, str)):
        return {"value": v}
    raise AutoshardError(f"cannot export a call with a {type(v).__name__} argument or output "
                         f"({v!r:.60}); only tensors and None, bool, int, float, str, dtype "
                         "and device values are stored")


def _unconst(d):
    if "tensor" in d:
        return TENSOR
    if "dtype" in d:
        return getattr(torch, d["dtype"])
    if "device" in d:
        return torch.device(d["device"])
    return d["value"]


def _tree_doc(spec) -> Any:
    """A pytree spec as JSON: null for a leaf, else its type, context and children."""
    if spec.is_leaf():
        return None
    kids = [_tree_doc(c) for c in spec.children()]
    t, ctx = spec.type, spec.context
    if t in (tuple, list):
        return {"type": t.__name__, "children": kids}
    if t in (dict, collections.OrderedDict):
        return {"type": t.__name__, "keys": list(ctx), "children": kids}
    if t is collections.namedtuple or pytree.is_namedtuple_class(t):
        cls = ctx if t is collections.namedtuple else t
        return {"type": "namedtuple", "name": cls.__name__, "fields": list(cls._fields),
                "children": kids}
    if isinstance(ctx, (list, tuple)) and all(isinstance(k, str) for k in ctx):
        return {"type": "class", "class": f"{t.__module__}:{t.__qualname__}",
                "keys": list(ctx), "children": kids}
    raise AutoshardError(f"cannot export an output of type {t.__qualname__}: return tensors "
                         "in tuples, lists, dicts, namedtuples or a Hugging Face ModelOutput")


def _tree_spec(doc):
    if doc is None:
        return pytree.treespec_leaf()
    kids = [_tree_spec(c) for c in doc["children"]]
    kind = doc["type"]
    if kind in ("tuple", "list"):
        return pytree.TreeSpec(tuple if kind == "tuple" else list, None, kids)
    if kind in ("dict", "OrderedDict"):
        t = dict if kind == "dict" else collections.OrderedDict
        return pytree.TreeSpec(t, list(doc["keys"]), kids)
    if kind == "namedtuple":
        cls = collections.namedtuple(doc["name"], doc["fields"])
        return pytree.TreeSpec(collections.namedtuple, cls, kids)
    cls = _output_class(doc["class"])
    if cls is None:  # a class of the model's own code: its fields, as a namedtuple
        cls = collections.namedtuple(doc["class"].rpartition(":")[2].split(".")[-1],
                                     doc["keys"])
        return pytree.TreeSpec(collections.namedtuple, cls, kids)
    return pytree.TreeSpec(cls, list(doc["keys"]), kids)


def _output_class(name: str):
    module, _, qual = name.partition(":")
    if module.split(".")[0] not in OUTPUT_LIBRARIES:
        return None
    obj = importlib.import_module(module)
    for part in qual.split("."):
        obj = getattr(obj, part)
    return obj


def spec_from_doc(d: dict, version: int) -> ParamSpec:
    """A stored parameter description: ``ParamSpec.to_dict``'s from version 3 (before 4
    without ``tp`` and ``tp_size``: no tensor parallelism); before, the fields as they were
    written (placements ``"S0"`` / ``"R"``, no ``replica``: those exports hold only
    strategies without replicas; version 1 also no ``grad_divide``, ``force_sum``)."""
    if version < 4:
        d = dict(d, tp=d.get("tp"), tp_size=d.get("tp_size", 1))
    if version < 3:
        d = dict(d, placements=["Shard(0)" if p == "S0" else "Replicate()"
                                for p in d["placements"]])
        d.setdefault("replica", False)
        d.setdefault("grad_divide", None)
        d.setdefault("force_sum", False)
    try:
        return ParamSpec.from_dict(d)
    except ValueError as e:
        raise AutoshardError(f"an exported parameter description cannot be read ({e}): the "
                             "file was changed. Copy the export again, or export again.") from None


def respec(p: ParamSpec, mesh, config: Config, device: str) -> ParamSpec:
    """``p`` placed over another ``mesh`` as ``config``'s strategy places it (what
    ``param_specs`` gives the model's parameter), with its gradient's division and ``device``:
    the description the passes plan an exported joint graph with at another mesh shape."""
    strategy = "zero3" if config.strategy == "auto" else config.strategy
    placements = placements_for(p.shape, mesh.ndim, strategy, p.dtype)
    return dataclasses.replace(
        p, mesh_shape=tuple(mesh.shape), device=device, placements=placements,
        replica=strategy == "zero1" and shards_over_mesh(placements),
        grad_divide=config.gradient_divide_factor,
        force_sum=config.force_sum_reduction_for_comms)


def dtype_name(d: torch.dtype) -> str:
    return str(d).replace("torch.", "")


def captured_doc(cap: Captured) -> dict:
    return {
        "params": [p.to_dict() for p in cap.params],
        "buffers": list(cap.buffer_fqns),
        "inputs": str(cap.in_spec),
        "in_consts": [_const(c) for c in cap.in_consts],
        "out_spec": _tree_doc(cap.out_spec),
        "out_consts": [_const(c) for c in cap.out_consts],
        "diff_outputs": list(cap.diff_outputs),
        "input_grads": list(cap.input_grads),
        "mutated_buffers": list(cap.mutated_buffers),
        "has_backward": cap.has_backward,
        "grad_enabled": cap.grad_enabled,
        "grad_tangents": [[r, k, sorted(deps)] for (r, k), deps in cap.grad_tangents.items()],
    }


def captured_from_doc(doc: dict, params: list, gm) -> Captured:
    return Captured(
        gm=gm, params=params, buffer_fqns=list(doc["buffers"]), in_spec=None,
        in_consts=[_unconst(c) for c in doc["in_consts"]], out_spec=_tree_spec(doc["out_spec"]),
        out_consts=[_unconst(c) for c in doc["out_consts"]],
        diff_outputs=list(doc["diff_outputs"]), input_grads=list(doc["input_grads"]),
        mutated_buffers=list(doc["mutated_buffers"]), has_backward=doc["has_backward"],
        # an export written before the grad mode was recorded: a backward means grad on
        grad_enabled=doc.get("grad_enabled", doc["has_backward"]),
        grad_tangents={(r, k): frozenset(deps) for r, k, deps in doc["grad_tangents"]},
        pristine=gm)


# --- the module tree --------------------------------------------------------------------------


def module_tree_doc(model: torch.nn.Module, config: Config) -> dict:
    first: dict = {}
    modules = []
    for path, mod in model.named_modules(remove_duplicate=False):
        same = first.setdefault(id(mod), path)
        modules.append({"path": path, "class": user_class_name(mod), "same_as": same if same != path
                        else None, "container": type(mod).__name__
                        if type(mod) in _CONTAINERS.values() else None})
    params = []
    for fqn, p in model.named_parameters(remove_duplicate=False):
        same = first.setdefault(id(p), fqn)
        params.append({"fqn": fqn, "shape": list(p.shape), "dtype": dtype_name(p.dtype),
                       "requires_grad": p.requires_grad,
                       "same_as": same if same != fqn else None})
    buffers = []
    for fqn, b in model.named_buffers(remove_duplicate=False):
        mod_path, _, name = fqn.rpartition(".")
        same = first.setdefault(id(b), fqn)
        buffers.append({"fqn": fqn, "shape": list(b.shape), "dtype": dtype_name(b.dtype),
                        "persistent": name not in model.get_submodule(mod_path)
                        ._non_persistent_buffers_set,
                        "same_as": same if same != fqn else None})
    return {"class": user_class_name(model), "modules": modules, "params": params,
            "buffers": buffers, "config": config.to_dict()}


_CONTAINERS = {c.__name__: c for c in (torch.nn.ModuleList, torch.nn.Sequential,
                                       torch.nn.ModuleDict)}


def skeleton(doc: dict) -> torch.nn.Module:
    """Modules named and classed as the exported model's (containers as torch's own, so the
    planner finds the repeated blocks), parameters and buffers on the meta device."""
    classes: dict = {}

    def make(entry):
        if entry["container"]:
            return _CONTAINERS[entry["container"]]()
        name = entry["class"]
        if name not in classes:
            classes[name] = type(name.split(".")[-1], (torch.nn.Module,),
                                 {"__module__": "autoshard.exported", "__qualname__": name})
        return classes[name]()

    mods = {}
    for entry in doc["modules"]:
        mod = mods[entry["same_as"]] if entry["same_as"] is not None else make(entry)
        path = entry["path"]
        if path:
            parent, _, name = path.rpartition(".")
            mods[parent].add_module(name, mod)
        mods[path] = mod
    tensors: dict = {}
    for entry in doc["params"]:
        parent, _, name = entry["fqn"].rpartition(".")
        p = tensors.get(entry["same_as"]) if entry["same_as"] else None
        if p is None:
            p = torch.nn.Parameter(
                torch.empty(entry["shape"], dtype=getattr(torch, entry["dtype"]),
                            device="meta"), requires_grad=entry["requires_grad"])
        tensors[entry["fqn"]] = p
        mods[parent].register_parameter(name, p)
    for entry in doc["buffers"]:
        parent, _, name = entry["fqn"].rpartition(".")
        b = tensors.get(entry["same_as"]) if entry["same_as"] else None
        if b is None:
            b = torch.empty(entry["shape"], dtype=getattr(torch, entry["dtype"]), device="meta")
        tensors[entry["fqn"]] = b
        mods[parent].register_buffer(name, b, persistent=entry["persistent"])
    return mods[""]


def zero_tensors(module: torch.nn.Module) -> None:
    """Initialise a skeleton module's own tensors (the checkpoint overwrites them)."""
    with torch.no_grad():
        for t in [*module._parameters.values(), *module._buffers.values()]:
            if t is not None:
                t.zero_()


def module_tensors(model) -> dict:
    """What an export stores of the model's state: every parameter and buffer by module
    path, read from the modules (state-dict hooks that rename or fuse keys do not apply)."""
    return module_state(model, every_buffer=True)


def group_names(mesh) -> list:
    """The process group names the graphs' collectives name, one per mesh dimension."""
    names = _dist.group_name(mesh)
    return [names] if isinstance(names, str) else list(names)

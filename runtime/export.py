"""Export a sharded program, and load it without the model's source.

``sharded.export(path)`` (every rank) writes a directory::

    manifest.json      the format and its version, the torch and autoshard versions, the world
                       size, mesh shape and device it was compiled for, each program's input
                       signature, the data folder, the size and SHA-256 of every other file,
                       and one hash over them all. Written last, by an atomic rename, once
                       every rank wrote its files (``autoshard.runtime.commit``): a directory
                       without it is an export that did not finish, and an export over an
                       earlier one replaces it whole or not at all.
    data-<token>/      the files of this export:
      model.json       the module tree (class names, parameter and buffer names, shapes,
                       dtypes, tied names) and the Config it was planned with
      programs/K/      one per compiled input signature (K = 0, 1, ...):
        program.json   the signature, how the call's inputs and outputs map to the graphs'
                       flat ones, the process group of each mesh dimension the graphs'
                       collectives name, each parameter's description (ParamSpec.to_dict:
                       placements, dtypes, device, replica), the plan
        joint.json     the joint forward+backward graph as captured, before any pass: it
                       holds full parameter shapes and no collective, so it is the same for
                       every world size
        forward.json   the compiled forward and backward graphs for the export's world size
        backward.json  (none for an inference signature)
        constants.pt   tensors the graphs hold, a dict of plain tensors
      checkpoint/      the parameters and buffers by module path (read from the modules, not
                       through state-dict hooks): a torch.distributed.checkpoint (DCP)
                       directory in which each rank wrote its own shards

Graph files are ``autoshard.runtime.graphio`` JSON: ops are named, never pickled, so loading
imports nothing of the model's code. ``load(path)`` builds a module with the same names,
parameters as DTensor shards over the new mesh, and the stored programs: on a mesh of the
export's shape and device type the stored graphs run as they are, each collective moved onto
this process's group of its mesh dimension; otherwise the passes run again on the stored joint
graphs, each parameter placed over the new mesh by the Config's strategy, and DCP reshards the
checkpoint. Every strategy (``ddp``, ``zero1`` with its replicas, ``zero2``, ``zero3``,
``auto`` as it resolved) exports, on a 1-D or a 2-D ("replicate", "shard") mesh.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import importlib
import json
import math
import os
from typing import Any, Optional

import torch
import torch.distributed as dist
from autoshard._compat import pytree

from autoshard import meta, progress
from autoshard.capture import _class_name
from autoshard.captured import TENSOR, Captured
from autoshard.config import Config
from autoshard.errors import AutoshardError
from autoshard.spec import ParamSpec, hosted, placements_for, shards_over_mesh
from autoshard.runtime import commit, commit_files, commit_ranks, dcpio, graphio

FORMAT = "autoshard-export"
# 2: the files under a data folder the manifest names; state by module path. 3: every
# strategy and 2-D meshes: each ParamSpec whole (ParamSpec.to_dict, its replica included), the
# mesh's shape, and the process group each mesh dimension's collectives name
VERSION = 3
READS = (1, 2, 3)
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


def _spec(d: dict, version: int) -> ParamSpec:
    """A stored parameter description: ``ParamSpec.to_dict``'s from version 3; before, the
    fields as they were written (placements ``"S0"`` / ``"R"``, no ``replica``: those exports
    hold only strategies without replicas; version 1 also no ``grad_divide``, ``force_sum``)."""
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


def _respec(p: ParamSpec, mesh, config: Config, device: str) -> ParamSpec:
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


def _dtype(d: torch.dtype) -> str:
    return str(d).replace("torch.", "")


def _captured_doc(cap: Captured) -> dict:
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


def _captured(doc: dict, params: list, gm) -> Captured:
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


def _model_doc(model: torch.nn.Module, config: Config) -> dict:
    first: dict = {}
    modules = []
    for path, mod in model.named_modules(remove_duplicate=False):
        same = first.setdefault(id(mod), path)
        modules.append({"path": path, "class": _class_name(mod), "same_as": same if same != path
                        else None, "container": type(mod).__name__
                        if type(mod) in _CONTAINERS.values() else None})
    params = []
    for fqn, p in model.named_parameters(remove_duplicate=False):
        same = first.setdefault(id(p), fqn)
        params.append({"fqn": fqn, "shape": list(p.shape), "dtype": _dtype(p.dtype),
                       "requires_grad": p.requires_grad,
                       "same_as": same if same != fqn else None})
    buffers = []
    for fqn, b in model.named_buffers(remove_duplicate=False):
        mod_path, _, name = fqn.rpartition(".")
        same = first.setdefault(id(b), fqn)
        buffers.append({"fqn": fqn, "shape": list(b.shape), "dtype": _dtype(b.dtype),
                        "persistent": name not in model.get_submodule(mod_path)
                        ._non_persistent_buffers_set,
                        "same_as": same if same != fqn else None})
    return {"class": _class_name(model), "modules": modules, "params": params,
            "buffers": buffers, "config": config.to_dict()}


_CONTAINERS = {c.__name__: c for c in (torch.nn.ModuleList, torch.nn.Sequential,
                                       torch.nn.ModuleDict)}


def _skeleton(doc: dict) -> torch.nn.Module:
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


def _zero(module: torch.nn.Module) -> None:
    """Initialise a skeleton module's own tensors (the checkpoint overwrites them)."""
    with torch.no_grad():
        for t in [*module._parameters.values(), *module._buffers.values()]:
            if t is not None:
                t.zero_()


# --- export -----------------------------------------------------------------------------------


def _write_json(path: str, doc, *, compact: bool = False) -> None:
    """Indented for the files people read; graphs (tens of thousands of nodes for a large
    model) without whitespace."""
    with open(path, "w") as f:
        if compact:
            json.dump(doc, f, separators=(",", ":"))
        else:
            json.dump(doc, f, indent=1)


def _example(prog, device) -> tuple:
    """Zero tensors of a program's input signature, as (args, kwargs)."""
    cap = prog.captured
    it = iter(_input_vals(cap.pristine))
    leaves = []
    for c in cap.in_consts:
        if c is TENSOR:
            v = next(it)
            x = torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=device).zero_()
            leaves.append(x.requires_grad_(v.requires_grad))
        else:
            leaves.append(c)
    return pytree.tree_unflatten(leaves, cap.in_spec)


def _input_vals(gm) -> list:
    return [n.meta["val"] for n in gm.graph.nodes
            if n.op == "placeholder" and meta.role(n) == meta.ROLE_INPUT]


def _add_inference_programs(model) -> None:
    """For each training signature, compile the same call in eval mode without gradients
    (the graph an inference-only load runs), unless it is compiled already."""
    st = model._autoshard
    if st.is_loaded():
        return  # loaded from an export: it holds what it holds
    _, device, _ = st.placement()
    training = model.training
    try:
        for key, prog in st.compiled_programs().items():
            if not (key[2] and key[3]):
                continue
            args, kwargs = _example(prog, device)
            model.eval()
            with torch.no_grad():
                model.precompile(*args, **kwargs)
    finally:
        model.train(training)


def export(model, path, *, inference: bool = True) -> None:
    """Write ``model``'s compiled programs, plan and state to the directory ``path`` (every
    rank calls it; see the module docstring for what it holds). ``inference``: also compile
    and store each training signature's eval-mode, no-gradient program.

    Everything that can refuse (the path, a call or output that cannot be stored) is checked
    on every rank before anything is written, so a refusal is an error on every rank and
    never leaves one rank waiting for the others. The write commits whole
    (``autoshard.runtime.commit``): an earlier export at ``path`` is replaced only once
    every rank wrote its part, and stays whole otherwise."""

    st = model._autoshard
    mesh, device, config = st.placement()
    ranks = st.ranks()
    path = os.path.abspath(os.fspath(path))
    if not st.compiled_programs() and not st.is_loaded():
        raise AutoshardError(
            "nothing to export yet: call the model (or sharded.precompile(*inputs)) once with each "
            "input signature the exported program should accept, then export")
    found = commit.state(path, MANIFEST, ("checkpoint.json",))
    ranks("export", f"to {path}: {found}", explain=lambda seen: commit_ranks.differ("export", seen))
    if found not in ("free", "complete", "interrupted"):
        raise AutoshardError(f"cannot export to {path}: it is {found}, not an export; choose "
                             "a new path or remove it first")
    if inference:
        _add_inference_programs(model)
    groups = _groups(mesh)
    programs = [_program_files(key, prog, groups) for key, prog in _programs(model).items()]
    model_doc = _model_doc(model, config)
    rank0 = ranks.rank == 0

    def write_data(folder):
        with progress.phase("writing the export", total=1 + len(programs) * rank0,
                            unit="parts") as p:
            dcpio.save({"tensors": _tensors(model)}, os.path.join(folder, CHECKPOINT), ranks.group)
            p.step(note="the programs")
            if rank0:
                for k, files in enumerate(programs):
                    entries.append(_write_program(os.path.join(folder, "programs", str(k)),
                                                  files))
                    p.step()
                _write_json(os.path.join(folder, "model.json"), model_doc)

    def document(folder, files):
        data = os.path.basename(folder)
        manifest = {
            "format": FORMAT, "version": VERSION, "torch": torch.__version__,
            "autoshard": commit_files.version(), "world_size": mesh.size(),
            "mesh_shape": list(mesh.shape),
            "device": device.type, "model": _class_name(model),
            "programs": [dict(e, dir=f"{data}/{e['dir']}") for e in entries],
            "files": {f"{data}/{rel}": e for rel, e in files.items()}}
        manifest["hash"] = _content_hash(manifest["files"])
        return manifest

    entries: list = []
    commit.write(path, "export", MANIFEST, ranks, write_data, document,
                 other_markers=("checkpoint.json",))


def _tensors(model) -> dict:
    """What an export stores of the model's state: every parameter and buffer by module
    path, read from the modules (state-dict hooks that rename or fuse keys do not apply)."""
    from autoshard.runtime.checkpoint import module_state

    return module_state(model, every_buffer=True)


def _programs(model) -> dict:
    """Every program of the module by repr(signature): those compiled, and for a module
    loaded from an export, the stored ones not called yet."""
    out = model._autoshard.every_program(model)
    for prog in out.values():
        lifted = getattr(prog.captured, "lifted", None)
        if lifted:  # fed from the module's attribute on each call: an export has no module
            mod, name = lifted[0]
            raise AutoshardError(
                f"the program for {getattr(prog, 'described', ('a call',))[0]} reads "
                f"the float attribute '{name}' of {type(mod).__name__} as an input, because it "
                "changed between calls (autoshard.guards); an export holds no Python module "
                "to read it from. Make the value a buffer (register_buffer) to export it, or "
                "export a model on which it stays fixed.")
    return out


def _groups(mesh) -> list:
    """The process group names the graphs' collectives name, one per mesh dimension."""
    from autoshard.runtime import dist as _dist

    names = _dist.group_name(mesh)
    return [names] if isinstance(names, str) else list(names)


def _reshard_groups_of(fwd) -> dict:
    """hpZ (``Config.reshard_after_forward=k``): ``{group name: k}`` of the groups of k ranks
    the graphs' chunks and backward all-gathers name (this rank's own; each rank has its
    own group, so a load maps each name to the loading rank's group of the same k)."""
    from autoshard.runtime.ops import chunk_op

    return {n.args[2]: n.args[1] for n in fwd.graph.nodes
            if n.op == "call_function" and n.target is chunk_op}


def _program_files(key: str, prog, groups: list) -> dict:
    """A program's files as data: the graphs' documents and constants, program.json
    (``groups``: the group names of the mesh dimensions, which the graphs' collectives
    name)."""
    cap, split = prog.captured, prog.split
    graphs = {"joint": cap.pristine, "forward": split.fwd, "backward": split.bwd}
    docs, constants = {}, {}
    for name, gm in graphs.items():
        if gm is not None:
            docs[name], constants[name] = graphio.dump_graph(gm)
    call, training, grad = prog.described
    docs["program"] = {
        "key": key, "call": call, "training": training, "grad": grad, "groups": groups,
        "reshard_groups": _reshard_groups_of(split.fwd),
        "captured": _captured_doc(cap),
        "split": {"fwd_roles": split.fwd_roles, "bwd_roles": split.bwd_roles,
                  "saved": split.saved, "n_tangents": split.n_tangents},
        "plan": json.loads(prog.plan.to_json()),
    }
    return {"docs": docs, "constants": constants}


def _write_program(folder: str, files: dict) -> dict:
    os.makedirs(folder)
    for name, doc in files["docs"].items():
        _write_json(os.path.join(folder, f"{name}.json"), doc, compact=name != "program")
    torch.save(files["constants"], os.path.join(folder, "constants.pt"))
    p = files["docs"]["program"]
    return {"dir": os.path.relpath(folder, os.path.dirname(os.path.dirname(folder))),
            "key": p["key"], "call": p["call"], "training": p["training"], "grad": p["grad"]}


def _content_hash(files: dict) -> str:
    h = hashlib.sha256()
    for rel in sorted(files):
        h.update(f"{rel}\0{files[rel]['sha256']}\n".encode())
    return h.hexdigest()


# --- reading ----------------------------------------------------------------------------------


_FIELDS = {"format": str, "version": int, "torch": str, "autoshard": str, "world_size": int,
           "device": str, "model": str, "programs": list, "files": dict, "hash": str}
_PROGRAM_FIELDS = {"dir": str, "key": str, "call": str, "training": bool, "grad": bool}


def read_manifest(path, *, verify: bool = True) -> dict:
    """The export's manifest, after checking that it is one this autoshard reads, field by
    field, and (with ``verify``) that every file it lists is there, whole and unchanged."""
    path = os.fspath(path)
    where = os.path.join(path, MANIFEST)
    manifest = commit.read_marker(path, MANIFEST, "export", _FIELDS)
    commit_files.check_format(manifest, where, FORMAT, READS, "export")
    if manifest["version"] >= 2 and not isinstance(manifest.get("data"), str):
        raise AutoshardError(f"{where} has no field 'data' (the folder holding the export's "
                             "files): it was changed. Copy the export again, or export again.")
    manifest.setdefault("data", "")  # version 1: the files beside the manifest
    shape = manifest.setdefault("mesh_shape", [manifest["world_size"]])  # before 3: 1-D
    if not (isinstance(shape, list) and shape and all(type(n) is int and n > 0 for n in shape)
            and math.prod(shape) == manifest["world_size"]):
        raise AutoshardError(f"{where}: field 'mesh_shape' ({shape!r}) is not a mesh of "
                             f"{manifest['world_size']} ranks: the file was changed. Copy the "
                             "export again, or export again.")
    for k, entry in enumerate(manifest["programs"]):
        for name, kind in _PROGRAM_FIELDS.items():
            if not isinstance(entry, dict) or not isinstance(entry.get(name), kind):
                raise AutoshardError(
                    f"{where}: program {k} has no {kind.__name__} field {name!r}: the file was "
                    "changed. Copy the export again, or export again.")
    for rel, entry in manifest["files"].items():
        if not (isinstance(entry, dict) and isinstance(entry.get("bytes"), int)
                and isinstance(entry.get("sha256"), str)):
            raise AutoshardError(f"{where}: the entry of file {rel!r} is not a size and a "
                                 "SHA-256: the file was changed. Copy the export again.")
    for entry in manifest["programs"]:
        if not (commit_files.inside(path, entry["dir"])
                and f"{entry['dir']}/program.json" in manifest["files"]):
            raise AutoshardError(
                f"{where}: the program of {entry['call']} is in the folder {entry['dir']!r}, "
                "which is not one of the export's own (not a plain path inside it, or its files "
                "are not listed): the file was changed, and nothing was read. Copy the export "
                "again from a source you trust.")
    if verify:
        commit_files.verify(path, manifest["files"], manifest["world_size"], "export")
        _nothing_unlisted(path, manifest)
    return manifest


def _nothing_unlisted(path: str, manifest: dict) -> None:
    """Every file in the export's data folder is one the manifest lists (and so was checked):
    a reader never reads a file an editor added beside them."""
    if not manifest["data"]:
        return  # version 1: the files beside the manifest, nothing else read
    data = os.path.join(path, manifest["data"])
    for sub, _, names in os.walk(data):
        for name in names:
            rel = os.path.relpath(os.path.join(sub, name), path).replace(os.sep, "/")
            if rel not in manifest["files"]:
                raise AutoshardError(
                    f"{os.path.join(sub, name)} is not a file {os.path.join(path, MANIFEST)} "
                    "lists: it was added after the export. Copy the export again from a "
                    "source you trust, or remove the file.")


def _read_json(path: str):
    with open(path) as f:
        try:
            return json.load(f)
        except (ValueError, RecursionError) as e:  # RecursionError: nested too deeply
            what = ("nests values too deeply" if isinstance(e, RecursionError)
                    else f"is not JSON ({e})")
            raise AutoshardError(f"{path} {what}: the file was changed. Copy the export again, "
                                 "or export again.") from None


@dataclasses.dataclass
class Loaded:
    """What a loaded module runs: the export's programs by repr(signature), each read (and,
    at another world size, planned) on its first call."""

    path: str
    entries: dict  # repr(signature) -> the manifest's entry for its program
    same: bool  # the export's world size, device type and Config: run its graphs as stored
    inference: bool = False  # only the eval-mode programs, called without gradients
    version: int = VERSION  # the export's format version: how its files are written
    programs: dict = dataclasses.field(default_factory=dict)  # repr(signature) -> Program
    # commit.Held: the data folder, kept from any sweep while the module lives
    held: Any = None

    @property
    def calls(self) -> list:
        return [e["call"] for e in self.entries.values()]

    def program(self, key: str, model):
        if key not in self.programs and key in self.entries:
            folder = os.path.join(self.path, self.entries[key]["dir"])
            try:
                self.programs[key] = _load_program(folder, model, model._autoshard, self.same,
                                                   self.version)
            except Exception:  # a file gone, or cut short while a sweep removed it
                data = self.entries[key]["dir"].split("/")[0]
                if data.startswith(commit.DATA) and not os.path.isdir(
                        os.path.join(self.path, data)):  # not held: no lock at the path
                    raise AutoshardError(
                        f"the export at {self.path} was replaced after it was loaded (its data "
                        f"folder {data} is gone); load it again") from None
                raise
        return self.programs.get(key)


def load(path, mesh=None, config: Optional[Config] = None, *, inference: bool = False,
         verify: bool = True):
    """The exported model on ``mesh`` (every rank calls it): a ShardedModule with the same
    parameter, buffer and state-dict names, DTensor parameters, and the stored programs.
    ``config``: plan with this instead of the export's Config (the passes then run again).
    ``inference``: load only the eval-mode, no-gradient programs (forward graphs only); the
    module is put in eval mode and runs every call without gradients. ``verify``: check
    every file's SHA-256.

    The module reads each program's files on its first call, so it holds the export's data
    folder while it lives (``commit.reading``): another export to ``path`` meanwhile
    replaces it for later loads and leaves this one's files until a sweep after the module
    is gone."""
    with commit.reading(path, MANIFEST) as held:
        model = _load(path, mesh, config, inference=inference, verify=verify)
        model._autoshard.exported.held = held.kept()
    return model


def _load(path, mesh, config: Optional[Config], *, inference: bool, verify: bool):
    """``load``, the export's data folder held."""
    from autoshard import api
    from autoshard.runtime import dist as _dist

    path = os.fspath(path)
    manifest = read_manifest(path, verify=False)  # the files: below, shared by the ranks
    data = os.path.join(path, manifest["data"])
    if verify:  # what is read before the ranks can share the work
        model_json = f"{manifest['data']}/model.json".lstrip("/")
        commit_files.verify(path, {model_json: manifest["files"].get(model_json, {
            "bytes": -1, "sha256": ""})}, manifest["world_size"], "export")
    model_doc = _read_json(os.path.join(data, "model.json"))
    stored = Config.from_dict(model_doc["config"])
    cfg = config if config is not None else stored
    if cfg.to_dict()["mp_policy"] != stored.to_dict()["mp_policy"]:
        raise AutoshardError(
            f"the export's graphs compute in the dtypes of mp_policy={stored.mp_policy}, and "
            f"the Config passed to load() has mp_policy={cfg.mp_policy}: the dtypes are part "
            "of the captured graphs. Pass a Config with the export's mp_policy.")
    entries = {e["key"]: e for e in manifest["programs"]
               if not inference or not (e["training"] or e["grad"])}
    if inference and not entries:
        raise AutoshardError(
            f"{path} holds no inference program (eval mode, no gradients): export with "
            "sharded.export(path, inference=True), or load without inference=True")
    mesh = mesh if mesh is not None else _dist.default_mesh(cfg.timeout)
    _check_backend(mesh, path)
    model = api.autoshard(_skeleton(model_doc), mesh=mesh, config=cfg, param_init_fn=_zero)
    st = model._autoshard
    st.ranks()("load", f"export {manifest['hash'][:16]}", exact=manifest["hash"],
               explain=lambda seen: _differ(path, seen))
    if verify:  # each file hashed by one rank
        commit_files.verify(path, manifest["files"], manifest["world_size"], "export", st.ranks())
        _nothing_unlisted(path, manifest)
    _read_state(model, os.path.join(data, CHECKPOINT), manifest, path)

    same = (list(mesh.shape) == manifest["mesh_shape"]
            and st.placement()[1].type == manifest["device"]
            and cfg.to_dict() == stored.to_dict())
    st.mark_loaded(Loaded(path, entries, same, inference, manifest["version"]))
    if inference:
        model.eval()
    return model


def _differ(path, seen: list) -> str:
    """The error when the ranks loaded different exports from ``path``."""
    lines = "\n".join(f"  rank {r}: {d}" for r, d in enumerate(seen))
    return (f"the ranks read different exports at {path}, or were given different paths "
            f"(nothing was built):\n{lines}\nAn export to the path while they loaded it "
            "replaced it: load it again. Every rank must pass the same path, on a file system "
            "every rank sees.")


def _read_state(model, folder: str, manifest: dict, path: str) -> None:
    """The stored parameters and buffers into ``model``'s (the skeleton's, which has no
    state-dict hooks), every rank's part read before any is used."""
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict,
                                                         set_model_state_dict)

    ranks = model._autoshard.ranks()
    version = manifest["version"]
    if version == 1:
        loose = set(model.state_dict())
        state = {"model": get_model_state_dict(model),
                 "buffers": {f: b for f, b in model.named_buffers() if f not in loose}}
    else:
        state = {"tensors": _tensors(model)}
    with progress.phase("loading the export's checkpoint"):
        outcome = commit_ranks.attempt(lambda: dcpio.load(state, folder, ranks.group,
                                                    files=_listed(path, folder, manifest)),
                                 ranks.rank)
    commit_ranks.settle(ranks, outcome, f"load of the export {path}", "nothing was built")
    if version == 1:
        set_model_state_dict(model, state["model"])


def _listed(path: str, folder: str, manifest: dict) -> set:
    """The names of the files of ``folder`` (a DCP folder of the export) its manifest lists."""
    prefix = os.path.relpath(folder, path).replace(os.sep, "/") + "/"
    return {rel[len(prefix):] for rel in manifest["files"] if rel.startswith(prefix)}


# the backend each device type's collectives need: another one (torch's fake process group,
# a group without this device's backend) would run the graphs' collectives wrongly or not
_BACKENDS = {"cpu": ("gloo",), "cuda": ("nccl",)}


def _check_backend(mesh, path: str) -> None:
    device = mesh.device_type
    backend = str(dist.get_backend(mesh.get_group(0)))
    per_device = dict(b.split(":", 1) for b in backend.split(",") if ":" in b)
    got = per_device.get(device, backend)
    if got not in _BACKENDS.get(device, (got,)):
        raise AutoshardError(
            f"cannot load the export {path} on a {device} mesh whose process group runs "
            f"{backend!r}: its programs' collectives on {device} need "
            f"{' or '.join(_BACKENDS[device])}. Initialise the process group with that backend "
            f"(init_process_group('{_BACKENDS[device][0]}')), or launch with torchrun and let "
            "autoshard make it.")


def _load_program(folder: str, model, st, same: bool, version: int = VERSION):
    """The stored program in ``folder`` on ``st``'s mesh: at the export's mesh shape, device
    type and Config (``same``) its compiled graphs, each collective on the group of its mesh
    dimension here; otherwise its joint graph planned again for this mesh and Config."""
    from autoshard.passes.split import SplitProgram
    from autoshard.plans import Plan

    doc = _read_json(os.path.join(folder, "program.json"))
    constants = _read_constants(os.path.join(folder, "constants.pt"))
    mesh, device, config = st.placement()
    # before version 3 the export's mesh was 1-D: every collective on its one group
    regroup = dict(zip(doc.get("groups", [None]), _groups(mesh)))
    hpz = doc.get("reshard_groups", {})  # format 3 before hpZ has none
    if same and hpz:
        from autoshard.runtime import dist as _dist

        here = _dist.reshard_groups(mesh, sorted(set(hpz.values())))
        regroup.update({name: here[k] for name, k in hpz.items()})

    def graph(name, **kw):
        path = os.path.join(folder, f"{name}.json")
        return graphio.load_graph(_read_json(path), constants[name], source=path, **kw)

    cdoc = doc["captured"]
    joint = graph("joint", device=device)
    _check_params(joint, model, os.path.join(folder, "joint.json"))
    stored = [_spec(p, version) for p in cdoc["params"]]
    if same:
        cap = _captured(cdoc, stored, joint)
        s = doc["split"]
        split = SplitProgram(
            fwd=_regrouped(graph("forward"), regroup, folder),
            bwd=_regrouped(graph("backward"), regroup, folder)
            if "backward" in constants else None,
            fwd_roles=s["fwd_roles"], bwd_roles=s["bwd_roles"], saved=s["saved"],
            n_tangents=s["n_tangents"])
        prog = st.program_of(cap, split, Plan.from_json(json.dumps(doc["plan"])))
    else:
        from autoshard.config import offloads

        host = hosted([(p.fqn, p.shape) for p in stored], offloads(config))
        params = [_respec(p, mesh, config, "host" if p.fqn in host else "device")
                  for p in stored]
        prog = st.plan_program(_captured(cdoc, params, joint), model)
    prog.described = (doc["call"], doc["training"], doc["grad"])
    return prog


def _read_constants(path: str) -> dict:
    """A program's constant tensors, read as plain data (``weights_only``): no code runs."""
    import pickle

    try:
        return torch.load(path, weights_only=True)
    except (pickle.UnpicklingError, RuntimeError) as e:
        first = str(e).strip().splitlines()
        raise AutoshardError(
            f"{path} holds more than tensors and plain data, and was not read "
            f"({type(e).__name__}: {first[-1][:200] if first else ''}): it was changed to run "
            "code when loaded. Copy the export again from a source you trust.") from None


def _check_params(joint, model, path: str) -> None:
    """Each parameter placeholder of the stored joint graph has the shape and dtype of the
    model's parameter of its FQN: the fake values its nodes were computed from are those of
    the tensors the program runs on."""
    params = dict(model.named_parameters(remove_duplicate=False))
    for n in joint.graph.nodes:
        if not meta.is_param(n):
            continue
        fqn, v = meta.tag(n, meta.FQN), n.meta["val"]
        p = params.get(fqn) if isinstance(fqn, str) else None
        got = f"{_dtype(v.dtype)}{list(v.shape)}" if isinstance(v, torch.Tensor) else repr(v)
        have = "no such parameter" if p is None else f"{_dtype(p.dtype)}{list(p.shape)}"
        if got != have:
            raise AutoshardError(
                f"{path}: node {n.name} reads the parameter {fqn} as {got}, but the model has "
                f"{have}: the file was changed. Copy the export again, or export again.")


def _regrouped(gm, regroup: dict, folder: str):
    """``gm`` with each collective's process group replaced by this process's group of the
    same mesh dimension (``regroup``: stored name -> name here; the key None: every one)."""
    from autoshard._compat import OpOverload
    from autoshard.runtime.ops import chunk_op

    for n in gm.graph.nodes:
        t = n.target
        if not (n.op == "call_function" and isinstance(t, OpOverload)
                and (t.namespace == "_c10d_functional" or t is chunk_op)):
            continue
        names = [a.name for a in t._schema.arguments]
        key = "group" if t is chunk_op else "group_name"
        at = names.index(key) if key in names else None
        if at is None:
            continue
        old = n.args[at] if at < len(n.args) else n.kwargs.get(key)
        new = regroup.get(old, regroup.get(None))
        if new is None:
            raise AutoshardError(
                f"{folder}: node {n.name} runs on process group {old!r}, which the program "
                f"does not list ({sorted(k for k in regroup if k)}): the file was changed. "
                "Copy the export again, or export again.")
        if at < len(n.args):
            n.args = n.args[:at] + (new,) + n.args[at + 1:]
        else:
            n.kwargs = {**n.kwargs, key: new}
    gm.recompile()
    return gm


# --- inspection -------------------------------------------------------------------------------


def stored_plan(path, program: int = 0, manifest: Optional[dict] = None):
    """The plan of the export's ``program``-th program (``Plan``)."""
    from autoshard.plans import Plan

    manifest = manifest or read_manifest(path, verify=False)
    entries = manifest["programs"]
    if not 0 <= program < len(entries):
        raise AutoshardError(f"{path} holds programs 0 to {len(entries) - 1}, not {program}")
    doc = _read_json(os.path.join(os.fspath(path), entries[program]["dir"], "program.json"))
    return Plan.from_json(json.dumps(doc["plan"]))


def describe(path, *, verify: bool = True) -> str:
    """What ``python -m autoshard inspect`` prints: the manifest, then for each program its
    call, the plan's prediction (memory included), its units and its schedule."""
    from tabulate import tabulate

    from autoshard.plans import _fmt_bytes

    manifest = read_manifest(path, verify=verify)
    files = manifest["files"]
    shards = sum(1 for rel in files if rel.endswith(".distcp"))
    rows = [
        ("export", os.fspath(path)),
        ("format", f"{manifest['format']} version {manifest['version']}"),
        ("written by", f"autoshard {manifest['autoshard']}, torch {manifest['torch']}"),
        ("model", manifest["model"]),
        ("compiled for", f"{manifest['world_size']} ranks{_mesh_text(manifest)}, "
                         f"{manifest['device']}"),
        ("programs", len(manifest["programs"])),
        ("files", f"{len(files)}, {_fmt_bytes(sum(e['bytes'] for e in files.values()))} "
                  f"({shards} checkpoint shard files)"),
        ("content hash", manifest["hash"] + (" (verified)" if verify else "")),
    ]
    out = [tabulate(rows, tablefmt="plain")]
    for k, entry in enumerate(manifest["programs"]):
        mode = "training" if entry["grad"] else "inference (forward only)"
        out.append(f"\n=== program {k} ({entry['dir']}): {mode}\ncall: {entry['call']}\n")
        out.append(str(stored_plan(path, k, manifest)))
    return "\n".join(out)


def _mesh_text(manifest: dict) -> str:
    shape = manifest["mesh_shape"]
    return f" ({' x '.join(map(str, shape))} mesh)" if len(shape) > 1 else ""


def export_factory(rank: int, world: int, spec: str, opts: dict) -> None:
    """One rank of ``python -m autoshard export``: build the factory's model (the same seed
    on every rank), shard it, compile it for the factory's inputs, export."""
    from autoshard.factory import load_factory
    from autoshard.api import autoshard
    from autoshard.check import default_inputs

    factory = load_factory(spec)
    torch.manual_seed(0)
    model = factory()
    torch.manual_seed(1 + rank)
    inputs = default_inputs(model, factory, opts["batch"], opts["seq"])
    sharded = autoshard(model, config=opts["config"], example_inputs=inputs)
    sharded.export(opts["out"], inference=opts["inference"])

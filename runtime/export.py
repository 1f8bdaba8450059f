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

import hashlib
import json
import os
from typing import Optional

import torch
from autoshard.core import meta, progress
from autoshard.core._compat import pytree
from autoshard.core.captured import TENSOR
from autoshard.core.errors import AutoshardError
from autoshard.core.guards import user_class_name
from autoshard.runtime import commit, commit_files, commit_ranks, dcpio, graphio
from autoshard.runtime.export_format import (CHECKPOINT, FORMAT, MANIFEST, VERSION, captured_doc,
                                             group_names, module_tensors, module_tree_doc)
from autoshard.runtime.export_load import read_json, read_manifest
# autoshard.runtime.export's public names (docs/api.md), whichever module holds them
from autoshard.runtime.export_format import OUTPUT_LIBRARIES, READS  # noqa: F401
from autoshard.runtime.export_load import Loaded  # noqa: F401
from autoshard.core.ops import chunk_op
from autoshard.core.plans import Plan
from autoshard.core.plans import fmt_bytes


# --- export -----------------------------------------------------------------------------------


def _write_json(path: str, doc, *, compact: bool = False) -> None:
    """Indented for the files people read; graphs (tens of thousands of nodes for a large
    model) without whitespace."""
    with open(path, "w") as f:
        if compact:
            json.dump(doc, f, separators=(",", ":"))
        else:
            json.dump(doc, f, indent=1)


def example_inputs(prog, device) -> tuple:
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


def export(model, st, path, *, add_programs=None) -> None:
    """Write ``model``'s compiled programs, plan and state to the directory ``path`` (every
    rank calls it; see the module docstring for what it holds). ``st``: the model's
    ``CallState``, handed by ``ShardedModule.export``. ``add_programs``: called once the
    path is checked, before anything is written (the eval-mode programs ``inference=True``
    compiles).

    Everything that can refuse (the path, a call or output that cannot be stored) is checked
    on every rank before anything is written, so a refusal is an error on every rank and
    never leaves one rank waiting for the others. The write commits whole
    (``autoshard.runtime.commit``): an earlier export at ``path`` is replaced only once
    every rank wrote its part, and stays whole otherwise."""

    mesh, device, config = st.sharding()
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
    if add_programs is not None:
        add_programs()
    groups = group_names(mesh)
    programs = [_program_files(key, prog, groups)
                for key, prog in _programs(model, st).items()]
    model_doc = module_tree_doc(model, config)
    rank0 = ranks.rank == 0

    def write_data(folder):
        with progress.phase("writing the export", total=1 + len(programs) * rank0,
                            unit="parts") as p:
            dcpio.save({"tensors": module_tensors(model)}, os.path.join(folder, CHECKPOINT),
                       ranks.group)
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
            "device": device.type, "model": user_class_name(model),
            "programs": [dict(e, dir=f"{data}/{e['dir']}") for e in entries],
            "files": {f"{data}/{rel}": e for rel, e in files.items()}}
        manifest["hash"] = _content_hash(manifest["files"])
        return manifest

    entries: list = []
    commit.write(path, "export", MANIFEST, ranks, write_data, document,
                 other_markers=("checkpoint.json",))


def _programs(model, st) -> dict:
    """Every program of the module by repr(signature): those compiled, and for a module
    loaded from an export, the stored ones not called yet."""
    out = st.every_program(model)
    for prog in out.values():
        lifted = getattr(prog.captured, "lifted", None)
        if lifted:  # fed from the module's attribute on each call: an export has no module
            mod, name = lifted[0]
            raise AutoshardError(
                f"the program for {getattr(prog, 'described', ('a call',))[0]} reads "
                f"the float attribute '{name}' of {type(mod).__name__} as an input, because it "
                "changed between calls (autoshard.core.guards); an export holds no Python module "
                "to read it from. Make the value a buffer (register_buffer) to export it, or "
                "export a model on which it stays fixed.")
    return out


def _reshard_groups_of(fwd) -> dict:
    """hpZ (``Config.reshard_after_forward=k``): ``{group name: k}`` of the groups of k ranks
    the graphs' chunks and backward all-gathers name (this rank's own; each rank has its
    own group, so a load maps each name to the loading rank's group of the same k)."""

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
        "captured": captured_doc(cap),
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


# --- inspection -------------------------------------------------------------------------------


def stored_plan(path, program: int = 0, manifest: Optional[dict] = None):
    """The plan of the export's ``program``-th program (``Plan``), read under the export's
    reader lock (``commit.reading``): a write to ``path`` meanwhile sweeps no file read."""
    with commit.reading(path, MANIFEST):
        return _stored_plan(path, program, manifest)


def _stored_plan(path, program: int, manifest: Optional[dict]):
    manifest = manifest or read_manifest(path, verify=False)
    entries = manifest["programs"]
    if not 0 <= program < len(entries):
        raise AutoshardError(f"{path} holds programs 0 to {len(entries) - 1}, not {program}")
    doc = read_json(os.fspath(path), f"{entries[program]['dir']}/program.json",
                    manifest["files"])
    return Plan.from_json(json.dumps(doc["plan"]))


def describe(path, *, verify: bool = True) -> str:
    """What ``python -m autoshard inspect`` prints: the manifest, then for each program its
    call, the plan's prediction (memory included), its units and its schedule. Read under
    the export's reader lock, as ``autoshard.load`` reads it: a write to ``path`` meanwhile
    leaves the export being described whole."""
    with commit.reading(path, MANIFEST):
        return _describe(path, verify)


def _describe(path, verify: bool) -> str:
    from tabulate import tabulate

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
        ("files", f"{len(files)}, {fmt_bytes(sum(e['bytes'] for e in files.values()))} "
                  f"({shards} checkpoint shard files)"),
        ("content hash", manifest["hash"] + (" (verified)" if verify else "")),
    ]
    out = [tabulate(rows, tablefmt="plain")]
    for k, entry in enumerate(manifest["programs"]):
        mode = "training" if entry["grad"] else "inference (forward only)"
        out.append(f"\n=== program {k} ({entry['dir']}): {mode}\ncall: {entry['call']}\n")
        out.append(str(_stored_plan(path, k, manifest)))
    return "\n".join(out)


def _mesh_text(manifest: dict) -> str:
    shape = manifest["mesh_shape"]
    return f" ({' x '.join(map(str, shape))} mesh)" if len(shape) > 1 else ""

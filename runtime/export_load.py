"""Loading an export without the model's source, the parts ``autoshard.load(path)`` runs
around building the module (``autoshard/front/files.py``): ``open_export`` checks the manifest field
by field and reads the module tree; ``read_into`` checks every file and reads the parameters
into the module built from that tree, as DTensor shards over this mesh; ``Loaded`` reads the
stored programs on their first call (run as they are on a mesh of the export's shape, planned
again from the stored joint graphs on another).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import math
import os
from typing import Any, Optional

import torch
import torch.distributed as dist

from autoshard.core import meta, progress
from autoshard.core._compat import OpOverload
from autoshard.core.captured import SplitProgram
from autoshard.core.config import Config, offloads
from autoshard.core.errors import AutoshardError
from autoshard.core.ops import chunk_op
from autoshard.core.plans import Plan
from autoshard.runtime import (commit, commit_files, commit_ranks, dcpio, dist as _dist,
                               graphcost, graphio)
from autoshard.runtime.export_format import (CHECKPOINT, FORMAT, MANIFEST, READS, VERSION,
                                             captured_from_doc, dtype_name, group_names,
                                             module_tensors, respec, spec_from_doc)
from autoshard.core.spec import hosted


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


def read_file(root: str, rel: str, files: Optional[dict] = None, *,
              document: bool = True) -> bytes:
    """The bytes of the file ``rel`` (a plain path inside the export at ``root``), read
    through one descriptor opened without following a symlink at any step of the path. A JSON
    ``document`` larger than ``graphcost.DOCUMENT_BYTES`` is refused before anything is read.
    With ``files`` (the manifest's listing, as read at the load) the file must have the size
    and SHA-256 recorded there, checked on the bytes returned: what is checked is what is
    used, whatever happens to the file afterwards."""
    where = os.path.join(root, rel)
    try:
        fd = commit_files.open_inside(root, rel, what="export")
    except OSError as e:
        raise AutoshardError(f"{where} cannot be read ({e.strerror}): the export was changed "
                             "or removed; load it again") from None
    try:
        size = os.fstat(fd).st_size
        entry = None if files is None else files.get(rel)
        if files is not None and entry is None:
            raise AutoshardError(f"{where} is not a file {os.path.join(root, MANIFEST)} lists: "
                                 "the export was changed. Copy it again, or export again.")
        bound = graphcost.DOCUMENT_BYTES
        if document and size > (limit := bound.value()):
            raise AutoshardError(f"{where} holds {bound.refusal(size, limit)} (checked before "
                                 "reading it)")
        if entry is not None and size != entry["bytes"]:
            raise AutoshardError(_changed(where, f"{size} bytes, not the {entry['bytes']} the "
                                                 "manifest records"))
        chunks, left = [], size + 1  # one byte more: a file that grew meanwhile is not read on
        while left > 0 and (chunk := os.read(fd, min(left, 1 << 24))):
            chunks.append(chunk)
            left -= len(chunk)
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) != size:
        raise AutoshardError(_changed(where, "its size changed while it was read"))
    if entry is not None and hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise AutoshardError(_changed(where, "its SHA-256 is not the one the manifest records"))
    return data


def _changed(where: str, how: str) -> str:
    return (f"{where} was changed ({how}) since the export was written or loaded, and was not "
            "used: load the export again, or copy it again from a source you trust")


def read_json(root: str, rel: str, files: Optional[dict] = None):
    """The JSON document ``rel`` of the export at ``root`` (``read_file``)."""
    data = read_file(root, rel, files)
    where = os.path.join(root, rel)
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as e:  # RecursionError: nested too deeply
        what = ("nests values too deeply" if isinstance(e, RecursionError)
                else f"is not JSON ({e})")
        raise AutoshardError(f"{where} {what}: the file was changed. Copy the export again, "
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
    # the manifest's files as the load read it: each program's files are checked against it
    # when they are read, at the program's first call
    files: dict = dataclasses.field(default_factory=dict)
    programs: dict = dataclasses.field(default_factory=dict)  # repr(signature) -> Program
    # commit.Held: the data folder, kept from any sweep while the module lives
    held: Any = None

    @property
    def calls(self) -> list:
        return [e["call"] for e in self.entries.values()]

    def program(self, key: str, model, st):
        """The program of ``key`` (None if the export holds none), read on its first call onto
        ``st``, the loaded ``model``'s CallState."""
        if key not in self.programs and key in self.entries:
            folder = Folder(self.path, self.entries[key]["dir"], self.files)
            try:
                self.programs[key] = _load_program(folder, model, st, self.same, self.version)
            except Exception:  # a file gone, or cut short while a sweep removed it
                data = self.entries[key]["dir"].split("/")[0]
                if data.startswith(commit.DATA) and not os.path.isdir(
                        os.path.join(self.path, data)):  # not held: no lock at the path
                    raise AutoshardError(
                        f"the export at {self.path} was replaced after it was loaded (its data "
                        f"folder {data} is gone); load it again") from None
                raise
        return self.programs.get(key)


@dataclasses.dataclass
class Opened:
    """An export's manifest and module tree, read and checked before any module is built."""

    path: str
    manifest: dict
    model_doc: dict  # model.json: the module tree and the Config it was planned with
    config: Config  # what the load plans with: the one passed, else the stored one
    stored: Config
    entries: dict  # repr(signature) -> the manifest's entry, of the programs to load


def open_export(path, config: Optional[Config], *, inference: bool, verify: bool) -> Opened:
    """The first half of ``autoshard.load``: the manifest and the module tree (hashed first
    with ``verify``), and the Config the load plans with, checked against the export's."""
    path = os.fspath(path)
    manifest = read_manifest(path, verify=False)  # the files: below, shared by the ranks
    model_json = f"{manifest['data']}/model.json".lstrip("/")
    if verify:  # what is read before the ranks can share the work
        commit_files.verify(path, {model_json: manifest["files"].get(model_json, {
            "bytes": -1, "sha256": ""})}, manifest["world_size"], "export")
    # the bytes verified are the bytes read
    model_doc = read_json(path, model_json, manifest["files"] if verify else None)
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
    return Opened(path, manifest, model_doc, cfg, stored, entries)


def read_into(model, st, opened: Opened, *, inference: bool, verify: bool) -> Loaded:
    """The second half of ``autoshard.load``, on every rank: the export's state into
    ``model`` (the module built from its tree, whose CallState is ``st``), once the ranks
    agree that they read the same export and every file is checked; what the module runs."""
    path, manifest = opened.path, opened.manifest
    ranks = st.ranks()
    ranks("load", f"export {manifest['hash'][:16]}", exact=manifest["hash"],
          explain=lambda seen: _differ(path, seen))
    if verify:  # each file hashed by one rank
        commit_files.verify(path, manifest["files"], manifest["world_size"], "export", ranks)
        _nothing_unlisted(path, manifest)
    _read_state(model, ranks, os.path.join(path, manifest["data"], CHECKPOINT), manifest, path)
    mesh, device, _ = st.sharding()
    same = (list(mesh.shape) == manifest["mesh_shape"] and device.type == manifest["device"]
            and opened.config.to_dict() == opened.stored.to_dict())
    return Loaded(path, opened.entries, same, inference, manifest["version"], manifest["files"])


def _differ(path, seen: list) -> str:
    """The error when the ranks loaded different exports from ``path``."""
    lines = "\n".join(f"  rank {r}: {d}" for r, d in enumerate(seen))
    return (f"the ranks read different exports at {path}, or were given different paths "
            f"(nothing was built):\n{lines}\nAn export to the path while they loaded it "
            "replaced it: load it again. Every rank must pass the same path, on a file system "
            "every rank sees.")


def _read_state(model, ranks, folder: str, manifest: dict, path: str) -> None:
    """The stored parameters and buffers into ``model``'s (the skeleton's, which has no
    state-dict hooks), every rank's part read before any is used."""
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict,
                                                         set_model_state_dict)

    version = manifest["version"]
    if version == 1:
        loose = set(model.state_dict())
        state = {"model": get_model_state_dict(model),
                 "buffers": {f: b for f, b in model.named_buffers() if f not in loose}}
    else:
        state = {"tensors": module_tensors(model)}
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


def check_backend(mesh, path: str) -> None:
    """Refuse a mesh whose process group cannot run the export's collectives."""
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


@dataclasses.dataclass(frozen=True)
class Folder:
    """A program's folder of an export: ``root`` the export, ``rel`` the folder in it,
    ``files`` the manifest's listing its files are checked against as they are read."""

    root: str
    rel: str
    files: dict

    def path(self, name: str = "") -> str:
        return os.path.join(self.root, self.rel, name) if name else os.path.join(self.root,
                                                                                 self.rel)

    def read(self, name: str, *, document: bool = True) -> bytes:
        return read_file(self.root, f"{self.rel}/{name}", self.files, document=document)

    def json(self, name: str):
        return read_json(self.root, f"{self.rel}/{name}", self.files)


def _load_program(folder: Folder, model, st, same: bool, version: int = VERSION):
    """The stored program in ``folder`` on ``st``'s mesh: at the export's mesh shape, device
    type and Config (``same``) its compiled graphs, each collective on the group of its mesh
    dimension here; otherwise its joint graph planned again for this mesh and Config. Each
    file is checked against the manifest as read at the load: hashed as the bytes used."""
    doc = folder.json("program.json")
    constants = _read_constants(folder)
    mesh, device, config = st.sharding()
    # before version 3 the export's mesh was 1-D: every collective on its one group
    regroup = dict(zip(doc.get("groups", [None]), group_names(mesh)))
    hpz = doc.get("reshard_groups", {})  # format 3 before hpZ has none
    if same and hpz:
        here = _dist.reshard_groups(mesh, sorted(set(hpz.values())))
        regroup.update({name: here[k] for name, k in hpz.items()})

    def graph(name, **kw):
        return graphio.load_graph(folder.json(f"{name}.json"), constants[name],
                                  source=folder.path(f"{name}.json"), **kw)

    cdoc = doc["captured"]
    joint = graph("joint", device=device)
    _check_params(joint, model, folder.path("joint.json"))
    stored = [spec_from_doc(p, version) for p in cdoc["params"]]
    if same:
        cap = captured_from_doc(cdoc, stored, joint)
        s = doc["split"]
        split = SplitProgram(
            fwd=_regrouped(graph("forward"), regroup, folder.path()),
            bwd=_regrouped(graph("backward"), regroup, folder.path())
            if "backward" in constants else None,
            fwd_roles=s["fwd_roles"], bwd_roles=s["bwd_roles"], saved=s["saved"],
            n_tangents=s["n_tangents"])
        prog = st.program_of(cap, split, Plan.from_json(json.dumps(doc["plan"])))
    else:
        host = hosted([(p.fqn, p.shape) for p in stored], offloads(config))
        params = [respec(p, mesh, config, "host" if p.fqn in host else "device")
                  for p in stored]
        prog = st.plan_program(captured_from_doc(cdoc, params, joint), model)
    prog.described = (doc["call"], doc["training"], doc["grad"])
    return prog


def _read_constants(folder: Folder) -> dict:
    """A program's constant tensors, read as plain data (``weights_only``): no code runs."""
    import pickle

    path = folder.path("constants.pt")
    data = folder.read("constants.pt", document=False)
    try:
        return torch.load(io.BytesIO(data), weights_only=True)
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
        got = f"{dtype_name(v.dtype)}{list(v.shape)}" if isinstance(v, torch.Tensor) else repr(v)
        have = "no such parameter" if p is None else f"{dtype_name(p.dtype)}{list(p.shape)}"
        if got != have:
            raise AutoshardError(
                f"{path}: node {n.name} reads the parameter {fqn} as {got}, but the model has "
                f"{have}: the file was changed. Copy the export again, or export again.")


def _regrouped(gm, regroup: dict, folder: str):
    """``gm`` with each collective's process group replaced by this process's group of the
    same mesh dimension (``regroup``: stored name -> name here; the key None: every one)."""
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

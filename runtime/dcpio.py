"""torch.distributed.checkpoint (DCP) folders written and read so that reading runs no code and
touches nothing outside the folder.

DCP itself unpickles: its ``FileSystemReader`` reads ``.metadata`` with ``pickle.load``, and
its ``DefaultLoadPlanner`` reads each value that is not a tensor (an optimizer's learning
rate, betas) with ``torch.load(weights_only=False)``. A checkpoint from someone else could
run any code there. Here:

- ``.metadata`` is read by an unpickler that admits only DCP's metadata classes, ``torch.Size``,
  torch's dtypes and layouts, and path objects; any other global (``os.system``, a class
  with a ``__reduce__`` of its own) is refused before it is looked up, naming the file and
  the global. Tensors are read by DCP with ``torch.load(weights_only=True)`` as before, and
  the other values now are too.
- Every storage file the metadata names must be a plain name inside the folder (no ``..``,
  no separator, no symlink out) and, when the caller passes the file list a marker
  recorded, one of the files the writer listed (and whose SHA-256 the caller checked).
  Every file is opened by ``commit_files.open_checked``: never through a symlink or a hard
  link, and, within a ``commit.reading`` block, through the descriptor that was hashed (or
  hashed again as it is opened), so a file swapped after the check is refused, not read.
- Before any tensor is read, the metadata of each one the state asks for must have its
  shape and dtype, and chunks that cover each of its elements exactly once; otherwise the
  load is refused naming the metadata file and the key (DCP would copy what the chunks hold,
  cast to the state's dtype, and leave the rest of the tensor as it was).
- Each tensor a storage file holds must be of the metadata's dtype and of its chunk's shape,
  checked as it is read, before it is copied into the state; otherwise the load is refused
  naming the storage file and the key (DCP would cast another dtype, cut a larger tensor to
  the chunk's lengths, and fail on a smaller one naming no file).
- ``strict`` (the default) refuses a load whose state and checkpoint keys differ, naming the
  missing and unexpected keys (a param group's hyperparameter that one side lacks, such as an
  LR scheduler's ``initial_lr``, is reported, not refused); ``strict=False`` loads what both
  hold and reports the rest.

A hash kept in the same directory cannot stop an attacker who edits the directory (they can
rewrite the hash too), so safety rests on the restricted reader, not on the hashes; the
hashes catch damage.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import pickle
from typing import NamedTuple, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType
from torch.futures import Future

from autoshard.core._compat import dcp_set_element
from autoshard.core.errors import AutoshardError
from autoshard.runtime.commit_files import open_checked, open_inside

METADATA = ".metadata"

_DCP_METADATA = frozenset({"Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
                           "TensorStorageMetadata", "ChunkStorageMetadata",
                           "BytesStorageMetadata", "_MEM_FORMAT_ENCODING"})
# (module, name) a DCP .metadata may name; torch's dtypes (torch.float32, ...) separately
_ALLOWED = {
    **{("torch.distributed.checkpoint.metadata", n): None for n in _DCP_METADATA},
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): None,
    ("torch", "Size"): None,
    ("torch.serialization", "_get_layout"): None,
    ("pathlib", "PosixPath"): None, ("pathlib", "PurePosixPath"): None,
    ("pathlib", "WindowsPath"): None, ("pathlib", "PureWindowsPath"): None,
    ("collections", "OrderedDict"): None,
}


class IncompatibleKeys(NamedTuple):
    """What a ``strict=False`` load skipped: keys the state asked for that the checkpoint
    lacks, and keys the checkpoint holds that the state does not name (its flattened DCP
    names: ``model.<fqn>``, ``optim.state.<fqn>.exp_avg``, ...)."""

    missing_keys: list
    unexpected_keys: list


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, f, where: str):
        super().__init__(f)
        self.where = where

    def find_class(self, module, name):
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise AutoshardError(
            f"{self.where} names {module}.{name}, which a DCP checkpoint's metadata never "
            "holds: it was changed to run code when loaded, and was not read. Copy the "
            "checkpoint again from a source you trust, or save it again.")


def read_metadata(path: str):
    """The ``Metadata`` of DCP's ``.metadata`` file at ``path``, read without running code
    (and, within ``commit.reading``, through the descriptor that was hashed)."""
    try:
        with open_checked(os.path.dirname(path) or ".", os.path.basename(path),
                          "checkpoint") as f:
            md = _MetadataUnpickler(f, path).load()
    except AutoshardError:
        raise
    except Exception as e:  # noqa: BLE001 - a truncated or foreign file
        raise AutoshardError(f"{path} cannot be read as DCP metadata ({type(e).__name__}: "
                             f"{e}); copy the checkpoint again, or save it again") from None
    if type(md).__name__ != "Metadata" or not hasattr(md, "state_dict_metadata"):
        raise AutoshardError(f"{path} is not DCP metadata (it holds a {type(md).__name__})")
    return md


class SafeReader(FileSystemReader):
    """DCP's file reader with the metadata read as ``read_metadata`` does and every storage
    file it names checked to be a plain file of ``folder`` (and of ``files``, when given)."""

    def __init__(self, folder: str, files: Optional[set] = None):
        super().__init__(folder)
        self.folder = os.fspath(folder)
        self.files = files
        self.checked = None  # the global metadata, once read
        self.fs = _Files(self.folder)  # DCP's reads of the storage files

    def read_metadata(self, *args, **kwargs):
        rank = kwargs.get("rank")
        if rank is None and self.checked is not None:  # read and checked before dcp.load
            return self.checked
        name = METADATA if rank is None else f"__{rank}{METADATA}"
        where = os.path.join(self.folder, name)
        md = read_metadata(where)
        for rel in {getattr(info, "relative_path", None)
                    for info in (md.storage_data or {}).values()}:
            self._check(rel, where)
        if getattr(md, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        if rank is None:
            self.checked = md
        return md

    def read_data(self, plan, planner):
        """DCP's ``FileSystemReader.read_data``, with each stored tensor checked (``_stored``)
        before it is copied into the state (which the callers copy into the model only once
        every rank has read all of it)."""
        by_file: dict = {}
        for req in plan.items:
            by_file.setdefault(self.storage_data[req.storage_index].relative_path, []).append(req)
        for rel, reqs in by_file.items():
            where = os.path.join(self.folder, rel)
            with self.fs.create_stream(self.fs.concat_path(self.path, rel), "rb") as f:
                for req in reqs:
                    info = self.storage_data[req.storage_index]
                    if info.transform_descriptors or not (
                            type(info.offset) is int and type(info.length) is int
                            and info.offset >= 0 and info.length >= 0):
                        raise AutoshardError(
                            f"{where}: {req.storage_index.fqn}: the metadata stores it "
                            f"transformed ({info.transform_descriptors}) or at bytes "
                            f"{info.offset!r} (+{info.length!r}), which autoshard never "
                            "writes; nothing was read. The checkpoint was changed: copy it "
                            "again from a source you trust, or save it again.")
                    view = io.BufferedReader(_Slice(f, info.offset, info.length))
                    if req.type == LoadItemType.BYTE_IO:
                        planner.load_bytes(req, io.BytesIO(view.read()))
                        continue
                    value = _stored(view, req, planner.metadata, where)
                    for dim, (at, n) in enumerate(zip(req.storage_offsets, req.lengths)):
                        value = value.narrow(dim, at, n)
                    target = planner.resolve_tensor(req).detach()
                    target.copy_(value)
                    planner.commit_tensor(req, target)
        done: Future = Future()
        done.set_result(None)
        return done

    def _check(self, rel, where: str) -> None:
        plain = (isinstance(rel, str) and rel not in ("", ".", "..") and "/" not in rel
                 and "\\" not in rel and os.sep not in rel)
        full = os.path.join(self.folder, rel) if plain else None
        inside = plain and os.path.isfile(full) and not os.path.islink(full)
        listed = self.files is None or rel in self.files
        if not (inside and listed):
            why = ("is not a plain file name inside the checkpoint's folder (a path, a symlink, "
                   "or missing)" if not inside else
                   "is not one of the files the checkpoint's marker lists")
            shown = f" ({full})" if plain else ""
            raise AutoshardError(f"{where} names the storage file {rel!r}{shown}, which {why}: "
                                 "the checkpoint was changed, and nothing was read. Copy it "
                                 "again from a source you trust, or save it again.")


def _stored(view, req, md, where: str) -> torch.Tensor:
    """The tensor ``view`` holds for the read item ``req``, if it has the dtype the metadata
    ``md`` gives its key and the shape of its chunk; else AutoshardError naming the storage
    file ``where`` and the key."""
    key, at = req.storage_index.fqn, tuple(req.storage_index.offset)
    tmd = md.state_dict_metadata[key]
    sizes = next(tuple(c.sizes) for c in tmd.chunks if tuple(c.offsets) == at)
    try:
        value = torch.load(view, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - a foreign or damaged record
        first = str(e).strip().splitlines()
        value = f"cannot be read as a tensor ({first[-1][:200] if first else type(e).__name__})"
    why = None
    if isinstance(value, str):
        why = value
    elif not isinstance(value, torch.Tensor):
        why = f"is a {type(value).__name__}, not a tensor"
    elif value.layout != torch.strided:
        why = f"is a tensor of layout {value.layout}, not a dense one"
    elif value.dtype != tmd.properties.dtype:
        why = (f"is of dtype {value.dtype}, and the metadata gives {tmd.properties.dtype} (a "
               "load never casts)")
    elif tuple(value.shape) != sizes:
        why = (f"has the shape {tuple(value.shape)}, and the metadata's chunk at offsets {at} "
               f"has the sizes {sizes}")
    if why is not None:
        raise AutoshardError(
            f"{where}: {key}: the stored value {why}, and was not loaded. The checkpoint was "
            "changed: copy it again from a source you trust, or save it again.")
    return value


class _Slice(io.RawIOBase):
    """Bytes ``start`` to ``start + length`` of the seekable file ``f``, as a file of their
    own (DCP's storage item: one ``torch.save`` record in a storage file)."""

    def __init__(self, f, start: int, length: int):
        super().__init__()
        self.f, self.start, self.length, self.at = f, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        n = max(0, min(len(b), self.length - self.at))
        self.f.seek(self.start + self.at)
        data = self.f.read(n)
        b[:len(data)] = data
        self.at += len(data)
        return len(data)

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        self.at = {os.SEEK_SET: 0, os.SEEK_CUR: self.at, os.SEEK_END: self.length}[whence]
        self.at += offset
        return self.at

    def tell(self) -> int:
        return self.at


class _Files(FileSystem):
    """DCP's file system for ``SafeReader``: a file of the folder is read through
    ``open_checked``; nothing is written."""

    def __init__(self, folder: str):
        super().__init__()
        self.folder = folder

    @contextlib.contextmanager
    def create_stream(self, path, mode: str):
        rel = _file_of(self.folder, path, mode, "rb", "the checkpoint reader opens only "
                       "files of {folder}, for reading")
        with open_checked(self.folder, rel, "checkpoint") as f:
            yield f


def _file_of(folder: str, path, mode: str, want: str, says: str) -> str:
    """``path``'s name in ``folder``, where it is a file right in it opened as ``want``."""
    rel = os.path.relpath(os.fspath(path), folder)
    if mode != want or os.path.dirname(rel) or rel in (".", ".."):
        raise AutoshardError(f"{path}: {says.format(folder=folder)} (asked: {mode!r})")
    return rel


class _NewFiles(FileSystem):
    """DCP's file system for ``save``: each file it writes is made new in the (fresh) folder,
    never opened through a symlink or over a file planted there (``O_EXCL``)."""

    def __init__(self, folder: str):
        super().__init__()
        self.folder = os.fspath(folder)

    @contextlib.contextmanager
    def create_stream(self, path, mode: str):
        rel = _file_of(self.folder, path, mode, "wb", "the checkpoint writer makes only new "
                       "files of {folder}")
        fd = open_inside(self.folder, rel, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        with os.fdopen(fd, "wb") as f:
            yield f


class SafePlanner(DefaultLoadPlanner):
    """DCP's load planner, with values that are not tensors read by ``torch.load(
    weights_only=True)``, and the keys of the state and of the checkpoint compared first:
    ``strict`` refuses any difference, naming the keys; otherwise ``skipped`` has them."""

    def __init__(self, strict: bool, where: str, metadata_file: Optional[str] = None):
        super().__init__(allow_partial_load=True)  # what is missing: decided here
        self.strict, self.where = strict, where
        self.metadata_file = metadata_file or os.path.join(where, METADATA)
        self.skipped = IncompatibleKeys([], [])

    def create_local_plan(self):
        wanted = set(self.state_dict)
        held = set(self.metadata.state_dict_metadata)
        parts = {k.split(".", 1)[0] for k in wanted}  # "model", "optim": only what is asked
        missing = sorted(wanted - held)
        unexpected = sorted(k for k in held - wanted if k.split(".", 1)[0] in parts)
        # a param group's hyperparameters: an entry one side has and the other lacks (an LR
        # scheduler's initial_lr) keeps the optimizer's own, as torch's load_state_dict of a
        # group without it would; it is reported, never refused
        groups = [k for k in missing + unexpected if k.startswith("optim.param_groups.")]
        if self.strict and (set(missing) | set(unexpected)) - set(groups):
            raise AutoshardError(
                f"{self.where} does not match the model{' and optimizer' * ('optim' in parts)}"
                f": missing {_keys(missing)}; unexpected {_keys(unexpected)}. Load into the "
                "model that saved it, or pass strict=False to load the keys both hold")
        self.skipped = IncompatibleKeys(missing, unexpected)
        for key in sorted(wanted & held):
            _check_tensor(key, self.metadata.state_dict_metadata[key], self.state_dict[key],
                          self.metadata_file)
        return super().create_local_plan()

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except (pickle.UnpicklingError, RuntimeError) as e:
            first = str(e).strip().splitlines()
            raise AutoshardError(
                f"{self.where}: the value of {read_item.dest_index.fqn} holds more than plain "
                f"data, and was not read ({first[-1][:200] if first else type(e).__name__}): "
                "it was changed to run code when loaded, or saved from an object that is not "
                "plain data. Copy the checkpoint again from a source you trust.") from None
        if self.flatten_state_dict:
            dcp_set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn],
                        loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def _check_tensor(key: str, md, value, where: str) -> None:
    """The metadata ``md`` of ``key`` describes the tensor ``value`` (the state's; a DTensor
    by its global shape): a tensor of its shape and dtype whose chunks cover each element
    exactly once. Else AutoshardError naming ``where`` (the metadata file) and the key."""
    if not isinstance(value, torch.Tensor):
        return  # a plain value (a param group's lr): read by load_bytes
    why = None
    shape = tuple(value.size())
    if not isinstance(md, TensorStorageMetadata):
        why = f"holds it as {type(md).__name__}, not a tensor"
    elif tuple(md.size) != shape:
        why = f"gives it the shape {tuple(md.size)}, and the model's is {shape}"
    elif getattr(md.properties, "dtype", None) != value.dtype:
        why = (f"gives it the dtype {getattr(md.properties, 'dtype', None)}, and the model's "
               f"is {value.dtype} (a load never casts)")
    else:
        why = _uncovered(shape, md.chunks)
    if why is not None:
        raise AutoshardError(
            f"{where}: {key}: the metadata {why}; nothing was read. The checkpoint was changed, "
            "or was saved from another model: copy it again from a source you trust, or load "
            "it into the model that saved it.")


def _uncovered(shape: tuple, chunks) -> Optional[str]:
    """Why ``chunks`` (DCP's ``ChunkStorageMetadata``) do not cover a tensor of ``shape``
    exactly once, or None."""
    boxes = []
    for c in chunks:
        at, size = tuple(c.offsets), tuple(c.sizes)
        if not (len(at) == len(size) == len(shape) and all(
                type(a) is int and type(n) is int and 0 <= a and 0 <= n and a + n <= d
                for a, n, d in zip(at, size, shape))):
            return f"has a chunk at offsets {at} of sizes {size}, outside the shape {shape}"
        if all(size):
            boxes.append((at, size))
    covered = sum(math.prod(size) for _, size in boxes)
    total = math.prod(shape)
    if covered == total:  # then a gap is an overlap: look for one (sorted by the first dim)
        boxes.sort()
        for i, (a, n) in enumerate(boxes):
            for b, m in boxes[i + 1:]:
                if shape and b[0] >= a[0] + n[0]:
                    break
                if all(x < y + k and y < x + j for x, j, y, k in zip(a, n, b, m)):
                    covered = -1
                    break
            if covered < 0:
                break
    if covered == total:
        return None
    rows = sorted({(a[0], a[0] + n[0]) for a, n in boxes}) if shape else []
    held = ", ".join(f"{lo}-{hi - 1}" for lo, hi in rows[:6]) + (", ..." if len(rows) > 6 else "")
    return (f"has chunks that do not cover each of its {total} elements exactly once "
            f"(rows held: {held or 'none'}, of {shape[0] if shape else 1}): a chunk is missing, "
            "cut short or overlaps another, and the rest of the tensor would keep the model's "
            "values")


def _keys(keys: list, shown: int = 8) -> str:
    if not keys:
        return "none"
    more = f" and {len(keys) - shown} more" if len(keys) > shown else ""
    return f"{len(keys)} ({', '.join(keys[:shown])}{more})"


def save(state: dict, folder: str, group) -> None:
    """``dcp.save`` with each tensor that is not a DTensor (a buffer) saved from the lowest
    rank. DCP saves such a tensor once, from whichever rank balances the files by default, so
    a buffer each rank updates from its own batch (BatchNorm's running statistics without
    SyncBatchNorm) would load as a different rank's copy from one save to the next; rank 0's
    is what ``torch.save`` on rank 0 would keep."""
    writer = dcp.FileSystemWriter(folder)
    writer.fs = _NewFiles(folder)
    dcp.save(state, checkpoint_id=folder, process_group=group, storage_writer=writer,
             planner=dcp.DefaultSavePlanner(dedup_save_to_lowest_rank=True))


def load(state: dict, folder: str, group, *, files: Optional[set] = None, strict: bool = True,
         where: Optional[str] = None) -> IncompatibleKeys:
    """``dcp.load`` of ``state`` (in place) from ``folder`` through ``SafeReader`` and
    ``SafePlanner``; returns the keys a ``strict=False`` load skipped."""
    planner = SafePlanner(strict, where or folder, os.path.join(folder, METADATA))
    reader = SafeReader(folder, files)
    if os.path.isfile(os.path.join(folder, METADATA)):
        reader.read_metadata()  # refused here, not in DCP's fallback to per-rank metadata
    dcp.load(state, checkpoint_id=folder, process_group=group, storage_reader=reader,
             planner=planner)
    return planner.skipped

"""Writes that commit whole or not at all: checkpoints and exports.

A write to ``path`` (a directory) goes in four steps, every rank taking part:

1. The ranks agree on the path and on what is there (nothing, a complete write of the same
   kind, an interrupted one); a directory holding anything else is refused on every rank.
2. Each rank writes its files into ``path/data-<token>``, a folder no reader looks at: the
   token is rank 0's, fresh for this write.
3. The ranks exchange how their writes ended. If any failed (an error, a full disk, a
   killed peer), every rank raises ``AutoshardError`` naming each failed rank, the path and
   the cause; the folder is removed and the path holds what it held before.
4. Rank 0 writes the marker (``checkpoint.json``, ``manifest.json``), which names the data
   folder, to a temporary file and renames it over the old one (``os.replace``, atomic on
   POSIX file systems). That rename is the commit: a reader follows the marker, so it sees
   the previous write or this one, never a mix. Then the previous data folder goes.

A reader that finds no marker but data folders says the write was interrupted and that
nothing complete is at the path. The data folder of a finished write is never changed
again, so a plain DCP reader may also be pointed at it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from typing import Callable, Optional

import torch.distributed as dist

from autoshard.errors import AutoshardError

DATA = "data-"


def state(path: str, marker: str, other_markers: tuple = ()) -> str:
    """What is at ``path``: "free" (nothing, or an empty directory), "complete" (a marker),
    "interrupted" (data folders and no marker), or a description of what is in the way."""
    if not os.path.exists(path):
        return "free"
    if not os.path.isdir(path):
        return "a file"
    names = os.listdir(path)
    if marker in names:
        return "complete"
    for other in other_markers:
        if other in names:
            return f"a directory holding {other}"
    if names and all(n.startswith(DATA) or n.startswith(".") for n in names):
        return "interrupted"
    if names:
        shown = ", ".join(sorted(names)[:4]) + (", ..." if len(names) > 4 else "")
        return f"a directory holding other files ({shown})"
    return "free"


def write(path, what: str, marker: str, agreement, write_data: Callable[[str], None],
          document: Callable[[str], dict], other_markers: tuple = ()) -> str:
    """Write ``what`` ("checkpoint", "export") to the directory ``path`` as the module
    docstring says (every rank calls it): ``write_data(folder)`` writes this rank's files
    (collectives inside are fine); ``document(folder)`` runs on rank 0 after every rank
    finished and returns the marker's content (``"data"`` is added). Returns the data
    folder."""
    path = os.path.abspath(os.fspath(path))
    found = state(path, marker, other_markers)
    agreement(what, f"to {path}: {found}", explain=lambda seen: differ(what, seen))
    if found not in ("free", "complete", "interrupted"):
        raise AutoshardError(f"cannot write the {what} to {path}: it is {found}, not an "
                             f"autoshard {what}. Choose a new path, or remove it first.")
    kept = (f"{path} still holds the previous {what}" if found == "complete" else
            f"nothing was written to {path}")
    doing = f"{what} to {path}"
    token = _exchange(agreement, uuid.uuid4().hex[:12], doing, kept)[0]
    folder = os.path.join(path, DATA + token)
    settle(agreement, attempt(lambda: (os.makedirs(folder, exist_ok=True), write_data(folder)),
                              agreement.rank), doing, kept, folder)
    outcome = attempt(lambda: _commit(path, marker, folder, document)) if (
        agreement.rank == 0) else {}
    try:
        settle(agreement, outcome, doing, kept, folder)
    except AutoshardError:
        if _committed(path, marker, folder):  # rank 0 was lost after its commit: it stands
            return folder
        raise
    if agreement.rank == 0:
        _sweep(path, keep=os.path.basename(folder))
    return folder


def differ(what: str, seen: list) -> str:
    """The error when the ranks are all at a ``what`` but name different paths (or see
    different things there)."""
    lines = "\n".join(f"  rank {r}: {d}" for r, d in enumerate(seen))
    return (f"the ranks called the {what} with different paths, or see different things at "
            f"the path (nothing was written):\n{lines}\nEvery rank must pass the same path, "
            "on a file system every rank sees (a shared directory)")


def read_marker(path, marker: str, what: str, fields: dict) -> dict:
    """The marker of a complete write at ``path``, each of ``fields`` (name -> type)
    checked, or AutoshardError saying what is wrong and what to do."""
    path = os.fspath(path)
    where = os.path.join(path, marker)
    if not os.path.isdir(path):
        raise AutoshardError(f"{path} is not a directory: pass the directory the {what} "
                             "was written to")
    if not os.path.isfile(where):
        if state(path, marker) == "interrupted":
            raise AutoshardError(
                f"{path} is an incomplete {what}: a write to it was interrupted before every "
                f"rank finished ({marker}, written last, is missing), and no complete {what} "
                "is there. Use an earlier one, or write it again.")
        raise AutoshardError(f"{where} is missing: {path} is not an autoshard {what}, or its "
                             f"write did not finish ({marker} is written last)")
    try:
        with open(where) as f:
            doc = json.load(f)
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise AutoshardError(f"{where} cannot be read ({e}); copy the {what} again from its "
                             "source, or write it again") from None
    if not isinstance(doc, dict):
        raise AutoshardError(f"{where} is not an autoshard {what} marker (not an object)")
    for name, kind in fields.items():
        if name not in doc:
            raise AutoshardError(f"{where} has no field {name!r}: it was not written by "
                                 f"autoshard, or was changed. Write the {what} again.")
        if not isinstance(doc[name], kind):
            raise AutoshardError(
                f"{where}: field {name!r} is {type(doc[name]).__name__} "
                f"({str(doc[name])[:60]}), not {_kind_name(kind)}: the file was changed or "
                f"is not an autoshard {what}. Write the {what} again.")
    data = doc.get("data")
    if data is not None and not (data == "" or inside(path, data)) or (
            data and not os.path.isdir(os.path.join(path, data))):
        raise AutoshardError(f"{where} names the data folder {data!r}, which is not a folder "
                             f"inside {path} (an absolute path, '..', a symlink out, or "
                             f"missing). Copy the whole {what} directory.")
    return doc


def _kind_name(kind) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(k.__name__ for k in kinds)


def attempt(fn, rank: int = 0) -> dict:
    """{} when ``fn`` ran, else {rank: what stopped it}: this rank's error, or for DCP's
    CheckpointException (which gathers every rank's), each failed rank's."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        fn()
        return {}
    except CheckpointException as e:
        return {r: _cause(exc[0] if isinstance(exc, tuple) else exc)
                for r, exc in e.failures.items()}
    except Exception as e:  # noqa: BLE001 - reported on every rank, then raised there
        return {rank: _cause(e)}


def _cause(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:400] if text else ''}"


def settle(agreement, outcome: dict, doing: str, kept: str,
           folder: Optional[str] = None) -> None:
    """Every rank learns how every rank's part of ``doing`` ended (``outcome``, from
    ``attempt``); any failure is an AutoshardError on all, saying what is ``kept``."""
    failed: dict = {}
    for got in _exchange(agreement, outcome, doing, kept):
        failed.update(got)
    if not failed:
        return
    if agreement.rank == 0 and folder is not None:
        shutil.rmtree(folder, ignore_errors=True)
    ranks = sorted(failed)
    lines = "\n".join(f"  rank {r}: {failed[r]}" for r in ranks)
    raise AutoshardError(f"the {doing} failed on rank{'s' if len(ranks) > 1 else ''} "
                         f"{', '.join(map(str, ranks))}; nothing was committed, and {kept}:"
                         f"\n{lines}")


def _exchange(agreement, mine, doing: str, kept: str) -> list:
    """Each rank's ``mine``, in rank order (the agreement's group and timeout)."""
    if agreement.world == 1 or agreement.fake:
        return [mine]
    got = [None] * agreement.world
    try:
        dist.all_gather_object(got, mine, group=agreement.group)
    except Exception as e:  # noqa: BLE001 - a lost or stuck peer, whatever the backend says
        peers = [r for r in range(agreement.world) if r != agreement.rank]
        raise AutoshardError(
            f"rank {agreement.rank}: the {doing} did not complete: no answer from "
            f"peer ranks {peers} within {agreement.timeout_s:g} s (a rank was killed, ran out "
            f"of space, or hangs); nothing was committed, and {kept}."
            f"{' This rank saw: ' + str(mine) if mine else ''}\n  "
            f"{str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__}"
        ) from None
    return got


def _commit(path: str, marker: str, folder: str, document) -> None:
    doc = dict(document(folder), data=os.path.basename(folder))
    tmp = os.path.join(path, f".{marker}.{os.path.basename(folder)}")
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(path, marker))
    _fsync_dir(path)


def _committed(path: str, marker: str, folder: str) -> bool:
    try:
        with open(os.path.join(path, marker)) as f:
            return json.load(f).get("data") == os.path.basename(folder)
    except (OSError, ValueError, AttributeError):
        return False


def _sweep(path: str, keep: str) -> None:
    """Data folders no marker names any more (the previous write, interrupted ones)."""
    for name in os.listdir(path):
        if name.startswith(DATA) and name != keep:
            shutil.rmtree(os.path.join(path, name), ignore_errors=True)
        elif name.startswith(".") and DATA in name:  # a marker's temporary file
            try:
                os.remove(os.path.join(path, name))
            except OSError:
                pass


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def entries(folder: str) -> dict:
    """Every file under ``folder``: relative path -> ``{"bytes": size, "sha256": hex}``, what a
    reader checks before it reads anything (``verify``)."""
    out = {}
    for sub, _, names in os.walk(folder):
        for name in names:
            full = os.path.join(sub, name)
            out[os.path.relpath(full, folder).replace(os.sep, "/")] = {
                "bytes": os.path.getsize(full), "sha256": sha256(full)}
    return dict(sorted(out.items()))


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def inside(root: str, rel) -> bool:
    """``rel`` is a plain relative path (``/``-separated, no ``..``, ``.`` or empty part, not
    absolute) that stays inside ``root`` once symlinks are followed."""
    if not isinstance(rel, str) or not rel or rel.startswith("/") or "\\" in rel:
        return False
    parts = rel.split("/")
    if any(p in ("", ".", "..") for p in parts) or os.path.isabs(rel):
        return False
    real_root = os.path.realpath(root)
    return os.path.realpath(os.path.join(root, *parts)) == os.path.join(real_root, *parts)


def verify(root: str, files: dict, world_size: int, what: str) -> None:
    """Every file of ``files`` (relative path -> an ``entries`` entry, or a size alone, as
    checkpoints before format 2 recorded) is a plain file inside ``root``, whole and, where a
    SHA-256 is recorded, unchanged; AutoshardError naming the file and what is wrong."""
    for rel, entry in files.items():
        full = os.path.join(root, rel)
        if not inside(root, rel):
            raise AutoshardError(
                f"the {what} at {root} lists the file {rel!r}, which is not a plain relative "
                f"path inside it (an absolute path, '..', or a symlink out): the {what} was "
                f"changed, and nothing was read. Copy the {what} again from a source you trust.")
        size, digest = (entry, None) if isinstance(entry, int) else (entry["bytes"],
                                                                     entry["sha256"])
        got = os.path.getsize(full) if os.path.isfile(full) else None
        if got is None:
            raise AutoshardError(f"{full} is missing{whose(rel, world_size)}. Copy the whole "
                                 f"{what} directory, every rank's files included.")
        if got != size:
            raise AutoshardError(
                f"{full} is {got} bytes, but the {what} wrote {size}: it is truncated or was "
                f"changed{whose(rel, world_size)}. Copy it again from the {what}'s source, or "
                f"write the {what} again.")
        if digest is not None and sha256(full) != digest:
            raise AutoshardError(
                f"{full} does not match the SHA-256 the {what} records{whose(rel, world_size)}"
                f": it is corrupt or was changed after it was written. Copy it again from "
                f"the {what}'s source, or write the {what} again.")


def version() -> str:
    """This autoshard's version (``autoshard.__version__``)."""
    import autoshard

    return autoshard.__version__


def check_format(doc: dict, where: str, fmt: str, reads: tuple, what: str) -> None:
    """Refuse a marker of another format or of a version this autoshard cannot read, naming
    both; warn when the torch or autoshard that wrote it differs from this one."""
    import warnings

    import torch

    if doc["format"] != fmt:
        raise AutoshardError(f"{where} is format {doc['format']!r}, not an autoshard {what} "
                             f"({fmt!r})")
    if doc["version"] not in reads:
        raise AutoshardError(
            f"{where} is {what} format version {doc['version']} (written by autoshard "
            f"{doc['autoshard']}, torch {doc['torch']}); this autoshard {version()} reads "
            f"version{'s' if len(reads) > 1 else ''} {', '.join(map(str, reads))}. Load it "
            f"with the autoshard that wrote it, or write the {what} again with this one.")
    mine = {"torch": torch.__version__, "autoshard": version()}
    changed = [f"{k} {doc[k]} (this process: {mine[k]})" for k in mine if doc[k] != mine[k]]
    if changed:
        warnings.warn(f"{where} was written by {', '.join(changed)}; its format version "
                      f"{doc['version']} is one this autoshard reads, so it loads",
                      stacklevel=3)


def whose(rel: str, world_size: int) -> str:
    """For a DCP shard file (``__R_0.distcp``), which rank wrote it."""
    name = os.path.basename(rel)
    if name.startswith("__") and name.endswith(".distcp"):
        return (f" (the shards rank {name[2:].split('_')[0]} wrote, of the {world_size} "
                "ranks that wrote them)")
    return ""

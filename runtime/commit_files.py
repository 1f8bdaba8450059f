"""The files of a checkpoint or an export: what a marker lists of them (``entries``: size and
SHA-256), and whether what is on disk is that (``verify``), before anything is read.

Also the format checks of a marker (``check_format``) and the message naming which rank
wrote a missing or changed file (``whose``). ``commit.py`` writes and commits; this module
only reads the file system.
"""

from __future__ import annotations

import hashlib
import os
from typing import Optional

from autoshard.errors import AutoshardError
from autoshard.runtime.commit_ranks import exchange
from autoshard.version import VERSION


def fsync_dir(path: str) -> None:
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


def entries(folder: str, names: Optional[list] = None) -> dict:
    """Every file under ``folder`` (or those of ``names``): relative path -> ``{"bytes": size,
    "sha256": hex}``, what a reader checks before it reads anything (``verify``)."""
    names = listing(folder) if names is None else names
    return {rel: {"bytes": os.path.getsize(os.path.join(folder, rel)),
                  "sha256": sha256(os.path.join(folder, rel))} for rel in names}


def listing(folder: str) -> list:
    """The relative paths (``/``-separated) of every file under ``folder``, sorted."""
    out = []
    for sub, _, names in os.walk(folder):
        out += [os.path.relpath(os.path.join(sub, n), folder).replace(os.sep, "/")
                for n in names]
    return sorted(out)


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _plain(rel) -> bool:
    """``rel`` is a plain relative path: ``/``-separated, no ``..``, ``.`` or empty part, not
    absolute."""
    return (isinstance(rel, str) and bool(rel) and not rel.startswith("/") and "\\" not in rel
            and not os.path.isabs(rel)
            and not any(p in ("", ".", "..") for p in rel.split("/")))


def inside(root: str, rel) -> bool:
    """``rel`` is a plain relative path that stays inside ``root`` once symlinks are
    followed."""
    if not _plain(rel):
        return False
    parts = rel.split("/")
    real_root = os.path.realpath(root)
    return os.path.realpath(os.path.join(root, *parts)) == os.path.join(real_root, *parts)


def _real_files(root: str, tops: set) -> set:
    """The relative paths of the regular files under ``root``'s entries ``tops``, reached
    without following a symlink (one walk, where ``inside`` per file would resolve each)."""
    out = set()
    for top in tops:
        base = os.path.join(root, top)
        if os.path.islink(base):
            continue
        if os.path.isfile(base):
            out.add(top)
            continue
        for sub, _, names in os.walk(base):  # a symlinked folder is listed, not entered
            rel = os.path.relpath(sub, root).replace(os.sep, "/")
            out.update(f"{rel}/{n}" for n in names if not os.path.islink(os.path.join(sub, n)))
    return out


def verify(root: str, files: dict, world_size: int, what: str, agreement=None) -> None:
    """Every file of ``files`` (relative path -> an ``entries`` entry, or a size alone, as
    checkpoints before format 2 recorded) is a plain file inside ``root``, whole and, where a
    SHA-256 is recorded, unchanged; AutoshardError naming the file and what is wrong. With
    ``agreement`` (every rank calls it) each file is hashed by one rank and every rank
    raises the first problem any rank found."""
    if agreement is None or agreement.world == 1 or agreement.fake:
        _verify(root, files, world_size, what, hashed=set(files))
        return
    names = sorted(files)
    problem = None
    try:
        _verify(root, files, world_size, what,
                hashed=set(names[agreement.rank::agreement.world]))
    except AutoshardError as e:
        problem = str(e)
    found = [p for p in exchange(agreement, problem, f"check of the {what} at {root}",
                                  "nothing was read") if p]
    if found:
        raise AutoshardError(found[0])


def _verify(root: str, files: dict, world_size: int, what: str, hashed: set) -> None:
    real = _real_files(root, {rel.split("/")[0] for rel in files if _plain(rel)})
    for rel, entry in files.items():
        full = os.path.join(root, rel)
        if not _plain(rel) or (rel not in real and os.path.lexists(full)):
            raise AutoshardError(
                f"the {what} at {root} lists the file {rel!r}, which is not a plain relative "
                f"path inside it (an absolute path, '..', or a symlink out): the {what} was "
                f"changed, and nothing was read. Copy the {what} again from a source you trust.")
        size, digest = (entry, None) if isinstance(entry, int) else (entry["bytes"],
                                                                     entry["sha256"])
        got = os.path.getsize(full) if rel in real else None
        if got is None:
            raise AutoshardError(f"{full} is missing{whose(rel, world_size)}. Copy the whole "
                                 f"{what} directory, every rank's files included.")
        if got != size:
            raise AutoshardError(
                f"{full} is {got} bytes, but the {what} wrote {size}: it is truncated or was "
                f"changed{whose(rel, world_size)}. Copy it again from the {what}'s source, or "
                f"write the {what} again.")
        if digest is not None and rel in hashed and sha256(full) != digest:
            raise AutoshardError(
                f"{full} does not match the SHA-256 the {what} records{whose(rel, world_size)}"
                f": it is corrupt or was changed after it was written. Copy it again from "
                f"the {what}'s source, or write the {what} again.")


def version() -> str:
    """This autoshard's version (``autoshard.__version__``)."""
    return VERSION


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

"""The files of a checkpoint or an export: what a marker lists of them (``entries``: size and
SHA-256), and whether what is on disk is that (``verify``), before anything is read.

Every file of this layer (markers, lock files, shard files) is opened by ``open_inside``:
relative to its directory, each folder on the way and the file itself without following a
symlink, and refused unless it is a regular file with no other hard link, so nothing outside
the directory is read, written or created through a name inside it. What ``verify`` hashed is
what a load reads: within ``keeping()`` (a ``commit.reading`` block) the descriptors it
hashed stay open, and ``open_checked`` reads through them; a file another rank hashed is
hashed again through the descriptor it is read from.

Also the format checks of a marker (``check_format``) and the message naming which rank
wrote a missing or changed file (``whose``). ``commit.py`` writes and commits; this module
only reads the file system.
"""

from __future__ import annotations

import contextlib
import contextvars
import errno
import hashlib
import io
import json
import os
import stat
from typing import NamedTuple, Optional

from autoshard.core.errors import AutoshardError
from autoshard.runtime import graphcost
from autoshard.runtime.commit_ranks import exchange
from autoshard.core.version import VERSION

_FLAGS = (getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
          | getattr(os, "O_NONBLOCK", 0))  # a FIFO planted at a name never blocks the open
# the directory itself (the caller's path, which may be a symlink), then a folder in it
_ROOT = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)
_DIRECTORY = _ROOT | _FLAGS
# what open(2) says of a symlink it was told not to follow (EMLINK: the BSDs), or of a
# folder on the way that is a symlink or a file
_LINKED = {errno.ELOOP, errno.EMLINK, errno.ENOTDIR}


class Refused(AutoshardError):
    """A name in a checkpoint or export that is not a plain file inside it: a symlink (or one
    on the path), a hard link, a special file, a path out of it."""


def open_inside(root: str, rel: str, flags: int = os.O_RDONLY, mode: int = 0o644, *,
                what: str = "checkpoint or export") -> int:
    """A descriptor of the regular file ``rel`` (``/``-separated) under the directory ``root``,
    opened with ``flags`` (``os.O_CREAT`` makes it there): each folder on the way and the file
    itself opened relative to the one before, never through a symlink. ``Refused`` for a
    symlink, a file with another hard link (its bytes are also a file outside), anything but a
    regular file, or a path that is not plain; OSError as ``os.open`` raises it otherwise."""
    where = os.path.join(root, rel) if isinstance(rel, str) else repr(rel)
    if not _plain(rel):
        raise Refused(f"{where} is not a plain relative path inside {root} (an absolute path, "
                      f"'..', or a NUL byte): the {what} was changed. Copy it again from a "
                      "source you trust.")
    parts = rel.split("/")
    fd = os.open(root, _ROOT)
    try:
        for k, part in enumerate(parts):
            last = k == len(parts) - 1
            try:
                nxt = os.open(part, flags | _FLAGS if last else _DIRECTORY, mode, dir_fd=fd)
            except OSError as e:
                if e.errno not in _LINKED:
                    raise
                which = ("is a symlink" if last else f"is under {'/'.join(parts[:k + 1])}, "
                         "a symlink or not a folder")
                raise Refused(f"{where} {which}: the {what}'s files are opened as plain "
                              "files inside it, never through a symlink. Copy it again from a "
                              "source you trust.") from None
            os.close(fd)
            fd = nxt
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Refused(f"{where} is not a plain file: the {what} was changed. Copy it again "
                          "from a source you trust.")
        if st.st_nlink > 1:
            raise Refused(f"{where} has {st.st_nlink} hard links: its bytes are also a file "
                          f"elsewhere, which a {what} never reads or writes. Copy the {what} "
                          "with a plain copy (cp -r), which gives each file its own bytes.")
        out, fd = fd, -1
        return out
    finally:
        if fd >= 0:
            os.close(fd)


def read_bytes(root: str, rel: str, what: str) -> bytes:
    """The bytes of the file ``rel`` of ``root`` (``open_inside``), or AutoshardError; one
    larger than ``graphcost.DOCUMENT_BYTES`` is refused on the open file, before it is read."""
    where, bound = os.path.join(root, rel), graphcost.DOCUMENT_BYTES
    try:
        fd = open_inside(root, rel, what=what)
    except (OSError, ValueError) as e:
        raise AutoshardError(f"{where} cannot be read "
                             f"({getattr(e, 'strerror', None) or e})") from None
    with os.fdopen(fd, "rb") as f:
        size, limit = os.fstat(fd).st_size, bound.value()
        data = f.read(limit + 1) if size <= limit else b""  # + 1: one that grew meanwhile
    if max(size, len(data)) > limit:
        raise AutoshardError(f"{where} holds {bound.refusal(max(size, len(data)), limit)} "
                             "(checked before reading it)")
    return data


def read_document(root: str, rel: str, what: str):
    """The JSON document ``rel`` of ``root``; AutoshardError naming the file when it cannot
    be read, is larger than ``graphcost.DOCUMENT_BYTES``, is not JSON, or nests too deeply
    for the parser."""
    where = os.path.join(root, rel)
    data = read_bytes(root, rel, what)
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        why = ("nests values too deeply to be read" if isinstance(e, RecursionError) else
               f"cannot be read as JSON ({e})")
        raise AutoshardError(f"{where} {why}: it was changed or cut short. Copy the {what} "
                             "again from its source, or write it again") from None


def fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, _ROOT)
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
    out = {}
    for rel in listing(folder) if names is None else names:
        fd = open_inside(folder, rel)
        try:
            out[rel] = {"bytes": os.fstat(fd).st_size, "sha256": _hash(fd)}
        finally:
            os.close(fd)
    return out


def listing(folder: str) -> list:
    """The relative paths (``/``-separated) of every file under ``folder``, sorted."""
    out = []
    for sub, _, names in os.walk(folder):
        out += [os.path.relpath(os.path.join(sub, n), folder).replace(os.sep, "/")
                for n in names]
    return sorted(out)


def sha256(path: str) -> str:
    """The SHA-256 of the file at ``path``, opened without following a symlink."""
    fd = open_inside(os.path.dirname(path) or ".", os.path.basename(path))
    try:
        return _hash(fd)
    finally:
        os.close(fd)


def _hash(fd: int) -> str:
    h, at = hashlib.sha256(), 0
    while block := os.pread(fd, 1 << 20, at):
        h.update(block)
        at += len(block)
    return h.hexdigest()


def _plain(rel) -> bool:
    """``rel`` is a plain relative path: ``/``-separated, no ``..``, ``.`` or empty part, not
    absolute, no NUL byte."""
    return (isinstance(rel, str) and bool(rel) and not rel.startswith("/") and "\\" not in rel
            and "\0" not in rel and not os.path.isabs(rel)
            and not any(p in ("", ".", "..") for p in rel.split("/")))


def inside(root: str, rel) -> bool:
    """``rel`` is a plain relative path that stays inside ``root`` once symlinks are
    followed."""
    if not _plain(rel):
        return False
    parts = rel.split("/")
    real_root = os.path.realpath(root)
    return os.path.realpath(os.path.join(root, *parts)) == os.path.join(real_root, *parts)


# --- what verify hashed, read through the same descriptors ------------------------------------

class _Checked(NamedTuple):
    fd: Optional[int]  # the descriptor this process hashed, kept open; None: not kept
    size: int
    sha256: Optional[str]  # None: a format-1 checkpoint, sizes alone


# absolute path -> _Checked, of the files verify checked within the current ``keeping()``
_checked: contextvars.ContextVar = contextvars.ContextVar("autoshard_checked", default=None)
_KEPT = 256  # descriptors kept open at most (a load of many ranks' files hashes the rest again)


@contextlib.contextmanager
def keeping():
    """Within the block, the descriptors ``verify`` hashed stay open, and ``open_checked``
    reads the files through them; closed at its end."""
    mine: dict = {}
    token = _checked.set(mine)
    try:
        yield
    finally:
        _checked.reset(token)
        for got in mine.values():
            if got.fd is not None:
                os.close(got.fd)


def _key(root: str, rel: str) -> str:
    return os.path.normpath(os.path.join(os.path.abspath(root), rel))


def open_checked(folder: str, rel: str, what: str) -> io.BufferedReader:
    """The file ``rel`` of ``folder``, for reading, as ``verify`` checked it: through the
    descriptor it hashed, still at that name; a file another rank hashed (or whose descriptor
    was not kept) opened again and hashed through the descriptor returned; a file no
    ``verify`` checked, opened (``open_inside``) as it is. AutoshardError naming the file
    when it cannot be opened or is not what was checked."""
    where = os.path.join(folder, rel)
    got = (_checked.get() or {}).get(_key(folder, rel))
    if got is not None and got.fd is not None:
        try:
            now, held = os.lstat(where), os.fstat(got.fd)
            same = (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino)
        except OSError:
            same = False
        if not same:
            raise AutoshardError(
                f"{where} was replaced (renamed over, removed or made a symlink) after it was "
                f"checked, and was not read: the {what} was changed while it was loaded. Load "
                "it again, from a copy no one changes meanwhile.")
        return io.BufferedReader(_Positioned(got.fd, owned=False))
    try:
        fd = open_inside(folder, rel, what=what)
    except OSError as e:
        raise AutoshardError(f"{where} cannot be read ({e.strerror}): the {what} was changed "
                             "or removed while it was read; load it again") from None
    try:
        if got is not None and (os.fstat(fd).st_size != got.size or (
                got.sha256 is not None and _hash(fd) != got.sha256)):
            raise AutoshardError(
                f"{where} is not the file that was checked when the load began (its size or "
                f"SHA-256 differs now): the {what} was changed while it was read, and this "
                "file was not used. Load it again, from a copy no one changes meanwhile.")
        return io.BufferedReader(_Positioned(fd, owned=True))
    except BaseException:
        os.close(fd)
        raise


class _Positioned(io.RawIOBase):
    """A descriptor read with ``pread`` from a position of its own, so readers of one kept
    descriptor never move each other's offset; ``owned``: closed with the reader."""

    def __init__(self, fd: int, owned: bool):
        super().__init__()
        self.fd, self.owned, self.at = fd, owned, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        data = os.pread(self.fd, len(b), self.at)
        b[:len(data)] = data
        self.at += len(data)
        return len(data)

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self.at,
                os.SEEK_END: os.fstat(self.fd).st_size}[whence]
        self.at = max(0, base + offset)
        return self.at

    def tell(self) -> int:
        return self.at

    def close(self) -> None:
        if not self.closed and self.owned:
            os.close(self.fd)
        super().close()


def verify(root: str, files: dict, world_size: int, what: str, agreement=None) -> None:
    """Every file of ``files`` (relative path -> an ``entries`` entry, or a size alone, as
    checkpoints before format 2 recorded) is a plain file inside ``root`` (``open_inside``),
    whole and, where a SHA-256 is recorded, unchanged; AutoshardError naming the file and
    what is wrong. With ``agreement`` (every rank calls it) each file is hashed by one rank
    (a DCP shard file by the rank that wrote it, which reads it again at the same world size)
    and every rank raises the first problem any rank found. Within ``keeping()`` the
    descriptors hashed here are what a load reads (``open_checked``)."""
    if agreement is None or agreement.world == 1 or agreement.fake:
        _verify(root, files, world_size, what, hashed=set(files))
        return
    problem = None
    try:
        _verify(root, files, world_size, what,
                hashed=_share(sorted(files), agreement.rank, agreement.world))
    except AutoshardError as e:
        problem = str(e)
    found = [p for p in exchange(agreement, problem, f"check of the {what} at {root}",
                                  "nothing was read") if p]
    if found:
        raise AutoshardError(found[0])


def _share(names: list, rank: int, world: int) -> set:
    """The files of ``names`` rank ``rank`` of ``world`` hashes: the DCP shard files of
    the rank of its number (modulo ``world``), every ``world``-th of the others."""
    mine, rest = set(), []
    for rel in names:
        writer = _writer(rel)
        if writer is None:
            rest.append(rel)
        elif writer % world == rank:
            mine.add(rel)
    return mine | set(rest[rank::world])


def _writer(rel: str) -> Optional[int]:
    """The rank that wrote the DCP shard file ``rel`` (``__R_0.distcp``), else None."""
    name = os.path.basename(rel)
    head = name[2:].split("_")[0]
    return int(head) if (name.startswith("__") and name.endswith(".distcp")
                         and head.isdigit()) else None


def _verify(root: str, files: dict, world_size: int, what: str, hashed: set) -> None:
    keep = _checked.get()
    room = _KEPT - sum(c.fd is not None for c in keep.values()) if keep is not None else 0
    for rel, entry in files.items():
        size, digest = (entry, None) if isinstance(entry, int) else (entry["bytes"],
                                                                     entry["sha256"])
        full = os.path.join(root, rel) if isinstance(rel, str) else repr(rel)
        try:
            fd = open_inside(root, rel, what=what)
        except Refused as e:
            raise AutoshardError(
                f"the {what} at {root} lists the file {rel!r}, which is not a plain file inside "
                f"it (an absolute path, '..', a symlink out, a hard link): the {what} was "
                f"changed, and nothing was read. {e}") from None
        except FileNotFoundError:
            raise AutoshardError(f"{full} is missing{whose(rel, world_size)}. Copy the whole "
                                 f"{what} directory, every rank's files included.") from None
        except (OSError, ValueError) as e:
            raise AutoshardError(f"{full} cannot be read ({getattr(e, 'strerror', None) or e})"
                                 f"; copy the {what} again from its source") from None
        kept = False
        try:
            got = os.fstat(fd).st_size
            if got != size:
                raise AutoshardError(
                    f"{full} is {got} bytes, but the {what} wrote {size}: it is truncated or "
                    f"was changed{whose(rel, world_size)}. Copy it again from the {what}'s "
                    f"source, or write the {what} again.")
            mine = rel in hashed
            if digest is not None and mine and _hash(fd) != digest:
                raise AutoshardError(
                    f"{full} does not match the SHA-256 the {what} records"
                    f"{whose(rel, world_size)}: it is corrupt or was changed after it was "
                    f"written. Copy it again from the {what}'s source, or write the {what} "
                    "again.")
            if keep is not None:
                old = keep.get(_key(root, rel))
                if old is not None and old.fd is not None:  # checked again: the new one holds
                    os.close(old.fd)
                    room += 1
                kept = mine and room > 0
                room -= kept
                keep[_key(root, rel)] = _Checked(fd if kept else None, size, digest)
        finally:
            if not kept:
                os.close(fd)


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
    writer = _writer(rel)
    if writer is not None:
        return f" (the shards rank {writer} wrote, of the {world_size} ranks that wrote them)"
    return ""

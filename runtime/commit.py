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

Two jobs at one path, and readers during a write (``fcntl.flock``; a lock ends with its
process):

- One writer at a time. Rank 0 of a write holds an exclusive lock on ``path/.lock`` from the
  token exchange to the end of the sweep, the file naming its host, process id and start
  time. A second job writing to the path meanwhile is refused on every rank, before it
  writes anything, with an ``AutoshardError`` naming that writer. So the sweep after a
  commit removes only folders of writes that ended (replaced, or interrupted), never those
  of a write under way, and the marker always names a folder that is there.
- A reader holds a shared lock on ``path/.lock-data-<token>`` while it reads that folder (a
  module loaded from an export: while the module lives), taken after reading the marker and
  checked against the folder, so a folder swept meanwhile sends it to the marker again. The
  sweep removes a folder only under that file's exclusive lock, taken without waiting: one
  being read stays until a later sweep. A multi-rank load reads rank 0's folder on every rank.
- A lock file exists while someone holds it (its last holder removes it) and is no part of
  the checkpoint or export. Lock files, like the marker's temporary file, are made inside the
  directory and opened there without following a symlink (``commit_files.open_inside``): a
  symlink or hard link planted at such a name is unlinked and the file made anew, so nothing
  outside the directory is created or written through it. Where the file system has no
  flock, writes and reads go on unlocked as before, with a warning; a reader that cannot
  create the lock file (a read-only directory) reads unlocked.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import errno
import json
import os
import shutil
import socket
import stat
import time
import uuid
import warnings
import weakref
from typing import Callable, Optional

from autoshard.core.errors import AutoshardError
from autoshard.runtime.commit_files import (Refused, entries, fsync_dir, inside, keeping,
                                            listing, open_inside, read_document)
from autoshard.runtime.commit_ranks import attempt, differ, exchange, settle

try:
    import fcntl
except ImportError:  # no flock on this platform: writes and reads go on unlocked
    fcntl = None

DATA = "data-"
LOCK = ".lock"  # held by rank 0 of the job writing to the path
READ_LOCK = ".lock-"  # + a data folder's name: held (shared) by each process reading it


def state(path: str, marker: str, other_markers: tuple = ()) -> str:
    """What is at ``path``: "free" (nothing, or an empty directory), "complete" (a marker),
    "interrupted" (data folders and no marker), or a description of what is in the way."""
    if not os.path.exists(path):
        return "free"
    if not os.path.isdir(path):
        return "a file"
    names = [n for n in os.listdir(path) if not is_lock(n)]
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
    (collectives inside are fine); ``document(folder, files)`` runs on rank 0 after every
    rank finished, with ``entries(folder)`` (each file hashed by one rank), and returns the
    marker's content (``"data"`` is added). Returns the data folder."""
    path = _absolute(path, what)
    found = state(path, marker, other_markers)
    agreement(what, f"to {path}: {found}", explain=lambda seen: differ(what, seen))
    if found not in ("free", "complete", "interrupted"):
        raise AutoshardError(f"cannot write the {what} to {path}: it is {found}, not an "
                             f"autoshard {what}. Choose a new path, or remove it first.")
    kept = (f"{path} still holds the previous {what}" if found == "complete" else
            f"nothing was written to {path}")
    doing = f"{what} to {path}"
    lock, busy = _lock_writes(path, what) if agreement.rank == 0 else (None, None)
    try:
        # rank 0's token, or why it cannot write (another job holds the path)
        token = exchange(agreement, {"busy": busy} if busy else uuid.uuid4().hex[:12],
                          doing, kept)[0]
        if isinstance(token, dict):
            raise AutoshardError(f"cannot write the {what} to {path}: another job is writing "
                                 f"to it, {token['busy']}. Nothing of this {what} was "
                                 "written: two jobs writing to one path would delete each "
                                 "other's files. Wait until that write ends, or write to "
                                 "another path.")
        folder = os.path.join(path, DATA + token)
        settle(agreement, attempt(lambda: (_make_folder(folder), write_data(folder)),
                                  agreement.rank),
               doing, kept, folder)
        files = _shared_entries(folder, agreement, doing, kept)
        outcome = attempt(lambda: _commit(path, marker, folder,
                                          lambda f: document(f, files))) if (
            agreement.rank == 0) else {}
        try:
            settle(agreement, outcome, doing, kept, folder)
        except AutoshardError:
            if _committed(path, marker, folder):  # rank 0 was lost after its commit: it stands
                return folder
            raise
        if agreement.rank == 0:
            _sweep(path, spare=os.path.basename(folder))
        return folder
    finally:
        if lock is not None:
            _drop(lock, os.path.join(path, LOCK))


def _absolute(path, what: str) -> str:
    """``path`` made absolute; AutoshardError for one no file system holds (a NUL byte)."""
    path = os.path.abspath(os.fspath(path))
    if "\0" in path:
        raise AutoshardError(f"the {what} path {path!r} holds a NUL byte, which no file name "
                             "can: pass the directory's path as it is spelled on disk")
    return path


def read_marker(path, marker: str, what: str, fields: dict) -> dict:
    """The marker of a complete write at ``path``, each of ``fields`` (name -> type)
    checked, or AutoshardError saying what is wrong and what to do."""
    path = os.fspath(path)
    where = os.path.join(path, marker)
    held = _held.get().get((os.path.abspath(path), marker))  # within ``reading``
    if held is not None:
        doc = copy.deepcopy(held)
    elif not os.path.isdir(path):
        raise AutoshardError(f"{path} is not a directory: pass the directory the {what} "
                             "was written to")
    elif not os.path.isfile(where):
        if state(path, marker) == "interrupted":
            raise AutoshardError(
                f"{path} is an incomplete {what}: a write to it was interrupted before every "
                f"rank finished ({marker}, written last, is missing), and no complete {what} "
                "is there. Use an earlier one, or write it again.")
        raise AutoshardError(f"{where} is missing: {path} is not an autoshard {what}, or its "
                             f"write did not finish ({marker} is written last)")
    else:
        doc = read_document(path, marker, what)
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


def _make_folder(folder: str) -> None:
    """The data folder (every rank makes it; the first one does), refused where a symlink
    was planted at its name: the write would go where it points."""
    os.makedirs(folder, exist_ok=True)
    if os.path.islink(folder) or not os.path.isdir(folder):
        raise AutoshardError(f"{folder} is a symlink or not a folder: it was put there while "
                             "the write began, and nothing is written through it")


def _kind_name(kind) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(k.__name__ for k in kinds)


def _commit(path: str, marker: str, folder: str, document) -> None:
    doc = dict(document(folder), data=os.path.basename(folder))
    tmp = f".{marker}.{os.path.basename(folder)}"
    with os.fdopen(_create(path, tmp, os.O_WRONLY), "w") as f:
        json.dump(doc, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(os.path.join(path, tmp), os.path.join(path, marker))  # renames the name alone
    fsync_dir(path)


def _create(path: str, name: str, flags: int) -> int:
    """A new file ``name`` in the directory ``path`` (the marker's temporary file, no part of
    the checkpoint or export), made there and nowhere else: whatever is at the name (a
    symlink, dangling or not, a hard link to a file elsewhere) is unlinked, never followed or
    written through. OSError when the directory refuses."""
    for _ in range(2):
        try:
            return open_inside(path, name, flags | os.O_CREAT | os.O_EXCL)
        except FileExistsError:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(path, name))  # unlinks a symlink, not its target
    return open_inside(path, name, flags | os.O_CREAT | os.O_EXCL)


def _committed(path: str, marker: str, folder: str) -> bool:
    try:
        return read_document(path, marker, "write").get("data") == os.path.basename(folder)
    except (AutoshardError, AttributeError):
        return False


def _sweep(path: str, spare: str) -> None:
    """Data folders no marker names any more (the previous write, interrupted ones), but
    not ``spare`` (the one just committed) nor one a reader holds (a later sweep removes it);
    lock files left by readers of folders that are gone."""
    for name in os.listdir(path):
        if name.startswith(DATA) and name != spare:
            _remove_unread(path, name)
        elif name.startswith(READ_LOCK + DATA):
            if not os.path.exists(os.path.join(path, name[len(READ_LOCK):])):
                _remove_unread(path, name[len(READ_LOCK):])
        elif name.startswith(".") and DATA in name:  # a marker's temporary file
            try:
                os.remove(os.path.join(path, name))
            except OSError:
                pass


def _remove_unread(path: str, name: str) -> None:
    """The data folder ``name`` (if there) and its lock file, unless a reader holds it."""
    where = os.path.join(path, READ_LOCK + name)
    try:
        fd = _take(where, _EX | _NB)
    except _NoLock:  # no locks here: removed unlocked, as before locks
        fd = -1
    if fd is None:  # being read
        return
    shutil.rmtree(os.path.join(path, name), ignore_errors=True)
    if fd >= 0:
        _drop(fd, where)


# --- locks --------------------------------------------------------------------------------

_SH, _EX, _NB = ((fcntl.LOCK_SH, fcntl.LOCK_EX, fcntl.LOCK_NB) if fcntl is not None
                 else (1, 2, 4))
# flock's answers on a file system without it (some network file systems)
_UNSUPPORTED = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL, errno.ENOSYS}
_TRIES = 20  # a reader's marker reads, each after a write committed and swept its folder
_warned: set = set()


def is_lock(name: str) -> bool:
    """Whether ``name`` (in a checkpoint or export directory) is a lock file."""
    return name == LOCK or name.startswith(READ_LOCK + DATA)


class _NoLock(Exception):
    """No lock at this path: the file system has no flock (``unsupported``), or the lock
    file cannot be made (a read-only directory)."""

    def __init__(self, why: str, unsupported: bool):
        super().__init__(why)
        self.unsupported = unsupported


def _open_lock(where: str) -> int:
    """The lock file ``where``, opened (made if missing) inside its directory and never
    through a symlink or a hard link (``open_inside``): one planted at the name is unlinked
    and the lock file made anew; no one holds a lock through such a name. OSError (or
    ``Refused``, planted again each time) when it cannot be opened."""
    path, name = os.path.split(where)
    for tries in range(3):
        try:
            return open_inside(path, name, os.O_RDWR | os.O_CREAT)
        except PermissionError:  # another user's lock file: a shared lock needs no writing
            return open_inside(path, name, os.O_RDONLY)
        except Refused:
            if tries == 2:
                raise
            with contextlib.suppress(FileNotFoundError):
                st = os.lstat(where)
                if not stat.S_ISREG(st.st_mode) or st.st_nlink > 1:  # still the planted one
                    os.unlink(where)  # the name alone, never what it points at


def _take(where: str, how: int) -> Optional[int]:
    """A descriptor holding ``how`` (``_SH``, ``_EX``, with ``_NB`` not waiting) on the lock
    file ``where``, made if missing; None when ``_NB`` and another holds it. The file may
    lose its name to its last holder between our open and our lock, and a lock on a file no
    longer at ``where`` guards nothing: then it opens again."""
    if fcntl is None:
        raise _NoLock("this platform has no flock", True)
    while True:
        try:
            fd = _open_lock(where)
        except (OSError, Refused) as e:  # Refused: one planted again as it was unlinked
            raise _NoLock(f"cannot open {where} ({getattr(e, 'strerror', None) or e})",
                          False) from None
        try:
            fcntl.flock(fd, how)
        except BlockingIOError:
            os.close(fd)
            return None
        except OSError as e:
            os.close(fd)
            with contextlib.suppress(OSError):  # nobody can hold it: locks do not work here
                os.unlink(where)
            raise _NoLock(f"flock on {where} failed ({e.strerror})",
                          e.errno in _UNSUPPORTED) from None
        if _named(fd, where):
            return fd
        os.close(fd)


def _named(fd: int, where: str) -> bool:
    """Whether the file open as ``fd`` is still the one at ``where``."""
    try:
        a, b = os.fstat(fd), os.lstat(where)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _drop(fd: int, where: str) -> None:
    """Release a lock from ``_take``, removing its file when no one else holds it (taking it
    exclusively without waiting says so; a process that opened it meanwhile finds it
    unnamed, and opens it again)."""
    try:
        fcntl.flock(fd, _EX | _NB)
        if _named(fd, where):
            os.unlink(where)
    except OSError:
        pass
    finally:
        os.close(fd)


def _warn_unlocked(path: str, e: _NoLock, doing: str) -> None:
    if e.unsupported and path not in _warned:
        _warned.add(path)
        warnings.warn(f"autoshard: cannot lock {path} ({e}): {doing} unlocked. Two jobs "
                      "writing to it at once, or a job writing to it while another reads it, "
                      "may delete each other's files: give each job a path of its own.",
                      stacklevel=4)


def _lock_writes(path: str, what: str):
    """Rank 0 of a write: (descriptor, None) holding the writer lock of ``path``; (None,
    who holds it) when another job writes there; (None, None) where no lock can be taken
    (the file system has no flock: a warning says so) or the path cannot be made (the write
    fails there, and says so)."""
    where = os.path.join(path, LOCK)
    try:
        os.makedirs(path, exist_ok=True)
        fd = _take(where, _EX | _NB)
    except _NoLock as e:
        _warn_unlocked(path, e, f"writing the {what}")
        return None, None
    except OSError:
        return None, None
    if fd is None:
        return None, _holder(where)
    with contextlib.suppress(OSError):
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"what": what, "host": socket.gethostname(),
                                 "pid": os.getpid(),
                                 "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}).encode())
    return fd, None


def _holder(where: str) -> str:
    """Who holds the writer lock ``where``, as its file says (written just after the lock
    was taken: an empty file is waited for a moment)."""
    path, name = os.path.split(where)
    for _ in range(50):
        try:
            fd = open_inside(path, name)
            with os.fdopen(fd, "rb") as f:  # a lock's own document is some 150 bytes
                doc = json.loads(f.read(4096) or "null")
        except (OSError, ValueError, RecursionError, AutoshardError):
            doc = None
        if isinstance(doc, dict):
            what = str(doc.get("what", "write"))
            return (f"{'an' if what[:1] in 'aeiou' else 'a'} {what} by pid {doc.get('pid')} "
                    f"on host {doc.get('host')} that started at {doc.get('since')} (it holds "
                    f"{where})")
        time.sleep(0.01)
    return f"a writer that holds {where} and has not said who it is"


# --- readers ------------------------------------------------------------------------------


class Held:
    """A marker as read (``doc``; None where there was none to read) and a shared lock on the
    data folder it names, which keeps any sweep from removing it until ``release()``, the
    object's collection, or the process's end."""

    def __init__(self, path: str, marker: str, doc=None, fd=None, where=None):
        self.path, self.marker, self.doc = path, marker, doc
        self.outlives_block = False  # held after the reading block (``kept``)
        self._release = (weakref.finalize(self, _release, fd, where, os.getpid())
                         if fd is not None else None)

    @property
    def locked(self) -> bool:
        return self._release is not None and self._release.alive

    def release(self) -> None:
        if self._release is not None:
            self._release()

    def kept(self) -> "Held":
        """Hold on after the ``reading`` block (a module loaded from an export, for its
        lifetime)."""
        self.outlives_block = True
        return self


def _release(fd: int, where: str, pid: int) -> None:
    if os.getpid() == pid:
        _drop(fd, where)
    else:  # a forked child's copy of the descriptor: the lock stays the parent's
        os.close(fd)


def hold(path, marker: str, name: Optional[str] = None) -> Held:
    """The marker at ``path`` as read now, and a shared lock on the data folder it names
    (``name``: on that folder, whatever the marker says). A folder gone once the lock is
    taken (a write committed and swept it after the marker was read) sends it to the
    marker again. Without a lock (a read-only directory, no flock) the marker alone."""
    path = os.path.abspath(os.fspath(path))
    doc = None
    for _ in range(_TRIES):
        doc = _raw_marker(path, marker) if name is None else None
        data = name if name is not None else doc.get("data") if isinstance(doc, dict) else None
        if not (isinstance(data, str) and data.startswith(DATA) and os.sep not in data
                and "\0" not in data):
            break  # nothing to hold: read_marker says what is wrong, if anything
        where = os.path.join(path, READ_LOCK + data)
        try:
            fd = _take(where, _SH)
        except _NoLock as e:
            _warn_unlocked(path, e, "reading it")
            break
        if os.path.isdir(os.path.join(path, data)):
            return Held(path, marker, doc, fd, where)
        _drop(fd, where)
        if name is not None:
            break
    return Held(path, marker, doc)


def _raw_marker(path: str, marker: str):
    try:
        return read_document(path, marker, "read")
    except AutoshardError:  # read_marker says what is wrong
        return None


# the markers a ``reading`` block holds: (path, marker) -> the marker as read
_held: contextvars.ContextVar = contextvars.ContextVar("autoshard_held", default={})


@contextlib.contextmanager
def reading(path, marker: str, agreement=None, what: str = "load"):
    """Within the block the data folder of the marker at ``path`` stays on disk, and
    ``read_marker(path, marker)`` returns that marker as it was read, though a write may
    commit meanwhile: the reader reads the previous write or the new one, whole. With
    ``agreement`` (every rank enters it, at ``what``) every rank holds rank 0's folder.
    Yields the ``Held``; ``held.kept()`` holds it on after the block."""
    path = _absolute(path, "checkpoint or export")
    held = hold(path, marker)
    try:
        if agreement is not None and agreement.world > 1 and not agreement.fake:
            held = _follow(agreement, held, what)
        docs = dict(_held.get())
        if isinstance(held.doc, dict):
            docs[(path, marker)] = held.doc
        token = _held.set(docs)
        try:
            with keeping():  # what is hashed in the block is what is read in it
                yield held
        finally:
            _held.reset(token)
    finally:
        if not held.outlives_block:
            held.release()


def _follow(agreement, held: Held, what: str) -> Held:
    """Every rank's ``Held`` of rank 0's folder: rank 0 holds it, so it is there."""
    agreement(what, held.path, explain=lambda seen: differ(what, seen))
    path, doc = exchange(agreement, (held.path, held.doc), f"{what} of {held.path}",
                          "nothing was read")[0]
    if path != held.path or not isinstance(doc, dict) or not isinstance(held.doc, dict) or (
            doc.get("data") == held.doc.get("data")):
        return held
    held.release()
    mine = hold(held.path, held.marker, name=doc.get("data"))
    mine.doc = doc
    return mine


def _shared_entries(folder: str, agreement, doing: str, kept: str) -> dict:
    """``entries(folder)`` on every rank, each file hashed by one rank: rank 0's listing,
    every ``world``-th file from the rank's own index, so the hashing costs each rank its
    share of the bytes, as the write did."""
    names = exchange(agreement, listing(folder) if agreement.rank == 0 else None, doing,
                      kept)[0]
    mine: dict = {}
    share = names[agreement.rank::agreement.world] if not agreement.fake else names
    settle(agreement, attempt(lambda: mine.update(entries(folder, share)), agreement.rank),
           doing, kept, folder)
    files: dict = {}
    for got in exchange(agreement, mine, doing, kept):
        files.update(got)
    return dict(sorted(files.items()))

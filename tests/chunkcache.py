"""Keep CPython 3.11's frame stack from mapping and unmapping memory on every call.

CPython 3.11 and 3.12 free a chunk of a thread's frame stack (16 KiB, from ``mmap``) as soon
as the frame that opened it returns (python/cpython#142183; 3.13 and 3.14 keep one chunk). A
loop whose calls reach just past a chunk's edge then maps and unmaps one per call: where the
depth of pytest's own frames put such an edge inside the loops of tracing and planning, a third
of the suite's CPU time went to that, as system time (test_remat_inplace alone: 1.25 million
``munmap`` calls, 10 of its 28 s; the same test run as a script made 5 thousand).

``activate`` builds ``chunkcache.c``, an arena allocator that keeps up to four freed chunks for
reuse and passes everything else through, installs it in this process, and puts a
``sitecustomize`` beside it on ``PYTHONPATH`` so that every Python process the tests start
(rank processes, torchrun, the CLI) installs it too. The code under test is the same either
way. Without a C compiler or CPython's headers nothing is installed and the suite runs as it
did; ``AUTOSHARD_TEST_CHUNKCACHE=0`` turns it off (to measure it)."""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("chunkcache.c")
SITE = """\
import ctypes, os
try:  # tests/chunkcache.py
    ctypes.PyDLL(os.path.join(os.path.dirname(__file__), "chunkcache.so")).install()
except OSError:
    pass
"""


def activate() -> str:
    """Install the cache here and in the processes started from here; what was done, for
    pytest's header."""
    if os.environ.get("AUTOSHARD_TEST_CHUNKCACHE") == "0":
        return "off (AUTOSHARD_TEST_CHUNKCACHE=0)"
    if sys.implementation.name != "cpython" or sys.version_info < (3, 11):
        return "not needed on this interpreter"
    if sysconfig.get_config_var("Py_GIL_DISABLED"):  # the C code counts on the GIL
        return "not used on a free-threaded build"
    try:
        where = _build()
        ctypes.PyDLL(str(where / "chunkcache.so")).install()
    except (OSError, subprocess.CalledProcessError) as e:
        return f"not built or not loaded ({e}): the suite runs slower"
    path = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if str(where) not in path:
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(where), *path]))
    return f"installed from {where.name}"


def _build() -> Path:
    """The built library and its ``sitecustomize`` in a folder of the temporary directory
    named by the source, the interpreter and the user (built once, then reused; written
    whole; readable by its user alone, as ``mkdtemp`` makes it)."""
    user = str(os.getuid() if hasattr(os, "getuid") else "")
    key = hashlib.sha256(SOURCE.read_bytes() + SITE.encode() + sys.version.encode()
                         + sys.executable.encode() + user.encode()).hexdigest()[:16]
    where = Path(tempfile.gettempdir()) / f"autoshard-chunkcache-{key}"
    if _built(where):
        return where
    include = sysconfig.get_paths()["include"]
    if not Path(include, "Python.h").exists():
        raise OSError(f"no Python.h in {include}")
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise OSError("no C compiler")
    tmp = Path(tempfile.mkdtemp(prefix=where.name + "."))
    try:
        subprocess.run([cc, "-O2", "-shared", "-fPIC", f"-I{include}", "-o",
                        str(tmp / "chunkcache.so"), str(SOURCE)], check=True,
                       capture_output=True)
        (tmp / "sitecustomize.py").write_text(SITE)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        os.replace(tmp, where)
    except OSError:  # built meanwhile by another process (keep theirs), or not ours
        if not _built(where):
            return tmp
        shutil.rmtree(tmp, ignore_errors=True)
    return where


def _built(where: Path) -> bool:
    """Whether ``where`` holds a complete build that this user made and no one else can
    write to (a folder of that name made by another user is not loaded)."""
    try:
        st = where.stat()
    except OSError:
        return False
    uid = os.getuid() if hasattr(os, "getuid") else st.st_uid
    return (st.st_uid == uid and not st.st_mode & 0o022
            and (where / "chunkcache.so").exists() and (where / "sitecustomize.py").exists())

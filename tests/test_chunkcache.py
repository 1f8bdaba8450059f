"""The test processes' frame-stack chunk cache (tests/chunkcache.py): installed in this
process, in rank processes and in Python processes started from here, and it does what it is
for: a loop whose calls cross a chunk's edge stops faulting in fresh memory on every call."""

import ctypes
import os
import subprocess
import sys

import pytest

import chunkcache
from conftest import CHUNKCACHE
from harness import run_ranks

pytestmark = pytest.mark.skipif(not CHUNKCACHE.startswith("installed"), reason=CHUNKCACHE)

# recursion to every depth from 0 to 400 frames, 50 times over: the calls cross the first
# chunk edges above the caller's depth on the way in and out again, whatever that depth is
CROSSING = """
import resource

def down(n):
    return n if n == 0 else down(n - 1)

before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(50):
    for depth in range(400):
        down(depth)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _installed() -> int:
    return ctypes.PyDLL(str(chunkcache._build() / "chunkcache.so")).installed()


def _rank(rank, world, payload):
    return _installed()


def test_installed_here_and_in_rank_processes():
    assert _installed() == 1
    assert run_ranks(2, _rank) == [1, 1]


def _faults(with_cache: bool) -> int:
    env = dict(os.environ)
    if not with_cache:
        env["PYTHONPATH"] = ""
    out = subprocess.run([sys.executable, "-c", CROSSING], env=env, capture_output=True,
                         text=True, timeout=120, check=True)
    return int(out.stdout)


def test_a_loop_across_chunk_edges_reuses_its_chunks():
    without, with_cache = _faults(False), _faults(True)
    # without: at least one fresh page per crossing (seen: 4 per crossing, 80 thousand)
    assert without > 5000, without
    assert with_cache < without / 20, (with_cache, without)


def test_a_folder_others_can_write_is_never_loaded(tmp_path, monkeypatch):
    """The folder's name is predictable: one another user made, or can write to, is passed
    over, and the library is built in a folder of this process's own."""
    monkeypatch.setattr(chunkcache.tempfile, "tempdir", str(tmp_path))
    made = chunkcache._build()
    assert made.parent == tmp_path and chunkcache._built(made)
    made.chmod(0o777)  # anyone may now swap the library
    again = chunkcache._build()
    assert again != made and again.parent == tmp_path and chunkcache._built(again)
    assert oct(again.stat().st_mode & 0o077) == "0o0"

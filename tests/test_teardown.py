"""A script that trains with autoshard on 2 gloo ranks and ends exits 0 on every rank, launched
as a user launches it (torchrun): no "terminate called" abort at interpreter exit. Before
autoshard freed its groups at exit about one run in ten aborted, so the five runs here catch
such a regression about four times in ten; the loop of 200 in the README is the full check.
A rank that fails with a collective in flight still exits at once."""

import os
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "teardown_script.py")


def _run(*args):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         SCRIPT, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("args, runs", [((), 3), (("--own-group",), 2)],
                         ids=["autoshard-group", "own-group"])
def test_a_training_script_that_ends_exits_cleanly_on_every_rank(args, runs):
    """autoshard's group (torchrun's environment) is destroyed by autoshard at exit; the
    script's own group by the script, and autoshard lets go of it at exit."""
    for i in range(runs):
        p = _run(*args)
        assert p.returncode == 0 and "terminate called" not in p.stderr, (i, p.stderr[-3000:])


def test_a_rank_that_fails_with_a_collective_in_flight_exits_at_once():
    """autoshard frees no group while a collective is unwaited: freeing would wait for it up
    to the group's timeout (300 s), and torchrun stops the other ranks only once one exits."""
    t0 = time.perf_counter()
    p = _run("--fail-in-flight")
    assert p.returncode != 0 and "rank 0 failed with a collective in flight" in p.stderr
    assert time.perf_counter() - t0 < 60, p.stderr[-3000:]

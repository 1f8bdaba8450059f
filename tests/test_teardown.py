"""A script that trains with autoshard on 2 gloo ranks and ends exits 0 on every rank, launched
as a user launches it (torchrun): no "terminate called" abort at interpreter exit. Before
autoshard destroyed its groups at exit about one run in ten aborted, so a few runs of each kind
catch a regression often, not always; a loop of 200 is the real check (see the README)."""

import os
import subprocess
import sys

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

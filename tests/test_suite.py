"""The suite's own setup: CI runs every test module, and pytest runs without pytest-xdist."""

import os
import re
import shlex
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _pytest_runs(script: str) -> list:
    """The argument lists of the ``tier`` (pytest) calls of a CI script."""
    return [shlex.split(m.group(1)) for m in re.finditer(r"^tier (.+)$", script, re.M)]


def test_ci_runs_the_readme_command_then_every_other_module():
    runs = _pytest_runs(open(os.path.join(ROOT, ".ci", "run")).read())
    readme = open(os.path.join(ROOT, "README.md")).read()
    command = re.search(r"python -m pytest (.+)$", readme, re.M).group(1)
    assert runs[0] == shlex.split(command), "CI's first tier is the README's test command"
    markers = [r[r.index("-m") + 1] if "-m" in r else None for r in runs]
    # "not slow" then "slow" is every test: no module is left out
    assert markers == ["not slow", "slow"], markers
    assert all(not any(a.endswith(".py") or "::" in a for a in r) for r in runs), runs


def _pytest_without_xdist(*args) -> subprocess.CompletedProcess:
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:xdist", "-p", "no:xdist.looponfail",
         "-p", "no:cacheprovider", "-q", "-W", "error::pytest.PytestUnknownMarkWarning", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTEST_XDIST_WORKER_COUNT": "1"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


def test_pytest_runs_without_xdist():
    """A machine without pytest-xdist (a GPU machine's preinstalled torch, a user's venv)
    runs the suite serially; its hook and its marker are optional in tests/conftest.py."""
    assert "1 passed" in _pytest_without_xdist(
        "tests/test_layers.py::test_no_import_cycle").stdout
    # a module whose tests share a module-scoped fixture gets the xdist_group marker
    assert "tests collected" in _pytest_without_xdist(
        "--collect-only", "tests/runtime/test_graphio.py").stdout

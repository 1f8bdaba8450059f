"""The wheel built from the repository installs the one import name with its subpackages."""

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_wheel_installs_autoshard_with_passes_and_runtime(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation",
         "-q", "-w", str(tmp_path / "dist")],
        check=True, timeout=300,
    )
    wheel = next((tmp_path / "dist").glob("autoshard-*.whl"))
    venv = tmp_path / "venv"
    # system site packages give the venv torch; the wheel itself goes into the venv
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)],
                   check=True, timeout=300)
    py = venv / "bin" / "python"
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", str(wheel)],
                   check=True, timeout=300)
    code = ("import autoshard, autoshard.passes, autoshard.runtime, autoshard.runtime.ops\n"
            "print(autoshard.__file__); print(autoshard.passes.__file__); "
            "print(autoshard.runtime.__file__)")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([str(py), "-c", code], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=300, check=True)
    paths = out.stdout.split()
    assert len(paths) == 3
    for p in paths:
        assert p.startswith(str(venv)), p
    assert paths[1].endswith(os.path.join("autoshard", "passes", "__init__.py"))
    assert paths[2].endswith(os.path.join("autoshard", "runtime", "__init__.py"))

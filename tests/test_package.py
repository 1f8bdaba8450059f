"""The wheel built from the repository installs the one import name with its subpackages, and
the package's public names read the same after either import of ``autoshard``."""

import importlib.util
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_wheel_installs_autoshard_with_passes_and_runtime(tmp_path):
    # build with this environment's setuptools where it has one (no download), else isolated
    isolation = ["--no-build-isolation"] if importlib.util.find_spec("setuptools") else []
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", *isolation,
         "-q", "-w", str(tmp_path / "dist")],
        check=True, timeout=300,
    )
    wheel = next((tmp_path / "dist").glob("autoshard-*.whl"))
    # the wheel alone into a target folder; torch and the rest come from this interpreter
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
                    str(target), str(wheel)], check=True, timeout=300)
    code = ("import autoshard, autoshard.passes, autoshard.runtime, autoshard.runtime.ops\n"
            "print(autoshard.__file__); print(autoshard.passes.__file__); "
            "print(autoshard.runtime.__file__)")
    env = {**os.environ, "PYTHONPATH": str(target)}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300, check=True)
    paths = out.stdout.split()
    assert len(paths) == 3
    for p in paths:
        assert p.startswith(str(target)), p
    assert paths[1].endswith(os.path.join("autoshard", "passes", "__init__.py"))
    assert paths[2].endswith(os.path.join("autoshard", "runtime", "__init__.py"))


def test_the_function_carries_the_package_names():
    import autoshard as package
    from autoshard import autoshard

    assert package.autoshard is autoshard
    for name in package.__all__:
        if name != "autoshard":
            assert getattr(autoshard, name) is getattr(package, name), name

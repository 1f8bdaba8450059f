"""The wheel built from the repository installs the one import name with its subpackages and
the examples the README runs, ``autoshard.__version__`` says which it is, and the package's
public names read the same after either import of ``autoshard``."""

import ast
import importlib
import importlib.metadata
import importlib.util
import os
import pathlib
import re
import subprocess
import sys
import zipfile

import pytest

from autoshard.core import old_names

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """The wheel ``pip wheel .`` builds (not editable), and the folder it is installed in."""
    tmp = tmp_path_factory.mktemp("wheel")
    # build with this environment's setuptools where it has one (no download), else isolated
    isolation = ["--no-build-isolation"] if importlib.util.find_spec("setuptools") else []
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", *isolation,
         "-q", "-w", str(tmp / "dist")],
        check=True, timeout=300,
    )
    built = next((tmp / "dist").glob("autoshard-*.whl"))
    # the wheel alone into a target folder; torch and the rest come from this interpreter
    target = tmp / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
                    str(target), str(built)], check=True, timeout=300)
    return built, target


def _run_installed(target, *args, timeout=300):
    """``python *args`` seeing the installed wheel and not the checkout."""
    env = {**os.environ, "PYTHONPATH": str(target), "OMP_NUM_THREADS": "1",
           "AUTOSHARD_PROGRESS": "0"}
    return subprocess.run([sys.executable, *args], cwd=target.parent, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_wheel_installs_autoshard_with_passes_and_runtime(wheel):
    _, target = wheel
    code = ("import autoshard, autoshard.passes, autoshard.runtime, autoshard.core.ops\n"
            "print(autoshard.__file__); print(autoshard.passes.__file__); "
            "print(autoshard.runtime.__file__)")
    out = _run_installed(target, "-c", code)
    assert out.returncode == 0, out.stderr
    paths = out.stdout.split()
    assert len(paths) == 3
    for p in paths:
        assert p.startswith(str(target)), p
    assert paths[1].endswith(os.path.join("autoshard", "passes", "__init__.py"))
    assert paths[2].endswith(os.path.join("autoshard", "runtime", "__init__.py"))


def test_wheel_holds_every_layer(wheel):
    built, _ = wheel
    names = set(zipfile.ZipFile(built).namelist())
    for module in ("autoshard/examples/__init__.py", "autoshard/examples/gpt_shapes.py",
                   "autoshard/examples/train_gpt.py", "autoshard/passes/__init__.py",
                   "autoshard/runtime/__init__.py", "autoshard/runtime/export.py",
                   "autoshard/front/_reference.py", "autoshard/core/config.py",
                   "autoshard/compiler/capture.py", "autoshard/planner/search.py",
                   "autoshard/check/runs.py", "autoshard/fuzz/spec.py"):
        assert module in names, f"{module} is not in {built.name}"
    assert not any(n.startswith(("examples/", "passes/", "runtime/", "tests/")) for n in names)


def test_the_readme_plan_command_runs_on_the_installed_examples(wheel):
    _, target = wheel
    out = _run_installed(target, "-m", "autoshard", "plan",
                         "autoshard.examples.gpt_shapes:gpt_small", "--world-size", "2",
                         "--summary-only")
    assert out.returncode == 0, out.stderr[-3000:]
    assert re.search(r"^world size\s+2$", out.stdout, re.M), out.stdout
    assert "predicted step time" in out.stdout


def _pyproject_version() -> str:
    text = (ROOT / "pyproject.toml").read_text()
    return re.search(r'^version = "([^"]+)"', text, re.M).group(1)


def test_version_is_the_distribution_version(wheel):
    _, target = wheel
    out = _run_installed(target, "-c", "import autoshard; print(autoshard.__version__)")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == _pyproject_version()
    import autoshard

    assert autoshard.__version__ == _pyproject_version()


def test_version_falls_back_to_pyproject_in_a_checkout_not_installed(monkeypatch):
    import autoshard

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    if not (pathlib.Path(autoshard._root) / "pyproject.toml").is_file():
        pytest.skip("autoshard is imported from an installation, not from a checkout")
    assert autoshard._version() == _pyproject_version()
    monkeypatch.setattr(autoshard, "_root", str(ROOT / "no-such-folder"))
    assert autoshard._version() == "unknown"


def test_the_function_carries_the_package_names():
    import autoshard as package
    from autoshard import autoshard

    assert package.autoshard is autoshard
    for name in package.__all__:
        if name != "autoshard":
            assert getattr(autoshard, name) is getattr(package, name), name
    assert autoshard.load is package.front.files.load  # autoshard.load(...) either way


def _forget(name: str) -> None:
    """Forget the old name ``autoshard.<name>`` (the import bound it on its parent package
    too), so that its next import finds it again."""
    parent, _, child = f"autoshard.{name}".rpartition(".")
    sys.modules.pop(f"autoshard.{name}", None)
    vars(sys.modules[parent]).pop(child, None)


@pytest.mark.parametrize("old", sorted(old_names.OLD_NAMES))
def test_a_modules_name_before_0_5_imports_it_with_a_warning(old):
    """0.5 grouped the package by layer; each old name imports the module itself (a patch
    through either name reaches the same code), saying its new name, until 0.6."""
    new = f"autoshard.{old_names.OLD_NAMES[old]}"
    _forget(old)
    try:
        with pytest.warns(FutureWarning, match=rf"autoshard\.{old} is {new} since autoshard "
                                               rf"0\.5.*stops working in 0\.6"):
            module = importlib.import_module(f"autoshard.{old}")
        assert module is importlib.import_module(new)
        assert module.__spec__.name == new and module.__name__ == new  # its own, kept
    finally:
        _forget(old)


def test_old_names_read_as_attributes_and_from_imports():
    import autoshard as package
    from autoshard.core.errors import AutoshardError

    _forget("errors")
    with pytest.warns(FutureWarning, match="autoshard.core.errors"):
        assert package.errors.AutoshardError is AutoshardError
    _forget("passes.planner")
    with pytest.warns(FutureWarning, match="autoshard.planner since"):
        from autoshard.passes.planner import choose
    from autoshard.planner import choose as now
    assert choose is now
    with pytest.raises(AttributeError, match="no attribute 'errros'"):
        package.errros  # noqa: B018
    _forget("errors")
    _forget("passes.planner")


def test_no_module_of_the_project_imports_an_old_name():
    """The suite runs with the old names' warning as an error (pyproject.toml's
    filterwarnings); this reads the source, imports inside functions too."""
    old = {f"autoshard.{n}" for n in old_names.OLD_NAMES}
    found = []
    sources = (p for d in ("autoshard", "passes", "runtime", "examples", "tests", "bench")
               for p in (ROOT / d).rglob("*.py"))
    for path in sorted(sources):
        if path.name == "test_package.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] + [f"{node.module}.{a.name}" for a in node.names]
                     if isinstance(node, ast.ImportFrom) and node.module else [])
            found += [f"{path.relative_to(ROOT)}:{node.lineno} {n}" for n in names if n in old]
    assert not found, found

"""Private torch APIs are used only through ``autoshard/_compat.py``, and no library module
imports the command line: both read from the source, so a new use fails here by file:line."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("autoshard", "passes", "runtime")
COMPAT = ROOT / "autoshard" / "_compat.py"
# DTensor's internals, whatever the object is named
PRIVATE_ATTRS = {"_local_tensor", "_spec"}


def _sources() -> list:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")
                  if "__pycache__" not in p.parts)


def _dotted(node) -> str:
    """``torch.utils._pytree.tree_map`` for that attribute chain, "" for anything else."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return ""
    return ".".join([node.id, *reversed(parts)])


def _private(name: str) -> bool:
    """A torch name with a private part (``torch._ops``, ``torch.utils._pytree``); ops looked
    up through ``torch.ops`` (``torch.ops.aten._to_copy``) are the operator registry's names."""
    parts = name.split(".")
    if parts[0] != "torch" or parts[1:2] == ["ops"]:
        return False
    return any(p.startswith("_") and not p.startswith("__") for p in parts[1:])


def private_uses(source: str) -> list:
    """(line, what) for each private torch name ``source`` uses."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if _private(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found += [(node.lineno, f"{node.module}.{a.name}") for a in node.names
                      if _private(f"{node.module}.{a.name}")]
        elif isinstance(node, ast.Attribute):
            if node.attr in PRIVATE_ATTRS:
                found.append((node.lineno, f".{node.attr}"))
            elif isinstance(node.value, ast.Name) and _private(_dotted(node)):
                found.append((node.lineno, _dotted(node)))
    return sorted(set(found))


def test_the_scan_finds_every_form_of_private_use():
    src = ("import torch.utils._pytree as p\nfrom torch._ops import OpOverload\n"
           "from torch.utils import _pytree\nx = torch._check(1)\ny = t._local_tensor\n"
           "z = d._spec\nok = torch.ops.aten._to_copy.default\nv = torch.__version__\n"
           "w = torch.nn.Linear\n")
    assert [line for line, _ in private_uses(src)] == [1, 2, 3, 4, 5, 6]


def test_private_torch_apis_only_through_compat():
    bad = []
    for path in _sources():
        if path == COMPAT:
            continue
        for line, what in private_uses(path.read_text()):
            bad.append(f"{path.relative_to(ROOT)}:{line}: {what}")
    assert not bad, "private torch APIs outside autoshard/_compat.py:\n" + "\n".join(bad)


def test_no_library_module_imports_the_command_line():
    bad = []
    for path in _sources():
        if path.name == "__main__.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
                     if isinstance(node, ast.ImportFrom) else [])
            if any(n == "autoshard.__main__" or n.endswith(".__main__") for n in names):
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not bad, "library modules importing the CLI: " + ", ".join(bad)

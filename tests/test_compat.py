"""Private torch APIs are used only through ``autoshard/core/_compat.py``, and no library module
imports the command line: both read from the source, so a new use fails here by file:line."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("autoshard", "passes", "runtime")
COMPAT = ROOT / "autoshard" / "core" / "_compat.py"
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
    assert not bad, "private torch APIs outside autoshard/core/_compat.py:\n" + "\n".join(bad)


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


def _checkpoint_forms():
    """Every way users reach torch.utils.checkpoint: both flavours, Hugging Face's partial
    (non-reentrant by default), checkpoint_wrapper, and the curried form where torch has it."""
    import functools

    import torch
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.utils.checkpoint import checkpoint

    lin = torch.nn.Linear(4, 4)
    forms = {
        "reentrant": lambda x: checkpoint(lin, x, use_reentrant=True),
        "non-reentrant": lambda x: checkpoint(lin, x, use_reentrant=False),
        "hf partial": lambda x: functools.partial(checkpoint, use_reentrant=False)(lin, x),
        "checkpoint_wrapper": checkpoint_wrapper(lin),
    }
    try:  # checkpoint(use_reentrant=False)(fn): added in 2.14
        curried = checkpoint(use_reentrant=False)
    except Exception:  # noqa: BLE001 - older torch calls function=None
        curried = None
    if callable(curried):
        forms["curried"] = lambda x: curried(lin)(x)
    return lin, forms


def test_every_checkpoint_form_runs_as_a_plain_call():
    """Each region calls enter() then leave() once, around the function itself: none of
    torch's checkpoint machinery runs (it would under make_fx, and re-enter the sharded step)."""
    import torch

    from autoshard.core import _compat

    lin, forms = _checkpoint_forms()
    seen = []
    hook = lin.register_forward_hook(lambda *a: seen.append("fn"))
    x = torch.randn(2, 4, requires_grad=True)
    try:
        for name, form in forms.items():
            seen.clear()
            with _compat.transparent_checkpoint(lambda: seen.append("enter"),
                                                lambda: seen.append("leave")):
                out = form(x)
            assert seen == ["enter", "fn", "leave"], f"{name}: {seen}"
            assert "Checkpoint" not in type(out.grad_fn).__name__, name
    finally:
        hook.remove()
    import torch.utils.checkpoint as ckpt  # restored on exit

    assert ckpt.CheckpointFunction.__name__ == "CheckpointFunction"
    assert _compat.checkpoint_implementations()[0] == "CheckpointFunction"
    assert len(_compat.checkpoint_implementations()) >= 2


def test_an_unknown_checkpoint_layout_warns(monkeypatch):
    from autoshard.core import _compat

    monkeypatch.setattr(_compat, "CHECKPOINT_GENERATORS", ("_no_such_generator",))
    import pytest

    with pytest.warns(RuntimeWarning, match="does not know torch"):
        with _compat.transparent_checkpoint(lambda: None, lambda: None):
            pass

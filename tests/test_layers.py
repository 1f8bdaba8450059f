"""The layers of the code, held: every project import (those inside functions too) goes down
the table below or stays within its layer, failing with file:line where one goes against it.
A module's layer is its sub-package of ``autoshard/`` (``passes/``, ``runtime/`` and
``examples/`` sit beside the package and install as ``autoshard.passes``, ...):

    front     the API: front/ (api, calls, files, integrations), check/, fuzz/, examples/,
              the package and the command line
    compiler  compiler/: capture and the compile step
    planner   planner/: the planner, above the passes
    passes    passes/: the runner and the rewrites
    runtime   runtime/: programs, collectives, storage, checkpoints, export, commits
    core      core/: graph and node tags, ops, specs, Config, cost model, plans

passes and runtime do not import each other. Also held: no module imports another module's
private name, and no import cycle, imports inside functions counted. What is left to do is
listed, with its reason, in ``KNOWN`` (an entry that no longer happens fails too, so the list
only shrinks),
and in the imports left inside functions (``INSIDE_FUNCTIONS``, each with its reason: a new
one fails until it is imported at the top of its module or given a reason there)."""

import ast
import os

import networkx as nx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "autoshard")
LAYERS = {"core": "core", "compiler": "compiler", "planner": "planner", "passes": "passes",
          "runtime": "runtime", "front": "front", "check": "front", "fuzz": "front",
          "examples": "front"}
ALLOWED = {"core": {"core"}, "passes": {"core", "passes"}, "runtime": {"core", "runtime"},
           "planner": {"core", "passes", "planner"},
           "compiler": {"core", "planner", "passes", "runtime", "compiler"},
           "front": {"core", "planner", "passes", "runtime", "compiler", "front"}}
# (importer, imported): why it still goes against the table (none left: the export's loader,
# which built the module with autoshard(), is the front door's autoshard.load now)
KNOWN: dict = {}
# (importer, imported): why the import is made inside a function (136 such imports before the
# layers were drawn, 126 after; these 4 statements are what is left, the planner's gone once
# the runner moved out of the package's __init__ into passes/pipeline.py, the export loader's
# once the front door built the loaded module)
INSIDE_FUNCTIONS = {
    ("autoshard.__main__", "autoshard.fuzz"):
        "the command line loads a subcommand's modules when that subcommand runs",
    ("autoshard.__main__", "autoshard.front.demo"):
        "the command line loads a subcommand's modules when that subcommand runs",
    ("autoshard.runtime.inductor", "autoshard.core._compat"):
        "inductor takes seconds to import: only a compiled step pays it",
}


def layer(module: str) -> str:
    parts = module.split(".")
    return LAYERS[parts[1]] if len(parts) > 1 and parts[1] in LAYERS else "front"


# the folders beside the package that install as its sub-packages
BESIDE = ("passes", "runtime", "examples")


def modules() -> dict:
    """Every module of the package: its dotted name -> its path below the checkout."""
    out = {}
    for folder in BESIDE:
        for f in sorted(os.listdir(os.path.join(ROOT, folder))):
            if f.endswith(".py"):
                name = f"autoshard.{folder}" + ("" if f == "__init__.py" else f".{f[:-3]}")
                out[name] = os.path.join(folder, f)
    for folder, dirs, files in os.walk(PACKAGE):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        rel = os.path.relpath(folder, PACKAGE)
        package = "autoshard" if rel == "." else "autoshard." + rel.replace(os.sep, ".")
        for f in sorted(files):
            if f.endswith(".py"):
                name = package if f == "__init__.py" else f"{package}.{f[:-3]}"
                out[name] = os.path.relpath(os.path.join(folder, f), ROOT)
    return out


def test_the_package_holds_no_module_beside_its_layers():
    """autoshard/ holds the package's door and the command line; every other module lives
    in the sub-package of its layer."""
    loose = sorted(f for f in os.listdir(PACKAGE) if f.endswith(".py"))
    assert loose == ["__init__.py", "__main__.py"], loose
    inside = set(LAYERS) - set(BESIDE)
    assert inside <= set(os.listdir(PACKAGE)), inside - set(os.listdir(PACKAGE))


def _targets(mods: dict, importer: str, node) -> list:
    """(module, name or None) for each project module ``node`` imports from."""
    if isinstance(node, ast.Import):
        pairs = [(a.name, None) for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            parts = importer.split(".")
            if not mods[importer].endswith("__init__.py"):
                parts = parts[:-1]
            parts = parts[:len(parts) - node.level + 1]
            base = ".".join(parts + ([base] if base else []))
        pairs = [(base, a.name) for a in node.names]
    out = []
    for base, name in pairs:
        if name and f"{base}.{name}" in mods:
            out.append((f"{base}.{name}", None))
            continue
        while base and base not in mods:
            base = base.rpartition(".")[0]
        if base:
            out.append((base, name))
    return out


def edges() -> list:
    """(importer, imported, name, inside a function, file:line) of every project import."""
    mods, out = modules(), []
    for importer, path in mods.items():
        tree = ast.parse(open(os.path.join(ROOT, path)).read())
        inner = {id(c) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef,
                                                                 ast.AsyncFunctionDef))
                 for c in ast.walk(f) if isinstance(c, (ast.Import, ast.ImportFrom))}
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target, name in _targets(mods, importer, node):
                    if target != importer:
                        out.append((importer, target, name, id(node) in inner,
                                    f"{path}:{node.lineno}"))
    return out


def test_every_import_goes_down_the_layers():
    against = {}
    for importer, target, _, _, where in edges():
        if layer(target) not in ALLOWED[layer(importer)]:
            against.setdefault((importer, target), []).append(where)
    new = {k: v for k, v in against.items() if k not in KNOWN}
    assert not new, "imports against the layers (" + ", ".join(
        f"{layer(a)} -> {layer(b)}: {', '.join(w)}" for (a, b), w in new.items()) + ")"
    gone = set(KNOWN) - set(against)
    assert not gone, f"no longer imported, remove from KNOWN: {sorted(gone)}"


def test_no_private_name_is_imported_across_modules():
    private = [f"{where}: {name} from {target}" for _, target, name, _, where in edges()
               if name and name.startswith("_") and not name.startswith("__")]
    assert not private, private


def test_no_import_cycle():
    """Counting the imports inside functions: one there closes a cycle as surely as one at
    the top, only later (the import order then depends on which call runs first)."""
    where = {}
    for a, b, _, _, at in edges():
        where.setdefault((a, b), []).append(at)
    cycles = list(nx.simple_cycles(nx.DiGraph(list(where))))
    assert not cycles, [" -> ".join(c + c[:1]) + ": " + ", ".join(
        w for a, b in zip(c, c[1:] + c[:1]) for w in where[(a, b)]) for c in cycles]


def test_imports_inside_functions_each_have_a_reason():
    inner = {}
    for importer, target, _, is_inner, where in edges():
        if is_inner:
            inner.setdefault((importer, target), []).append(where)
    new = {k: v for k, v in inner.items() if k not in INSIDE_FUNCTIONS}
    assert not new, ("imports inside functions with no reason in INSIDE_FUNCTIONS: import at "
                     f"the top of the module, or lower the layer of what is imported: {new}")
    gone = set(INSIDE_FUNCTIONS) - set(inner)
    assert not gone, f"no longer imported inside a function, remove: {sorted(gone)}"
    statements = {w for ws in inner.values() for w in ws}
    assert len(statements) <= 4, sorted(statements)


def test_the_layer_table_reads_the_tree():
    layers = {layer(m) for m in modules()}
    assert layers == set(ALLOWED), layers
    assert layer("autoshard.planner") == "planner" and layer("autoshard.front.api") == "front"
    assert layer("autoshard.passes.units") == "passes" and layer("autoshard.fuzz.spec") == "front"
    assert layer("autoshard.core.graph") == "core" and layer("autoshard") == "front"
    assert layer("autoshard.compiler.capture") == "compiler"


# the modules that read the state autoshard() hangs on the model (``model._autoshard``); the
# others are handed what they need of it
STATE_READERS = {"autoshard.front.api", "autoshard.front.calls"}
# (module, why it names the attribute without reading it)
STATE_NAMED = {"autoshard.core.guards": "the tree's guards leave the attribute out, as they "
                                        "leave nn.Module's own bookkeeping"}


def test_only_the_front_door_reads_the_model_state():
    found = {}
    for name, path in modules().items():
        for node in ast.walk(ast.parse(open(os.path.join(ROOT, path)).read())):
            if (isinstance(node, ast.Attribute) and node.attr == "_autoshard") or (
                    isinstance(node, ast.Constant) and node.value == "_autoshard"):
                found.setdefault(name, []).append(f"{path}:{node.lineno}")
    against = {m: w for m, w in found.items() if m not in STATE_READERS | set(STATE_NAMED)}
    assert not against, ("model._autoshard read outside the front door (hand the layer "
                         f"what it needs instead): {against}")
    assert set(STATE_NAMED) <= set(found), set(STATE_NAMED) - set(found)

"""What the code's structure promises: short functions in the library."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
LONGEST = 80  # lines, docstring included

MODULE_LINES = 600


def _library():
    for folder in ("autoshard", "passes", "runtime"):
        yield from sorted((ROOT / folder).rglob("*.py"))


def test_no_library_function_is_longer_than_80_lines():
    long = []
    for path in _library():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > LONGEST:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({n})")
    assert not long, "functions over 80 lines:\n" + "\n".join(long)


def test_no_library_module_is_longer_than_600_lines():
    long = [f"{p.relative_to(ROOT)} ({n})" for p in _library()
            if (n := len(p.read_text().splitlines())) > MODULE_LINES]
    assert not long, "modules over 600 lines (split them by job):\n" + "\n".join(long)


def _returns_a_pair(fn: ast.FunctionDef) -> bool:
    """Whether ``fn`` itself (not a function inside it) returns a tuple somewhere."""
    todo, found = list(fn.body), False
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, ast.Return) and isinstance(node.value, ast.Tuple):
            found = True
        todo.extend(ast.iter_child_nodes(node))
    return found


def test_every_pass_says_what_it_returns():
    """A pass returns its graph, or ``(graph, {field: value})``: its annotation says which."""
    wrong = []
    for path in sorted((ROOT / "passes").glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and node.name.endswith("_pass"):
                said = ast.unparse(node.returns) if node.returns else None
                want = ("tuple[fx.GraphModule, dict]" if _returns_a_pair(node)
                        else "fx.GraphModule")
                if said != want:
                    wrong.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} -> "
                                 f"{said}, returns {want}")
    assert len(wrong) == 0, "\n".join(wrong)

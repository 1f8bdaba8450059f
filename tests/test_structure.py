"""What the code's structure promises: short functions in the library."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
LONGEST = 80  # lines, docstring included


def test_no_library_function_is_longer_than_80_lines():
    long = []
    for folder in ("autoshard", "passes", "runtime"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    n = node.end_lineno - node.lineno + 1
                    if n > LONGEST:
                        long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({n})")
    assert not long, "functions over 80 lines:\n" + "\n".join(long)

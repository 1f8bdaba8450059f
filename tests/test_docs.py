"""The fault table in docs/faults.md names, for each row, a test that keeps it true."""

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_every_row_of_the_fault_table_names_an_existing_test():
    rows = [line for line in (ROOT / "docs" / "faults.md").read_text().splitlines()
            if line.startswith("| ") and not line.startswith("| what goes wrong")]
    assert len(rows) >= 6
    for row in rows:
        ref = re.findall(r"`(tests/[\w/]+\.py)::(\w+)`", row.rsplit("|", 2)[-2])
        assert ref, f"no test named in row: {row[:80]}"
        for path, name in ref:
            tree = ast.parse((ROOT / path).read_text())
            names = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
            assert name in names, f"{path} has no test {name}"

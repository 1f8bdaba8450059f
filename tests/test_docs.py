"""The docs stay true: each row of the fault table in docs/faults.md names an existing test,
and docs/config.md is what its generator writes from the Config docstring."""

import ast
import pathlib
import re

import pytest

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


def test_config_reference_is_what_the_generator_writes():
    from autoshard.front import _reference

    page = ROOT / "docs" / "config.md"
    assert page.read_text() == _reference.render(), (
        "docs/config.md is not what the Config docstring gives; regenerate it with "
        f"`{_reference.COMMAND}` (from the repository root)")


def test_config_reference_names_every_field_once_with_type_and_default():
    import dataclasses

    from autoshard import Config
    from autoshard.front import _reference

    text = _reference.render()
    for f in dataclasses.fields(Config):
        assert text.count(f"\n### `{f.name}`\n") == 1, f.name
        assert f"`{f.name}: {f.type} = {f.default!r}`" in text, f.name
    doc = Config.__doc__
    dropped = re.sub(r"\n    optimizer: .*\n", "\n", doc)
    assert dropped != doc
    with pytest.raises(ValueError, match=r"missing: \['optimizer'\]"):
        _reference.sections(dropped)
    with pytest.raises(ValueError, match="'no_such_field', which is not a field"):
        _reference.sections(doc + "\n    no_such_field: nothing\n")


def test_config_reference_documents_each_option_a_field_carries():
    import autoshard
    from autoshard.front import _reference

    text = _reference.render()
    for cls in (autoshard.Module, autoshard.Size, autoshard.Bucket, autoshard.Prefetch,
                autoshard.Offload):
        assert text.count(f"\n### `{cls.__name__}`\n") == 1, cls.__name__
    assert "`Prefetch(depth: int = 2, bytes: Union[int, str, None] = None)`" in text
    assert ("`Offload(state: Optional[float] = None, params: Optional[float] = None, "
            "pin_memory: bool = True)`") in text


def test_config_reference_check_mode_names_the_command(tmp_path):
    from autoshard.front import _reference

    stale = tmp_path / "config.md"
    stale.write_text("# old\n")
    assert _reference.main(["--check", "--out", str(stale)]) == 1
    assert _reference.main(["--out", str(stale)]) == 0
    assert _reference.main(["--check", "--out", str(stale)]) == 0

"""Loading a checkpoint or an export from someone else runs no code and reads nothing outside
its directory; damage names the file; keys load strictly unless asked otherwise.

Each case is a copy of one checkpoint or export changed as someone who can edit the directory
would (the recorded sizes and SHA-256s recomputed, so only the reader's own rules stop it),
then loaded on one gloo rank (``safe_load_workers.cases``). A planted payload runs a shell
command that creates a file; the tests check that file never appears."""

import pytest

import safe_load_workers
from harness import run_ranks


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    return run_ranks(1, safe_load_workers.cases, str(tmp_path_factory.mktemp("safe")))[0]


def _refused(out, name, *words):
    got = out[name]["outcome"]
    assert got.startswith("AutoshardError"), (name, got)
    for w in words:
        assert w in got, (name, w, got)
    return got


@pytest.mark.parametrize("name, words", [
    ("metadata_payload_checkpoint", ("system", ".metadata", "run code")),
    ("metadata_payload_export", ("system", ".metadata", "run code")),
    ("bytes_payload_checkpoint", ("param_groups", "run code")),
    ("constants_payload_export", ("constants.pt", "run code")),
])
def test_a_planted_pickle_payload_never_runs(out, name, words):
    assert not out[name]["ran"], f"{name}: the payload ran"
    _refused(out, name, *words)


@pytest.mark.parametrize("kind", ["checkpoint", "export"])
@pytest.mark.parametrize("data", ["dotdot", "absolute", "dot"])
def test_a_data_folder_outside_the_directory_is_refused(out, kind, data):
    _refused(out, f"data_{data}_{kind}", "data folder", "inside")


def test_a_data_folder_symlinked_out_is_refused(out):
    _refused(out, "data_symlink_checkpoint", "data folder", "symlink")


def test_a_listed_file_symlinked_out_is_refused(out):
    _refused(out, "file_symlink_checkpoint", ".distcp", "symlink out")


@pytest.mark.parametrize("how", ["dotdot", "absolute"])
def test_a_program_folder_outside_the_export_is_refused(out, how):
    _refused(out, f"program_dir_{how}_export", "not one of the export's own")


def test_a_storage_file_outside_the_folder_is_refused(out):
    _refused(out, "storage_path_checkpoint", ".metadata", "not a plain file name")


def test_a_file_added_to_an_export_is_refused(out):
    _refused(out, "unlisted_file_export", "extra.json", "lists")


@pytest.mark.parametrize("name", ["flipped_shard_checkpoint", "flipped_metadata_checkpoint"])
def test_a_flipped_byte_is_refused_naming_the_file(out, name):
    _refused(out, name, out[name]["file"], "SHA-256")


def test_keys_load_strictly_by_default(out):
    _refused(out, "unexpected_key_strict", "unexpected 1 (model.b.bias)", "strict=False")
    _refused(out, "missing_key_strict", "missing 1 (model.b.bias)", "strict=False")


def test_strict_false_loads_what_both_hold_and_reports_the_rest(out):
    assert out["unexpected_key_not_strict"]["outcome"] == "ok"
    assert out["unexpected_key_not_strict"]["skipped"] == [[[], ["model.b.bias"]]]
    assert out["strict_values"], "the keys both hold were not loaded"
    assert out["missing_key_not_strict"]["outcome"] == "ok"
    assert out["missing_key_not_strict"]["skipped"] == [[["model.b.bias"], []]]


def test_the_untouched_checkpoint_and_export_load(out):
    assert out["clean_checkpoint"]["outcome"] == "ok", out["clean_checkpoint"]
    assert out["clean_export"]["outcome"] == "ok", out["clean_export"]


def test_a_file_another_rank_hashes_is_refused_on_every_rank(tmp_path):
    """Each file is hashed by one rank; the problem it finds is every rank's error."""
    ranks = run_ranks(2, safe_load_workers.shared_check, str(tmp_path))
    for r, got in enumerate(ranks):
        for kind in ("checkpoint", "export"):
            msg = got[kind]["outcome"]
            assert msg.startswith("AutoshardError"), (r, kind, msg)
            assert got[kind]["file"] in msg and "SHA-256" in msg, (r, kind, msg)

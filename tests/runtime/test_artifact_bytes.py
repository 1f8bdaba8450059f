"""What an artifact's files hold is checked before it is used: a tensor a checkpoint's storage
file holds must be of the dtype and shape its metadata says, before any tensor is copied into
the model; a marker or manifest larger than ``AUTOSHARD_MAX_DOCUMENT_BYTES`` is refused before
it is read.

The checkpoint cases are copies of one checkpoint changed as someone who can edit the
directory would (the marker's sizes and SHA-256s recomputed, the metadata kept), loaded on one
gloo rank (``cases``) into a model whose values differ from the checkpoint's."""

from __future__ import annotations

import io
import os
import pickle
import shutil
import time

import pytest
import torch

import autoshard
from autoshard.core.errors import AutoshardError
from autoshard.runtime import commit, dcpio, export_load
from harness import outcome, run_ranks
from safe_load_workers import _data, _rehash_checkpoint
from test_artifact_fs import X, _model

KEY = "model.b.weight"  # read after model.a.*: a load that copied as it went would change them


def _restore(path: str, key: str, change) -> str:
    """The storage file holding ``key``'s chunk given, at the file's end, ``change(tensor)`` in
    place of the tensor it held; the metadata's record of where it lies moved there (what it
    says of the tensor, its dtype, shape and chunks, kept). Returns the storage file."""
    folder = _data(path, "checkpoint.json")
    meta = os.path.join(folder, dcpio.METADATA)
    md = dcpio.read_metadata(meta)
    index = next(i for i in md.storage_data if i.fqn == key)
    info = md.storage_data[index]
    shard = os.path.join(folder, info.relative_path)
    with open(shard, "rb") as f:
        f.seek(info.offset)
        stored = torch.load(io.BytesIO(f.read(info.length)), weights_only=True)
    buf = io.BytesIO()
    torch.save(change(stored), buf)
    with open(shard, "ab") as f:
        info.offset, info.length = f.tell(), len(buf.getvalue())
        f.write(buf.getvalue())
    with open(meta, "wb") as f:
        pickle.dump(md, f)
    _rehash_checkpoint(path)
    return shard


def _weights(model) -> dict:
    return {k: v.full_tensor().clone() for k, v in model.state_dict().items()}


CHANGES = {
    "same": lambda t: t.clone(),  # the forgery itself changes nothing: this one loads
    "dtype": lambda t: t.double(),  # DCP casts it silently
    "wider": lambda t: torch.cat([t, t[:, :1]], 1),  # 4 x 14: DCP cuts it to 4 x 13 silently
    "narrower": lambda t: t[:, :12].clone(),  # 4 x 12: DCP's AssertionError, naming no file
    "not_a_tensor": lambda t: {"w": t},  # DCP's AttributeError
}


def cases(rank, world, root):
    out = {}
    model, opt = _model(0)
    other, other_opt = _model(1)
    theirs = f"{root}/theirs"
    autoshard.save(theirs, other, other_opt)
    for name, change in CHANGES.items():
        path = f"{root}/{name}"
        shutil.copytree(theirs, path)
        shard = _restore(path, KEY, change)
        before = _weights(model)
        got = {"outcome": outcome(lambda: autoshard.load_checkpoint(path, model, opt)),
               "file": shard}
        after = _weights(model)
        got["unchanged"] = all(torch.equal(before[k], after[k]) for k in before)
        got["loaded"] = all(torch.equal(after[k], v) for k, v in _weights(other).items())
        out[name] = got

    # a marker past the document bound (set small here): refused naming it, before reading
    path = f"{root}/bounded"
    shutil.copytree(theirs, path)
    size = os.path.getsize(os.path.join(path, "checkpoint.json"))
    os.environ["AUTOSHARD_MAX_DOCUMENT_BYTES"] = str(size - 1)
    try:
        out["marker_bound"] = {"outcome": outcome(
            lambda: autoshard.load_checkpoint(path, model, opt)), "size": size}
    finally:
        del os.environ["AUTOSHARD_MAX_DOCUMENT_BYTES"]
    out["marker_bound"]["then"] = outcome(lambda: autoshard.load_checkpoint(path, model, opt))
    return out


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    return run_ranks(1, cases, str(tmp_path_factory.mktemp("artifact_bytes")))[0]


def test_a_restored_tensor_of_the_same_dtype_and_shape_loads(out):
    got = out["same"]
    assert got["outcome"] == "ok" and got["loaded"], got


@pytest.mark.parametrize("name, words", [
    ("dtype", ("is of dtype torch.float64, and the metadata gives torch.float32",)),
    ("wider", ("has the shape (4, 14)", "has the sizes (4, 13)")),
    ("narrower", ("has the shape (4, 12)", "has the sizes (4, 13)")),
    ("not_a_tensor", ("is a dict, not a tensor",)),
])
def test_a_stored_tensor_unlike_its_metadata_is_refused_before_any_copy(out, name, words):
    got = out[name]
    msg = got["outcome"]
    assert msg.startswith("AutoshardError"), (name, msg)
    assert f"{got['file']}: {KEY}:" in msg, (name, msg)
    for w in words:
        assert w in msg, (name, w, msg)
    assert got["unchanged"], f"{name}: the model's values changed"


def test_a_marker_past_the_document_bound_is_refused_naming_it(out):
    got = out["marker_bound"]
    assert got["outcome"].startswith("AutoshardError"), got
    assert "checkpoint.json holds" in got["outcome"], got
    assert f"{got['size']:,} bytes in one JSON document" in got["outcome"], got
    assert "AUTOSHARD_MAX_DOCUMENT_BYTES" in got["outcome"], got
    assert got["then"] == "ok", got  # the bound raised (here: its default), it loads


@pytest.mark.parametrize("marker, what", [("checkpoint.json", "checkpoint"),
                                          ("manifest.json", "export")])
def test_a_huge_marker_is_refused_before_it_is_read(tmp_path, marker, what):
    with open(tmp_path / marker, "wb") as f:  # 200 MiB, not JSON: read, it would say so
        f.truncate(200 << 20)
    t0 = time.perf_counter()
    with pytest.raises(AutoshardError, match=rf"{marker} holds 209,715,200 bytes in one JSON "
                       r"document, more than AUTOSHARD_MAX_DOCUMENT_BYTES \(134,217,728\).*"
                       r"checked before reading it"):
        commit.read_marker(str(tmp_path), marker, what, {})
    assert time.perf_counter() - t0 < 1


def test_a_huge_manifest_is_refused_by_the_export_loader(tmp_path):
    with open(tmp_path / "manifest.json", "wb") as f:
        f.truncate(200 << 20)
    with pytest.raises(AutoshardError, match=r"manifest\.json holds 209,715,200 bytes"):
        export_load.read_manifest(str(tmp_path))

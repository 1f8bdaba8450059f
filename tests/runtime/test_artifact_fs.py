"""Nothing outside a checkpoint's or an export's directory is read, written or created through a
name inside it (a symlink, a hard link, a file swapped between its check and its read), and
what a checkpoint's metadata says of each tensor is checked before any of it is read.

Each case is a copy of one checkpoint or export changed as someone who can edit the directory
would, then saved over or loaded on one gloo rank (``cases``). Beside each copy lies a decoy
file outside the directory, whose bytes (or absence) the tests check after the call."""

from __future__ import annotations

import json
import os
import pickle
import shutil

import pytest
import torch
import torch.nn as nn

import autoshard
from autoshard.runtime import commit, commit_files, dcpio
from harness import outcome, run_ranks

DECOY = b"# a file of the user's, outside the checkpoint\n"


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(9, 13), nn.Linear(13, 4)  # a.weight: 13 x 9

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


X = torch.randn(4, 9, generator=torch.Generator().manual_seed(3))


def _model(seed: int):
    torch.manual_seed(seed)
    model = autoshard.autoshard(Net())
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(X).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def _data(path: str, marker: str = "checkpoint.json") -> str:
    with open(os.path.join(path, marker)) as f:
        return os.path.join(path, json.load(f)["data"])


def _rehash(path: str) -> None:
    """checkpoint.json's entries made to match the files again (as an editor of the
    directory would): only the reader's own rules stop what follows."""
    where = os.path.join(path, "checkpoint.json")
    with open(where) as f:
        doc = json.load(f)
    doc["files"] = commit.entries(os.path.join(path, doc["data"]))
    with open(where, "w") as f:
        json.dump(doc, f)


def _shard(path: str, marker: str = "checkpoint.json", sub: str = "") -> str:
    folder = os.path.join(_data(path, marker), sub)
    return os.path.join(folder, next(n for n in sorted(os.listdir(folder))
                                     if n.endswith(".distcp")))


def _weights(model) -> dict:
    return {k: v.full_tensor().clone() for k, v in model.state_dict().items()}


def cases(rank, world, root):
    out = {}
    model, opt = _model(0)
    other, other_opt = _model(1)  # another checkpoint of the same shapes: swapped in
    ckpt, theirs, ex = f"{root}/ckpt", f"{root}/theirs", f"{root}/ex"
    autoshard.save(ckpt, model, opt)
    autoshard.save(theirs, other, other_opt)
    model.export(ex)
    n = [0]

    def copy(src):
        n[0] += 1
        dst = f"{root}/copy{n[0]}"
        shutil.copytree(src, dst, symlinks=True)
        return dst

    def decoy(name):
        where = f"{root}/{name}"
        with open(where, "wb") as f:
            f.write(DECOY)
        return where

    def case(name, fn, decoy_at=None, absent=None):
        before = _weights(model)
        got = {"outcome": outcome(fn)}
        got["unchanged"] = all(torch.equal(before[k], v) for k, v in _weights(model).items())
        if decoy_at is not None:
            with open(decoy_at, "rb") as f:
                got["decoy"] = f.read() == DECOY
        if absent is not None:
            got["absent"] = not os.path.lexists(absent)
        out[name] = got
        return got

    # 1. the writer lock planted as a symlink to, or a hard link of, a file outside
    p = copy(ckpt)
    os.symlink(decoy("bashrc1"), f"{p}/.lock")
    case("writer_lock_symlink", lambda: autoshard.save(p, model, opt), f"{root}/bashrc1")
    p2 = copy(ckpt)
    os.link(decoy("bashrc2"), f"{p2}/.lock")
    case("writer_lock_hardlink", lambda: autoshard.save(p2, model, opt), f"{root}/bashrc2")
    p2b = copy(ckpt)
    os.symlink(f"{root}/made_by_writer", f"{p2b}/.lock")  # dangling
    case("writer_lock_dangling", lambda: autoshard.save(p2b, model, opt),
         absent=f"{root}/made_by_writer")
    out["writer_lock_gone"] = not any(os.path.lexists(f"{q}/.lock") for q in (p, p2, p2b))

    # 2. the marker's temporary file planted at the name the next write uses
    p3 = copy(ckpt)
    token = "feedfacecafe"
    os.symlink(decoy("bashrc3"), f"{p3}/.checkpoint.json.data-{token}")
    real_uuid4 = commit.uuid.uuid4
    commit.uuid.uuid4 = lambda: real_uuid4().__class__(token * 2 + "0" * 8)
    try:
        case("marker_tmp_symlink", lambda: autoshard.save(p3, model, opt), f"{root}/bashrc3")
    finally:
        commit.uuid.uuid4 = real_uuid4

    # ... and a shard file planted in the data folder the next write makes
    p3b = copy(ckpt)
    os.makedirs(f"{p3b}/data-{token}")
    os.symlink(decoy("bashrc3b"), f"{p3b}/data-{token}/__0_0.distcp")
    commit.uuid.uuid4 = lambda: real_uuid4().__class__(token * 2 + "0" * 8)
    try:
        case("shard_planted", lambda: autoshard.save(p3b, model, opt), f"{root}/bashrc3b")
    finally:
        commit.uuid.uuid4 = real_uuid4
    case("shard_planted_kept", lambda: autoshard.load_checkpoint(p3b, model, opt))

    # 3. a read lock planted as a dangling symlink (the load would create its target)
    p4 = copy(ckpt)
    os.symlink(f"{root}/made_by_reader", f"{p4}/.lock-{os.path.basename(_data(p4))}")
    case("read_lock_dangling", lambda: autoshard.load_checkpoint(p4, model, opt),
         absent=f"{root}/made_by_reader")
    e4 = copy(ex)
    os.symlink(f"{root}/made_by_export_reader",
               f"{e4}/.lock-{os.path.basename(_data(e4, 'manifest.json'))}")
    case("read_lock_dangling_export", lambda: autoshard.load(e4),
         absent=f"{root}/made_by_export_reader")
    p4b = copy(ckpt)
    os.link(decoy("bashrc4"), f"{p4b}/.lock-{os.path.basename(_data(p4b))}")
    case("read_lock_hardlink", lambda: autoshard.load_checkpoint(p4b, model, opt),
         f"{root}/bashrc4")

    # 4. the marker, or a shard, a symlink to or a hard link of a file outside
    p5 = copy(ckpt)
    os.rename(f"{p5}/checkpoint.json", f"{root}/marker5")
    os.symlink(f"{root}/marker5", f"{p5}/checkpoint.json")
    case("marker_symlink", lambda: autoshard.load_checkpoint(p5, model, opt))
    p6 = copy(ckpt)
    os.rename(f"{p6}/checkpoint.json", f"{root}/marker6")
    os.link(f"{root}/marker6", f"{p6}/checkpoint.json")
    case("marker_hardlink", lambda: autoshard.load_checkpoint(p6, model, opt))
    e6 = copy(ex)  # the export's DCP folder a symlink to a copy outside (same bytes)
    sub = os.path.join(_data(e6, "manifest.json"), "checkpoint")
    os.rename(sub, f"{root}/dcp6")
    os.symlink(f"{root}/dcp6", sub)
    case("dcp_folder_symlink_export", lambda: autoshard.load(e6))
    out["dcp_folder_symlink_export"]["file"] = os.path.relpath(sub, e6)
    p7 = copy(ckpt)
    shard7 = _shard(p7)
    os.rename(shard7, f"{root}/shard7")
    os.link(f"{root}/shard7", shard7)
    case("shard_hardlink", lambda: autoshard.load_checkpoint(p7, model, opt))
    out["shard_hardlink"]["file"] = shard7

    # 5. a shard swapped between its check and its read: renamed over by another
    # checkpoint's (same size), or made a symlink to it
    for how in ("renamed", "symlink", "export"):
        src = ex if how == "export" else ckpt
        p8 = copy(src)
        if how == "export":
            shard8 = _shard(p8, "manifest.json", "checkpoint")
            swap_from = f"{root}/their_export"
            other.export(swap_from)  # another export of the same shapes
            swap_from = _shard(swap_from, "manifest.json", "checkpoint")
        else:
            shard8 = _shard(p8)
            swap_from = _shard(theirs)
        same_size = os.path.getsize(swap_from) == os.path.getsize(shard8)
        real_verify = commit_files.verify

        def verify_then_swap(root_, files, *args, _s=shard8, _f=swap_from, _h=how, **kwargs):
            real_verify(root_, files, *args, **kwargs)
            if os.path.relpath(_s, root_) in files:  # the check of the shard: swap it now
                if _h == "symlink":
                    os.remove(_s)
                    os.symlink(_f, _s)
                else:
                    shutil.copy(_f, _s + ".new")
                    os.replace(_s + ".new", _s)

        commit_files.verify = verify_then_swap
        try:
            load = (lambda: autoshard.load(p8)) if how == "export" else (
                lambda: autoshard.load_checkpoint(p8, model, opt))
            case(f"swapped_{how}", load)
        finally:
            commit_files.verify = real_verify
        out[f"swapped_{how}"]["file"] = shard8
        out[f"swapped_{how}"]["same_size"] = same_size
        out[f"swapped_{how}"]["swapped"] = os.path.samefile(shard8, swap_from) or (
            open(shard8, "rb").read() == open(swap_from, "rb").read())

    # 6. the metadata of a.weight (13 x 9) edited: a chunk of rows 0-6, another dtype, 13 x 8
    def edited(change):
        p9 = copy(ckpt)
        where = os.path.join(_data(p9), ".metadata")
        md = dcpio.read_metadata(where)
        change(md.state_dict_metadata["model.a.weight"])
        with open(where, "wb") as f:
            pickle.dump(md, f)
        _rehash(p9)
        return p9

    def rows(md):
        chunk = md.chunks[0]
        chunk.sizes = torch.Size([7, *chunk.sizes[1:]])

    def dtype(md):
        md.properties.dtype = torch.float64

    def shape(md):
        md.size = torch.Size([13, 8])
        for chunk in md.chunks:
            chunk.sizes = torch.Size([chunk.sizes[0], 8])

    for name, change in (("rows", rows), ("dtype", dtype), ("shape", shape)):
        p9 = edited(change)
        case(f"metadata_{name}", lambda: autoshard.load_checkpoint(p9, model, opt))
        out[f"metadata_{name}"]["file"] = os.path.join(_data(p9), ".metadata")

    # 7. malformed files: nesting deeper than the parser goes, a NUL byte in a path
    p10 = copy(ckpt)
    with open(f"{p10}/checkpoint.json", "w") as f:
        f.write("[" * 100_000 + "]" * 100_000)
    case("deep_marker", lambda: autoshard.load_checkpoint(p10, model, opt))
    p11 = copy(ckpt)
    with open(f"{p11}/checkpoint.json") as f:
        doc = json.load(f)
    doc["data"] = doc["data"] + "\0x"
    with open(f"{p11}/checkpoint.json", "w") as f:
        json.dump(doc, f)
    case("nul_data", lambda: autoshard.load_checkpoint(p11, model, opt))
    p12 = copy(ckpt)
    with open(f"{p12}/checkpoint.json") as f:
        doc = json.load(f)
    doc["files"] = {k.replace(".distcp", "\0.distcp"): v for k, v in doc["files"].items()}
    with open(f"{p12}/checkpoint.json", "w") as f:
        json.dump(doc, f)
    case("nul_file", lambda: autoshard.load_checkpoint(p12, model, opt))
    case("nul_path_load", lambda: autoshard.load_checkpoint(f"{ckpt}\0x", model, opt))
    case("nul_path_save", lambda: autoshard.save(f"{root}/new\0x", model, opt))

    # the untouched copies still load; saves over the planted ones loaded back; the
    # directory itself may be a symlink (the caller's own path)
    case("clean", lambda: autoshard.load_checkpoint(ckpt, model, opt))
    p13 = copy(ckpt)
    os.symlink(p13, f"{root}/linked")
    case("linked_save", lambda: autoshard.save(f"{root}/linked", model, opt))
    case("linked_load", lambda: autoshard.load_checkpoint(f"{root}/linked", model, opt))
    e13 = copy(ex)
    os.symlink(e13, f"{root}/linked_export")
    case("linked_export", lambda: autoshard.load(f"{root}/linked_export")(X))
    case("saved_over", lambda: autoshard.load_checkpoint(p, model, opt))
    case("clean_export", lambda: autoshard.load(ex)(X))
    return out


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    return run_ranks(1, cases, str(tmp_path_factory.mktemp("artifact_fs")))[0]


def _refused(got: dict, *words) -> str:
    msg = got["outcome"]
    assert msg.startswith("AutoshardError"), msg
    for w in words:
        assert w in msg, (w, msg)
    assert got["unchanged"], "a refused load changed the model"
    return msg


@pytest.mark.parametrize("how", ["symlink", "hardlink"])
def test_saving_over_a_planted_writer_lock_writes_nothing_outside(out, how):
    got = out[f"writer_lock_{how}"]
    assert got["outcome"] == "ok", got
    assert got["decoy"], "the file the lock pointed at was written"


def test_a_dangling_writer_lock_creates_nothing_outside(out):
    got = out["writer_lock_dangling"]
    assert got["outcome"] == "ok", got
    assert got["absent"], "the write created the file the dangling lock named"
    assert out["writer_lock_gone"], "a lock file was left behind"


def test_a_planted_marker_temporary_file_is_not_written_through(out):
    got = out["marker_tmp_symlink"]
    assert got["outcome"] == "ok", got
    assert got["decoy"], "the marker's temporary file was written through the symlink"


def test_a_shard_file_planted_in_the_next_data_folder_is_not_written_through(out):
    got = out["shard_planted"]
    assert got["decoy"], "the save wrote through the planted shard file"
    assert got["outcome"].startswith("AutoshardError") and "FileExistsError" in got["outcome"]
    assert "still holds the previous checkpoint" in got["outcome"], got["outcome"]
    assert out["shard_planted_kept"]["outcome"] == "ok", out["shard_planted_kept"]


@pytest.mark.parametrize("name", ["read_lock_dangling", "read_lock_dangling_export"])
def test_a_dangling_read_lock_creates_nothing_outside(out, name):
    got = out[name]
    assert got["outcome"] == "ok", got
    assert got["absent"], "the load created the file the dangling lock named"


def test_a_hard_linked_read_lock_leaves_the_file_outside_alone(out):
    got = out["read_lock_hardlink"]
    assert got["outcome"] == "ok", got
    assert got["decoy"]


@pytest.mark.parametrize("name, words", [
    ("marker_symlink", ("checkpoint.json", "symlink")),
    ("marker_hardlink", ("checkpoint.json", "hard links")),
])
def test_a_marker_that_is_a_link_is_refused(out, name, words):
    _refused(out[name], *words)


def test_a_folder_on_the_path_that_is_a_symlink_is_refused(out):
    got = out["dcp_folder_symlink_export"]
    _refused(got, f"is under {got['file']}, a symlink")


def test_a_hard_linked_shard_is_refused(out):
    _refused(out["shard_hardlink"], out["shard_hardlink"]["file"], "hard link")


@pytest.mark.parametrize("how", ["renamed", "symlink", "export"])
def test_a_shard_swapped_after_its_check_is_refused(out, how):
    got = out[f"swapped_{how}"]
    assert got["same_size"], "the swapped-in shard differs in size: the size check would tell"
    assert got["swapped"], "the shard was not swapped: the case tests nothing"
    _refused(got, got["file"])
    assert "replaced" in got["outcome"] or "symlink" in got["outcome"], got["outcome"]


@pytest.mark.parametrize("name, words", [
    ("rows", ("do not cover", "rows held: 0-6, of 13")),
    ("dtype", ("torch.float64", "torch.float32")),
    ("shape", ("(13, 8)", "(13, 9)")),
])
def test_metadata_that_does_not_describe_the_tensor_is_refused(out, name, words):
    got = out[f"metadata_{name}"]
    _refused(got, got["file"], "model.a.weight", *words)


@pytest.mark.parametrize("name, words", [
    ("deep_marker", ("checkpoint.json", "nests values too deeply")),
    ("nul_data", ("checkpoint.json", "data folder")),
    ("nul_file", ("\\x00.distcp", "not a plain")),
    ("nul_path_load", ("NUL",)),
    ("nul_path_save", ("NUL",)),
])
def test_malformed_files_are_autoshard_errors_naming_the_file(out, name, words):
    _refused(out[name], *words)


@pytest.mark.parametrize("name", ["clean", "saved_over", "clean_export", "linked_save",
                                  "linked_load", "linked_export"])
def test_untouched_and_saved_over_copies_load(out, name):
    assert out[name]["outcome"] == "ok", out[name]


def _save_one_rank(rank, world, root):
    """World 1: a checkpoint, and another of the same shapes (the swapped-in shard)."""
    for seed, name in ((0, "ckpt"), (1, "theirs")):
        model, opt = _model(seed)
        autoshard.save(f"{root}/{name}", model, opt)


def _swap_on_two_ranks(rank, world, root):
    """World 2 loads the world-1 checkpoint: rank 0 hashed its one shard (and reads it through
    that descriptor), rank 1 reads rows of it without having hashed it (so hashes it again as
    it opens it). Rank 0 renames the other checkpoint's shard over it once both checked it."""
    import torch.distributed as dist

    model, opt = _model(2)
    shard, swap_from = _shard(f"{root}/ckpt"), _shard(f"{root}/theirs")
    same_size = os.path.getsize(shard) == os.path.getsize(swap_from)
    real_verify = commit_files.verify

    def verify_then_swap(*args, **kwargs):
        real_verify(*args, **kwargs)  # its exchange: every rank checked every file
        if rank == 0:
            shutil.copy(swap_from, shard + ".new")
            os.replace(shard + ".new", shard)

    before = _weights(model)
    commit_files.verify = verify_then_swap
    try:
        got = outcome(lambda: autoshard.load_checkpoint(f"{root}/ckpt", model, opt))
    finally:
        commit_files.verify = real_verify
    dist.barrier()
    return {"outcome": got, "file": shard, "same_size": same_size,
            "unchanged": all(torch.equal(before[k], v) for k, v in _weights(model).items())}


def test_a_shard_swapped_after_its_check_is_refused_on_every_rank(tmp_path):
    run_ranks(1, _save_one_rank, str(tmp_path))
    got = run_ranks(2, _swap_on_two_ranks, str(tmp_path))
    assert got[0]["same_size"], "the swapped-in shard differs in size: the size check would tell"
    for r in (0, 1):
        msg = _refused(got[r], "failed on ranks 0, 1")
        assert f"rank 0: AutoshardError: {got[r]['file']} was replaced" in msg, msg
        assert f"rank 1: AutoshardError: {got[r]['file']} is not the file that was checked" in (
            msg), msg

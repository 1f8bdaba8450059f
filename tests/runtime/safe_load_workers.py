"""What the rank of the safe-load tests runs: a checkpoint and an export of a small model, each
copied and changed as an attacker who can edit the directory would (hashes recomputed), and
loaded. Each case returns the outcome ("ok" or the error) and whether a planted payload ran."""

from __future__ import annotations

import glob
import json
import os
import pickle
import shutil

import torch
import torch.nn as nn

import autoshard
from autoshard.runtime import commit, dcpio
from harness import outcome


class Net(nn.Module):
    def __init__(self, bias: bool = True):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4, bias=bias)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


X = torch.randn(4, 8, generator=torch.Generator().manual_seed(7))


class Payload:
    """Unpickled, it runs a shell command that creates ``path``."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def _model(bias: bool = True):
    torch.manual_seed(0)
    model = autoshard.autoshard(Net(bias))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(X).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    return model, opt



def _data(path: str, marker: str) -> str:
    with open(os.path.join(path, marker)) as f:
        return os.path.join(path, json.load(f)["data"])


def _rehash_checkpoint(path: str) -> None:
    """checkpoint.json's file entries made to match the files again."""
    where = os.path.join(path, "checkpoint.json")
    with open(where) as f:
        doc = json.load(f)
    doc["files"] = commit.entries(os.path.join(path, doc["data"]))
    with open(where, "w") as f:
        json.dump(doc, f)


def _rehash_export(path: str) -> None:
    from autoshard.runtime import export

    where = os.path.join(path, "manifest.json")
    with open(where) as f:
        doc = json.load(f)
    doc["files"] = {f"{doc['data']}/{rel}": e
                    for rel, e in commit.entries(os.path.join(path, doc["data"])).items()}
    doc["hash"] = export._content_hash(doc["files"])
    with open(where, "w") as f:
        json.dump(doc, f)


def _edit_marker(path: str, marker: str, **fields) -> None:
    where = os.path.join(path, marker)
    with open(where) as f:
        doc = json.load(f)
    doc.update(fields)
    with open(where, "w") as f:
        json.dump(doc, f)


def _plant_metadata(folder: str, sentinel: str) -> None:
    """The folder's DCP .metadata rewritten to run a command as it is unpickled, then give the
    real metadata (a load that runs it reports success with exact values)."""
    where = os.path.join(folder, ".metadata")
    md = dcpio.read_metadata(where)
    md.storage_meta.modules = [Payload(sentinel)]
    with open(where, "wb") as f:
        pickle.dump(md, f)


def cases(rank, world, root):
    out = {}
    model, opt = _model()
    ckpt, ex = f"{root}/ckpt", f"{root}/ex"
    autoshard.save(ckpt, model, opt)
    model.export(ex)

    def copy(src, name):
        dst = f"{root}/{name}"
        shutil.copytree(src, dst)
        return dst

    def case(name, fn, sentinel=None):
        out[name] = {"outcome": outcome(fn),
                     "ran": sentinel is not None and os.path.exists(sentinel)}

    # 1. a pickle payload in DCP's .metadata, of a checkpoint and of an export
    p = copy(ckpt, "meta_ckpt")
    _plant_metadata(_data(p, "checkpoint.json"), f"{root}/ran_meta_ckpt")
    _rehash_checkpoint(p)
    case("metadata_payload_checkpoint", lambda: autoshard.load_checkpoint(p, model, opt),
         f"{root}/ran_meta_ckpt")
    p2 = copy(ex, "meta_ex")
    _plant_metadata(os.path.join(_data(p2, "manifest.json"), "checkpoint"), f"{root}/ran_meta_ex")
    _rehash_export(p2)
    case("metadata_payload_export", lambda: autoshard.load(p2), f"{root}/ran_meta_ex")

    # 2. a payload in a value DCP stores as bytes (an optimizer's param group entry): the
    # writer pickles it as it is; DCP's own planner would unpickle it with weights_only=False
    p3 = f"{root}/bytes_ckpt"
    opt.param_groups[0]["extra"] = Payload(f"{root}/ran_bytes")
    autoshard.save(p3, model, opt)
    opt.param_groups[0]["extra"] = 0
    case("bytes_payload_checkpoint", lambda: autoshard.load_checkpoint(p3, model, opt),
         f"{root}/ran_bytes")
    del opt.param_groups[0]["extra"]

    # 3. a payload in an export's constants.pt
    p4 = copy(ex, "constants_ex")
    for f in glob.glob(os.path.join(_data(p4, "manifest.json"), "programs", "*",
                                    "constants.pt")):
        torch.save({"joint": {"c": Payload(f"{root}/ran_constants")}}, f)
    _rehash_export(p4)
    case("constants_payload_export", lambda: autoshard.load(p4)(X), f"{root}/ran_constants")

    # 4. paths out of the directory
    for name, data in (("dotdot", ".."), ("absolute", os.path.abspath(ckpt)), ("dot", ".")):
        p5 = copy(ckpt, f"data_{name}_ckpt")
        _edit_marker(p5, "checkpoint.json", data=data)
        case(f"data_{name}_checkpoint", lambda: autoshard.load_checkpoint(p5, model, opt))
        p6 = copy(ex, f"data_{name}_ex")
        _edit_marker(p6, "manifest.json", data=data)
        case(f"data_{name}_export", lambda: autoshard.load(p6))
    p7 = copy(ckpt, "symlink_ckpt")
    outside = copy(_data(ckpt, "checkpoint.json"), "outside_data")
    shutil.rmtree(_data(p7, "checkpoint.json"))
    os.symlink(outside, _data(p7, "checkpoint.json"))
    case("data_symlink_checkpoint", lambda: autoshard.load_checkpoint(p7, model, opt))

    # a listed file that is a symlink to a copy outside (same bytes, so only the link tells)
    p7b = copy(ckpt, "file_symlink_ckpt")
    shard = glob.glob(os.path.join(_data(p7b, "checkpoint.json"), "*.distcp"))[0]
    shutil.copy(shard, f"{root}/outside_shard")
    os.remove(shard)
    os.symlink(f"{root}/outside_shard", shard)
    case("file_symlink_checkpoint", lambda: autoshard.load_checkpoint(p7b, model, opt))

    # the export's program folder pointing at another copy (graphs that compute otherwise)
    elsewhere = copy(ex, "elsewhere")
    for name, where in (("dotdot", os.path.relpath(_data(elsewhere, "manifest.json"), ex)),
                        ("absolute", _data(elsewhere, "manifest.json"))):
        p8 = copy(ex, f"program_{name}_ex")
        with open(os.path.join(p8, "manifest.json")) as f:
            doc = json.load(f)
        for e in doc["programs"]:
            e["dir"] = f"{where}/programs/0".replace(os.sep, "/")
        with open(os.path.join(p8, "manifest.json"), "w") as f:
            json.dump(doc, f)
        case(f"program_dir_{name}_export", lambda: autoshard.load(p8)(X))

    # a storage file the metadata names outside the folder
    p9 = copy(ckpt, "storage_ckpt")
    meta = os.path.join(_data(p9, "checkpoint.json"), ".metadata")
    md = dcpio.read_metadata(meta)
    for info in md.storage_data.values():
        info.relative_path = f"../../{os.path.basename(ckpt)}/{info.relative_path}"
    with open(meta, "wb") as f:
        pickle.dump(md, f)
    _rehash_checkpoint(p9)
    case("storage_path_checkpoint", lambda: autoshard.load_checkpoint(p9, model, opt))

    # a file added to the export's data folder
    p10 = copy(ex, "unlisted_ex")
    with open(os.path.join(_data(p10, "manifest.json"), "programs", "0", "extra.json"),
              "w") as f:
        f.write("{}")
    case("unlisted_file_export", lambda: autoshard.load(p10))

    # 5. one byte flipped (same size) in a shard and in .metadata
    for name, pattern in (("shard", "*.distcp"), ("metadata", ".metadata")):
        p11 = copy(ckpt, f"flip_{name}_ckpt")
        target = glob.glob(os.path.join(_data(p11, "checkpoint.json"), pattern))[0]
        raw = bytearray(open(target, "rb").read())
        raw[len(raw) // 2] ^= 0x01
        open(target, "wb").write(bytes(raw))
        case(f"flipped_{name}_checkpoint", lambda: autoshard.load_checkpoint(p11, model, opt))
        out[f"flipped_{name}_checkpoint"]["file"] = os.path.basename(target)

    # 6. keys: a checkpoint of a model with b.bias into one without it
    small, small_opt = _model(bias=False)
    case("unexpected_key_strict", lambda: autoshard.load_checkpoint(ckpt, small))
    skipped = []
    case("unexpected_key_not_strict",
         lambda: skipped.append(autoshard.load_checkpoint(ckpt, small, strict=False)))
    out["unexpected_key_not_strict"]["skipped"] = [list(s) for s in skipped]
    out["strict_values"] = torch.equal(small.a.weight.full_tensor(),
                                       model.a.weight.full_tensor())
    small_ckpt = f"{root}/small"
    autoshard.save(small_ckpt, small)
    case("missing_key_strict", lambda: autoshard.load_checkpoint(small_ckpt, model))
    skipped2 = []
    case("missing_key_not_strict",
         lambda: skipped2.append(autoshard.load_checkpoint(small_ckpt, model, strict=False)))
    out["missing_key_not_strict"]["skipped"] = [list(s) for s in skipped2]

    # the untouched checkpoint and export still load
    case("clean_checkpoint", lambda: autoshard.load_checkpoint(ckpt, model, opt))
    case("clean_export", lambda: autoshard.load(ex)(X))
    return out


def shared_check(rank, world, root):
    """World 2: a byte flipped in a file the other rank hashes (each file is hashed by one
    rank) is still an error on every rank, naming the file, for a checkpoint and an export."""
    import torch.distributed as dist

    model, opt = _model()
    out = {}
    for kind, path, marker in (("checkpoint", f"{root}/ck", "checkpoint.json"),
                               ("export", f"{root}/ex", "manifest.json")):
        if kind == "checkpoint":
            autoshard.save(path, model, opt)
        else:
            model.export(path)
        data = _data(path, marker)
        names = [n for n in commit.listing(data) if n.endswith(".distcp")]
        # a shard file that rank 1 hashes: the one it wrote (each rank hashes its own)
        target = next(n for n in names if os.path.basename(n).startswith("__1_"))
        if rank == 0:
            full = os.path.join(data, target)
            raw = bytearray(open(full, "rb").read())
            raw[len(raw) // 2] ^= 0x01
            open(full, "wb").write(bytes(raw))
        dist.barrier()
        if kind == "checkpoint":
            got = outcome(lambda: autoshard.load_checkpoint(path, model, opt))
        else:
            got = outcome(lambda: autoshard.load(path))
        out[kind] = {"outcome": got, "file": os.path.basename(target)}
    return out

"""Export and load: a model whose module is gone afterwards loads in fresh processes and
trains on, bitwise at the export's world size and within 1e-6 at world sizes 1 and 4.

One world-2 run builds each model from a module written for the test, trains 2 steps,
compiles the per-rank batches the other world sizes use (the global batch stays 4), exports,
and trains 3 more steps (the uninterrupted run). The module file is then deleted; fresh
world-2, world-4 and world-1 runs load each export and train the same 3 steps.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

import export_workers
from harness import run_ranks, train_step

import autoshard
from autoshard.core.errors import AutoshardError
from autoshard.core.models import gpt_loss
from autoshard.runtime import commit_files
from autoshard.runtime import export as export_mod
from autoshard.runtime import export_format
from autoshard.core.spec import ParamSpec

MODULE = "autoshard_export_test_models"
SOURCE = '''
"""The user's code: model classes of its own, gone when the exports are loaded."""
import torch
from transformers import LlamaForCausalLM, MixtralForCausalLM

from autoshard.core.models import GPT, tiny_hf


class UserGPT(GPT):
    pass


class UserLlama(LlamaForCausalLM):
    pass


class UserMixtral(MixtralForCausalLM):
    pass


def gpt():
    torch.manual_seed(0)
    return UserGPT(vocab=96, layers=2)


def hf_llama():
    torch.manual_seed(0)
    return UserLlama(tiny_hf("llama", 96).config)


def hf_mixtral():
    torch.manual_seed(0)
    return UserMixtral(tiny_hf("mixtral", 96).config)
'''
NAMES = ("gpt", "hf_llama", "hf_mixtral")
GLOBAL, SEQ, VOCAB = 4, 16, 96
TRAINED, MORE = 2, 3  # steps before the export, steps after it


def _data(step, world, rank):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randint(0, VOCAB, (GLOBAL, SEQ), generator=g)
    return x.chunk(world)[rank], torch.roll(x, -1, 1).chunk(world)[rank]


def _call(name, model, x):
    return model(x) if name == "gpt" else model(input_ids=x)


def _logits(out):
    return out.logits if hasattr(out, "logits") else out


def _step(name, model, opt, step, rank, world, device="cpu") -> float:
    x, y = (t.to(device) for t in _data(step, world, rank))
    return train_step(gpt_loss(_logits(_call(name, model, x)), y), opt, world)


def _eval(name, model, rank, world):
    """Logits in eval mode without gradients (the inference program), gathered."""
    x, _ = _data(99, world, rank)
    with torch.no_grad():
        out = _call(name, model, x)
    logits = _logits(out)
    parts = [torch.empty_like(logits) for _ in range(world)]
    dist.all_gather(parts, logits.contiguous())
    return torch.cat(parts), type(out).__qualname__


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.5)


# --- ranks --------------------------------------------------------------------------------


def _export_and_train(rank, world, root):
    sys.path.insert(0, root)
    user = importlib.import_module(MODULE)
    out = {}
    for name in NAMES:
        model = autoshard.autoshard(getattr(user, name)())
        opt = _sgd(model)
        losses = [_step(name, model, opt, s, rank, world) for s in range(TRAINED)]
        for batch in (GLOBAL // 4, GLOBAL):  # what each rank of world 4 and world 1 gets
            x = torch.zeros(batch, SEQ, dtype=torch.long)
            model.precompile(x) if name == "gpt" else model.precompile(input_ids=x)
        t0 = time.perf_counter()
        model.export(os.path.join(root, name))
        seconds = time.perf_counter() - t0
        model.eval()
        logits, kind = _eval(name, model, rank, world)
        model.train()
        losses += [_step(name, model, opt, s, rank, world) for s in range(TRAINED, TRAINED + MORE)]
        out[name] = {"losses": losses, "keys": list(model.state_dict()), "eval": logits,
                     "output": kind, "export_s": seconds}
    return out


def _load_and_train(rank, world, root):
    gone = MODULE not in sys.modules and importlib.util.find_spec(MODULE) is None
    out = {}
    for name in NAMES:
        t0 = time.perf_counter()
        model = autoshard.load(os.path.join(root, name))
        loaded_s = time.perf_counter() - t0
        opt = _sgd(model)
        t0 = time.perf_counter()
        losses = [_step(name, model, opt, s, rank, world) for s in range(TRAINED, TRAINED + MORE)]
        steps_s = time.perf_counter() - t0
        out[name] = {
            "stored_graphs": model._autoshard.exported.same,
            "losses": losses, "keys": list(model.state_dict()), "load_s": loaded_s,
            "steps_s": steps_s,
            "dtensors": all(isinstance(p, DTensor) for p in model.parameters()),
            "optimizer_holds_them": all(
                a is b for a, b in zip(opt.param_groups[0]["params"], model.parameters())),
        }
        if world == 2:
            try:
                _call(name, model, torch.zeros(3, SEQ, dtype=torch.long))
            except AutoshardError as e:
                out[name]["unknown_call"] = str(e)
            inf = autoshard.load(os.path.join(root, name), inference=True)
            out[name]["eval"], out[name]["output"] = _eval(name, inf, rank, world)
            x, _ = _data(99, world, rank)
            plain = _logits(_call(name, inf, x))  # no torch.no_grad(): the load knows
            out[name]["plain_call"] = not plain.requires_grad and torch.equal(
                plain, out[name]["eval"].chunk(world)[rank])
            out[name]["forward_only"] = inf._autoshard.last.bwd is None
            out[name]["inference_training"] = inf.training
    out["gone"] = gone and MODULE not in sys.modules
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("export"))
    with open(os.path.join(root, f"{MODULE}.py"), "w") as f:
        f.write(SOURCE)
    exported = run_ranks(2, _export_and_train, root)
    os.remove(os.path.join(root, f"{MODULE}.py"))
    shutil.rmtree(os.path.join(root, "__pycache__"), ignore_errors=True)
    # fresh processes: none of them has imported the deleted module
    loaded = {w: run_ranks(w, _load_and_train, root, fresh=True) for w in (2, 4, 1)}
    return root, exported, loaded


# --- the proof ----------------------------------------------------------------------------


def test_the_module_is_gone_when_loading(runs):
    _, _, loaded = runs
    assert all(r[0]["gone"] for r in loaded.values())


@pytest.mark.parametrize("name", NAMES)
def test_same_world_size_trains_on_bitwise(runs, name):
    _, exported, loaded = runs
    ref = exported[0][name]
    got = loaded[2][0][name]
    assert got["stored_graphs"]  # the export's own graphs ran, not a new plan
    assert got["losses"] == ref["losses"][TRAINED:], (got["losses"], ref["losses"])
    assert got["keys"] == ref["keys"]
    assert got["dtensors"] and got["optimizer_holds_them"]


@pytest.mark.parametrize("world", [1, 4])
@pytest.mark.parametrize("name", NAMES)
def test_other_world_sizes_train_on(runs, name, world):
    _, exported, loaded = runs
    ref = exported[0][name]["losses"][TRAINED:]
    got = loaded[world][0][name]
    assert not got["stored_graphs"]  # planned again for this world size
    diff = max(abs(a - b) for a, b in zip(got["losses"], ref))
    assert diff <= 1e-6, (world, got["losses"], ref)
    assert got["keys"] == exported[0][name]["keys"] and got["dtensors"]


@pytest.mark.parametrize("name", NAMES)
def test_inference_load_runs_the_forward_only_program(runs, name):
    _, exported, loaded = runs
    got, ref = loaded[2][0][name], exported[0][name]
    assert got["forward_only"] and not got["inference_training"] and got["plain_call"]
    assert torch.equal(got["eval"], ref["eval"])
    assert got["output"] == ref["output"]
    expected = "Tensor" if name == "gpt" else "CausalLMOutputWithPast"  # Moe... for Mixtral
    assert ref["output"].endswith(expected)


def test_the_directory_holds_what_it_says(runs):
    root, _, _ = runs
    path = os.path.join(root, "hf_llama")
    manifest = export_mod.read_manifest(path)
    assert manifest["world_size"] == 2 and manifest["device"] == "cpu"
    assert manifest["mesh_shape"] == [2] and manifest["version"] == export_mod.VERSION == 4
    assert {p["training"] for p in manifest["programs"]} == {True, False}
    assert len(manifest["programs"]) == 6  # three batches, each trained and in inference
    for entry in manifest["programs"]:
        files = os.listdir(os.path.join(path, entry["dir"]))
        graphs = {"joint.json", "forward.json"} | ({"backward.json"} if entry["grad"] else set())
        assert graphs <= set(files) and "program.json" in files
    data = os.path.join(path, manifest["data"])
    shards = [f for f in os.listdir(os.path.join(data, "checkpoint")) if f.endswith(".distcp")]
    assert sorted(shards) == ["__0_0.distcp", "__1_0.distcp"]
    # no file names a class of the user's module
    for rel in manifest["files"]:
        if rel.endswith(".json"):
            with open(os.path.join(path, rel)) as f:
                assert MODULE not in f.read(), rel


def test_a_call_the_export_does_not_hold_lists_those_it_holds(runs):
    _, _, loaded = runs
    msg = loaded[2][0]["gpt"]["unknown_call"]
    assert "holds no program for this call:\n  args[0] int64[3, 16] (train, grad)" in msg
    assert "args[0] int64[2, 16] (train, grad)" in msg
    assert "args[0] int64[2, 16] (eval, no grad)" in msg


# --- every strategy, a 2-D mesh, and the format before version 3 ---------------------------


def _as_version_2(src, dst) -> None:
    """The export at ``src`` copied to ``dst`` as format version 2 wrote it: placements
    "S0"/"R", no ``replica``, no group names, no mesh shape in the manifest."""
    shutil.copytree(src, dst)
    manifest = json.loads((dst / "manifest.json").read_text())
    for entry in manifest["programs"]:
        rel = f"{entry['dir']}/program.json"
        doc = json.loads((dst / rel).read_text())
        del doc["groups"]
        for p in doc["captured"]["params"]:
            del p["replica"]
            p["placements"] = ["S0" if pl == "Shard(0)" else "R" for pl in p["placements"]]
        (dst / rel).write_text(json.dumps(doc, indent=1))
        manifest["files"][rel] = {"bytes": (dst / rel).stat().st_size,
                                  "sha256": commit_files.sha256(str(dst / rel))}
    del manifest["mesh_shape"]
    manifest.update(version=2, hash=export_mod._content_hash(manifest["files"]))
    (dst / "manifest.json").write_text(json.dumps(manifest))


@pytest.fixture(scope="module")
def strategies(tmp_path_factory):
    """Each case of ``export_workers.CASES`` exported by 4 ranks, then loaded by 4 fresh
    ranks (on the export's mesh shape) and by 2 (a 1-D mesh: planned again)."""
    root = tmp_path_factory.mktemp("strategies")
    exported = run_ranks(4, export_workers.export_cases, str(root))
    _as_version_2(root / "ddp", root / "ddp_v2")
    return {"export": exported[0],
            4: run_ranks(4, export_workers.load_cases, str(root), fresh=True)[0],
            2: run_ranks(2, export_workers.load_cases, str(root), fresh=True)[0]}


def _same_step(ref, got, tol) -> None:
    """The probe's logits, loss and every gradient agree within ``tol`` (0: bit for bit)."""
    pairs = [("logits", ref["logits"], got["logits"]), ("loss", ref["loss"], got["loss"])]
    pairs += [(f, ref["grads"][f], got["grads"][f]) for f in ref["grads"]]
    assert set(got["grads"]) == set(ref["grads"])
    for what, a, b in pairs:
        diff = (a - b).abs().max().item()
        assert diff <= tol and (tol or torch.equal(a, b)), (what, diff)


@pytest.mark.parametrize("name", export_workers.LOADED)
def test_every_strategy_and_a_2d_mesh_load_on_their_mesh_bit_for_bit(strategies, name):
    strategy, shape = export_workers.LOADED[name]
    ref, got = strategies["export"][name.removesuffix("_v2")], strategies[4][name]
    assert "refused" not in got, got.get("refused")
    assert got["same"]  # the stored graphs ran
    _same_step(ref, got, 0)
    assert got["strategy"] == ref["strategy"] and got["placements"] == ref["placements"]
    assert got["replicas"] == ref["replicas"]  # ZeRO-1's replicas came back
    if strategy == "auto":
        assert ref["strategy"] in ("zero1", "zero2", "zero3")
    else:
        assert ref["strategy"] == strategy
    assert bool(ref["replicas"]) == (ref["strategy"] == "zero1")
    assert got["mesh_shape"] == ref["mesh_shape"] == list(shape)
    if len(shape) == 2:
        # each collective of the stored graphs runs on this process's group of the mesh
        # dimension it ran on when exported (an all-reduce across the replicas, the
        # all-gathers and reduce-scatters within one). The names themselves are counters of
        # each process, which the two processes may or may not have advanced alike.
        assert len(got["groups"]) == 2
        assert got["collectives"] == ref["collectives"]
        assert {d for dims in got["collectives"].values() for d in dims} == {0, 1}
    # hpZ: the chunks and backward all-gathers run on each loading rank's own group of 2
    assert got["reshard_to"] == ref["reshard_to"] == ([2] if name == "hpz" else [0])


@pytest.mark.parametrize("name", export_workers.LOADED)
def test_every_strategy_and_a_2d_mesh_load_at_another_world_size(strategies, name):
    ref, got = strategies["export"][name.removesuffix("_v2")], strategies[2][name]
    assert "refused" not in got, got.get("refused")
    assert not got["same"]  # planned again for 2 ranks on a 1-D mesh
    _same_step(ref, got, 1e-6)
    # "auto" searches the strategies again for 2 ranks, and may choose another
    assert got["strategy"] == ref["strategy"] or export_workers.LOADED[name][0] == "auto"
    assert bool(got["replicas"]) == (got["strategy"] == "zero1")


def test_a_version_2_parameter_description_reads_as_before():
    old = {"fqn": "w", "shape": [4, 2], "dtype": "float32", "requires_grad": True,
           "compute_dtype": "bfloat16", "reduce_dtype": "float32", "mesh_shape": [2],
           "placements": ["S0"], "device": "host", "grad_divide": None, "force_sum": False}
    spec = export_format.spec_from_doc(old, 2)
    assert spec == ParamSpec("w", (4, 2), torch.float32, True, torch.bfloat16, torch.float32,
                             mesh_shape=(2,), device="host")
    assert spec.placements == (Shard(0),) and not spec.replica
    with pytest.raises(AutoshardError, match=r"cannot be read \(ParamSpec 'w': no field"):
        export_format.spec_from_doc(old, 3)


# --- what a bad export says -------------------------------------------------------------


def _copy(runs, tmp_path, name="gpt"):
    root, _, _ = runs
    dst = tmp_path / name
    shutil.copytree(os.path.join(root, name), dst)
    return dst


def _folder(path):
    """The data folder of the export at ``path``, which its manifest names."""
    return path / json.loads((path / "manifest.json").read_text())["data"]


def test_a_truncated_file_is_named(runs, tmp_path):
    path = _copy(runs, tmp_path)
    target = _folder(path) / "programs" / "0" / "forward.json"
    target.write_bytes(target.read_bytes()[:100])
    with pytest.raises(AutoshardError, match=r"forward\.json is 100 bytes.*truncated"):
        export_mod.read_manifest(path)


def test_a_corrupt_file_is_named(runs, tmp_path):
    path = _copy(runs, tmp_path)
    target = _folder(path) / "checkpoint" / "__0_0.distcp"
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0xFF
    target.write_bytes(bytes(data))
    with pytest.raises(AutoshardError, match=r"__0_0\.distcp does not match the SHA-256"):
        export_mod.read_manifest(path)


def _refused(path, match: str) -> None:
    """Reading the export at ``path`` fails with an error matching ``match``."""
    with pytest.raises(AutoshardError, match=match):
        export_mod.read_manifest(path)


def test_a_missing_rank_shard_is_named(runs, tmp_path):
    path = _copy(runs, tmp_path)
    os.remove(_folder(path) / "checkpoint" / "__1_0.distcp")
    _refused(path, r"__1_0\.distcp is missing \(the shards rank 1 wrote, of the 2 ranks")


def test_a_version_mismatch_is_named(runs, tmp_path):
    path = _copy(runs, tmp_path)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["version"] = export_mod.VERSION + 1
    (path / "manifest.json").write_text(json.dumps(manifest))
    _refused(path, rf"manifest\.json is export format version {export_mod.VERSION + 1} \("
             r"written by autoshard .*\); this autoshard .* reads versions 1, 2, 3")


def test_the_manifest_is_checked_field_by_field(runs, tmp_path):
    path = _copy(runs, tmp_path)
    good = json.loads((path / "manifest.json").read_text())
    for change, match in [
        (lambda m: m.pop("files"), r"has no field 'files'"),
        (lambda m: m.update(world_size="2"), r"field 'world_size' is str \(2\), not int"),
        (lambda m: m["programs"][0].pop("dir"), r"program 0 has no str field 'dir'"),
        (lambda m: m.update(data="elsewhere"), r"names the data folder 'elsewhere'"),
    ]:
        manifest = json.loads(json.dumps(good))
        change(manifest)
        (path / "manifest.json").write_text(json.dumps(manifest))
        _refused(path, match)


def test_another_torch_or_autoshard_version_warns_naming_both(runs, tmp_path):
    path = _copy(runs, tmp_path)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest.update(torch="2.99.0", autoshard="9.9")
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.warns(UserWarning, match=r"written by torch 2\.99\.0 \(this process: "
                      r"2\.\d+.*autoshard 9\.9 \(this process"):
        export_mod.read_manifest(path)


def test_an_unfinished_export_is_named(runs, tmp_path):
    path = _copy(runs, tmp_path)
    os.remove(path / "manifest.json")
    with pytest.raises(AutoshardError, match=r"is an incomplete export: a write to it was "
                       r"interrupted before every rank finished"):
        export_mod.read_manifest(path)
    (path / "manifest.json").write_text("{not json")
    with pytest.raises(AutoshardError, match=r"manifest\.json cannot be read"):
        export_mod.read_manifest(path)


# --- across device types (a GPU machine; skipped without CUDA) ------------------------------


def _export_here(rank, world, root):
    """World 1 on this process's mesh device (gloo: CPU; torchrun environment: CUDA)."""
    model = autoshard.autoshard(_tiny_gpt())
    device = model._autoshard.device
    x, y = (t.to(device) for t in _data(0, world, rank))
    model(x)
    model.export(os.path.join(root, device.type))
    return _train_three(model, device)


def _load_here(rank, world, payload):
    root, made_on = payload
    model = autoshard.load(os.path.join(root, made_on))
    return _train_three(model, model._autoshard.device)


def _tiny_gpt():
    from autoshard.core.models import GPT

    torch.manual_seed(0)
    return GPT(vocab=VOCAB, layers=2)


def _train_three(model, device) -> list:
    opt = _sgd(model)
    return [_step("gpt", model, opt, s, 0, 1, device) for s in range(TRAINED, TRAINED + MORE)]


@pytest.mark.gpu
def test_an_export_moves_between_cpu_and_gpu(tmp_path):
    root = str(tmp_path)
    on_cpu = run_ranks(1, _export_here, root)[0]  # gloo: a CPU mesh
    on_gpu = run_ranks(1, _export_here, root, torchrun_env=True)[0]  # NCCL: a CUDA mesh
    cpu_from_gpu = run_ranks(1, _load_here, (root, "cuda"), fresh=True)[0]
    gpu_from_cpu = run_ranks(1, _load_here, (root, "cpu"), torchrun_env=True)[0]
    # the same model and data on either device: losses agree to float rounding
    for got in (on_gpu, cpu_from_gpu, gpu_from_cpu):
        assert max(abs(a - b) for a, b in zip(got, on_cpu)) <= 1e-4, (got, on_cpu)


# --- programs keyed the same on every device type ---------------------------------------------

LEGACY_KEYS = {"cpu": "(('cpu', False, None),)",  # before 0.3, on a CPU and on a GPU
               "cuda": "(('cuda', False, None), ('cpu', False, None))"}


def _export_tiny_and_train(rank, world, root):
    model = autoshard.autoshard(_tiny_gpt())
    x, _ = _data(0, world, rank)
    model(x)
    model.export(root)
    return _train_three(model, torch.device("cpu"))


def test_a_program_key_names_no_device_type_and_older_keys_still_load(tmp_path):
    """An export made on a GPU is found on a CPU: a program's key names the autocast state
    of "the device" and "the host", not of "cuda" and "cpu" (on the first GPU run the
    cross-device test failed: a GPU's key never matched a CPU's call). Exports written
    before, keyed by device type either way, still load and train the same."""
    from autoshard.core import _compat

    assert _compat.autocast_state("cuda") == _compat.autocast_state("cpu")
    root = str(tmp_path / "e")
    trained = run_ranks(1, _export_tiny_and_train, root)[0]
    manifest = json.loads((tmp_path / "e" / "manifest.json").read_text())
    key = manifest["programs"][0]["key"]
    neutral = repr(_compat.autocast_state("cpu"))
    assert neutral in key and "cuda" not in key, key
    for legacy in LEGACY_KEYS.values():
        old = tmp_path / f"old{len(legacy)}"
        shutil.copytree(root, old)
        m = json.loads((old / "manifest.json").read_text())
        for e in m["programs"]:
            e["key"] = e["key"].replace(neutral, legacy)
        (old / "manifest.json").write_text(json.dumps(m))
        got = run_ranks(1, _load_here, (str(tmp_path), old.name), fresh=True)[0]
        assert got == trained, (legacy, got, trained)

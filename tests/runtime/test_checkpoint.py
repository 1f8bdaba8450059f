"""Checkpoints as FSDP2 users write them: DCP save and load of the model and the AdamW state
at the same and at other world sizes, full state dicts both ways, and per-rank shard files
refused on another rank or world size.

Trajectory: N steps, save, M more steps at world size 2 (global batch 4, each rank its
chunk). A resume in fresh processes at world size 2 equals it bit for bit (losses and final
parameters). At world sizes 1 and 4 the loaded model and optimizer state equal the saved
state bit for bit; the continued losses and parameters differ only by the data-parallel
reduction order (per-rank means are averaged over another number of ranks), within TOL.

Ranks are spawned four times: world 2 (train, save), world 4 (load, save again), world 2
(fresh: resume; load the world-4 save; full state dicts), world 1 (load the world-2 save).
"""

import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map_only

from autoshard import autoshard
from autoshard.core.models import GPT, gpt_loss
from harness import run_ranks, train_step

N, M = 3, 3
BATCH = 4
TOL = 1e-5
FULL = StateDictOptions(full_state_dict=True)


class Net(GPT):
    """A one-block GPT (tied head) with 95 vocabulary rows (uneven shards on 2 and 4 ranks),
    a (3, 95) logit bias (an empty shard on rank 3 of 4), a scalar (replicated) and a frozen
    position embedding (no optimizer state)."""

    def __init__(self):
        super().__init__(vocab=95, layers=1)
        self.extra = nn.Parameter(torch.randn(3, 95) * 0.02)
        self.gain = nn.Parameter(torch.tensor(1.0))
        self.wpe.weight.requires_grad_(False)

    def forward(self, idx):
        return super().forward(idx) * self.gain + self.extra.mean(0)


def _build(seed=0):
    torch.manual_seed(seed)
    model = autoshard(Net())
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _step(model, opt, step, rank, world) -> float:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randint(0, 95, (BATCH, 16), generator=g)
    loss = gpt_loss(model(x.chunk(world)[rank]), torch.roll(x, -1, 1).chunk(world)[rank])
    return train_step(loss, opt, world)


def _dcp_save(path, model, opt):
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
             checkpoint_id=path)


def _dcp_load(path, model, opt):
    """FSDP2's recipe, unchanged."""
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])


def _full(model, opt) -> dict:
    """A copy of the full model and optimizer state (a collective: every rank calls it).
    Tensors that are not sharded (AdamW's step) come back as the live objects: cloned."""
    state = {"model": model.full_state_dict(),
             "optim": get_optimizer_state_dict(model, opt, options=FULL)}
    return tree_map_only(torch.Tensor, torch.clone, state)


def _locals(model) -> dict:
    return {k: v.to_local().clone() for k, v in model.state_dict().items()}


def _refused(model, sd) -> str:
    before = _locals(model)
    try:
        model.load_state_dict(sd)
    except ValueError as e:
        after = _locals(model)
        assert all(torch.equal(before[k], after[k]) for k in before), "a refused load wrote"
        return str(e)
    return ""


def _same_objects(model, opt) -> bool:
    """The optimizer holds the model's parameters (not copies of them)."""
    held = [p for g in opt.param_groups for p in g["params"]]
    params = list(model.parameters())
    return len(held) == len(params) and all(a is b for a, b in zip(held, params))


# --- ranks --------------------------------------------------------------------------------


def _train_and_save(rank, world, root):
    """World 2: the uninterrupted run, with a DCP save and per-rank shard files after N."""
    model, opt = _build()
    losses = [_step(model, opt, s, rank, world) for s in range(N)]
    _dcp_save(f"{root}/ckpt2", model, opt)
    saved = _full(model, opt)
    torch.save(model.state_dict(), f"{root}/w2_rank{rank}.pt")
    dist.barrier()
    other = torch.load(f"{root}/w2_rank{1 - rank}.pt")  # weights_only: DTensors load
    refusals = {
        "other_rank": _refused(model, other),
        "local_tensors": _refused(model, {k: v.to_local() for k, v in other.items()}),
    }
    own = torch.load(f"{root}/w2_rank{rank}.pt")
    model.load_state_dict(own)  # this rank's own file loads
    model.load_state_dict(model.state_dict())
    losses += [_step(model, opt, s, rank, world) for s in range(N, N + M)]
    final = model.full_state_dict()  # a collective: every rank
    return {"losses": losses, "final": final, "saved": saved,
            "refusals": refusals} if rank == 0 else {"refusals": refusals}


def _resume(rank, world, root):
    """Fresh processes at world 1 or 4 (or 2): build, load the world-2 save, continue M steps.
    World 4 also saves again (DCP and shard files) for the world-2 run to load."""
    model, opt = _build(seed=1)  # other initial values: the load must overwrite them
    _dcp_load(f"{root}/ckpt2", model, opt)
    loaded = _full(model, opt)
    if world == 4:
        autoshard.save(f"{root}/ckpt4", model, opt)
        torch.save(model.state_dict(), f"{root}/w4_rank{rank}.pt")
    before = [p.to_local().clone() for p in model.parameters() if p.requires_grad]
    losses = [_step(model, opt, s, rank, world) for s in range(N, N + M)]
    moved = all(not torch.equal(a, p.to_local()) for a, p in
                zip(before, [p for p in model.parameters() if p.requires_grad]) if a.numel())
    out = {"losses": losses, "final": model.full_state_dict(), "loaded": loaded,
           "same_objects": _same_objects(model, opt), "moved": moved}
    return out if rank == 0 else {"same_objects": out["same_objects"], "moved": moved}


def _resume_w2(rank, world, root):
    """World 2, fresh: the bitwise resume, the world-4 save, full state dicts both ways."""
    out = _resume(rank, world, root)
    # the save made at world 4 loads at world 2
    model, opt = _build(seed=2)
    autoshard.load_checkpoint(f"{root}/ckpt4", model, opt)
    out["from4"] = _full(model, opt)
    out["refusals"] = {"other_world": _refused(model, torch.load(f"{root}/w4_rank{rank}.pt"))}

    # full tensors in: an unsharded model's state_dict(), a torch.load of one, and DCP's helper
    torch.manual_seed(3)
    plain = Net()
    ref = {k: v.detach().clone() for k, v in plain.state_dict().items()}
    torch.save(plain.state_dict(), f"{root}/plain{rank}.pt")
    ok = {}
    for how in ("load_state_dict", "torch_load", "set_model_state_dict", "assign"):
        model, opt = _build(seed=4)
        if how == "load_state_dict":
            model.load_state_dict(plain.state_dict())
        elif how == "assign":  # copied into the parameters all the same
            model.load_state_dict(plain.state_dict(), assign=True)
        elif how == "torch_load":
            model.load_state_dict(torch.load(f"{root}/plain{rank}.pt"))
        else:
            set_model_state_dict(model, dict(ref), options=FULL)  # it rewrites the dict given
        full = model.full_state_dict()
        local = model.state_dict()
        ok[how] = (all(torch.equal(full[k], ref[k]) for k in ref)
                   and all(torch.equal(local[k].to_local(),
                                       ref[k].chunk(world)[rank] if ref[k].dim() else ref[k])
                           for k in ref if local[k].to_local().numel())
                   and model.head.weight is model.wte.weight and _same_objects(model, opt))
    # full tensors out: an unsharded copy equals the sharded model
    copy = Net()
    copy.load_state_dict(model.full_state_dict())
    ok["unsharded_copy"] = all(torch.equal(copy.state_dict()[k], ref[k]) for k in ref)
    offloaded = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    ok["cpu_offload"] = (len(offloaded) == len(ref) and all(
        torch.equal(offloaded[k], ref[k]) and not isinstance(offloaded[k], DTensor)
        for k in ref)) if rank == 0 else offloaded == {}
    # the same from full_state_dict's own options; rank 0's copy alone loads on every rank
    mine = model.full_state_dict(cpu_offload=True, rank0_only=True)
    ok["rank0_only"] = _equal(mine, offloaded) and all(v.device.type == "cpu"
                                                      for v in mine.values())
    model2, _ = _build(seed=7)
    set_model_state_dict(model2, mine, options=StateDictOptions(full_state_dict=True,
                                                                broadcast_from_rank0=True))
    full2 = model2.full_state_dict()
    ok["broadcast_from_rank0"] = all(torch.equal(full2[k], ref[k]) for k in ref)
    # strict=False: missing and unexpected keys reported, the rest loaded; strict refuses
    partial = {k: v + 1 for k, v in ref.items() if not k.startswith("blocks.0.")}
    partial["unknown.weight"] = torch.zeros(2)
    res = model.load_state_dict(partial, strict=False)
    full = model.full_state_dict()
    ok["strict_false"] = (
        res.unexpected_keys == ["unknown.weight"]
        and set(res.missing_keys) == {k for k in ref if k.startswith("blocks.0.")}
        and all(torch.equal(full[k], partial[k] if k in partial else ref[k]) for k in ref))
    try:
        model.load_state_dict(partial)
        ok["strict_true"] = False
    except RuntimeError as e:
        ok["strict_true"] = "Missing key(s)" in str(e) and "Unexpected key(s)" in str(e)
    # the optimizer state as full tensors, out and back in
    model, opt = _build(seed=5)
    _dcp_load(f"{root}/ckpt2", model, opt)
    full_optim = get_optimizer_state_dict(model, opt, options=FULL)
    model2, opt2 = _build(seed=6)
    set_model_state_dict(model2, model.full_state_dict(), options=FULL)
    set_optimizer_state_dict(model2, opt2, full_optim, options=FULL)
    ok["full_optim"] = _equal(_full(model2, opt2), _full(model, opt))
    out["full_sd"] = ok
    return out


# --- the runs, once per module ----------------------------------------------------------


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ckpt"))
    w2 = run_ranks(2, _train_and_save, root)
    # resumes in fresh processes: nothing of the saving run's process carries over
    w4 = run_ranks(4, _resume, root, fresh=True)
    w2b = run_ranks(2, _resume_w2, root, fresh=True)
    w1 = run_ranks(1, _resume, root, fresh=True)
    return {"w2": w2, "w4": w4, "w2b": w2b, "w1": w1, "root": root}


def _equal(a, b) -> bool:
    """Bitwise equality of nested state (tensors, dicts, lists, numbers)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def _max_diff(a: dict, b: dict) -> float:
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def test_resume_at_the_same_world_size_is_bitwise(runs):
    ref, got = runs["w2"][0], runs["w2b"][0]
    assert _equal(got["loaded"], ref["saved"])
    assert got["losses"] == ref["losses"][N:]
    assert _equal(got["final"], ref["final"])


@pytest.mark.parametrize("world", [1, 4])
def test_resume_at_another_world_size(runs, world):
    ref, got = runs["w2"][0], runs[f"w{world}"][0]
    assert _equal(got["loaded"], ref["saved"])  # model and AdamW state, resharded exactly
    dloss = max(abs(a - b) for a, b in zip(got["losses"], ref["losses"][N:]))
    assert dloss <= TOL, f"world {world}: max |Δloss| {dloss:.3g}"
    assert _max_diff(got["final"], ref["final"]) <= TOL


def test_save_at_four_loads_at_two(runs):
    assert _equal(runs["w2b"][0]["from4"], runs["w2"][0]["saved"])


def test_loaded_parameters_are_the_ones_the_optimizer_steps(runs):
    for key in ("w1", "w2b", "w4"):
        for r in runs[key]:
            assert r["same_objects"] and r["moved"], key


def test_full_state_dicts_load_and_export(runs):
    for r in runs["w2b"]:
        assert r["full_sd"] == {k: True for k in r["full_sd"]}, r["full_sd"]


def test_a_shard_of_another_rank_or_world_size_is_refused(runs):
    for rank, r in enumerate(runs["w2"]):
        msg = r["refusals"]["other_rank"]
        assert f"is the shard of rank {1 - rank} (of 2), and this is rank {rank}" in msg, msg
        assert "'extra'" in msg and "torch.distributed.checkpoint" in msg
        assert "full_state_dict()" in msg
        msg = r["refusals"]["local_tensors"]
        assert "'extra'" in msg and "is a plain tensor of shape" in msg, msg
    for r in runs["w2b"]:
        msg = r["refusals"]["other_world"]
        assert "'extra'" in msg and "saved at world size 4" in msg, msg
        assert "sharded over 2 ranks" in msg and "torch.distributed.checkpoint" in msg


def test_same_shape_shard_files_differ_by_rank(runs):
    """The two ranks' files hold shards of the same shapes (the 32-row blocks): only the
    mesh coordinate pickled with each DTensor tells them apart, and it survives torch.load."""
    sd0, sd1 = (torch.load(os.path.join(runs["root"], f"w2_rank{r}.pt")) for r in (0, 1))
    key = "blocks.0.proj.weight"
    assert sd0[key].to_local().shape == sd1[key].to_local().shape
    assert sd0[key].device_mesh.get_coordinate() == (0,)
    assert sd1[key].device_mesh.get_coordinate() == (1,)


# --- a buffer each rank updates from its own batch ----------------------------------------


class Counting(nn.Module):
    """A Linear and a buffer that holds this rank's own statistic (as BatchNorm's running
    mean does without SyncBatchNorm): every rank's copy differs."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("seen", torch.zeros(4))

    def forward(self, x):
        if self.training:
            self.seen.add_(x.detach().mean(0))
        return self.lin(x - self.seen)


def _per_rank_buffer(rank, world, root):
    """Two saves and an export, each after another step: every rank loads its own copy of
    the buffer from a save at its world size; the export holds rank 0's copy, whatever rank
    DCP would balance its file onto."""
    import autoshard as api

    torch.manual_seed(0)
    model = autoshard(Counting())
    out = {"saved": [], "loaded": [], "exported": None}
    for k in range(2):
        model(torch.full((2, 4), float(10 * rank + k + 1))).sum().backward()
        out["saved"].append(model.seen.clone())
        api.save(f"{root}/buffers{k}", model)
    for k in range(2):
        api.load_checkpoint(f"{root}/buffers{k}", model)
        out["loaded"].append(model.seen.clone())
    model.export(f"{root}/buffers_export")
    out["exported"] = api.load(f"{root}/buffers_export").seen.clone()
    return out


def test_a_per_rank_buffer_loads_each_ranks_copy_and_exports_rank_0s(tmp_path):
    ranks = run_ranks(2, _per_rank_buffer, str(tmp_path))
    zero = ranks[0]["saved"]
    assert not torch.equal(zero[1], ranks[1]["saved"][1]), "the ranks' buffers must differ"
    for r, out in enumerate(ranks):
        for k in range(2):
            own = out["saved"][k]
            assert torch.equal(out["loaded"][k], own), (r, k, out["loaded"][k], own)
        assert torch.equal(out["exported"], zero[1]), (r, out["exported"], zero[1])

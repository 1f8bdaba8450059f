"""The meshes autoshard takes, 4 ranks: hybrid sharding under torchtitan's names too, and
meshes with a tensor-parallel dimension, whose "tp" dimension shards as FSDP does under
``Config(tensor_parallel="off")``. Each trains equal to eager data parallelism over the 4
ranks (1e-5 absolute, 3 AdamW steps). What is not built (tensor parallelism chosen by the
planner) and any other mesh are refused before the model changes, naming what to pass (a plan
given as a dict: tests/runtime/test_tensor_parallel.py)."""

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel

from autoshard import Config, autoshard
from harness import Recipe, outcome, reference, run_ranks, train_sharded

TOL = 1e-5
WORLD = 4


def _build():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 4))


def _data(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)


def _loss(model, x, y):
    return (model(x) - y).pow(2).mean()


RECIPE = Recipe(build=_build, data=_data, loss=_loss, steps=3,
                optimizer=lambda ps: torch.optim.AdamW(ps, lr=0.05))

# mesh shape, its names -> the mesh the parameters are sharded over (shape, placements)
MESHES = {
    "dp-tp": ((2, 2), ("dp", "tp"), (4,), (Shard(0),)),
    "dp_shard-tp": ((2, 2), ("dp_shard", "tp"), (4,), (Shard(0),)),
    "shard-tp": ((2, 2), ("shard", "tp"), (4,), (Shard(0),)),
    "replicate-shard-tp": ((2, 1, 2), ("replicate", "shard", "tp"), (2, 2),
                           (Replicate(), Shard(0))),
    "torchtitan-3d": ((1, 2, 2), ("dp_replicate", "dp_shard", "tp"), (1, 4),
                      (Replicate(), Shard(0))),
    "torchtitan-hsdp": ((2, 2), ("dp_replicate", "dp_shard"), (2, 2),
                        (Replicate(), Shard(0))),
}


def _state(model) -> dict:
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in model.state_dict().items()}


def _train_on(rank, world, name):
    shape, names, _, _ = MESHES[name]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    config = Config(tensor_parallel="off") if "tp" in names else None
    model, losses = train_sharded(RECIPE, lambda m: autoshard(m, mesh=mesh, config=config),
                                  rank, world)
    w = model[0].weight
    return {"losses": losses, "state": _state(model), "mesh": tuple(w.device_mesh.shape),
            "placements": tuple(w.placements)}


@pytest.mark.parametrize("name", sorted(MESHES))
def test_a_mesh_trains_as_eager_data_parallelism_over_its_ranks(name):
    ref_losses, ref_state = reference(RECIPE, WORLD)
    _, _, mesh_shape, placements = MESHES[name]
    for out in run_ranks(WORLD, _train_on, name):
        assert out["mesh"] == mesh_shape and out["placements"] == placements, out
        assert out["losses"] == pytest.approx(ref_losses, abs=TOL)
        for k, v in ref_state.items():
            torch.testing.assert_close(out["state"][k], v, rtol=0, atol=TOL, msg=k)


# what each call is refused with: a mesh shape, its names, the Config's tensor_parallel
REFUSED = {
    "auto": ((2, 2), ("dp", "tp"), "auto", "the planner does not choose tensor parallelism"),
    "plan-without-tp": ((2, 2), ("replicate", "shard"), {"0": ColwiseParallel()},
                        "the mesh has no 'tp' dimension"),
    "other-names": ((2, 2), ("data", "tp"), "off", "autoshard takes a 1-D mesh"),
    "tp-first": ((2, 2), ("tp", "dp"), "off", "one with a tensor-parallel dimension last"),
}


def _refused(rank, world, name):
    shape, names, tp, _ = REFUSED[name]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    model = _build()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    said = outcome(lambda: autoshard(model, mesh=mesh, config=Config(tensor_parallel=tp)))
    kept = all(type(p) is nn.Parameter for p in model.parameters()) and all(
        torch.equal(v, before[k]) for k, v in model.state_dict().items())
    return {"said": said, "kept": kept and type(model) is nn.Sequential}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_what_is_not_built_and_other_meshes_are_refused_naming_the_fix(name):
    for out in run_ranks(WORLD, _refused, name):
        assert out["said"].startswith("escaped ValueError") and REFUSED[name][3] in out["said"]
        assert out["kept"], out
    if name == "auto":
        assert "Config(tensor_parallel='off')" in out["said"]


def test_tensor_parallel_takes_auto_off_or_a_plan():
    assert Config().tensor_parallel == "auto"
    with pytest.raises(ValueError, match=r"Config.tensor_parallel='on' is not accepted; use "
                                         r"one of 'auto', 'off', or \{module pattern"):
        Config(tensor_parallel="on")
    plan = {"layers.*.wq": ColwiseParallel()}
    config = Config(tensor_parallel=plan)
    plan["layers.*.wk"] = ColwiseParallel()  # the caller's dict changes; the Config does not
    assert list(config.tensor_parallel) == ["layers.*.wq"]


def _save_at_2d_load_at_1d(rank, world, path):
    from autoshard import load_checkpoint, save

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model, _ = train_sharded(RECIPE, lambda m: autoshard(
        m, mesh=mesh, config=Config(tensor_parallel="off")), rank, world)
    save(path, model)
    fresh = autoshard(_build())  # on a 1-D mesh over the 4 ranks, as first built
    load_checkpoint(path, fresh)
    return {"saved": _state(model), "loaded": _state(fresh)}


def test_a_checkpoint_saved_on_a_mesh_with_tp_off_loads_on_a_1d_mesh(tmp_path):
    """The parameters are DTensors on the folded mesh, so DCP reshards them as any other."""
    for out in run_ranks(WORLD, _save_at_2d_load_at_1d, str(tmp_path / "ckpt")):
        for k, v in out["saved"].items():
            torch.testing.assert_close(out["loaded"][k], v, rtol=0, atol=0, msg=k)

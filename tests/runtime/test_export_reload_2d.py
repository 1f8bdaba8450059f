"""A 2-D-mesh export loaded in the process that ran other 2-D calls before it: the 2 x 2
call that trained and exported, then its process group destroyed and made again (as a
notebook re-creates groups), then the load on a new 2 x 2 mesh, on the same 4 ranks. The
loaded program must run on this process's groups, not on names an earlier group held, and
give the exporting call's probe bit for bit."""

import os

import torch
import torch.distributed as dist

import autoshard
import export_workers
from harness import run_ranks, train


def _export_then_load(rank, world, root):
    strategy, shape = export_workers.CASES["hsdp"]
    model = autoshard.autoshard(export_workers._gpt(), mesh=export_workers._mesh(shape),
                                config=autoshard.Config(strategy=strategy))
    train(model, export_workers.RECIPE, rank, world, local=True)
    before = export_workers.probe(model, rank, world)
    path = os.path.join(root, "hsdp")
    model.export(path)
    # other 2-D calls on new groups first: the names the export recorded are taken by them
    other = autoshard.autoshard(export_workers._gpt(), mesh=export_workers._mesh(shape))
    train(other, export_workers.RECIPE, rank, world, local=True)
    del model, other
    store = dist.distributed_c10d._get_default_store()
    dist.destroy_process_group()
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    loaded = autoshard.load(path, mesh=export_workers._mesh(shape))
    after = export_workers.probe(loaded, rank, world)
    return {"before": before, "after": after, "same": loaded._autoshard.exported.same,
            "groups": export_workers.export_groups(loaded)}


def test_a_2d_export_loads_after_other_2d_calls_in_the_process(tmp_path):
    for got in run_ranks(4, _export_then_load, str(tmp_path), fresh=True):
        assert got["same"]  # the stored graphs ran
        assert len(got["groups"]) == 2
        ref, out = got["before"], got["after"]
        assert torch.equal(ref["logits"], out["logits"]) and torch.equal(ref["loss"],
                                                                          out["loss"])
        for f, g in ref["grads"].items():
            assert torch.equal(g, out["grads"][f]), f

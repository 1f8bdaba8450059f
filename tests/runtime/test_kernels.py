"""Kernels see what they see in eager, so training matches an unsharded eager run:

- the grad mode: the CPU LSTM kernel keeps the workspace its backward reads only with grad
  on, so the forward graph, and a recomputed forward op, run in the grad mode capture traced
  them in. nn.LSTM and nn.GRU (bidirectional, two layers, batch-first or time-first, dropout
  between layers or none, under torch.utils.checkpoint) train to eager's numbers at world
  sizes 1 and 2, and autoshard.check finds no difference on any node;
- the layout: a gathered parameter reaches its ops contiguous, as an nn.Parameter is, also
  when it has no more rows than there are ranks (a view of the gathered buffer would be
  strided); CPU BatchNorm rounds differently on a strided weight. A BatchNorm1d(2) model
  trains bit for bit as eager and as FSDP2 at world size 2.

Tolerance: none. Parameters are compared bitwise after four AdamW steps (the ranks'
gradient average, a sum halved, is exact as eager's halved losses are); the reported losses,
summed over ranks in fp32 here and in fp64 by the reference, within 1e-6.
"""

import pytest
import torch

from harness import run_ranks
from kernel_workers import RECURRENT, kernel_worker, reference


# the ranks of each world size are spawned once and train every model of it in turn
CASES = ([(1, n) for n in RECURRENT] + [(2, n) for n in RECURRENT] + [(2, "tiny_norm")])


@pytest.fixture(scope="module")
def runs():
    cache = {}

    def results(world):
        if world not in cache:
            cache[world] = run_ranks(world, kernel_worker, [n for w, n in CASES if w == world])
        return cache[world]

    return results


def _assert_equal(got, want, what):
    for k, v in want.items():
        assert torch.equal(got[k], v), (
            f"{what}: {k} differs by {(got[k] - v).abs().max().item():.3g}")


@pytest.mark.parametrize("world,name", CASES, ids=[f"{n}-world{w}" for w, n in CASES])
def test_trains_as_eager(runs, world, name):
    results = runs(world)
    torch.set_num_threads(1)  # the ranks run single-threaded; keep reductions alike
    ref_losses, ref_params = reference(name, world)
    got = results[0][name]
    # the losses only as reported: the ranks sum theirs in fp32, the reference in fp64
    assert max(abs(a - b) for a, b in zip(got["losses"], ref_losses)) <= 1e-6
    _assert_equal(got["params"], ref_params, f"{name} world {world}")
    for r in results:
        ok, first, text = r[name]["check"]
        assert ok and first is None, text


def test_tiny_norm_trains_as_fsdp2(runs):
    results = runs(2)
    ours, fsdp = results[0]["tiny_norm"], results[0]["fsdp2:tiny_norm"]
    assert ours["losses"] == fsdp["losses"]
    _assert_equal(ours["params"], fsdp["params"], "against FSDP2")

"""Gradient accumulation without sync (``set_requires_gradient_sync``) in the nanoGPT loop,
against eager: after each optimizer step's last (synchronised) micro-batch, every parameter's
reduced gradient is eager's mean over the ranks of the summed micro-batch losses' gradients
(1e-5), for 1, 2 and 3 micro-batches, under every strategy, hpZ and HSDP, with
``clip_grad_norm_``, whichever call a process makes first. Each run starts from an empty
trace cache, as in a new process: a program must not depend on what the process compiled
before it (a cached packing trace once made the first accumulated step of a process reduce
one parameter's gradient in place of another's of the same shape).

Mixed precision (bfloat16 parameters and compute, float32 reduction) against eager on a
bfloat16 copy of the parameters: 2e-3, a bfloat16 rounding of gradients below 0.5."""

import pytest
import torch

from accumulation_workers import accumulate_worker, reference
from harness import run_ranks

TOL, MP_TOL = 1e-5, 2e-3

RUNS_2 = [("default", "off", True), ("zero2", "off", False),
          ("zero1", "off", False), ("ddp", "off", False), ("ddp", "on", True),
          ("mp", "off", False)]
RUNS_4 = [("hpz", "off", True), ("hsdp", "off", False)]


@pytest.fixture(scope="module")
def two():
    return 2, run_ranks(2, accumulate_worker, RUNS_2)[0]


@pytest.fixture(scope="module")
def four():
    return 4, run_ranks(4, accumulate_worker, RUNS_4)[0]


def _check(world, got, run):
    name, schedule, clip = run
    torch.set_num_threads(1)
    want = reference(world, schedule, clip, mp=name == "mp")
    tol = MP_TOL if name == "mp" else TOL
    assert len(got) == len(want)
    for step, (g, w) in enumerate(zip(got, want)):
        assert set(g) == set(w)
        bad = {k: round((g[k] - w[k]).abs().max().item(), 6) for k in w
               if (g[k] - w[k]).abs().max().item() > tol}
        assert not bad, f"{run} step {step}: max |Δgrad| above {tol} {bad}"


@pytest.mark.parametrize("run", RUNS_2, ids=["-".join(map(str, r)) for r in RUNS_2])
def test_accumulation_matches_eager(two, run):
    world, results = two
    _check(world, results[run], run)


@pytest.mark.parametrize("run", RUNS_4, ids=["-".join(map(str, r)) for r in RUNS_4])
def test_accumulation_matches_eager_on_4_ranks(four, run):
    world, results = four
    _check(world, results[run], run)

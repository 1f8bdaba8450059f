"""Offloaded activations on a CPU (the host is the device): the copies run, and the step
computes bit for bit what the same plan without them does."""

import warnings

from activation_offload_workers import parity_worker
from harness import run_ranks


def test_offloaded_activations_train_bit_for_bit_as_the_plan_without_one_rank():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # world size 1 says so
        r = parity_worker(0, 1, None)
    assert r["recompute"] == ("offload 2/2", "min-cut")
    assert r["copies"][0] > 0 and r["copies"][1] == 0
    assert r["trained"] and r["equal"]


def test_offloaded_activations_train_bit_for_bit_as_the_plan_without_two_ranks():
    for r in run_ranks(2, parity_worker):
        assert r["recompute"] == ("offload 2/2", "min-cut")
        assert r["copies"][0] > 0 and r["copies"][1] == 0
        assert r["trained"] and r["equal"]

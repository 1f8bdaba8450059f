"""Entries other than the root's forward: a submodule of the sharded model called directly
(a chunked loss calling ``lm_head``, one block run alone) and a method registered with
``register_forward_method`` each run as a captured step of their own, gathering their
parameters and reducing their gradients; training through them equals eager."""

import warnings

import pytest
import torch

from autoshard import autoshard
from entry_workers import Trunk, entry_worker, train
from harness import eager_and_sharded, run_ranks


def test_entries_at_world_size_1_equal_eager_bit_for_bit():
    ref, sharded = eager_and_sharded(Trunk)
    sharded.register_forward_method("encode")
    assert train(sharded, 0, 1) == train(ref, 0, 1)
    for (name, p), q in zip(ref.named_parameters(), sharded.parameters()):
        assert torch.equal(p.detach(), q.full_tensor()), name


def test_entries_at_world_size_2_equal_eager():
    results = run_ranks(2, entry_worker, None)
    r0 = results[0]
    assert results[0]["losses"] != results[1]["losses"]  # each rank saw its own half
    mean = [(a + b) / 2 for a, b in zip(results[0]["losses"], results[1]["losses"])]
    assert mean == pytest.approx(r0["ref_losses"], abs=1e-5)
    for name, want in r0["ref_params"].items():
        torch.testing.assert_close(r0["params"][name], want, rtol=0, atol=1e-5, msg=name)


def test_register_forward_method_refuses_what_is_not_a_method():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sharded = autoshard(Trunk())
    with pytest.raises(ValueError, match="Trunk has no method 'decode'"):
        sharded.register_forward_method("decode")


def test_a_copy_of_a_sharded_submodule_refuses_to_run_the_originals_programs():
    import copy

    from autoshard import AutoshardError

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sharded = autoshard(Trunk())
    head = copy.deepcopy(sharded.lm_head)
    with pytest.raises(AutoshardError, match="lm_head \\(called directly\\): this module is a "
                                             "copy"):
        head(torch.randn(2, 16))

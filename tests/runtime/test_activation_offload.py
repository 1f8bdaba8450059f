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


def test_offload_activations_with_the_default_planner_runs_a_step_as_eager():
    """``Config(offload_activations=True)`` with the default units and ``prefer``: the plan's
    FSDP2 reference (which offloads nothing) is built, and the step computes eager's loss
    and gradients."""
    import torch

    from autoshard import Config, autoshard
    from autoshard.core.models import GPT, gpt_loss

    torch.manual_seed(0)
    ref, model = GPT(seq=16, layers=2), GPT(seq=16, layers=2)
    model.load_state_dict(ref.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # world size 1 says so
        sharded = autoshard(model, config=Config(offload_activations=True))
    x = torch.randint(0, 96, (4, 16), generator=torch.Generator().manual_seed(1))
    loss = gpt_loss(sharded(x), x)
    loss.backward()
    want = gpt_loss(ref(x), x)
    want.backward()
    assert sharded.plan.predicted.get("fsdp2_peak_bytes") is not None
    assert abs(loss.item() - want.item()) <= 1e-6
    grads = dict(ref.named_parameters())
    for name, p in sharded.named_parameters():
        assert (p.grad.full_tensor() - grads[name].grad).abs().max() <= 1e-6, name

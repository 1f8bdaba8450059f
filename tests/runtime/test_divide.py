"""set_gradient_divide_factor and set_force_sum_reduction_for_comms, with FSDP2's meaning: the
GPT trained with its loss summed over the tokens and gradients reduced to their sum over 2
gloo ranks equals FSDP2 (fully_shard per block, the same setting) and unsharded eager SGD on
the summed gradients; a factor set after the first step takes effect on the next.

Tolerances: |Δloss| <= 1e-6 relative (the summed losses are near 600), max |Δparam| <= 1e-5
after 4 SGD steps (a gradient off by the factor 2 moves parameters by 1e-3 and more)."""

import pytest
import torch

from autoshard import Config, autoshard
from autoshard.core.models import GPT
from divide_workers import DIVIDE, divide_worker, reference, sum_loss
from harness import run_ranks

TOL = 1e-5


@pytest.fixture(scope="module")
def divided():
    return run_ranks(2, divide_worker)


def _close(got, ref_losses, ref_params, what):
    dloss = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], ref_losses))
    assert dloss <= 1e-6, f"{what}: max relative |Δloss| {dloss:.3g}"
    dparam = max((got["params"][k] - ref_params[k]).abs().max().item() for k in ref_params)
    assert dparam <= TOL, f"{what}: max |Δparam| {dparam:.3g}"


def test_summed_gradients_equal_fsdp2_and_eager(divided):
    torch.set_num_threads(1)
    r = divided[0]
    ref_losses, ref_params = reference(DIVIDE["setter"])
    _close(r["setter"], ref_losses, ref_params, "autoshard vs eager")
    _close(r["fsdp2"], ref_losses, ref_params, "FSDP2 vs eager")
    _close(r["setter"], r["fsdp2"]["losses"], r["fsdp2"]["params"], "autoshard vs FSDP2")
    assert r["setter"]["reduction"] == "sum / 1"
    assert r["setter"]["programs"] == 2  # the mean's, then the sum's
    # the same with DDP's all-reduce, summing from the start (Config)
    ref_losses, ref_params = reference(DIVIDE["config"])
    _close(r["config"], ref_losses, ref_params, "ddp, Config(gradient_divide_factor=1.0)")
    assert r["config"]["ops"] == ["all_reduce"]


def test_forced_sum_collectives_keep_the_mean(divided):
    torch.set_num_threads(1)
    r = divided[0]["forced"]
    ref_losses, ref_params = reference(DIVIDE["forced"])
    _close(r, ref_losses, ref_params, "force_sum_reduction_for_comms")
    assert r["reduction"] == "mean, sum collectives"


@pytest.mark.filterwarnings("ignore:autoshard. no process group")
def test_one_rank_divides_by_the_factor_and_programs_follow_the_setting():
    """On one rank nothing is reduced, and the gradient is divided by the factor, as FSDP2
    does; each setting is its own program, compiled once, the division a node of it."""
    torch.manual_seed(0)
    ref = GPT()
    sharded = autoshard(GPT(), config=Config(policy="module"))
    sharded.load_state_dict(ref.state_dict())
    x = torch.randint(0, 96, (2, 16))
    sum_loss(ref(x), torch.roll(x, -1, 1)).backward()
    want = {k: p.grad for k, p in ref.named_parameters()}
    for factor in (4.0, 1.0, 4.0):
        sharded.set_gradient_divide_factor(factor)
        sharded.zero_grad()
        sum_loss(sharded(x), torch.roll(x, -1, 1)).backward()
        for k, p in sharded.named_parameters():
            torch.testing.assert_close(p.grad.full_tensor() * factor, want[k], rtol=1e-6,
                                       atol=1e-6, msg=k)
        assert sharded.plan.reduction == f"sum / {factor:g}"
        assert "sum / " in sharded.plan.summary_table()
    assert len(sharded._autoshard.programs) == 2
    with pytest.raises(ValueError, match="gradient_divide_factor"):
        sharded.set_gradient_divide_factor(0)

"""Where users already train: Hugging Face's Trainer, accelerate, Lightning and Fabric take an
autoshard model with their standard recipes, at 2 gloo ranks of a torchrun environment, and
train it as they train the unsharded model (wrapped in DistributedDataParallel by the library):
2 accumulated micro-batches per step, clipping that acts, a learning-rate schedule, and for
the Trainer a checkpoint every 2 steps and a run resumed from one.

Tolerances (the issue's): losses 1e-5 and parameters 5e-5, absolute; the gradient norms
1e-5 relative. Skipped where a library is not installed (``.ci/run`` installs them)."""

import inspect

import pytest
import torch

transformers = pytest.importorskip("transformers")

from harness import eager_and_sharded, run_ranks  # noqa: E402
from integrations_workers import (STEPS, lightning_worker, tiny_llama,  # noqa: E402
                                  trainer_worker)

LOSS_TOL, PARAM_TOL, NORM_TOL = 1e-5, 5e-5, 1e-5


def _close_params(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def _close(a, b) -> float:
    assert len(a) == len(b), (a, b)
    return max(abs(x - y) for x, y in zip(a, b))


def test_forward_keeps_the_models_signature():
    ref, sharded = eager_and_sharded(tiny_llama)
    assert inspect.signature(sharded.forward) == inspect.signature(ref.forward)
    assert "labels" in inspect.signature(sharded.forward).parameters
    assert sharded.forward.__doc__ == type(ref).forward.__doc__


def test_no_sync_keeps_gradients_local_inside_it_only():
    _, sharded = eager_and_sharded(tiny_llama)
    with sharded.no_sync():
        assert sharded._autoshard.grad_sync is False
    assert sharded._autoshard.grad_sync is True


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    return run_ranks(2, trainer_worker, str(tmp_path_factory.mktemp("trainer")),
                     torchrun_env=True)[0]


def test_trainer_trains_a_sharded_model_as_the_unsharded_one(trainer):
    eager, sharded = trainer["eager"], trainer["sharded"]
    assert sharded["steps"] == eager["steps"] == list(range(1, STEPS + 1))
    assert _close(sharded["losses"], eager["losses"]) <= LOSS_TOL
    assert all(n > 0.5 for n in eager["norms"])  # clipping to 0.5 acts
    assert max(abs(a / b - 1) for a, b in zip(sharded["norms"], eager["norms"])) <= NORM_TOL
    assert _close_params(sharded["params"], eager["params"]) <= PARAM_TOL


def test_trainer_checkpoints_hold_the_full_weights_and_every_shard(trainer):
    assert {"autoshard", "model.safetensors", "scheduler.pt"} <= set(trainer["files"])
    assert "optimizer.pt" not in trainer["files"]  # rank 0's shard alone, as it would be
    saved = trainer["saved"]  # read back by from_pretrained
    assert _close_params(saved["sharded"], saved["eager"]) <= PARAM_TOL


def test_trainer_resumes_a_sharded_model_where_it_stopped(trainer):
    resumed, eager = trainer["resumed"], trainer["eager"]
    assert resumed["global_step"] == STEPS
    # steps 1 and 2 come from the checkpoint's log; 3 and 4 were trained after resuming
    assert _close(resumed["losses"], eager["losses"]) <= LOSS_TOL
    assert _close_params(resumed["params"], eager["params"]) <= PARAM_TOL
    # and a resume that loaded nothing would not be: two steps from the start differ
    assert _close_params(resumed["params"], trainer["saved"]["eager"]) > 10 * PARAM_TOL


def test_accelerate_prepare_trains_a_sharded_model_as_the_unsharded_one(trainer):
    got = trainer["accelerate"]  # the Trainer's ranks run accelerate's recipe too
    eager, sharded = got["eager"], got["sharded"]
    assert eager["wrapped"] == "DistributedDataParallel"
    assert sharded["wrapped"].startswith("Sharded")  # handed back as it is
    assert len(sharded["losses"]) == 2 * STEPS and len(sharded["norms"]) == STEPS
    assert _close(sharded["losses"], eager["losses"]) <= LOSS_TOL
    assert all(n > 0.5 for n in eager["norms"])
    assert max(abs(a / b - 1) for a, b in zip(sharded["norms"], eager["norms"])) <= NORM_TOL
    assert _close_params(sharded["params"], eager["params"]) <= PARAM_TOL


@pytest.fixture(scope="module")
def lightning(tmp_path_factory):
    pytest.importorskip("lightning")
    return run_ranks(2, lightning_worker, str(tmp_path_factory.mktemp("lightning")),
                     torchrun_env=True)[0]


@pytest.mark.parametrize("recipe", ["", "fabric_"])
def test_lightning_and_fabric_model_parallel_strategy_train_as_ddp(lightning, recipe):
    eager, sharded = lightning[f"{recipe}eager"], lightning[f"{recipe}sharded"]
    assert len(sharded["losses"]) == 2 * STEPS
    assert _close(sharded["losses"], eager["losses"]) <= LOSS_TOL
    assert _close_params(sharded["params"], eager["params"]) <= PARAM_TOL


def test_accelerate_mixed_precision_is_refused_naming_the_config():
    accelerate = pytest.importorskip("accelerate")
    _, sharded = eager_and_sharded(tiny_llama)
    try:
        acc = accelerate.Accelerator(mixed_precision="bf16", cpu=True)
        with pytest.raises(ValueError, match=r"mixed_precision='bf16'.*Config\(mp_policy="
                                             r"MixedPrecisionPolicy\(param_dtype=torch.bfloat16"):
            acc.prepare(sharded)
    finally:  # accelerate's state is one per process
        accelerate.state.AcceleratorState._reset_state(True)


def test_save_pretrained_takes_the_full_weights_and_names_them_without(tmp_path):
    ref, sharded = eager_and_sharded(tiny_llama)
    with pytest.raises(Exception, match=r"full_state_dict\(rank0_only=True\).*"
                                        r"autoshard.front.integrations import Trainer"):
        sharded.save_pretrained(tmp_path / "bare")
    assert not (tmp_path / "bare" / "model.safetensors").exists()
    sharded.save_pretrained(tmp_path / "full", state_dict=sharded.full_state_dict())
    again = type(ref).from_pretrained(tmp_path / "full")
    assert _close_params(again.state_dict(), ref.state_dict()) == 0.0

"""torchtitan's llama3 debug model, trained by torchtitan's own trainer pieces (its chunked
cross-entropy loss divided by the global count of valid tokens, ``OptimizersContainer`` with
its default AdamW, ``LRSchedulersContainer`` with the debugmodel's warmup and decay,
``clip_grad_norm_``), trains the same with ``autoshard(model)`` in place of torchtitan's
``fully_shard`` calls as with FSDP2 itself, on 2 gloo ranks, gradients summed over the ranks
as torchtitan sets them. Skipped where torchtitan is not installed (``.ci/run`` installs it).

Tolerances: the losses and the clipped gradient norms agree to 1e-6 relative (equal, or
one float32 ulp apart); the first step's reduced gradients are equal, bit for bit, but for
``lm_head``'s, which may differ in the last bit (<= 1e-8; FSDP2 sums the loss chunks'
gradients of ``lm_head`` before reducing them once, autoshard reduces each chunk's gradient
and sums the shards); after 4 AdamW steps the parameters agree to 2e-7 (AdamW's normalised
update carries that last bit into the parameters; 6e-8 here, and 2e-7 is below two float32
ulps of the embedding's values, which are near 1). A mean where torchtitan sums halves every
gradient and the gradient norm: the gradients and norms catch it (clipping and AdamW's
scale invariance leave the parameters within 6e-5 of FSDP2's)."""

import pytest

from harness import run_ranks
from torchtitan_workers import STEPS, torchtitan_or_skip, torchtitan_worker

torchtitan_or_skip()

PARAM_TOL = 2e-7


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return run_ranks(2, torchtitan_worker, str(tmp_path_factory.mktemp("torchtitan")))[0]


def _rel(a, b):
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def test_losses_and_clipped_norms_equal_fsdp2(trained):
    a, b = trained["fsdp2"], trained["autoshard"]
    assert len(b["losses"]) == STEPS
    assert _rel(b["losses"], a["losses"]) <= 1e-6, (b["losses"], a["losses"])
    assert _rel(b["grad_norms"], a["grad_norms"]) <= 1e-6, (b["grad_norms"], a["grad_norms"])
    assert b["lrs"] == a["lrs"]
    assert b["reduction"] == "sum / 1"


def test_gradients_and_parameters_equal_fsdp2(trained):
    a, b = trained["fsdp2"], trained["autoshard"]
    assert b["grads"].keys() == a["grads"].keys()
    for k, g in a["grads"].items():
        d = (b["grads"][k] - g).abs().max().item()
        assert d <= (1e-8 if k == "lm_head.weight" else 0.0), f"{k}: |Δgrad| {d:.3g}"
    # torchtitan's fused QKV projection saves wq/wk/wv: the keys are the unsharded model's
    assert b["params"].keys() == a["params"].keys()
    assert "layers.0.attention.qkv_linear.wq.weight" in b["params"]
    dparam = max((b["params"][k] - v).abs().max().item() for k, v in a["params"].items())
    assert dparam <= PARAM_TOL, f"max |Δparam| {dparam:.3g}"


def test_each_entry_captured_once(trained):
    """The model's forward and ``lm_head``, which the loss calls per chunk, are each
    captured once and reused for the 4 steps' calls (4 chunks each)."""
    captures = trained["autoshard"]["captures"]
    assert captures == {"forward": 1, "lm_head (called directly)": 1}, captures


def test_an_export_and_a_checkpoint_of_the_fused_qkv_model_load_back_exactly(trained):
    """torchtitan's fused QKV splits ``wqkv`` into ``wq``, ``wk``, ``wv`` in its state dict
    (hooks DCP's ``get_model_state_dict`` cannot follow): exports and checkpoints store the
    modules' own tensors and load them back bit for bit."""
    writes = trained["autoshard"]["writes"]
    assert writes == {"export": 0.0, "checkpoint": 0.0}, writes

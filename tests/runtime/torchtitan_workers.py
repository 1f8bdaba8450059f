"""What each rank runs in the torchtitan test: torchtitan's llama3 debug model trained by the
pieces of torchtitan's trainer (its chunked cross-entropy loss scaled by the global token
count, ``OptimizersContainer``, ``LRSchedulersContainer``, ``clip_grad_norm_``), sharded once
with FSDP2 as torchtitan's ``parallelize_llama`` shards it and once with ``autoshard``."""

from __future__ import annotations

import types

import torch

# torchtitan's llama3 is built as the benchmark builds it (one builder, bench/libmodels.py)
from bench.libmodels import titan_kernels_stand_in, titan_llama3

STEPS = 4
TRAINING_STEPS = 10  # the debugmodel's schedule length (warmup 2, decay 0.8 of it); 4 run
MAX_NORM = 0.5  # torchtitan's 1.0 is above these gradient norms (0.74-0.75): 0.5 clips
BATCH = 2  # per rank
SEQ = 32
VOCAB = 256
DIM = 64
LAYERS = 2
HEADS = 4
CHUNKS = 4  # the chunked loss splits each sequence in this many pieces
LR = 8e-4


def import_torchtitan():
    """torchtitan's trainer pieces the test uses (the model is imported by build_model)."""
    titan_kernels_stand_in()
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.distributed.fsdp import apply_fsdp_to_decoder
    return types.SimpleNamespace(
        ChunkedLossWrapper=ChunkedLossWrapper, CrossEntropyLoss=CrossEntropyLoss,
        LRSchedulersContainer=LRSchedulersContainer, default_adamw=default_adamw,
        dist_utils=dist_utils, apply_fsdp_to_decoder=apply_fsdp_to_decoder)


def torchtitan_or_skip():
    """Skip the calling test module, naming why, where torchtitan is missing or does not run
    on this torch (torchtitan 0.3.0 imports FSDP2 names that torch 2.11 lacks)."""
    import pytest

    pytest.importorskip("torchtitan", reason="torchtitan is not installed (.ci/run installs it)")
    try:
        import_torchtitan()
    except ImportError as e:
        import torchtitan

        pytest.skip(f"torchtitan {getattr(torchtitan, '__version__', '?')} does not run on "
                    f"torch {torch.__version__}: {e}", allow_module_level=True)


def build_model(tt):
    """The llama3 "debugmodel" flavour built the way torchtitan builds it (its layer
    configs with the depth-scaled inits, fused QKV, RoPE with llama scaling, its
    ``init_weights``), shrunk to run in seconds on CPU: width 64, 2 layers, 4 heads,
    vocabulary 256, RoPE table of the sequence length. Attention is torchtitan's SDPA
    backend (causal, as torchtitan's graph-trainer tests use it): the flavour's
    FlexAttention runs through ``torch.compile`` with max-autotune, minutes on CPU."""
    torch.manual_seed(0)
    return titan_llama3(VOCAB, dim=DIM, layers=LAYERS, heads=HEADS, kv_heads=None, seq=SEQ)


def batches(step, world):
    """Tokens and next-token labels for all ranks; a few labels are torchtitan's ignore index
    on rank 0 only, so the ranks count different numbers of valid tokens and the global
    count the loss divides by is not ``world`` times a rank's."""
    gen = torch.Generator().manual_seed(100 + step)
    seq = torch.randint(0, VOCAB, (world * BATCH, SEQ + 1), generator=gen)
    tokens, labels = seq[:, :-1].clone(), seq[:, 1:].clone()
    labels[0, : 3 + step] = -100
    return tokens.chunk(world), labels.chunk(world)


def train(tt, model, rank, world, mesh):
    """torchtitan's ``Trainer.train_step`` for one data-parallel dimension, step for step:
    zero the gradients in place, count the valid tokens over the ranks, the forward without
    the output projection, the chunked loss (its own ``lm_head`` call and backward per
    chunk, each chunk's summed cross-entropy divided by the global token count), the
    backward through the decoder, ``clip_grad_norm_``, the optimizers, the schedulers.
    Not ``harness.train``: the point is torchtitan's own step, written as it writes it."""
    from torchtitan.components.loss import IGNORE_INDEX

    loss_fn = tt.ChunkedLossWrapper.Config(
        num_chunks=CHUNKS, loss_fn=tt.CrossEntropyLoss.Config(global_vocab_size=VOCAB),
    ).build(compile_config=None)
    loss_fn.set_lm_head(model.lm_head)
    model._skip_lm_head = True
    # torchtitan's default "fused" AdamW: fused CPU kernels take DTensor parameters too
    optimizers = tt.default_adamw(lr=LR).build(model_parts=[model])
    lr_schedulers = tt.LRSchedulersContainer.Config(
        warmup_steps=2, decay_ratio=0.8, decay_type="linear", min_lr_factor=0.0,
    ).build(optimizers=optimizers, training_steps=TRAINING_STEPS)
    out = {"losses": [], "grad_norms": [], "lrs": []}
    for step in range(STEPS):
        optimizers.zero_grad(set_to_none=False)
        tokens, labels = (t[rank] for t in batches(step, world))
        local_valid_tokens = (labels != IGNORE_INDEX).sum()
        global_valid_tokens = tt.dist_utils.dist_sum_tensor(local_valid_tokens, mesh)
        pred = model(tokens)
        loss, _ = loss_fn(pred, labels, global_valid_tokens)
        del pred
        loss.backward()
        if step == 0:  # the first step's reduced gradients, before clipping
            out["grads"] = {k: p.grad.full_tensor().clone() for k, p in model.named_parameters()}
        grad_norm = tt.dist_utils.clip_grad_norm_(
            list(model.parameters()), MAX_NORM, foreach=True, pp_mesh=None, ep_enabled=False)
        out["lrs"].append(optimizers.optimizers[0].param_groups[0]["lr"])
        optimizers.step()
        lr_schedulers.step()
        out["losses"].append(tt.dist_utils.dist_sum(loss.detach(), mesh))
        out["grad_norms"].append(grad_norm.item())
    out["optimizer"] = optimizers.optimizers[0]
    return out


def _fsdp2(tt, rank, world, mesh):
    """System A: FSDP2 exactly as torchtitan's ``parallelize_llama`` applies it
    (``apply_fsdp_to_decoder``: the embedding, each block, norm and lm_head together, the
    root; gradient divide factor 1.0, the gradients summed). torchtitan's factor 1.0
    reduces with NCCL's PREMUL_SUM, which gloo lacks; ``set_force_sum_reduction_for_comms``
    makes FSDP2 reduce with SUM and skip the division by 1: the same gradients."""
    from torch.distributed.fsdp import FSDPModule

    model = build_model(tt)
    tt.apply_fsdp_to_decoder(model, mesh, param_dtype=torch.float32,
                             reduce_dtype=torch.float32, pp_enabled=False)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)
    out = train(tt, model, rank, world, mesh)
    out.pop("optimizer")
    out["params"] = {k: v.full_tensor() for k, v in model.state_dict().items()}
    return out


def _autoshard(tt, rank, world, mesh, root):
    """System B: ``autoshard(model)`` in place of those ``fully_shard`` calls, the gradients
    summed as torchtitan sets them (``set_gradient_divide_factor(1.0)``). Counts the
    captures of each entry (the model's forward, ``lm_head`` called by the loss)."""
    from autoshard import autoshard
    from autoshard.front import calls

    captures: dict = {}
    compile_ = calls.capture_and_compile

    def counting(module, st, *args, **kwargs):
        captures[st.entry] = captures.get(st.entry, 0) + 1
        return compile_(module, st, *args, **kwargs)

    calls.capture_and_compile = counting
    try:
        sharded = autoshard(build_model(tt), mesh=mesh)
        sharded.set_gradient_divide_factor(1.0)
        out = train(tt, sharded, rank, world, mesh)
    finally:
        calls.capture_and_compile = compile_
    out["params"] = sharded.full_state_dict()
    out["captures"] = captures
    out["reduction"] = sharded.plan.reduction
    out["writes"] = _writes(tt, sharded, out.pop("optimizer"), mesh, root)
    return out


def _writes(tt, sharded, optimizer, mesh, root):
    """The trained model exported and loaded back (the loaded forward's output against the
    model's), and saved with its optimizer and loaded into a new model and optimizer (every
    tensor against the trained one's): the fused QKV's state-dict hooks rename its keys."""
    import autoshard

    tokens = batches(STEPS, mesh.size())[0][mesh.get_local_rank()]
    with torch.no_grad():
        want = sharded(tokens)
    sharded.export(f"{root}/export", inference=False)
    with torch.no_grad():
        loaded = autoshard.load(f"{root}/export", mesh=mesh)(tokens)
    autoshard.save(f"{root}/checkpoint", sharded, optimizer)
    fresh = autoshard.autoshard(build_model(tt), mesh=mesh)
    fresh_opt = tt.default_adamw(lr=LR).build(model_parts=[fresh]).optimizers[0]
    autoshard.load_checkpoint(f"{root}/checkpoint", fresh, fresh_opt)
    pairs = [(p, q) for p, q in zip(sharded.parameters(), fresh.parameters())]
    state = [(optimizer.state[p][k], fresh_opt.state[q][k]) for p, q in pairs
             for k in ("exp_avg", "exp_avg_sq")]
    return {"export": (loaded - want).abs().max().item(),
            "checkpoint": max((a.to_local() - b.to_local()).abs().max().item()
                              for a, b in pairs + state)}


def torchtitan_worker(rank, world, root):
    from torch.distributed.device_mesh import init_device_mesh

    tt = import_torchtitan()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    out = {"fsdp2": _fsdp2(tt, rank, world, mesh),
           "autoshard": _autoshard(tt, rank, world, mesh, root)}
    if rank != 0:
        for run in out.values():
            run.pop("params"), run.pop("grads")
    return out

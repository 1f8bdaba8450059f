"""What each rank runs in the gradient accumulation tests, and the eager reference: the
nanoGPT loop (``set_requires_gradient_sync(micro == k - 1)`` before each micro-batch, the
losses summed, not divided) under each strategy, the first call of each run either without
sync or with it.

Each run starts from what a new process holds: autoshard's trace cache
(``autoshard.core.graph._TRACES``, the only process-wide state a compile reads) is emptied
first, so no earlier run of the same process decides how the next one compiles.

Not ``harness.train``: the loop under test is nanoGPT's own (the micro-batch count changes
from step to step, the losses are summed rather than averaged, the reduced gradients are read
after clipping), and the mixed precision reference trains a bfloat16 copy per rank."""

from __future__ import annotations

import torch
import torch.nn as nn

from autoshard import Config, autoshard
from autoshard.core import graph
from autoshard.core.models import GPT, gpt_loss

VOCAB, DIM, SEQ, MICRO = 96, 32, 32, 2  # MICRO: sequences per micro-batch and rank
LR, MAX_NORM = 0.05, 0.5
# micro-batches per optimizer step: the first call without sync ("off") or with it ("on")
SCHEDULES = {"off": (2, 3), "on": (1, 2)}


class GatedGPT(GPT):
    """The GPT (embeddings, tied with the head; 1-D LayerNorm and bias parameters; 2-D
    weights) and a (1, dim) gate: a parameter with fewer rows than ranks."""

    def __init__(self):
        super().__init__(vocab=VOCAB, dim=DIM, heads=4, layers=2, seq=SEQ)
        self.gate = nn.Parameter(torch.linspace(0.5, 1.5, DIM).unsqueeze(0))

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x * self.gate))


def build():
    torch.manual_seed(0)
    return GatedGPT()


def batch(step: int, world: int, k: int):
    """Step ``step``'s tokens and targets, [rank][micro-batch] -> (MICRO, SEQ)."""
    gen = torch.Generator().manual_seed(100 + step)
    x = torch.randint(0, VOCAB, (world, k, MICRO, SEQ), generator=gen)
    return x, torch.roll(x, -1, dims=-1)


def mp_policy():
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                output_dtype=torch.float32)


def config(name: str) -> Config:
    if name == "default":
        return Config()
    if name == "mp":
        return Config(policy="module", mp_policy=mp_policy())
    if name == "hpz":
        return Config(policy="module", reshard_after_forward=2)
    if name == "hsdp":
        return Config(policy="module")
    return Config(policy="module", strategy=name)


def _step_grads(model) -> dict:
    return {k: p.grad.full_tensor().clone() for k, p in model.named_parameters()}


def accumulate_worker(rank, world, runs):
    """Each (config name, schedule, clip) of ``runs`` on a new model from an empty trace
    cache: per optimizer step, the reduced full gradients (after ``clip_grad_norm_`` when
    ``clip``), then an SGD step. "hsdp" runs on a 2 x (world / 2) mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    out = {}
    for name, schedule, clip in runs:
        graph._TRACES.clear()
        mesh = (init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
                if name == "hsdp" else None)
        model = autoshard(build(), mesh=mesh, config=config(name))
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        grads = []
        for step, k in enumerate(SCHEDULES[schedule]):
            x, y = batch(step, world, k)
            for micro in range(k):
                model.set_requires_gradient_sync(micro == k - 1)
                gpt_loss(model(x[rank, micro]), y[rank, micro]).backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            grads.append(_step_grads(model))
            opt.step()
            opt.zero_grad()
        out[(name, schedule, clip)] = grads
    return out


def reference(world: int, schedule: str, clip: bool, mp: bool = False) -> list:
    """Eager in one process: per step, every rank's micro-batches, each loss divided by the
    world size (the mean over ranks of the summed micro-batch losses); the gradients (after
    ``clip_grad_norm_`` when ``clip``), then SGD. ``mp``: as the mixed precision policy
    computes, on a bfloat16 copy of the parameters whose gradients accumulate in bfloat16
    over the micro-batches, are reduced in float32 and update the float32 parameters."""
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    grads = []
    for step, k in enumerate(SCHEDULES[schedule]):
        x, y = batch(step, world, k)
        if mp:
            total = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
            for r in range(world):
                low = GatedGPT().to(torch.bfloat16)
                low.load_state_dict(model.state_dict())
                for micro in range(k):
                    logits = low(x[r, micro]).float()
                    gpt_loss(logits, y[r, micro]).backward()
                for n, p in low.named_parameters():
                    total[n] += p.grad.float()
            for n, p in model.named_parameters():
                p.grad = total[n] / world
        else:
            for r in range(world):
                for micro in range(k):
                    (gpt_loss(model(x[r, micro]), y[r, micro]) / world).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    return grads

"""The fuzzer's model: ``build_model(spec)``, a residual stack of the blocks a spec names.

Each block is a small module that exercises one thing autoshard must get right (tied
weights, a module called twice, running statistics, complex or float64 parameters, a
mixture of experts, ...); the same spec and seed build the same model on every rank and
for the eager reference.
"""

from __future__ import annotations

import dataclasses
import random

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from autoshard.front.factory import load_factory


# --- the model --------------------------------------------------------------------------------


def _residual(h, y):
    return h + 0.5 * torch.tanh(y)


class FuzzLinear(nn.Module):
    def __init__(self, d, bias=True, frozen=False):
        super().__init__()
        self.lin = nn.Linear(d, d, bias=bias)
        if frozen:
            self.lin.requires_grad_(False)

    def forward(self, h):
        return _residual(h, self.lin(h))


class FuzzTwice(nn.Module):
    """One Linear used twice in a forward: its parameters are read twice, their gradient is
    the sum of both uses."""

    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, h):
        return _residual(_residual(h, self.lin(h)), self.lin(h))


class FuzzNorm(nn.Module):
    def __init__(self, d, rms=False):
        super().__init__()
        self.norm = nn.RMSNorm(d) if rms else nn.LayerNorm(d)

    def forward(self, h):
        return self.norm(h)


class FuzzAttention(nn.Module):
    """Causal attention through SDPA. The keys have no bias: softmax is unchanged by adding
    one value to every score of a row, so a key bias's gradient is zero but for rounding, and
    AdamW's step (about lr times the sign of the gradient) turns that rounding into lr-sized
    differences between any two correct runs (seed 1073 of a long run)."""

    def __init__(self, d, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.qv_bias = nn.Parameter(torch.randn(2, d) * 0.1)
        self.out = nn.Linear(d, d, bias=False)

    def forward(self, h):
        b, t, d = h.shape
        qkv = self.qkv(h).view(b, t, 3, d)
        bias = torch.stack([self.qv_bias[0], torch.zeros_like(self.qv_bias[0]),
                            self.qv_bias[1]])
        q, k, v = (qkv + bias).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        return h + self.out(y.transpose(1, 2).reshape(b, t, d))


class FuzzConv(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.conv = nn.Conv1d(d, d, 3, padding=1)

    def forward(self, h):
        return _residual(h, self.conv(h.transpose(1, 2)).transpose(1, 2))


class FuzzMoE(nn.Module):
    """Top-1 routing: each token takes the expert its router scores highest (argmax, then a
    gather of that expert's weight by index), scaled by the expert's probability."""

    def __init__(self, d, experts=3):
        super().__init__()
        self.router = nn.Linear(d, experts, bias=False)
        self.w = nn.Parameter(torch.randn(experts, d, d) * d ** -0.5)

    def forward(self, h):
        probs = torch.softmax(self.router(h).float(), -1)
        top = probs.argmax(-1)
        gate = probs.gather(-1, top.unsqueeze(-1))
        y = torch.einsum("btd,bted->bte", h, self.w[top].to(h.dtype))
        return h + gate.to(h.dtype) * y


class FuzzRunning(nn.Module):
    """A buffer updated in forward in training mode (running-mean-like, from this rank's
    batch), read in every mode."""

    def __init__(self, d):
        super().__init__()
        self.register_buffer("running", torch.zeros(d))

    def forward(self, h):
        if self.training:
            self.running.mul_(0.9).add_(0.1 * h.detach().float().mean((0, 1)))
        return h - self.running.to(h.dtype)


class FuzzRow(nn.Module):
    """A parameter of one row: fewer rows than ranks."""

    def __init__(self, d):
        super().__init__()
        self.scale = nn.Parameter(0.1 * torch.randn(1, d))

    def forward(self, h):
        return h * (1 + self.scale)


class FuzzComplex(nn.Module):
    """A complex64 parameter rotating pairs of features."""

    def __init__(self, d):
        super().__init__()
        self.w = nn.Parameter(1 + 0.1 * torch.randn(d // 2, dtype=torch.complex64))

    def forward(self, h):
        b, t, d = h.shape
        hc = torch.view_as_complex(h.float().reshape(b, t, d // 2, 2).contiguous())
        return torch.view_as_real(hc * self.w).reshape(b, t, d).to(h.dtype)


class FuzzDouble(nn.Module):
    """A float64 parameter inside a float32 model."""

    def __init__(self, d):
        super().__init__()
        self.w = nn.Parameter(torch.randn(d, d, dtype=torch.float64) * d ** -0.5)

    def forward(self, h):
        return _residual(h, (h.double() @ self.w.t()).to(h.dtype))


class FuzzBatchNorm(nn.Module):
    """Linear, then BatchNorm1d over the features as channels (transposed in and out), then
    Linear: the batch norm reads a transposed input and the Linear a transposed output.
    ``momentum=None``: the statistics are cumulative averages (by num_batches_tracked). The
    first Linear has no bias: the batch norm subtracts each feature's mean, so a bias's
    gradient would be zero but for rounding, which AdamW's sign-like first steps turn into
    lr-sized differences between any two correct runs (as the attention block's key bias)."""

    def __init__(self, d, momentum=0.1):
        super().__init__()
        self.lin, self.out = nn.Linear(d, d, bias=False), nn.Linear(d, d)
        self.bn = nn.BatchNorm1d(d, momentum=momentum)

    def forward(self, h):
        return _residual(h, self.out(self.bn(self.lin(h).transpose(1, 2)).transpose(1, 2)))


def _block(kind: str, d: int) -> nn.Module:
    return {
        "linear": lambda: FuzzLinear(d), "linear_nobias": lambda: FuzzLinear(d, bias=False),
        "frozen": lambda: FuzzLinear(d, frozen=True), "twice": lambda: FuzzTwice(d),
        "layernorm": lambda: FuzzNorm(d), "rmsnorm": lambda: FuzzNorm(d, rms=True),
        "attention": lambda: FuzzAttention(d), "conv": lambda: FuzzConv(d),
        "moe": lambda: FuzzMoE(d), "running": lambda: FuzzRunning(d),
        "row1": lambda: FuzzRow(d), "complex": lambda: FuzzComplex(d),
        "float64": lambda: FuzzDouble(d), "batchnorm": lambda: FuzzBatchNorm(d),
        "batchnorm_cumulative": lambda: FuzzBatchNorm(d, momentum=None),
    }[kind]()


def block_class(kind: str) -> type:
    """The class of a block kind's module (Config "policy": "module:classes" names it)."""
    return type(_block(kind, 2))


@dataclasses.dataclass
class FuzzOutput:
    """What forward returns under model "output": "dataclass" (a plain dataclass, as many
    models' outputs are): the logits and the last hidden state, both read by the loss."""

    logits: torch.Tensor
    hidden: torch.Tensor


class FuzzNet(nn.Module):
    """Token embedding, the spec's blocks in order, and a head tied to the embedding (one
    parameter under two names) or its own Linear."""

    def __init__(self, model: dict):
        super().__init__()
        d, v = model["dim"], model["vocab"]
        self.emb = nn.Embedding(v, d)
        self.blocks = nn.ModuleList(_block(b["kind"], d) for b in model["blocks"])
        self.head = nn.Linear(d, v, bias=model["head"] == "untied_bias")
        if model["head"] == "tied":
            self.head.weight = self.emb.weight
        # a plain attribute forward reads and a loop may change on one rank only (as a
        # Trainer's save writes the model's config on rank 0): loop "rank_local"
        self.notes: list = []
        # model "writes": forward sets an auxiliary loss the loop adds (as MoE load-balancing
        # losses are read) and a detached hidden state (autoshard.core.writes)
        self.writes = bool(model.get("writes"))
        # model "unused": a parameter no forward reads (no gradient, no optimizer state);
        # model "output": "dataclass": forward returns a FuzzOutput, not the logits
        if model.get("unused"):
            self.unused = nn.Linear(d, 2)
        self.output = model.get("output")

    def forward(self, x):
        h = self.emb(x)
        if any(n < 0 for n in self.notes):  # never: the notes change what is read, not computed
            h = -h
        for block in self.blocks:
            h = block(h)
        if self.writes:
            self.aux_loss = h.float().pow(2).mean()
            self.last_hidden = h.detach()
        if self.output == "dataclass":
            return FuzzOutput(self.head(h), h)
        return self.head(h)


def build_model(spec: dict) -> nn.Module:
    """The spec's model, initialised from its seed (every process builds the same)."""
    torch.manual_seed(spec["seed"])
    model = spec["model"]
    if "factory" in model:
        return load_factory(model["factory"])()
    return FuzzNet(model)


def tensor_parallel_plan(model: nn.Module, seed: int) -> dict:
    """A tensor-parallel plan of 2 tp ranks drawn from ``seed`` (every rank draws the same)
    over the model's Linear layers, each placed or not, that computes what the model does
    alone: column-wise gathering its output (``output_layouts=Replicate()``) where 2 divide
    its out_features, row-wise splitting its input (``input_layouts=Replicate()``) where 2
    divide its in_features; never a layer whose weight is tied to another's."""
    rng = random.Random(seed * 7919 + 17)
    shared = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        shared[id(p)] = shared.get(id(p), 0) + 1
    plan = {}
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.Linear) or any(shared[id(p)] > 1 for p in mod.parameters()):
            continue
        styles = ([ColwiseParallel(output_layouts=Replicate())] * (mod.out_features % 2 == 0)
                  + [RowwiseParallel(input_layouts=Replicate())] * (mod.in_features % 2 == 0))
        if styles and rng.random() < 0.6:
            plan[name] = rng.choice(styles)
    return plan

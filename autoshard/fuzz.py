"""A differential fuzzer: random models, training loops and Configs, each trained sharded on N
gloo ranks and compared with one unsharded eager reference.

A case is a plain JSON spec made from a seed (``generate(seed)``)::

    {"seed": 7, "world": 3, "mesh": "1d",
     "model": {"dim": 16, "vocab": 32, "head": "tied", "blocks": [{"kind": "moe"}, ...]},
     "loop": {"steps": 2, "accumulate": 2, "sync": "last", "optimizer": "adamw", ...},
     "config": {"strategy": "zero3", "policy": "auto", ...}}

``run_case(spec)`` spawns ``world`` fresh processes (one case per spawn: process-level state,
such as which call of a process is its first, is part of what a case tests), trains the
sharded model there and, meanwhile, the reference in this process: the same model from the
same seed, fed every rank's batch in turn with that rank's own buffers (data parallelism:
each rank's loss, their mean as the gradient), so each reference forward has the very shapes
a rank's has. It compares every loss, clip norm, evaluation output and hook value per rank,
the parameters, the final gradients and each rank's buffers, within a tolerance per precision.
``shrink(spec)`` reduces a failing spec (delta debugging over blocks, loop features, Config
fields, world size and steps) to the smallest that still fails the same way.

``python -m bench.fuzz`` runs many cases; ``python -m autoshard fuzz MODULE:FACTORY`` fuzzes
loops and Configs over a model of your own. docs/correctness.md describes it.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import json
import os
import random
import tempfile
import time
import traceback
import warnings
from datetime import timedelta
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

# --- the spec ---------------------------------------------------------------------------------

BLOCKS = ("linear", "linear_nobias", "layernorm", "rmsnorm", "attention", "conv", "moe",
          "frozen", "twice", "running", "row1", "complex", "float64")
# relative odds of each block kind; complex parameters are rarer (one known failure class
# must not drown the others in a sample)
BLOCK_ODDS = {k: 1.0 for k in BLOCKS} | {"complex": 0.4, "float64": 0.6}
HEADS = ("tied", "untied", "untied_bias")

LOOP_DEFAULTS = {
    "steps": 2,            # optimizer steps
    "batch": 2,            # rows per rank per micro-batch
    "seq": None,           # sequence length per step (None: 8 each)
    "accumulate": 1,       # micro-batches per step
    "sync": "last",        # which micro-batches reduce: last, always, first_and_last
    "warmup": None,        # a call before the first step: None, "eval", "no_grad"
    "precision": "fp32",   # or "autocast_bf16"
    "optimizer": "adamw",  # adamw, sgd, in_backward (AdamW per parameter, stepped in its hook)
    "param_groups": False,
    "clip": None,          # clip_grad_norm_ max norm
    "zero_grad": "none",   # set_to_none: "none"; zeros: "zeros"
    "eval": None,          # after each step: None, "eval" (eval mode, no_grad), "no_grad"
    "hook": None,          # {"kind": "observe" | "modify", "at": step, "target": index}
    "checkpoint": None,    # {"at": s}: save after step s, load after step s + 1
}
CONFIG_DEFAULTS = {
    "strategy": "zero3", "policy": "auto", "recompute": True, "offload": None,
    "bucket": None, "prefetch": True, "reshard_after_forward": "auto", "mp": None,
    "gradient_divide_factor": None, "force_sum_reduction_for_comms": False, "verify": False,
}
DIM, VOCAB, SEQ = 16, 32, 8
LR = {"adamw": 1e-2, "in_backward": 1e-2, "sgd": 5e-2}
# (losses and other scalars, parameters and buffers, gradients): the largest difference over
# the reference's largest magnitude (at least 1 for losses and parameters, 1e-3 for gradients)
TOLERANCE = {"fp32": (2e-5, 2e-5, 2e-4), "bf16": (2e-2, 2e-2, 5e-2)}


def generate(seed: int, *, world_sizes=(1, 2, 3, 4), factory: Optional[str] = None) -> dict:
    """The spec of case ``seed``: the same seed gives the same spec. ``factory``
    (``MODULE:FACTORY``): the user's model, and only loops and Configs are drawn."""
    rng = random.Random(seed)
    world = rng.choice(list(world_sizes))
    mesh = "hsdp" if world == 4 and rng.random() < 0.3 else "1d"
    if factory is not None:
        model = {"factory": factory}
    else:
        kinds = list(BLOCK_ODDS)
        model = {"dim": DIM, "vocab": VOCAB, "head": rng.choice(HEADS),
                 "blocks": [{"kind": k} for k in rng.choices(
                     kinds, weights=[BLOCK_ODDS[k] for k in kinds], k=rng.randint(1, 4))]}
    steps = rng.choice([2, 2, 3])
    accumulate = rng.choice([1, 1, 2, 3])
    loop = dict(LOOP_DEFAULTS)
    loop.update(
        steps=steps, accumulate=accumulate,
        sync=rng.choice(["last", "last", "always", "first_and_last"]) if accumulate > 1
        else "last",
        warmup=rng.choice([None, None, "eval", "no_grad"]),
        precision="autocast_bf16" if rng.random() < 0.2 else "fp32",
        optimizer=rng.choice(["adamw", "sgd", "in_backward"]),
        param_groups=rng.random() < 0.3,
        clip=0.5 if rng.random() < 0.3 else None,
        zero_grad=rng.choice(["none", "zeros"]),
        eval=rng.choice([None, None, "eval", "no_grad"]),
        hook={"kind": rng.choice(["observe", "modify"]), "at": rng.randrange(steps),
              "target": rng.randrange(8)} if rng.random() < 0.25 else None,
        seq=[rng.choice([6, 8, 10]) for _ in range(steps)] if (
            factory is None and rng.random() < 0.25) else None,
        checkpoint={"at": rng.randrange(steps - 1)} if rng.random() < 0.2 else None,
    )
    strategies = ["zero3", "zero2"] if mesh == "hsdp" else ["zero3", "zero3", "zero2",
                                                             "zero1", "ddp"]
    strategy = rng.choice(strategies)
    raf = ["auto", True, False, "search"] + ([2] if world == 4 and mesh == "1d" else [])
    config = dict(CONFIG_DEFAULTS)
    config.update(
        strategy=strategy,
        policy=rng.choice(["auto", "module", "size", "per-parameter", "whole-model"]),
        recompute=rng.choice([True, False, "blocks", "auto"]),
        offload=rng.choice(["cpu", "half"]) if strategy in ("zero3", "zero2")
        and rng.random() < 0.2 else None,
        bucket=rng.choice([None, True, False]),
        prefetch=rng.choice([True, False, 1]),
        reshard_after_forward="auto" if strategy == "zero2" else rng.choice(raf),
        mp="bf16" if rng.random() < 0.15 else None,
        gradient_divide_factor=1.0 if rng.random() < 0.15 else None,
        force_sum_reduction_for_comms=rng.random() < 0.15,
        verify=rng.random() < 0.2,
    )
    spec = {"seed": seed, "world": world, "mesh": mesh, "model": model, "loop": loop,
            "config": config}
    _fix(spec)
    assert not problems(spec), (problems(spec), spec)
    return spec


def _fix(spec: dict) -> None:
    """Make the combinations ``problems`` refuses valid (the generator's side of the rules)."""
    loop, config = spec["loop"], spec["config"]
    if _precision(spec) == "bf16":
        loop["optimizer"] = "sgd"
    if loop["optimizer"] == "in_backward":
        loop["clip"] = None
    if any(b["kind"] == "float64" for b in spec["model"].get("blocks", ())):
        config["mp"] = None


def problems(spec: dict) -> list:
    """Why ``spec`` is not a case to run (empty: it is). These are combinations autoshard
    refuses by design or that have no eager meaning; the generator never makes them, and the
    shrinker skips them."""
    out = []
    world, loop, config = spec["world"], spec["loop"], spec["config"]
    model = spec["model"]
    if not 1 <= world <= 8:
        out.append("world size from 1 to 8")
    if spec["mesh"] == "hsdp" and world != 4:
        out.append("the 2 x 2 HSDP mesh needs 4 ranks")
    if spec["mesh"] == "hsdp" and config["strategy"] not in ("zero3", "zero2"):
        out.append("a 2-D mesh takes zero3 or zero2")
    raf = config["reshard_after_forward"]
    shard = 2 if spec["mesh"] == "hsdp" else world
    if isinstance(raf, int) and not isinstance(raf, bool) and (raf < 1 or shard % raf):
        out.append(f"reshard_after_forward={raf} must divide the shard size {shard}")
    if config["strategy"] == "zero2" and raf != "auto":
        out.append("zero2 keeps reshard_after_forward at auto")
    if config["offload"] and config["strategy"] in ("ddp", "zero1"):
        out.append("offload needs zero3 or zero2")
    if _precision(spec) == "bf16" and loop["optimizer"] != "sgd":
        out.append("bf16 cases use SGD (AdamW's first step is sign(g): rounding near zero "
                   "would become lr-sized differences)")
    if loop["optimizer"] == "in_backward" and loop["clip"] is not None:
        out.append("an optimizer stepped in backward leaves nothing to clip")
    if loop["steps"] < 1 or loop["accumulate"] < 1:
        out.append("at least one step and one micro-batch")
    if loop["seq"] is not None and len(loop["seq"]) != loop["steps"]:
        out.append("one sequence length per step")
    if loop["hook"] is not None and loop["hook"]["at"] >= loop["steps"]:
        out.append("the hook is registered at a step that runs")
    if loop["checkpoint"] is not None and loop["checkpoint"]["at"] + 1 >= loop["steps"]:
        out.append("a checkpoint is loaded one step after it is saved")
    if "factory" not in model and any(b["kind"] not in BLOCKS for b in model["blocks"]):
        out.append("unknown block kind")
    if config["mp"] is not None and any(b["kind"] == "float64" for b in model.get("blocks", ())):
        out.append("a MixedPrecisionPolicy casts the float64 block's parameter to its "
                   "param_dtype, which the block's float64 matmul cannot take (FSDP2's cast "
                   "too); autoshard refuses it at capture, naming the dtypes")
    return out


def _same(a, b) -> bool:
    """Equal and of one type: ``prefetch=1`` (a depth) is not ``prefetch=True``."""
    return type(a) is type(b) and a == b


def _precision(spec: dict) -> str:
    return "bf16" if (spec["loop"]["precision"] == "autocast_bf16"
                      or spec["config"]["mp"] == "bf16") else "fp32"


def features(spec: dict) -> list:
    """What a case exercises, as ``name=value`` strings (defaults left out), for coverage
    counts."""
    out = [f"world={spec['world']}", f"mesh={spec['mesh']}"]
    model = spec["model"]
    if "factory" in model:
        out.append("model=factory")
    else:
        out.append(f"head={model['head']}")
        out += [f"block={k}" for k in sorted({b["kind"] for b in model["blocks"]})]
    for part, defaults in (("loop", LOOP_DEFAULTS), ("config", CONFIG_DEFAULTS)):
        for key, default in defaults.items():
            value = spec[part][key]
            if key in ("batch",) or _same(value, default):
                continue
            if key == "seq":
                value = "changes" if len(set(value)) > 1 else "fixed"
            elif isinstance(value, dict):
                value = value.get("kind", "on")
            out.append(f"{key}={value}")
    return out


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


def _block(kind: str, d: int) -> nn.Module:
    return {
        "linear": lambda: FuzzLinear(d), "linear_nobias": lambda: FuzzLinear(d, bias=False),
        "frozen": lambda: FuzzLinear(d, frozen=True), "twice": lambda: FuzzTwice(d),
        "layernorm": lambda: FuzzNorm(d), "rmsnorm": lambda: FuzzNorm(d, rms=True),
        "attention": lambda: FuzzAttention(d), "conv": lambda: FuzzConv(d),
        "moe": lambda: FuzzMoE(d), "running": lambda: FuzzRunning(d),
        "row1": lambda: FuzzRow(d), "complex": lambda: FuzzComplex(d),
        "float64": lambda: FuzzDouble(d),
    }[kind]()


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

    def forward(self, x):
        h = self.emb(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def build_model(spec: dict) -> nn.Module:
    """The spec's model, initialised from its seed (every process builds the same)."""
    torch.manual_seed(spec["seed"])
    model = spec["model"]
    if "factory" in model:
        from autoshard.factory import load_factory

        return load_factory(model["factory"])()
    return FuzzNet(model)


# --- data and loss ----------------------------------------------------------------------------


def _seq(loop: dict, step: int) -> int:
    seq = loop["seq"]
    return SEQ if seq is None else seq[min(step, len(seq) - 1)]


def global_batch(spec: dict, model: nn.Module, step: int, micro: int) -> tuple:
    """(inputs, targets) of every rank at (step, micro), rows rank-major; targets None for a
    factory model (its loss is a fixed projection of the outputs)."""
    loop, world = spec["loop"], spec["world"]
    rows, seq = world * loop["batch"], _seq(loop, max(step, 0))
    seed = (spec["seed"] * 1_000_003 + (step + 7) * 1_009 + micro) % 2**62
    if "factory" in spec["model"]:
        from autoshard.check import default_inputs
        from autoshard.factory import load_factory

        torch.manual_seed(seed)
        inputs = default_inputs(model, load_factory(spec["model"]["factory"]), rows, seq)
        return (tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)), None
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, spec["model"]["vocab"], (rows, seq + 1), generator=gen)
    return (tokens[:, :-1],), tokens[:, 1:]


def rank_batch(spec: dict, batch: tuple, rank: int) -> tuple:
    inputs, targets = batch
    world = spec["world"]

    def part(x):
        return x.chunk(world)[rank].contiguous() if isinstance(x, torch.Tensor) else x

    return tuple(part(x) for x in inputs), (None if targets is None else part(targets))


def loss_of(out, targets) -> torch.Tensor:
    """Cross-entropy over the targets; for a factory model (no targets) a fixed random
    projection of every floating output (as ``autoshard.check``'s default loss, but also of
    outputs that need no gradient: an evaluation call's), scaled by their size."""
    if targets is None:
        gen = torch.Generator().manual_seed(0)
        leaves = _float_leaves(out)
        total = sum((t.float() * torch.randn(tuple(t.shape), generator=gen)).sum()
                    for t in leaves)
        return total / max(1, sum(t.numel() for t in leaves)) ** 0.5
    return F.cross_entropy(out.float().reshape(-1, out.shape[-1]), targets.reshape(-1))


def _float_leaves(out) -> list:
    from autoshard._compat import tree_leaves

    return [t for t in tree_leaves(out)
            if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _scalar(out, targets) -> float:
    """One number for an output (an evaluation call's): its loss."""
    return float(loss_of(out, targets).detach())


def _autocast(loop: dict):
    import contextlib

    if loop["precision"] == "autocast_bf16":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _synced(sync: str, micro: int, k: int) -> bool:
    return (micro == k - 1 or sync == "always" or (sync == "first_and_last" and micro == 0))


def _hook_target(model: nn.Module, index: int) -> tuple:
    """The module a hook goes on: the index-th (mod count) module a forward calls."""
    mods = [(n, m) for n, m in model.named_modules()
            if n and not isinstance(m, (nn.ModuleList, nn.ModuleDict))]
    return mods[index % len(mods)]


def _make_optimizers(model: nn.Module, loop: dict):
    """One optimizer (or one per parameter, for in_backward) over ``model``'s parameters,
    grouped by name the same way on both sides."""
    kind, lr = loop["optimizer"], LR[loop["optimizer"]]
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]

    def make(params, lr_, wd):
        if kind == "sgd":
            return torch.optim.SGD(params, lr=lr_, momentum=0.9, weight_decay=wd)
        return torch.optim.AdamW(params, lr=lr_, weight_decay=wd)

    def group_of(name, p):
        return 0 if (p.dim() >= 2 and name.endswith("weight")) else 1

    if kind == "in_backward":
        return {p: make([p], lr * (0.5 if loop["param_groups"] and group_of(n, p) else 1),
                        0.01) for n, p in named}
    if not loop["param_groups"]:
        return make([p for _, p in named], lr, 0.01)
    groups = [{"params": [p for n, p in named if group_of(n, p) == g],
               "lr": lr * (1, 0.5)[g], "weight_decay": (0.1, 0.0)[g]} for g in (0, 1)]
    return make([g for g in groups if g["params"]], lr, 0.01)


# --- one training loop, for both sides --------------------------------------------------------


def _drive(run) -> None:
    """The case's training loop, the same calls in the same order on the sharded ranks and
    the reference (``run`` is a ``_ShardedRun`` or a ``_ReferenceRun``)."""
    loop = run.spec["loop"]
    k = loop["accumulate"]
    if loop["warmup"]:
        run.evaluate(-1, loop["warmup"])
    for step in range(loop["steps"]):
        if loop["hook"] is not None and loop["hook"]["at"] == step:
            run.add_hook(loop["hook"])
        for micro in range(k):
            run.micro(step, micro, _synced(loop["sync"], micro, k))
        if loop["optimizer"] != "in_backward":
            if loop["clip"] is not None:
                run.clip(loop["clip"])
            run.step()
        if loop["eval"]:
            run.evaluate(step, loop["eval"])
        ck = loop["checkpoint"]
        if ck is not None and step == ck["at"]:
            run.save()
        if ck is not None and step == ck["at"] + 1:
            run.load()
    # the probe: one synchronised backward whose gradients are compared, with no step after
    # (an optimizer stepped in backward steps in it, on both sides)
    run.micro(loop["steps"], 0, True)


class _ShardedRun:
    def __init__(self, spec: dict, rank: int, tmp: str):
        from autoshard import Config, autoshard

        self.spec, self.rank, self.tmp = spec, rank, tmp
        self.records = []
        self.hook_values = []
        model = build_model(spec)
        mesh = None
        if spec["mesh"] == "hsdp":
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh("cpu", (2, spec["world"] // 2),
                                    mesh_dim_names=("replicate", "shard"))
        self.model = autoshard(model, mesh=mesh, config=Config(**config_kwargs(spec)))
        self.opt = _make_optimizers(self.model, spec["loop"])
        if spec["loop"]["optimizer"] == "in_backward":
            for p, opt in self.opt.items():
                p.register_post_accumulate_grad_hook(_step_in_backward(opt))

    def _batch(self, step, micro):
        return rank_batch(self.spec, global_batch(self.spec, self.model, step, micro),
                          self.rank)

    def micro(self, step, micro, sync):
        if self.spec["loop"]["accumulate"] > 1:
            self.model.set_requires_gradient_sync(sync)
        inputs, targets = self._batch(step, micro)
        with _autocast(self.spec["loop"]):
            loss = loss_of(self.model(*inputs), targets)
        loss.backward()
        self.records.append(("loss", step, micro, loss.item()))

    def evaluate(self, step, mode):
        inputs, targets = self._batch(step, 97)
        if mode == "eval":
            self.model.eval()
        with torch.no_grad(), _autocast(self.spec["loop"]):
            value = _scalar(self.model(*inputs), targets)
        self.model.train()
        self.records.append((mode, step, 0, value))

    def clip(self, max_norm):
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        self.records.append(("clip", -1, 0, float(norm)))

    def step(self):
        self.opt.step()
        self.opt.zero_grad(set_to_none=self.spec["loop"]["zero_grad"] == "none")

    def add_hook(self, hook):
        _, module = _hook_target(self.model, hook["target"])
        module.register_forward_hook(_forward_hook(hook["kind"], self.hook_values))

    def save(self):
        import autoshard

        opt = None if isinstance(self.opt, dict) else self.opt
        autoshard.save(os.path.join(self.tmp, "ckpt"), self.model, opt)

    def load(self):
        import autoshard

        opt = None if isinstance(self.opt, dict) else self.opt
        autoshard.load_checkpoint(os.path.join(self.tmp, "ckpt"), self.model, opt)

    def finish(self) -> dict:
        full = {k: v.detach().clone() for k, v in self.model.full_state_dict().items()}
        grads = {}
        for name, p in self.model.named_parameters():
            g = p.grad
            if g is not None and hasattr(g, "full_tensor"):
                g = g.full_tensor()
            grads[name] = None if g is None else g.detach().clone()
        buffers = {n: b.detach().clone() for n, b in self.model.named_buffers()}
        return {"records": self.records, "hooks": self.hook_values,
                "params": full if self.rank == 0 else None,
                "grads": grads if self.rank == 0 else None, "buffers": buffers}


def _step_in_backward(opt):
    def hook(p):
        opt.step()
        opt.zero_grad()
    return hook


def _forward_hook(kind: str, values: list):
    """"observe": records the output's norm on every call, returns None; "modify": returns
    the output halved, and records nothing (a hook that returns a value is traced into the
    step, where its Python side effects run at capture only, and a Python float of a tensor
    is refused there)."""
    def hook(module, args, output):
        if not isinstance(output, torch.Tensor):
            return None
        if kind == "modify":
            return output * 0.5
        values.append(float(output.detach().float().norm()))
        return None
    return hook


class _ReferenceRun:
    """The unsharded eager twin: every micro-batch runs each rank's rows in turn, with that
    rank's buffers, and backpropagates the ranks' losses summed and divided as the reduction
    does (their mean, or by ``gradient_divide_factor``)."""

    def __init__(self, spec: dict):
        self.spec = spec
        self.world = spec["world"]
        self.model = build_model(spec)
        self.records = []
        self.hook_values = [[] for _ in range(self.world)]
        self.current = 0
        self.buffers = [{n: b.detach().clone() for n, b in self.model.named_buffers()}
                        for _ in range(self.world)]
        self.opt = _make_optimizers(self.model, spec["loop"])
        self.divide = spec["config"]["gradient_divide_factor"] or float(self.world)
        self.mp = spec["config"]["mp"] == "bf16"

    def _forward(self, rank, inputs):
        """The model on one rank's inputs with that rank's buffers; under the bf16 policy
        with its parameters cast to bf16 as the all-gather does (gradients flow back to the
        float32 parameters through the cast)."""
        self.current = rank
        for name, value in self.buffers[rank].items():
            mod, _, attr = name.rpartition(".")
            self.model.get_submodule(mod)._buffers[attr] = value
        if not self.mp:
            return self.model(*inputs)
        params = {n: (p.to(torch.bfloat16) if p.is_floating_point() else p)
                  for n, p in self.model.named_parameters()}
        return torch.func.functional_call(self.model, params, inputs)

    def _batches(self, step, micro):
        batch = global_batch(self.spec, self.model, step, micro)
        return [rank_batch(self.spec, batch, r) for r in range(self.world)]

    def micro(self, step, micro, sync):
        total, values = 0.0, []
        for rank, (inputs, targets) in enumerate(self._batches(step, micro)):
            with _autocast(self.spec["loop"]):
                loss = loss_of(self._forward(rank, inputs), targets)
            values.append(loss.item())
            total = total + loss
        (total / self.divide).backward()
        self.records.append(("loss", step, micro, values))
        if self.spec["loop"]["optimizer"] == "in_backward" and sync:
            for p, opt in self.opt.items():
                if p.grad is not None:
                    opt.step()
                    opt.zero_grad()

    def evaluate(self, step, mode):
        values = []
        if mode == "eval":
            self.model.eval()
        for rank, (inputs, targets) in enumerate(self._batches(step, 97)):
            with torch.no_grad(), _autocast(self.spec["loop"]):
                values.append(_scalar(self._forward(rank, inputs), targets))
        self.model.train()
        self.records.append((mode, step, 0, values))

    def clip(self, max_norm):
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        self.records.append(("clip", -1, 0, [float(norm)] * self.world))

    def step(self):
        self.opt.step()
        self.opt.zero_grad(set_to_none=self.spec["loop"]["zero_grad"] == "none")

    def add_hook(self, hook):
        _, module = _hook_target(self.model, hook["target"])
        run = self

        values = [[] for _ in range(self.world)]
        self.hook_values = values if hook["kind"] == "observe" else self.hook_values

        class _Current(list):  # the list of the rank whose rows run now
            def append(self, v):
                values[run.current].append(v)

        module.register_forward_hook(_forward_hook(hook["kind"], _Current()))

    def save(self):
        self.saved = (copy.deepcopy(self.model.state_dict()),
                      None if isinstance(self.opt, dict) else copy.deepcopy(self.opt.state_dict()),
                      {n: b.clone() for n, b in self.buffers[0].items()})

    def load(self):
        """Back to the saved state; the buffers every rank loads are rank 0's (a checkpoint
        holds one copy of a replicated tensor)."""
        model_state, opt_state, buffers = self.saved
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                p.copy_(model_state[name])
        if opt_state is not None:
            self.opt.load_state_dict(opt_state)
        self.buffers = [{n: b.clone() for n, b in buffers.items()} for _ in range(self.world)]

    def finish(self) -> dict:
        params = {k: v.detach().clone() for k, v in self.model.state_dict().items()
                  if k not in dict(self.model.named_buffers())}
        grads = {n: None if p.grad is None else p.grad.detach().clone()
                 for n, p in self.model.named_parameters()}
        return {"records": self.records, "hooks": self.hook_values, "params": params,
                "grads": grads, "buffers": self.buffers}


def config_kwargs(spec: dict) -> dict:
    """The spec's Config fields as ``Config(**...)`` takes them."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

    from autoshard.config import Offload, Prefetch

    c = dict(spec["config"])
    out = {k: c[k] for k in ("strategy", "policy", "recompute", "bucket",
                             "reshard_after_forward", "gradient_divide_factor",
                             "force_sum_reduction_for_comms", "verify")}
    out["prefetch"] = Prefetch(depth=c["prefetch"]) if isinstance(c["prefetch"], int) and not \
        isinstance(c["prefetch"], bool) else c["prefetch"]
    out["offload_policy"] = {None: None, "cpu": CPUOffloadPolicy(pin_memory=False),
                             "half": Offload(state=0.5, pin_memory=False)}[c["offload"]]
    out["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                            reduce_dtype=torch.float32) if c["mp"] else None
    out["timeout"] = 120
    return out


# --- running a case ---------------------------------------------------------------------------


@dataclasses.dataclass
class CaseResult:
    """``status``: "pass"; "mismatch" (a silent wrong result: ``details`` says which values);
    "error" (a rank raised: ``details`` holds its traceback); "timeout"; "invalid" (the spec
    breaks a rule of ``problems``, or the eager reference itself failed)."""

    spec: dict
    status: str
    details: list
    seconds: float

    @property
    def ok(self) -> bool:
        return self.status == "pass"

    def signature(self) -> tuple:
        """What makes two failures the same failure, for the shrinker: the status, and for an
        error its exception's type (the traceback's last line up to the colon)."""
        if self.status == "error" and self.details:
            last = self.details[0].strip().splitlines()[-1] if self.details[0].strip() else ""
            return self.status, last.split(":")[0]
        return (self.status,)

    def __str__(self) -> str:
        head = f"{self.status} in {self.seconds:.1f} s: {json.dumps(self.spec)}"
        return "\n".join([head] + [f"  {d}" for d in self.details[:12]])


def _rank_entry(rank: int, world: int, spec: dict, tmp: str) -> None:
    import torch.distributed as dist

    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ.setdefault("AUTOSHARD_PROGRESS", "0")  # the case's result says what happened
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    try:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank,
                                world_size=world, timeout=timedelta(seconds=120))
        run = _ShardedRun(spec, rank, tmp)
        _drive(run)
        out = run.finish()
    except BaseException:  # noqa: BLE001 - any failure is the case's result
        out = {"error": traceback.format_exc()}
    path = os.path.join(tmp, f"result{rank}.pt")
    torch.save(out, path + ".part")
    os.replace(path + ".part", path)
    if "error" in out:
        os._exit(0)  # peers may wait in a collective; the parent ends them
    try:
        dist.barrier()
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass


def _reference(spec: dict) -> dict:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            run = _ReferenceRun(spec)
            _drive(run)
            return run.finish()
    finally:
        torch.set_num_threads(threads)


def run_case(spec: dict, *, timeout: float = 300.0) -> CaseResult:
    """Train ``spec`` sharded on ``spec["world"]`` fresh gloo processes and its reference
    here (at the same time), and compare them."""
    import torch.multiprocessing as mp

    t0 = time.perf_counter()
    bad = problems(spec)
    if bad:
        return CaseResult(spec, "invalid", bad, 0.0)
    world = spec["world"]
    with tempfile.TemporaryDirectory(prefix="autoshard-fuzz-") as tmp:
        ctx = mp.start_processes(_rank_entry, args=(world, spec, tmp), nprocs=world,
                                 join=False, start_method=_start_method())
        try:
            ref, ref_error = _reference(spec), None
        except Exception:  # noqa: BLE001
            ref, ref_error = None, traceback.format_exc()
        ranks, status = _collect(ctx, tmp, world, t0 + timeout)
    seconds = time.perf_counter() - t0
    if status == "timeout":
        return CaseResult(spec, "timeout", [f"no result within {timeout:.0f} s"], seconds)
    errors = [f"rank {r}: {out['error']}" for r, out in enumerate(ranks)
              if out is not None and "error" in out]
    missing = [f"rank {r} exited without a result" for r, out in enumerate(ranks)
               if out is None]
    if errors or missing:
        return CaseResult(spec, "error", errors + missing, seconds)
    if ref_error is not None:
        return CaseResult(spec, "invalid", [f"the eager reference failed: {ref_error}"],
                          seconds)
    details = compare(spec, ref, ranks)
    return CaseResult(spec, "mismatch" if details else "pass", details, seconds)


def _start_method() -> str:
    """"forkserver", with autoshard imported in the server: each case's ranks are forked from
    a process that imported the modules and ran nothing, so they start as fresh as spawned
    ones (no case's state, no thread pool) without paying the imports again (seconds per
    rank on a loaded machine). ``AUTOSHARD_FUZZ_START=spawn`` spawns instead."""
    import multiprocessing

    method = os.environ.get("AUTOSHARD_FUZZ_START", "forkserver")
    if method == "forkserver":
        multiprocessing.set_forkserver_preload(["torch", "torch.distributed", "autoshard",
                                                "autoshard.fuzz"])
    return method


def _collect(ctx, tmp: str, world: int, deadline: float) -> tuple:
    """Each rank's result (None where a rank died without one) and "done" or "timeout";
    once one rank reports an error the others get a few seconds, then are ended."""
    paths = [os.path.join(tmp, f"result{r}.pt") for r in range(world)]
    error_at = None
    status = "done"
    while True:
        present = [os.path.exists(p) for p in paths]
        alive = [p.is_alive() for p in ctx.processes]
        if all(present) or not any(alive):
            break
        if error_at is None and any(
                ok and "error" in torch.load(p, weights_only=False)
                for ok, p in zip(present, paths)):
            error_at = time.perf_counter()
        if error_at is not None and time.perf_counter() - error_at > 5:
            break
        if time.perf_counter() > deadline:
            status = "timeout"
            break
        time.sleep(0.05)
    for p in ctx.processes:
        p.join(timeout=10 if status == "done" and error_at is None else 0.1)
    for p in ctx.processes:
        if p.is_alive():
            p.terminate()
            p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join()
    ranks = [torch.load(p, weights_only=False) if os.path.exists(p) else None for p in paths]
    return ranks, status


# --- comparing --------------------------------------------------------------------------------


def _delta(a: torch.Tensor, b: torch.Tensor, floor: float) -> float:
    """The largest difference of ``a`` from ``b`` over ``b``'s largest magnitude (at least
    ``floor``); complex values as their real pairs."""
    if a.is_complex():
        a = torch.view_as_real(a)
    if b.is_complex():
        b = torch.view_as_real(b)
    a, b = a.detach().double(), b.detach().double()
    if a.shape != b.shape:
        return float("inf")
    if a.numel() == 0:
        return 0.0
    scale = max(float(b.abs().max()), floor)
    return float((a - b).abs().max()) / scale


def compare(spec: dict, ref: dict, ranks: list) -> list:
    """What differs between the reference's results and the ranks', one line each (empty:
    nothing, within the tolerances of the case's precision)."""
    tol_scalar, tol_param, tol_grad = TOLERANCE[_precision(spec)]
    out = []
    for rank, got in enumerate(ranks):
        if len(got["records"]) != len(ref["records"]):
            out.append(f"rank {rank}: {len(got['records'])} records, the reference "
                       f"{len(ref['records'])}")
            continue
        for (kind, step, micro, values), (gk, gs, gm, value) in zip(ref["records"],
                                                                     got["records"]):
            d = _delta(torch.tensor(value), torch.tensor(values[rank]), 1.0)
            if (kind, step, micro) != (gk, gs, gm) or not d <= tol_scalar:
                out.append(f"rank {rank}: {kind} at step {step} micro {micro}: {value:.7g}, "
                           f"the reference {values[rank]:.7g} (relative {d:.2e} > "
                           f"{tol_scalar:.0e})")
        hooks, ref_hooks = got["hooks"], ref["hooks"][rank]
        if len(hooks) != len(ref_hooks) or any(
                _delta(torch.tensor(a), torch.tensor(b), 1.0) > tol_scalar
                for a, b in zip(hooks, ref_hooks)):
            out.append(f"rank {rank}: forward hook saw {_short(hooks)}, the reference "
                       f"{_short(ref_hooks)}")
        for name, b in ref["buffers"][rank].items():
            got_b = got["buffers"].get(name)
            d = float("inf") if got_b is None else _delta(got_b, b, 1.0)
            if not d <= tol_param:
                out.append(f"rank {rank}: buffer {name} differs by {d:.2e}")
    params, grads = ranks[0]["params"], ranks[0]["grads"]
    for name, b in ref["params"].items():
        d = float("inf") if name not in params else _delta(params[name], b, 1.0)
        if not d <= tol_param:
            out.append(f"parameter {name} differs by {d:.2e} (> {tol_param:.0e})")
    if spec["loop"]["optimizer"] != "in_backward":
        for name, b in ref["grads"].items():
            a = grads.get(name, "absent")
            if isinstance(a, str):
                out.append(f"gradient of {name}: absent")
                continue
            if a is None and b is None:
                continue
            a = torch.zeros_like(b) if a is None else a
            b = torch.zeros_like(a) if b is None else b
            d = _delta(a, b, 1e-3)
            if not d <= tol_grad:
                out.append(f"gradient of {name} differs by {d:.2e} (> {tol_grad:.0e})")
    return out


def _short(values: list) -> str:
    return "[" + ", ".join(f"{v:.5g}" for v in values[:6]) + (", ...]" if len(values) > 6
                                                               else "]")


# --- shrinking --------------------------------------------------------------------------------


def _candidates(spec: dict):
    """Smaller variants of ``spec``, the largest cuts first: fewer ranks, fewer blocks, loop
    features and Config fields back to their defaults, fewer steps and micro-batches."""
    def variant(**changes):
        s = copy.deepcopy(spec)
        for path, value in changes.items():
            part, _, key = path.partition("__")
            if key:
                s[part][key] = value
            else:
                s[part] = value
        return s

    for world in range(1, spec["world"]):
        yield variant(world=world, mesh="1d")
    if spec["mesh"] != "1d":
        yield variant(mesh="1d")
    model = spec["model"]
    if "factory" not in model:
        blocks = model["blocks"]
        if blocks:
            yield variant(model=dict(model, blocks=[]))
        for i in range(len(blocks)):
            yield variant(model=dict(model, blocks=blocks[:i] + blocks[i + 1:]))
        if model["head"] != "untied":
            yield variant(model=dict(model, head="untied"))
    for key, default in LOOP_DEFAULTS.items():
        if key not in ("steps", "batch") and not _same(spec["loop"][key], default):
            yield variant(**{f"loop__{key}": default})
    for key, default in CONFIG_DEFAULTS.items():
        if not _same(spec["config"][key], default):
            yield variant(**{f"config__{key}": default})
    loop = spec["loop"]
    if loop["accumulate"] > 2:
        yield variant(loop__accumulate=2)
    if loop["steps"] > 1:
        s = variant(loop__steps=loop["steps"] - 1)
        if s["loop"]["seq"] is not None:
            s["loop"]["seq"] = s["loop"]["seq"][:-1]
        yield s


def shrink(spec: dict, fails: Optional[Callable[[dict], bool]] = None, *,
           max_runs: int = 40, log: Optional[Callable[[str], None]] = None) -> dict:
    """The smallest variant of the failing ``spec`` that still fails (delta debugging:
    repeatedly take the first smaller candidate that fails, until none does or ``max_runs``
    cases ran). ``fails`` (default: ``run_case`` fails with the same signature as ``spec``)
    decides; candidates ``problems`` refuses are skipped without a run."""
    if fails is None:
        first = run_case(spec)
        wanted = first.signature()
        if first.ok:
            return spec

        def fails(s):
            return run_case(s).signature() == wanted

    best, runs = spec, 0
    progress = True
    while progress and runs < max_runs:
        progress = False
        for cand in _candidates(best):
            if problems(cand):
                continue
            runs += 1
            if fails(cand):
                best, progress = cand, True
                if log:
                    log(f"shrink: still fails as {json.dumps(cand)}")
                break
            if runs >= max_runs:
                break
    return best


# --- many cases -------------------------------------------------------------------------------


@dataclasses.dataclass
class Summary:
    results: list
    shrunk: dict  # seed -> shrunk spec
    seconds: float

    def counts(self) -> dict:
        return dict(collections.Counter(r.status for r in self.results))

    def coverage(self) -> dict:
        c = collections.Counter(f for r in self.results for f in features(r.spec))
        return dict(sorted(c.items()))

    def render(self) -> str:
        n = len(self.results)
        failed = [r for r in self.results if not r.ok]
        lines = [f"{n} cases in {self.seconds:.0f} s ({self.seconds / max(n, 1):.1f} s a "
                 f"case): " + ", ".join(f"{k} {v}" for k, v in sorted(self.counts().items())),
                 "features covered (cases): " + ", ".join(
                     f"{k} {v}" for k, v in self.coverage().items())]
        for r in failed:
            lines.append(f"seed {r.spec['seed']}: {r}")
            if r.spec["seed"] in self.shrunk:
                lines.append(f"  shrunk: {json.dumps(self.shrunk[r.spec['seed']])}")
        return "\n".join(lines)


def fuzz(seeds, *, world_sizes=(1, 2, 3, 4), factory: Optional[str] = None,
         do_shrink: bool = False, max_shrink_runs: int = 30, timeout: float = 300.0,
         log: Optional[Callable[[str], None]] = print) -> Summary:
    """Run the case of each seed; with ``do_shrink``, shrink each failure."""
    t0 = time.perf_counter()
    results, shrunk = [], {}
    for seed in seeds:
        spec = generate(seed, world_sizes=world_sizes, factory=factory)
        result = run_case(spec, timeout=timeout)
        results.append(result)
        if log:
            log(f"seed {seed}: {result.status} ({result.seconds:.1f} s)"
                + ("" if result.ok else "\n" + str(result)))
        if do_shrink and not result.ok and result.status != "invalid":
            wanted = result.signature()
            shrunk[seed] = shrink(spec, lambda s: run_case(s, timeout=timeout).signature()
                                  == wanted, max_runs=max_shrink_runs, log=log)
            if log:
                log(f"seed {seed} shrunk to {json.dumps(shrunk[seed])}")
    return Summary(results, shrunk, time.perf_counter() - t0)

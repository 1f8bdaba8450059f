"""Meta-device initialisation: what each rank runs in tests/runtime/test_init.py, and the
peak-memory measurement on the 1.3B GPT.

    OMP_NUM_THREADS=1 python tests/runtime/init_workers.py            # GPT 1.3B, 2 ranks
    OMP_NUM_THREADS=1 python tests/runtime/init_workers.py --small    # the tests' GPT

Each rank builds the model on the meta device, calls autoshard(), and reports its peak
resident memory (VmHWM) next to what it keeps (its shards and the buffers) plus the largest
module's own tensors, the bound materialising module by module aims at.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import sys
import time

import torch
import torch.nn as nn

from autoshard import autoshard
from autoshard import deferred_init as autoshard_deferred_init
from autoshard.runtime.init_order import init_steps

HERE = os.path.dirname(os.path.abspath(__file__))
for _p in (os.path.dirname(HERE), os.path.dirname(os.path.dirname(HERE))):
    if _p not in sys.path:  # run as a script: tests/ (models, harness) and the repository
        sys.path.insert(0, _p)

from models import CASES  # noqa: E402

META_CASES = ["mlp", "cnn", "gpt", "hf_llama"]


def embedding_init(module: nn.Module) -> None:
    """What GPT.__init__ does after building its layers (autoshard.core.models.GPT)."""
    if isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, std=0.02)


INIT_FNS = {"gpt": embedding_init}


class NanoGPT(nn.Module):
    """nanoGPT's initialisation: the constructor ties the head to the token embedding, applies
    its own _init_weights (std 0.02, zero biases) and then draws every c_proj weight again
    with std 0.02 / sqrt(2 * n_layer)."""

    def __init__(self, vocab=64, block=16, n_layer=2, dim=32):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab, dim), wpe=nn.Embedding(block, dim),
            h=nn.ModuleList(nn.ModuleDict(dict(
                ln_1=nn.LayerNorm(dim), c_attn=nn.Linear(dim, 3 * dim),
                c_proj=nn.Linear(dim, dim))) for _ in range(n_layer)),
            ln_f=nn.LayerNorm(dim)))
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.transformer.wte.weight = self.lm_head.weight
        self.apply(self._init_weights)
        for pn, p in self.named_parameters():
            if pn.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)


class Drawn(nn.Module):
    """Values a constructor computes itself: a parameter from torch.randn scaled out of place,
    a rotary table from torch.arange, a weight scaled in place after its layer drew it, and
    layers deep-copied from one (nn.TransformerEncoder)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.cls = nn.Parameter(torch.randn(1, 8) * 0.02)
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8)),
                             persistent=False)
        self.encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(
            8, 2, 16, dropout=0.0), 2, enable_nested_tensor=False)
        with torch.no_grad():
            self.proj.weight.mul_(0.5)


def erfinv_trunc_normal_(t: torch.Tensor, std: float = 0.02, a: float = -2.0,
                         b: float = 2.0) -> torch.Tensor:
    """The truncated normal of torch < 2.13 and of timm: a chain of in-place ops (uniform_,
    erfinv_, mul_, add_, clamp_) on one tensor."""
    def cdf(x):
        return (1.0 + math.erf(x / math.sqrt(2.0))) / 2.0
    with torch.no_grad():
        t.uniform_(2 * cdf(a / std) - 1, 2 * cdf(b / std) - 1)
        t.erfinv_()
        t.mul_(std * math.sqrt(2.0))
        t.add_(0.0)
        t.clamp_(min=a, max=b)
    return t


class FusedQKV(nn.Module):
    """torchtitan's fused-QKV init: q, k and v drawn into temporaries, concatenated, viewed
    and copied into the fused parameter, after the layer's own reset_parameters(); the
    whole init under torch.no_grad() or not, the draws by ``draw``."""

    def __init__(self, dim=3, heads=2, no_grad=False, draw=nn.init.trunc_normal_):
        super().__init__()
        self.heads, self.draw = heads, draw
        self.wqkv = nn.Linear(dim, 3 * heads, bias=False)
        self.out = nn.Parameter(torch.empty(4, dim))
        with torch.no_grad() if no_grad else contextlib.nullcontext():
            self.init_weights()

    def init_weights(self):
        w = self.wqkv.weight
        q, k, v = (w.new_empty(self.heads, w.shape[1]) for _ in range(3))
        for t in (q, k, v):
            self.draw(t, std=0.02)
        fused = torch.cat([t.view(1, self.heads, -1) for t in (q, k, v)], 1)
        with torch.no_grad():
            w.copy_(fused.view(-1, w.shape[1]))
        nn.init.trunc_normal_(self.out, std=0.02)  # directly on a parameter


class SliceFused(nn.Module):
    """A fused weight assembled from slices of an uninitialised temporary, each drawn in
    place, then copied in: every element it reads was written first."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.empty(6, 3))
        with torch.no_grad():
            fused = self.w.new_empty(6, 3)
            nn.init.trunc_normal_(fused[:2], std=0.02)
            fused[2:4].uniform_(-0.1, 0.1)
            fused[4:].normal_().mul_(0.5)
            self.w.copy_(fused)


class SkippedOnMeta(nn.Module):
    """The other torch.nn.init functions that write nothing on the meta device: orthogonal_,
    sparse_ (both draw) and dirac_ (on a conv weight its layer drew first)."""

    def __init__(self):
        super().__init__()
        self.rot = nn.Parameter(torch.empty(4, 4))
        self.sparse = nn.Parameter(torch.empty(6, 4))
        self.conv = nn.Conv1d(2, 2, 3)
        nn.init.orthogonal_(self.rot)
        nn.init.sparse_(self.sparse, 0.5, std=0.02)
        nn.init.dirac_(self.conv.weight)


# built under autoshard.deferred_init(), with no param_init_fn
DEFERRED_CASES = {"nanogpt": NanoGPT, "drawn": Drawn, "gpt": CASES["gpt"][0],
                  "hf_llama": CASES["hf_llama"][0], "hf_gpt2": CASES["hf_gpt2"][0],
                  "fused_qkv": FusedQKV,
                  "fused_qkv_no_grad": functools.partial(FusedQKV, no_grad=True),
                  "fused_qkv_erfinv": functools.partial(FusedQKV, draw=erfinv_trunc_normal_),
                  "slice_fused": SliceFused, "skipped_on_meta": SkippedOnMeta}
DEFERRED_WORLD2 = ["nanogpt", "drawn", "fused_qkv_no_grad"]


def device_state(build) -> tuple:
    """``build()`` on the CPU with seed 0: every parameter and buffer, and the next draws."""
    torch.manual_seed(0)
    model = build()
    after = torch.rand(4)
    state = {k: v.detach() for k, v in model.named_parameters()}
    state.update({k: v.detach() for k, v in model.named_buffers()})
    return state, after


def shard_deferred(build, **kwargs) -> nn.Module:
    """``build()`` under autoshard.deferred_init(), then autoshard() with seed 0."""
    with autoshard_deferred_init():
        model = build()
    torch.manual_seed(0)
    return autoshard(model, **kwargs)


def build_on_device(name: str) -> nn.Module:
    torch.manual_seed(0)
    return CASES[name][0]()


def build_on_meta(name: str) -> nn.Module:
    with torch.device("meta"):
        return CASES[name][0]()


def shard_on_meta(name: str, **kwargs) -> nn.Module:
    """The model built on the meta device, then autoshard() with the device build's seed."""
    model = build_on_meta(name)
    torch.manual_seed(0)
    return autoshard(model, param_init_fn=INIT_FNS.get(name), **kwargs)


def local_state(model: nn.Module) -> dict:
    """Every parameter's local shard and every buffer (non-persistent ones too)."""
    out = {}
    for fqn, p in model.named_parameters():
        out[fqn] = p.to_local().detach().clone()
    for fqn, b in model.named_buffers():
        out[fqn] = b.detach().clone()
    return out


def meta_init_worker(rank, world, names):
    """Each rank: its local shards of every model in ``names`` built on the meta device."""
    out = {}
    for name in names:
        model = shard_on_meta(name)
        res = {"state": local_state(model)}
        if name == "gpt":
            res["tied"] = model.head.weight is model.wte.weight
        if name == "hf_llama":  # untied in this configuration; the same as built on the device
            res["tied"] = model.lm_head.weight is model.model.embed_tokens.weight
        res["after_rng"] = torch.rand(4)  # the generator stands where the device build left it
        out[name] = res
    for name in DEFERRED_WORLD2:
        model = shard_deferred(DEFERRED_CASES[name])
        out["deferred_" + name] = {"state": local_state(model), "after_rng": torch.rand(4)}
    out["memory"] = profiled_peak(wide_gpt)
    return out


def wide_gpt() -> nn.Module:
    """A GPT whose tensors dwarf the bookkeeping (4 MiB of parameters, 0.5 MiB the largest
    module), for measuring what materialising it holds at once."""
    from autoshard.core.models import GPT

    return GPT(vocab=1024, dim=128, heads=4, layers=4, seq=64)


def module_bytes(model: nn.Module) -> int:
    """The largest module's own parameters and buffers, in bytes."""
    return max(
        sum(t.numel() * t.element_size() for t in
            list(m.parameters(recurse=False)) + list(m.buffers(recurse=False)))
        for m in model.modules())


def profiled_peak(build) -> dict:
    """Peak bytes the allocator holds during autoshard() of ``build()`` on the meta device
    (torch.profiler's allocation events, so the count is exact), with what the rank keeps and
    the largest module."""
    from torch.profiler import ProfilerActivity, profile

    from autoshard.core import _compat

    with torch.device("meta"):
        model = build()
    largest = module_bytes(model)
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    steps = len(init_steps(model, embedding_init))
    torch.manual_seed(0)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model = autoshard(model, param_init_fn=embedding_init)
    live = peak = 0
    for _, delta in _compat.allocation_events(prof):
        live += delta
        peak = max(peak, live)
    kept = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    kept += sum(b.numel() * b.element_size() for b in model.buffers())
    return {"peak": peak, "kept": kept, "largest_module": largest, "full": full,
            "steps": steps, "rng_state_bytes": torch.get_rng_state().numel()}


# --- peak memory ------------------------------------------------------------------------------


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def memory_worker(rank, world, factory):
    """Build ``factory()`` on the meta device, autoshard it, report memory in bytes."""
    import importlib

    mod_name, _, fn_name = factory.partition(":")
    build = getattr(importlib.import_module(mod_name), fn_name)
    with torch.device("meta"):
        model = build()
    largest = module_bytes(model)
    before_rss = _status_kib("VmRSS") * 1024
    torch.manual_seed(0)
    t0 = time.perf_counter()
    model = autoshard(model, param_init_fn=embedding_init)
    seconds = time.perf_counter() - t0
    kept = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    kept += sum(b.numel() * b.element_size() for b in model.buffers())
    return {"peak_rss": _status_kib("VmHWM") * 1024, "rss_before": before_rss,
            "rss_after": _status_kib("VmRSS") * 1024, "kept": kept, "largest_module": largest,
            "seconds": seconds}


def measure(factory: str, world: int) -> list:
    from harness import run_ranks

    return run_ranks(world, memory_worker, factory)


def _gib(b: float) -> str:
    return f"{b / 2**30:.2f} GiB"


def main(argv=None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--small", action="store_true", help="the tests' GPT instead of 1.3B")
    ap.add_argument("--world-size", type=int, default=2)
    args = ap.parse_args(argv)
    factory = ("autoshard.core.models:GPT" if args.small
               else "autoshard.examples.gpt_shapes:gpt_1_3b")
    for r, res in enumerate(measure(factory, args.world_size)):
        bound = res["rss_before"] + res["kept"] + res["largest_module"]
        print(f"rank {r}: peak RSS {_gib(res['peak_rss'])} (before autoshard "
              f"{_gib(res['rss_before'])}, after {_gib(res['rss_after'])}); shards+buffers "
              f"{_gib(res['kept'])} + largest module {_gib(res['largest_module'])} + the RSS "
              f"before = {_gib(bound)}; peak - before = {_gib(res['peak_rss'] - res['rss_before'])}"
              f"; autoshard() took {res['seconds']:.1f} s")


if __name__ == "__main__":
    main()

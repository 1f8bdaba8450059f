"""The default plan against FSDP2's plan on the GPU profiles (predicted, no GPU needed).

    python -m bench.default_plan [--profiles h100,a100,h200] [--models gpt_1_3b:8:2048,...]

For each model and profile, three plans of the same step are made on fake tensors (the
model on the meta device): autoshard's default (``Config()``; on a GPU profile
``prefer="auto"`` is "balanced": among the plans no slower and no heavier than FSDP2's
plan, the fastest, then the lightest within 2% of its step), the fastest that fits
(``prefer="speed"``), and ``prefer="memory"``. FSDP2's plan is the one the planner predicts
for it (one unit per repeated block plus the root, resharded after the forward but the
root, nothing recomputed, prefetch of one), planned pinned here for every model. Printed:
each plan's predicted step and peak, the default's against FSDP2's, and ``plan.choice``
where the default is not the fastest.

Models: ``NAME:WORLD:SEQ`` at batch 1 per rank, from ``autoshard.examples.gpt_shapes``
(``gpt_1_3b``, ``gpt_13b``, ...), ``autoshard.examples.llama_shapes`` (``llama3_8b``,
``llama3_70b``, ``llama_1b``: TinyLlama's shape) or ``bench.compare``'s benchmark models
(``hf-llama``, ``gpt-small``, ...: batch 8, their own data).
"""

from __future__ import annotations

import argparse
import time

import torch

MODELS = ("hf-llama:8:64,gpt-small:8:64,hf-t5:8:64,llama_1b:8:2048,gpt_1_3b:8:2048,"
          "llama3_8b:8:4096,gpt_13b:32:2048,llama3_70b:64:4096")


def _factory(name: str):
    from autoshard.examples import gpt_shapes, llama_shapes

    if name == "llama_1b":
        return lambda: llama_shapes.Llama(vocab=32000, dim=2048, heads=32, kv_heads=4,
                                          ffn=5632, layers=22)
    for mod in (gpt_shapes, llama_shapes):
        if hasattr(mod, name):
            return getattr(mod, name)
    return None


def _inputs(name: str, seq: int):
    from bench import compare

    if _factory(name) is not None:
        return (torch.zeros(1, seq, dtype=torch.long),), {}
    x, _ = compare.batch_for(name, 8, seq, torch.Generator().manual_seed(0))
    return ((), x) if isinstance(x, dict) else ((x,), {})


def fsdp2_config(profile: str):
    """FSDP2's plan as the planner predicts it (``passes.planner.Planner._fsdp2``), pinned."""
    from autoshard import Config, Prefetch

    return Config(device_profile=profile, policy="module", recompute=False,
                  offload_activations=False, bucket=False, prefetch=Prefetch(depth=1),
                  reshard_after_forward="auto", strategy="zero3", prefer="speed")


def plan_of(name: str, world: int, seq: int, profile: str, prefer: str):
    import autoshard
    from autoshard import Config
    from bench import compare

    factory = _factory(name)
    with torch.device("meta" if factory is not None else "cpu"):
        torch.manual_seed(0)
        model = factory() if factory is not None else compare.MODELS[name]()
    args, kwargs = _inputs(name, seq)
    inputs = args if not kwargs else kwargs
    config = (fsdp2_config(profile) if prefer == "fsdp2"
              else Config(device_profile=profile, prefer=prefer))
    return autoshard.plan(model, inputs, world_size=world, config=config)


def row(name: str, world: int, seq: int, profile: str) -> dict:
    t0 = time.perf_counter()
    plans = {p: plan_of(name, world, seq, profile, p)
             for p in ("auto", "speed", "memory", "fsdp2")}
    d, ref = plans["auto"].predicted, plans["fsdp2"].predicted
    out = {"model": f"{name} x{world} seq {seq}", "profile": profile}
    for p, plan in plans.items():
        out[f"{p} ms"] = round(plan.predicted["step_s"] * 1e3, 2)
        out[f"{p} GiB"] = round(plan.predicted["peak_bytes"] / 2**30, 2)
    out["step x fsdp2"] = round(d["step_s"] / ref["step_s"], 3)
    out["peak x fsdp2"] = round(d["peak_bytes"] / ref["peak_bytes"], 3)
    out["s"] = round(time.perf_counter() - t0, 1)
    out["choice"] = plans["auto"].choice or ""
    return out


def main(argv=None) -> list:
    from tabulate import tabulate

    ap = argparse.ArgumentParser(prog="python -m bench.default_plan", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profiles", default="h100,a100,h200")
    ap.add_argument("--models", default=MODELS)
    args = ap.parse_args(argv)
    rows = []
    for spec in args.models.split(","):
        name, world, seq = spec.split(":")
        for profile in args.profiles.split(","):
            rows.append(row(name, int(world), int(seq), profile))
            r = rows[-1]
            print(f"{r['model']}, {profile}: {r['step x fsdp2']}x FSDP2's step, "
                  f"{r['peak x fsdp2']}x its peak ({r['s']} s)", flush=True)
    print(tabulate(rows, headers="keys", tablefmt="github"))
    return rows


if __name__ == "__main__":
    main()

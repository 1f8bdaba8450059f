"""What checking a captured step's guards costs per call, against the step it guards.

    python -m bench.guards [--steps 20] [--checks 2000] [--models gpt-small,hf-llama]

Before each call reuses a program, every guard capture recorded (``autoshard.core.guards``: the
module tree, hooks and dtypes, the attributes, globals and closure cells the forward read)
is compared with the value now. For each benchmark model (``bench.compare``'s, same batch)
this times, at world size 1 in this process, the median of ``checks`` guard checks and the
median of ``steps`` training steps (forward, backward, AdamW step), and prints both, the
number of guards and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch

from bench.compare import MODELS, _forward, _loss, batch_for


def measure(name: str, steps: int, checks: int, batch: int = 8, seq: int = 64) -> dict:
    from autoshard import autoshard

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # world size 1 says so
        model = autoshard(MODELS[name]())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = batch_for(name, batch, seq, torch.Generator().manual_seed(0))
    times = []
    for i in range(steps + 1):  # the first step captures: not timed
        t0 = time.perf_counter()
        _loss(_forward(model, x), y).backward()
        opt.step()
        opt.zero_grad()
        if i:
            times.append(time.perf_counter() - t0)
    guards = model._autoshard.last.captured.guards
    assert guards.failure() is None, "a guard failed on an unchanged model"
    cost = []
    for _ in range(checks):
        t0 = time.perf_counter()
        guards.failure()
        cost.append(time.perf_counter() - t0)
    step, check = statistics.median(times), statistics.median(cost)
    return {"model": name, "guards": len(guards), "check_us": check * 1e6,
            "step_ms": step * 1e3, "ratio": check / step}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--checks", type=int, default=2000)
    ap.add_argument("--models", default=",".join(MODELS))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    from tabulate import tabulate

    rows = [measure(m, args.steps, args.checks) for m in args.models.split(",")]
    print(tabulate([[r["model"], r["guards"], f"{r['check_us']:.0f}", f"{r['step_ms']:.1f}",
                     f"{100 * r['ratio']:.2f}%"] for r in rows],
                   headers=["model", "guards", "check (us)", "step (ms)", "check / step"]))


if __name__ == "__main__":
    main()

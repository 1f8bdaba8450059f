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
import multiprocessing.forkserver
import os
import tempfile
import time
import traceback
import warnings
from datetime import timedelta
from typing import Callable, Optional

import torch

from autoshard.fuzz.spec import (CONFIG_DEFAULTS, LOOP_DEFAULTS, data_rank, features, generate,
                                 precision_of, problems, same_value)
from autoshard.fuzz.train import ReferenceRun, ShardedRun, drive
# autoshard.fuzz's public names (docs/api.md), whichever module holds them
from autoshard.fuzz.model import (FuzzAttention, FuzzComplex, FuzzConv, FuzzDouble,  # noqa: F401
                                  FuzzLinear, FuzzMoE, FuzzNet, FuzzNorm, FuzzRow, FuzzRunning,
                                  FuzzTwice, build_model)
from autoshard.fuzz.spec import BLOCK_ODDS, BLOCKS, DIM, HEADS, LR, SEQ, VOCAB  # noqa: F401
from autoshard.fuzz.train import (config_kwargs, global_batch, loss_of,  # noqa: F401
                                  rank_batch)


# (losses and other scalars, parameters and buffers, gradients): the largest difference over
# the reference's largest magnitude (at least 1 for losses and parameters, 1e-3 for gradients)
TOLERANCE = {"fp32": (2e-5, 2e-5, 2e-4), "bf16": (2e-2, 2e-2, 5e-2)}


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


def _rank_entry(rank: int, world: int, spec: dict, tmp: str, env: dict) -> None:
    import torch.distributed as dist

    # the caller's environment at this case, as a spawned rank would have it: a rank forked
    # from the server has the server's, from whenever it started
    os.environ.clear()
    os.environ.update(env)
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ.setdefault("AUTOSHARD_PROGRESS", "0")  # the case's result says what happened
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    try:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank,
                                world_size=world, timeout=timedelta(seconds=120))
        run = ShardedRun(spec, rank, tmp)
        drive(run)
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
            run = ReferenceRun(spec)
            drive(run)
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
        ctx = mp.start_processes(_rank_entry, args=(world, spec, tmp, dict(os.environ)),
                                 nprocs=world, join=False, start_method=_start_method())
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
    rank on a loaded machine). Its modules are added to the process's preload list, which an
    application may have set (the server is one per process, started by whichever user
    needs it first). ``AUTOSHARD_FUZZ_START=spawn`` spawns instead."""
    method = os.environ.get("AUTOSHARD_FUZZ_START", "forkserver")
    if method == "forkserver":
        preload = forkserver_preload()
        multiprocessing.forkserver.set_forkserver_preload(
            preload + [m for m in FORKSERVER_MODULES if m not in preload])
    return method


# what the fuzzer's ranks import before any case: imported once, by the forkserver
FORKSERVER_MODULES = ("torch", "torch.distributed", "autoshard", "autoshard.fuzz")


def forkserver_preload() -> list:
    """The modules the process's forkserver imports when it starts, as set so far (the
    standard library keeps the list, and offers only its setter)."""
    return list(getattr(multiprocessing.forkserver._forkserver, "_preload_modules", []))


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
    tol_scalar, tol_param, tol_grad = TOLERANCE[precision_of(spec)]
    out = []
    for rank, got in enumerate(ranks):
        mine = data_rank(spec, rank)  # whose rows this rank read, in the reference
        if len(got["records"]) != len(ref["records"]):
            out.append(f"rank {rank}: {len(got['records'])} records, the reference "
                       f"{len(ref['records'])}")
            continue
        for (kind, step, micro, values), (gk, gs, gm, value) in zip(ref["records"],
                                                                     got["records"]):
            d = _delta(torch.tensor(value), torch.tensor(values[mine]), 1.0)
            if (kind, step, micro) != (gk, gs, gm) or not d <= tol_scalar:
                out.append(f"rank {rank}: {kind} at step {step} micro {micro}: {value:.7g}, "
                           f"the reference {values[mine]:.7g} (relative {d:.2e} > "
                           f"{tol_scalar:.0e})")
        hooks, ref_hooks = got["hooks"], ref["hooks"][mine]
        if len(hooks) != len(ref_hooks) or any(
                _delta(torch.tensor(a), torch.tensor(b), 1.0) > tol_scalar
                for a, b in zip(hooks, ref_hooks)):
            out.append(f"rank {rank}: forward hook saw {_short(hooks)}, the reference "
                       f"{_short(ref_hooks)}")
        for name, b in ref["buffers"][mine].items():
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
        for key in ("unused", "output"):  # a parameter no loss reads, a dataclass output
            if model.get(key):
                yield variant(model={k: v for k, v in model.items() if k != key})
    for key, default in LOOP_DEFAULTS.items():
        # .get: a spec written before a feature existed lacks its key (the default)
        if key not in ("steps", "batch") and not same_value(spec["loop"].get(key, default),
                                                             default):
            yield variant(**{f"loop__{key}": default})
    for key, default in CONFIG_DEFAULTS.items():
        if not same_value(spec["config"].get(key, default), default):
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

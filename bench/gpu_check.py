"""Every GPU check in one command, in stages, within a few minutes of one GPU.

    python -m bench.gpu_check [--out DIR] [--budget 420] [--only STAGE,...] [--dry-run]

Each stage runs in a process of its own under a deadline of its own (cut to what is left of
``--budget`` seconds), so a hang or a crash in one costs only that stage. After every stage
``DIR/gpu_check.json`` (every figure) and ``DIR/gpu_check.md`` (the table) are written
again, so a run stopped from outside still reports what it finished. The tests (stage 6)
run beside stages 2 and 4, which time nothing, from the moment the environment has passed;
the stages that time steps (3 and 5) start once they are done and have the GPU to
themselves. The stages:

1. ``env``: torch, CUDA and the device; NCCL at world size 1 (all-gather, reduce-scatter and
   all-reduce, the c10d functional ones the graphs run, compared with the values expected)
   and a bf16 matmul against float64. The run stops here if a check fails.
2. ``smoke``: a small Llama, three AdamW steps in float32 (TF32 off) of eager, autoshard's
   default Config, forced activation offload, CPU offload of the sharded state, the compiled
   graphs (``Config(compile=True)``) and FSDP2 per block: each system's losses and final
   parameters against eager's.
3. ``llama1b``: a 1.1B Llama (TinyLlama's shape) in bf16: eager, FSDP2 per block and
   autoshard, step medians over interleaved repetitions, the peak (the state when a step
   starts plus ``max_memory_allocated``'s rise in one step, ``bench.compare._peak``) against
   the plan's prediction, and from a profiler trace of one step each: the GPU's busy share
   (union of kernel time over the step's time) and NCCL kernel time not covered by compute.
4. ``fake8``: a world of 8 faked with torch's fake process group on the GPU mesh: the peak
   per rank of autoshard and FSDP2 and autoshard's predicted peak.
5. ``hostcost``: ``bench.host_cost`` on the device, the launch-bound regime where a GPU
   waits for the host: ATen ops per step and step time at world size 1 of eager, autoshard
   and FSDP2 on two small models (a 48-block MLP, a 4-layer Llama), and where the step goes
   (forward, backward, ``opt.step()``, ``zero_grad``).
6. ``pytest``: the suite's tests marked ``gpu``.

``--dry-run`` runs the same stages at tiny sizes on the CPU (gloo), as the test suite does;
its ``pytest`` stage runs the same command, whose tests skip there (no CUDA device).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist

GiB = 2**30
# (stage, deadline in seconds, must pass for the run to go on)
STAGES = (("env", 60, True), ("smoke", 150, False), ("llama1b", 240, False),
          ("fake8", 150, False), ("hostcost", 90, False), ("pytest", 240, False))
# the stage that runs beside the others from the start (it times nothing), and those that
# time steps, which wait for it to end first: the GPU's time-slicing would be in their figures
BACKGROUND, ALONE = "pytest", ("llama1b", "hostcost")
GPU_TESTS = ("tests/runtime/test_compile.py", "tests/runtime/test_export.py",
             "tests/runtime/test_gpu_streams.py")


# --- the driver ----------------------------------------------------------------------------

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="gpu_check_out",
                    help="folder for the JSON, the table and each stage's log")
    ap.add_argument("--budget", type=float, default=420.0, help="seconds for all stages")
    ap.add_argument("--only", default=None, help="comma-separated stages to run")
    ap.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU")
    ap.add_argument("--systems", default=None,
                    help="comma-separated systems of the smoke stage (default: all)")
    ap.add_argument("--stage", default=None, help=argparse.SUPPRESS)  # a stage's own process
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.stage:
        return run_stage(args)
    wanted = args.only.split(",") if args.only else [s for s, _, _ in STAGES]
    unknown = set(wanted) - {s for s, _, _ in STAGES}
    if unknown:
        ap.error(f"unknown stage(s) {sorted(unknown)}; known: {[s for s, _, _ in STAGES]}")
    report = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "dry_run": args.dry_run,
              "stages": {}}
    t0 = time.monotonic()
    background = None  # (name, the running stage) of BACKGROUND once started

    def left() -> float:
        return args.budget - (time.monotonic() - t0)

    def record(name: str, res: dict) -> None:
        report["stages"][name] = res
        _write(args.out, report)
        print(_table(report), flush=True)

    def join() -> None:
        nonlocal background
        if background is not None:
            record(background[0], background[1].finish())
            background = None

    for name, deadline, required in _order(STAGES):
        if name not in wanted:
            continue
        if name in ALONE:
            join()  # a stage that times steps has the GPU to itself
        if left() < 10:
            record(name, {"status": "skipped", "why": "out of time"})
            continue
        running = _Running(args, name, min(deadline, left()), t0)
        if name == BACKGROUND:
            background = (name, running)
            continue
        res = running.finish()
        record(name, res)
        if required and res["status"] != "ok":
            print(f"stage {name} failed: stopping", flush=True)
            if background is not None:
                background[1].stop()
            break
    join()
    report["stages"] = {n: report["stages"][n] for n, _, _ in STAGES if n in report["stages"]}
    report["seconds"] = round(time.monotonic() - t0, 1)
    _write(args.out, report)
    print(_table(report))
    return 0 if all(s.get("status") in ("ok", "skipped") for s in report["stages"].values()) \
        else 1


def _order(stages) -> list:
    """The order stages start in: the first (the environment, which must pass), the
    background one, those that time nothing (beside it), then those that time steps."""
    first, rest = stages[0], stages[1:]
    rank = {BACKGROUND: 0}
    return [first] + sorted(rest, key=lambda s: rank.get(s[0], 2 if s[0] in ALONE else 1))


class _Running:
    """One stage's process, started; ``finish`` waits for it (at most its deadline) and
    returns what it reported."""

    def __init__(self, args, name: str, deadline: float, since: float):
        cmd = [sys.executable, "-m", "bench.gpu_check", "--stage", name, "--out", args.out]
        if args.dry_run:
            cmd.append("--dry-run")
        if args.systems:
            cmd += ["--systems", args.systems]
        self.args, self.name, self.deadline = args, name, deadline
        self.log = os.path.join(args.out, f"{name}.log")
        self.t0 = time.monotonic()
        self.started = round(self.t0 - since, 1)  # seconds into the run
        with open(self.log, "w") as f:
            # a session of its own: a stage stopped takes what it started with it (the
            # pytest stage's ranks would otherwise keep the GPU)
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()

    def finish(self) -> dict:
        wait = self.deadline - (time.monotonic() - self.t0)
        try:
            rc = self.proc.wait(timeout=max(wait, 0))
            status = "ok" if rc == 0 else f"failed (exit {rc})"
        except subprocess.TimeoutExpired:
            self.stop()
            status = f"timed out after {self.deadline:.0f} s"
        took = time.monotonic() - self.t0
        own = os.path.join(self.args.out, f"{self.name}.json")
        res = _read(own)
        if os.path.exists(own):  # now in gpu_check.json: fewer files to carry back
            os.remove(own)
        res.update(status=status if res.get("status", "ok") == "ok" else res["status"],
                   seconds=round(took, 1), started=self.started)
        if status != "ok":
            with open(self.log) as f:
                res["log_tail"] = f.read()[-3000:]
            print(res["log_tail"], flush=True)
        return res


def _read(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _write(out: str, report: dict) -> None:
    for name, text in (("gpu_check.json", json.dumps(report, indent=1, default=str)),
                       ("gpu_check.md", _table(report))):
        tmp = os.path.join(out, name + ".tmp")
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, os.path.join(out, name))


def _table(report: dict) -> str:
    from tabulate import tabulate

    st = report["stages"]
    lines = [tabulate([(k, v.get("status"), v.get("seconds"), v.get("summary", ""))
                       for k, v in st.items()],
                      headers=["stage", "status", "s", "summary"], tablefmt="github")]
    for key in ("smoke", "llama1b", "fake8", "hostcost"):
        rows = st.get(key, {}).get("rows")
        if rows:
            lines.append(f"\n{key}: {st[key].get('what', '')}\n")
            lines.append(tabulate(rows, headers="keys", tablefmt="github"))
    if st.get("hostcost", {}).get("split"):
        lines.append("\nhostcost, where the step goes (each part ended by a synchronize):\n")
        lines.append(tabulate(st["hostcost"]["split"], headers="keys", tablefmt="github"))
    return "\n".join(lines) + "\n"


# --- a stage's process ---------------------------------------------------------------------

class Stage:
    """What a stage has found so far, written to ``DIR/<stage>.json`` at each ``save``."""

    def __init__(self, args):
        self.path = os.path.join(args.out, f"{args.stage}.json")
        self.data = {"rows": []}

    def save(self, **fields) -> None:
        self.data.update(fields)
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.data, f, indent=1, default=str)
        os.replace(tmp, self.path)


def run_stage(args) -> int:
    st = Stage(args)
    cuda = torch.cuda.is_available() and not args.dry_run
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(0)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    else:
        torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    fn = {"env": stage_env, "smoke": stage_smoke, "llama1b": stage_llama1b,
          "fake8": stage_fake8, "hostcost": stage_hostcost, "pytest": stage_pytest}[args.stage]
    try:
        fn(args, st, device)
    except Exception as e:  # noqa: BLE001  (recorded, and the stage fails)
        st.save(status=f"error: {type(e).__name__}: {str(e)[:300]}",
                traceback=traceback.format_exc()[-3000:])
        traceback.print_exc()
        return 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0 if st.data.get("status", "ok") == "ok" else 1


def _init_world_one(device, tmp: str) -> None:
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            init_method=f"file://{tmp}/store", rank=0, world_size=1)


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def stage_env(args, st: Stage, device) -> None:
    import autoshard

    info = {"torch": torch.__version__, "cuda": torch.version.cuda,
            "autoshard": getattr(autoshard, "__version__", "?"), "device": "cpu"}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(device=props.name, memory_gib=round(props.total_memory / GiB, 1),
                    capability=f"{props.major}.{props.minor}", nccl=torch.cuda.nccl.version())
    st.save(**info)
    checks = {}
    with tempfile.TemporaryDirectory() as tmp:
        _init_world_one(device, tmp)
        group = dist.group.WORLD.group_name
        x = torch.arange(4096, dtype=torch.float32, device=device)
        out = torch.empty_like(x)
        dist.all_gather_into_tensor(out, x)
        checks["all_gather"] = torch.equal(out, x)
        rs = torch.empty_like(x)
        dist.reduce_scatter_tensor(rs, x * 3)
        checks["reduce_scatter"] = torch.equal(rs, x * 3)
        b = (x % 7).to(torch.bfloat16)
        dist.all_reduce(b)
        checks["all_reduce_bf16"] = torch.equal(b, (x % 7).to(torch.bfloat16))
        ops = torch.ops._c10d_functional
        g = ops.wait_tensor(ops.all_gather_into_tensor(x, 1, group))
        r = ops.wait_tensor(ops.reduce_scatter_tensor(x, "sum", 1, group))
        checks["functional_collectives"] = torch.equal(g, x) and torch.equal(r, x)
        gen = torch.Generator().manual_seed(0)
        a, c = (torch.randn(512, 512, generator=gen, dtype=torch.float64) for _ in range(2))
        got = (a.to(device, torch.bfloat16) @ c.to(device, torch.bfloat16)).double().cpu()
        err = ((got - a @ c).norm() / (a @ c).norm()).item()
        checks["matmul_bf16_rel_err<1e-2"] = err < 1e-2
        _sync(device)
    failed = [k for k, ok in checks.items() if not ok]
    st.save(checks=checks, matmul_rel_err=err,
            status="ok" if not failed else f"failed: {', '.join(failed)}",
            summary=f"{info['device']}, torch {info['torch']}, "
                    f"{sum(checks.values())}/{len(checks)} checks")


# --- models and steps ----------------------------------------------------------------------

def _llama(dry: bool, big: bool):
    """A Hugging Face Llama from its config: TinyLlama's 1.1B shape (``big``), or a small one
    for the smoke stage and every dry run."""
    import transformers as T

    if big and not dry:
        cfg = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                   num_attention_heads=32, num_key_value_heads=4, vocab_size=32000,
                   max_position_embeddings=2048)
    else:
        cfg = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                   max_position_embeddings=256)
    config = T.LlamaConfig(use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0,
                           attention_dropout=0.0, **cfg)
    return T.LlamaForCausalLM(config)


def _batches(vocab: int, batch: int, seq: int, n: int, device) -> list:
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        t = torch.randint(0, vocab, (batch, seq + 1), generator=gen)
        out.append((t[:, :-1].to(device), t[:, 1:].to(device)))
    return out


def _loss(model, x, y):
    logits = model(input_ids=x).logits
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())


def _build(system: str, dry: bool, big: bool, device, dtype=torch.float32):
    """``system`` of a Llama built from seed 0 on ``device``, and its AdamW."""
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    from autoshard import Config, autoshard

    torch.manual_seed(0)
    model = _llama(dry, big).to(device=device, dtype=dtype)
    configs = {"autoshard": Config(),
               "act-offload": Config(offload_activations=True, prefer="speed"),
               "cpu-offload": Config(offload_policy=CPUOffloadPolicy()),
               "compiled": Config(compile=True)}
    if system in configs:
        model = autoshard(model, config=configs[system])
    elif system == "fsdp2":
        for blk in model.model.layers:
            fully_shard(blk)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, opt


def _as_kwargs(batch) -> tuple:
    """``(x, y)`` as ``bench.compare._peak`` takes it to call the model as ``_loss`` does,
    ``model(input_ids=x)``: a positional call would be another signature, captured apart."""
    x, y = batch
    return {"input_ids": x}, y


def _step(model, opt, x, y) -> float:
    loss = _loss(model, x, y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def _params(model) -> list:
    """The parameters in order, whole (world size 1: the local shard is the whole)."""
    from torch.distributed.tensor import DTensor

    return [(p.to_local() if isinstance(p, DTensor) else p).detach().float().cpu()
            for p in model.parameters()]


def stage_smoke(args, st: Stage, device) -> None:
    systems = ("autoshard", "act-offload", "cpu-offload", "fsdp2", "compiled")
    if args.systems:
        systems = tuple(s for s in systems if s in args.systems.split(","))
    data = _batches(256, 4, 32, 3, device)
    tol = 1e-4
    with tempfile.TemporaryDirectory() as tmp:
        _init_world_one(device, tmp)
        model, opt = _build("eager", args.dry_run, False, device)
        ref_loss = [_step(model, opt, x, y) for x, y in data]
        ref = _params(model)
        st.save(what=f"a small Llama, 3 AdamW steps in float32 against eager (limit {tol:g})")
        failed = []
        for system in systems:
            row = {"system": system}
            try:
                t0 = time.perf_counter()
                model, opt = _build(system, args.dry_run, False, device)
                losses = [_step(model, opt, x, y) for x, y in data]
                got = _params(model)
                assert [p.shape for p in got] == [p.shape for p in ref], "parameter shapes"
                row.update(first_s=round(time.perf_counter() - t0, 2),
                           dloss=max(abs(a - b) for a, b in zip(losses, ref_loss)),
                           dparam=max((a - b).abs().max().item() for a, b in zip(got, ref)))
                row["ok"] = row["dloss"] <= tol and row["dparam"] <= tol
                row.update(_captures(model))
            except Exception as e:  # noqa: BLE001  (one system's failure is a row)
                traceback.print_exc()
                row.update(ok=False, error=f"{type(e).__name__}: {str(e)[:200]}")
            if not row["ok"]:
                failed.append(system)
            st.data["rows"].append(row)
            st.save()
            del model, opt
    st.save(status="ok" if not failed else f"failed: {', '.join(failed)}",
            summary=f"{len(systems) - len(failed)}/{len(systems)} equal to eager")


def _captures(model) -> dict:
    """How often autoshard captured ``model``'s step: the programs kept, the guards whose
    failure caused a capture again, and where two calls were told apart by their keys
    (``autoshard.front.calls.call_key``), the parts that differ, printed to the stage's log."""
    st = getattr(model, "_autoshard", None)
    if st is None:
        return {}
    keys = list(st.variants)
    out = {"captures": sum(len(v) for v in st.variants.values())}
    if st.recaptures:
        out["recaptured_by"] = dict(st.recaptures)
    if len(keys) > 1:
        differ = [i for i, parts in enumerate(zip(*keys)) if len(set(map(repr, parts))) > 1]
        out["keys_differ_at"] = differ
        for k in keys:
            print("call key:", [repr(k[i])[:300] for i in differ], flush=True)
    return out


def _trace_figures(model, opt, x, y, device) -> dict:
    """One step under torch.profiler: its time, the GPU's busy share (the union of every
    kernel's interval over the step's time) and NCCL kernel time not covered by a compute
    kernel (exposed communication)."""
    from torch.profiler import ProfilerActivity, profile

    from bench.gpu_streams import _covered, _union

    if device.type != "cuda":
        return {}
    _sync(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        _step(model, opt, x, y)
        _sync(device)
        took_us = (time.perf_counter() - t0) * 1e6
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f).get("traceEvents", [])
    kernels = [(float(e["ts"]), float(e["ts"]) + float(e["dur"]), e.get("name", ""))
               for e in events if e.get("ph") == "X" and e.get("cat") == "kernel"]
    compute = _union([[s, e] for s, e, n in kernels if "nccl" not in n.lower()])
    everything = _union([[s, e] for s, e, _ in kernels])
    nccl = [(s, e) for s, e, n in kernels if "nccl" in n.lower()]
    nccl_us = sum(e - s for s, e in nccl)
    exposed = nccl_us - sum(_covered(s, e, compute) for s, e in nccl)
    return {"busy": round(sum(e - s for s, e in everything) / took_us, 3),
            "nccl_ms": round(nccl_us / 1e3, 2), "exposed_ms": round(exposed / 1e3, 2)}


def stage_llama1b(args, st: Stage, device) -> None:
    from bench.compare import _peak

    dry = args.dry_run
    batch, seq = (2, 32) if dry else (4, 1024)
    steps, reps = (2, 2) if dry else (3, 3)
    dtype = torch.float32 if dry else torch.bfloat16
    systems = ("eager", "fsdp2", "autoshard")
    data = _batches(256 if dry else 32000, batch, seq, 2, device)
    st.save(what=f"Llama {'tiny' if dry else '1.1B'} in {dtype}, batch {batch} x seq {seq}, "
                 f"AdamW; median of {reps} interleaved repetitions of {steps} steps")
    with tempfile.TemporaryDirectory() as tmp:
        _init_world_one(device, tmp)
        built, first = {}, {}
        for s in systems:
            t0 = time.perf_counter()
            built[s] = _build(s, dry, True, device, dtype)
            _step(*built[s], *data[0])
            _sync(device)
            first[s] = time.perf_counter() - t0
            st.save(first_s={k: round(v, 1) for k, v in first.items()})
        times = {s: [] for s in systems}
        for rep in range(reps):
            order = systems[rep % 3:] + systems[:rep % 3]
            for s in order:
                for i in range(steps):
                    _sync(device)
                    t0 = time.perf_counter()
                    _step(*built[s], *data[i % 2])
                    _sync(device)
                    times[s].append(time.perf_counter() - t0)
        med = {s: statistics.median(t) * 1e3 for s, t in times.items()}
        rows = []
        for s in systems:
            model, opt = built[s]
            peak = _peak(model, opt, *_as_kwargs(data[0]))
            row = {"system": s, "step_ms": round(med[s], 2),
                   "x_eager": round(med[s] / med["eager"], 3),
                   "x_fsdp2": round(med[s] / med["fsdp2"], 3),
                   "peak_gib": round(peak / GiB, 3)}
            if s == "autoshard":
                plan = model.plan
                row["predicted_gib"] = round(plan.predicted["peak_bytes"] / GiB, 3)
                row["units"] = len(plan.units)
                row.update(_captures(model))
            row.update(_trace_figures(model, opt, *data[0], device))
            rows.append(row)
            st.data["rows"] = rows
            st.save()
        fsdp2 = next(r for r in rows if r["system"] == "fsdp2")
        for r in rows:
            r["peak_x_fsdp2"] = round(r["peak_gib"] / fsdp2["peak_gib"], 3)
        a = rows[-1]
        st.save(rows=rows, status="ok",
                summary=f"autoshard {a['x_eager']}x eager, {a['x_fsdp2']}x FSDP2; peak "
                        f"{a['peak_x_fsdp2']}x FSDP2, predicted/measured "
                        f"{a['predicted_gib'] / a['peak_gib']:.2f}")


def stage_fake8(args, st: Stage, device) -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from bench.compare import _peak

    dry = args.dry_run
    dtype = torch.float32 if dry else torch.bfloat16
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    data = _batches(256 if dry else 32000, 2 if dry else 4, 32 if dry else 1024, 1, device)
    st.save(what="a world of 8 faked (torch's fake process group): peak per rank, one step")
    rows = []
    for s in ("autoshard", "fsdp2"):
        model, opt = _build(s, dry, True, device, dtype)
        if s == "autoshard":
            assert next(model.parameters()).device.type == device.type, "mesh device"
        _step(model, opt, *data[0])
        row = {"system": s, "peak_gib": round(_peak(model, opt, *_as_kwargs(data[0])) / GiB, 3)}
        if s == "autoshard":
            row["predicted_gib"] = round(model.plan.predicted["peak_bytes"] / GiB, 3)
            row.update(_captures(model))
        rows.append(row)
        st.save(rows=rows)
        del model, opt
    a, f = rows
    st.save(status="ok", summary=f"autoshard {a['peak_gib'] / f['peak_gib']:.2f}x FSDP2's "
                                 f"peak; predicted/measured "
                                 f"{a['predicted_gib'] / a['peak_gib']:.2f}")


def stage_hostcost(args, st: Stage, device) -> None:
    from bench import host_cost

    steps, reps = (2, 2) if args.dry_run else (10, 5)
    st.save(what=f"world size 1, fp32, AdamW; median of {reps} interleaved repetitions of "
                 f"{steps} steps, each ended by a synchronize")
    rows, split = [], []
    with tempfile.TemporaryDirectory() as tmp:
        _init_world_one(device, tmp)
        for name in ("mlp48", "llama4"):
            row = host_cost.measure(name, steps, reps, device, split=True)
            split += [{"model": name, **r} for r in row.pop("split")]
            rows.append(row)
            st.save(rows=rows, split=split)
    st.save(status="ok", summary="; ".join(
        f"{r['model']}: {r['x eager ops']}x eager's ops, step {r['autoshard x eager']}x "
        f"eager, FSDP2 {r['fsdp2 x eager']}x" for r in rows))


def stage_pytest(args, st: Stage, device) -> None:
    """``pytest -m gpu`` over ``GPU_TESTS``; in a dry run the same command, whose tests then
    skip (no CUDA device): what it proves there is that the files import and the mark still
    selects them (the suite runs the rest of those files)."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-rA", "-p", "no:cacheprovider",
           *GPU_TESTS]
    out = subprocess.run(cmd, capture_output=True, text=True)
    print(out.stdout + out.stderr)  # the whole output, in the stage's log
    tail = (out.stdout + out.stderr).strip().splitlines()
    # pytest's closing line ("4 skipped, 52 deselected in 2.55s"), not a warning after it
    result = [line for line in tail if re.search(r"\b(passed|failed|skipped|errors?|"
                                                 r"deselected|no tests ran)\b.* in [\d.]+s",
                                                 line)]
    st.save(status="ok" if out.returncode == 0 else f"failed (pytest exit {out.returncode})",
            summary=(result or tail or [""])[-1].strip("= "),
            output_tail="\n".join(tail[-40:]))


if __name__ == "__main__":
    sys.exit(main())

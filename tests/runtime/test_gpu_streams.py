"""Host<->device copies on copy streams (``autoshard.runtime.streams``).

On a CPU: where ``route`` puts the waits and that the routed graph computes what the graph
computes (a backend that records instead of using CUDA streams), and that an offloaded step
on a CPU runs the graphs as the passes wrote them. On a GPU (marked ``gpu``): offloaded
training on one device matches eager, and a profiler trace shows the copies on another stream
than the compute kernels, overlapping one of them.
"""

import pytest
import torch
from harness import run_ranks

from autoshard.core import meta
from autoshard.runtime import streams
from autoshard.core.ops import free_op

_TO_COPY = torch.ops.aten._to_copy.default
_HOST = torch.device("cpu")


class Recorder:
    """The streams backend, run on a CPU: copies run at once; issues, waits and drains are
    logged as ("issue", direction, reads_device), ("wait", event, place), ("drain", events),
    where an event is the number of the issue it follows."""

    def __init__(self):
        self.log = []

    def issue(self, direction, reads_device, op, args, kwargs):
        self.log.append(("issue", direction, reads_device))
        return op(*args, **kwargs), len(self.log) - 1

    def wait(self, event, place):
        self.log.append(("wait", event, place))

    def drain(self, events):
        self.log.append(("drain", sorted(events)))


def _step(host_w, x):
    w = _TO_COPY(host_w, device=_HOST)  # copied in
    y = x * 2
    z = y + 1
    g = _TO_COPY(z, device=_HOST)  # copied out
    free_op([z])
    out = torch.mm(y, w)
    h = g * 3  # a host op on the copy out
    return out, h


def _graph():
    """``_step`` traced, its copies tagged, and every value but ``host_w``, ``g`` and ``h``
    given a value on the (meta) device, as an offloaded GPU program's graph has them."""
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(_step)(torch.randn(3, 3), torch.randn(3, 3))
    names = [n for n in gm.graph.nodes if n.op != "output"]
    host_w, _, w, _, _, g = names[:6]
    meta.tags(w)[meta.COMM] = meta.H2D
    meta.tags(g)[meta.COMM] = meta.D2H
    on_host = {host_w.name, g.name, names[-1].name}
    for n in names:
        v = n.meta.get("val")
        if isinstance(v, torch.Tensor) and n.name not in on_host:
            n.meta["val"] = torch.empty(v.shape, dtype=v.dtype, device="meta")
    return gm, w, g


def _order(gm) -> list:
    """The routed graph's nodes as short words: the op of a node, or the closure it calls."""
    out = []
    for n in gm.graph.nodes:
        name = getattr(n.target, "__name__", str(n.target))
        out.append(name.split(".")[0] if n.op == "call_function" else n.op)
    return out


def test_route_waits_just_before_each_reader_and_before_a_free():
    gm, w, g = _graph()
    assert streams.copy_nodes(gm) == {w: streams.H2D, g: streams.D2H}
    rec = Recorder()
    routed = streams.route(gm, rec)
    assert _order(routed) == [
        "placeholder", "placeholder",
        "side_copy",  # w, copied in: issued where the graph has it
        "mul", "add",
        "side_copy",  # g, copied out
        "wait_for_copy", "free",  # z is freed only after g's copy read it
        "wait_for_copy", "mm",  # the compute stream waits for w just before its reader
        "wait_for_copy", "mul",  # the host waits for g before reading it
        "drain_copies", "output"]
    args = (torch.randn(3, 3), torch.randn(3, 3))
    got = routed(*args)
    want = gm(*[a.clone() for a in args])
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert rec.log == [
        ("issue", streams.H2D, False),  # reads host memory only: it waits for nothing
        ("issue", streams.D2H, True),  # reads z: its stream waits for the compute stream
        ("wait", 1, streams.COMPUTE), ("wait", 0, streams.COMPUTE), ("wait", 1, streams.HOST),
        ("drain", [0, 1])]
    assert gm.graph.nodes and _order(gm).count("side_copy") == 0  # the original is kept


def test_a_copy_reading_a_copy_waits_on_its_stream_and_each_wait_comes_once():
    def step(host_a):
        d = _TO_COPY(host_a, device=_HOST)  # in
        back = _TO_COPY(d, device=_HOST)  # out again: reads the copy in, on the d2h stream
        return d + 1, d * 2, back

    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(step)(torch.randn(4))
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    meta.tags(nodes[0])[meta.COMM] = meta.H2D
    meta.tags(nodes[1])[meta.COMM] = meta.D2H
    for n in nodes[:1] + nodes[2:]:
        n.meta["val"] = torch.empty(n.meta["val"].shape, device="meta")
    rec = Recorder()
    routed = streams.route(gm, rec)
    x = torch.randn(4)
    assert all(torch.equal(a, b) for a, b in zip(routed(x), gm(x)))
    assert rec.log == [("issue", streams.H2D, False), ("wait", 0, streams.D2H),
                       ("issue", streams.D2H, True), ("wait", 0, streams.COMPUTE),
                       ("drain", [0, 2])]


def test_no_copy_no_cuda_or_switched_off_runs_the_graphs_themselves(monkeypatch):
    gm, _, _ = _graph()
    assert streams.for_device(gm, None, "cpu") == (gm, None)
    monkeypatch.setenv("AUTOSHARD_COPY_STREAMS", "0")
    assert streams.for_device(gm, gm, "cuda") == (gm, gm)
    monkeypatch.delenv("AUTOSHARD_COPY_STREAMS")
    plain = torch.fx.symbolic_trace(lambda x: x + 1)
    assert streams.route(plain, Recorder()) is plain
    assert streams.for_device(plain, None, "cuda") == (plain, None)


def _offloaded_on_cpu(rank, world, _):
    from models import CASES, build, call
    from parity_workers import batches

    from autoshard import Config, Offload, autoshard

    torch.manual_seed(0)
    model = autoshard(build("gpt"), config=Config(
        policy="module", offload_policy=Offload(params=0.5, pin_memory=False)))
    x, y = batches("gpt", 0)
    CASES["gpt"][3](call("gpt", model, x), y).backward()
    (prog,) = model._autoshard.programs.values()
    copies = [n for g in (prog.split.fwd, prog.split.bwd) for n in g.graph.nodes
              if meta.tag(n, meta.COMM) in meta.COPIES]
    # the graphs run are the split graphs' nodes, in order, with none added (the ops call
    # their bindings: runtime.bindings)
    return {"same": all([n.name for n in run.graph.nodes] == [n.name for n in g.graph.nodes]
                        for run, g in ((prog.fwd, prog.split.fwd), (prog.bwd, prog.split.bwd))),
            "copies": len(copies)}


def test_an_offloaded_step_on_a_cpu_runs_the_graphs_as_written():
    """Nothing is routed on a CPU: the program runs the split graphs' nodes (the numbers,
    bit for bit as without offload, are tests/runtime/test_parity.py's
    test_offload_trains_exactly_as_on_the_device)."""
    (got,) = run_ranks(1, _offloaded_on_cpu)
    assert got["copies"] > 0 and got["same"]


def test_the_benchmark_without_cuda_exits_saying_why(monkeypatch):
    from bench import gpu_streams

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as e:
        gpu_streams.main([])
    assert "needs a CUDA device" in str(e.value.code)


def test_overlap_counts_copy_time_under_compute_kernels_only():
    from bench.gpu_streams import overlap

    def ev(cat, name, ts, dur, stream):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur,
                "args": {"stream": stream}}

    trace = {"traceEvents": [
        ev("kernel", "gemm", 0, 10, 7), ev("kernel", "add", 5, 10, 7),  # compute: 0..15
        ev("kernel", "ncclDevKernel_AllGather", 20, 30, 9),  # not compute
        ev("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 10, 10, 21),  # 5 of 10 under
        ev("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 25, 10, 22),  # 0 of 10
        ev("gpu_memcpy", "Memcpy DtoD (Device -> Device)", 0, 10, 7)]}  # not host<->device
    got = overlap(trace)
    assert (got["copy_us"], got["overlapped_us"], got["fraction"]) == (20.0, 5.0, 0.25)
    assert got["copy_streams"] == [21, 22] and got["compute_streams"] == [7]


# --- on a GPU ------------------------------------------------------------------------------

TOL = 1e-5


def _offloaded_on_gpu(rank, world, name):
    """Eager and ``CPUOffloadPolicy`` autoshard on one GPU, from the same init and data."""
    from models import CASES, build, call
    from parity_workers import batches
    from torch.distributed.fsdp import CPUOffloadPolicy

    from autoshard import Config, autoshard

    torch.cuda.set_device(0)
    ref = build(name).cuda()
    model = autoshard(build(name).cuda(), config=Config(
        policy="module", offload_policy=CPUOffloadPolicy()))
    out = {"losses": {}, "params": {}}
    for key, m in (("eager", ref), ("offload", model)):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        out["losses"][key] = []
        for step in range(3):
            x, y = (t.cuda() for t in batches(name, step))
            loss = CASES[name][3](call(name, m, x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            out["losses"][key].append(loss.item())
    out["params"] = {"eager": {k: v.detach().cpu() for k, v in ref.state_dict().items()},
                     "offload": model.full_state_dict()}
    (prog,) = model._autoshard.programs.values()
    out["routed"] = all(len(run.graph.nodes) > len(g.graph.nodes)  # the streams' nodes
                        for run, g in ((prog.fwd, prog.split.fwd), (prog.bwd, prog.split.bwd)))
    out["homes"] = {p.to_local().device.type for p in model.parameters()}
    return out


@pytest.mark.gpu
def test_offloaded_training_on_a_gpu_matches_eager():
    got = run_ranks(1, _offloaded_on_gpu, "gpt", torchrun_env=True)[0]
    assert got["routed"] and got["homes"] == {"cpu"}
    dloss = max(abs(a - b) for a, b in zip(*got["losses"].values()))
    assert dloss <= TOL, dloss
    ref, ours = got["params"]["eager"], got["params"]["offload"]
    dparam = max((ours[k].cpu() - ref[k]).abs().max().item() for k in ours)
    assert dparam <= TOL, dparam


def _profiled_on_gpu(rank, world, _):
    """``bench.gpu_streams``' measure on a GPT whose compute keeps the GPU busy: the host
    issues a unit's kernels faster than they run, so the next unit's copy in (and the last
    one's gradients out) start while compute is still queued. On a model too small for that
    (dim 512, seq 256: the first GPU run) the GPU drained each unit's work before the host
    reached the next copy, and none of 2.0 ms of copies overlapped a kernel."""
    import json
    import os
    import tempfile

    from torch.distributed.fsdp import CPUOffloadPolicy

    from autoshard import Config, autoshard
    from autoshard.core.models import GPT
    from bench.gpu_streams import overlap, profiled_step

    torch.cuda.set_device(0)
    torch.manual_seed(0)
    model = autoshard(GPT(vocab=512, dim=1024, heads=16, layers=4, seq=512).cuda(),
                      config=Config(policy="module", offload_policy=CPUOffloadPolicy()))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 512, (16, 512), device="cuda")

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        profiled_step(model, opt, [(x, torch.roll(x, -1, dims=1))], 2, path)
        with open(path) as f:
            return overlap(json.load(f))


@pytest.mark.gpu
def test_copies_run_on_their_own_streams_and_overlap_compute():
    got = run_ranks(1, _profiled_on_gpu, torchrun_env=True)[0]
    print("copy-stream overlap:", got)  # shown by ``pytest -rA`` (bench.gpu_check does)
    assert got["copy_us"] > 0, got
    assert got["copy_streams"] and not set(got["copy_streams"]) & set(got["compute_streams"])
    assert got["fraction"] > 0, got

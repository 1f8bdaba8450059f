import dataclasses
import json
import os

import pytest
import torch

import autoshard
from autoshard.core.cost import PROFILES, calibrate, collective_time, get_profile, node_time
from autoshard.core.models import GPT


def test_matmul_time_comes_from_its_flops():
    from graphs import captured

    gm, _ = captured(GPT(), torch.randint(0, 96, (2, 16)))
    mm = next(n for n in gm.graph.nodes if n.target == torch.ops.aten.mm.default)
    a, b = (x.meta["val"] for x in mm.args)
    flops = 2 * a.shape[0] * a.shape[1] * b.shape[1]
    h100 = PROFILES["h100"]
    moved = sum(x.numel() * 4 for x in (a, b, mm.meta["val"]))
    assert node_time(mm, h100) == max(flops / (h100.matmul_flops * h100.efficiency),
                                      moved / h100.mem_bandwidth)


def test_ring_collective_time():
    p = PROFILES["a100"]
    assert collective_time(8 * 2**20, 8, p) == 7 * p.alpha + 7 / 8 * 8 * 2**20 * p.beta


def _tp_collectives(rank, world, _):
    """Tensor parallelism's collectives as a style's redistribution traces them, over a
    group of 2: each one's predicted time on the h100 profile, and what a ring of its bytes
    over 2 ranks takes."""
    import torch.distributed as dist
    from torch.fx.experimental.proxy_tensor import make_fx

    name = dist.group.WORLD.group_name
    c10d = torch.ops._c10d_functional

    def step(x):
        r = c10d.wait_tensor(c10d.all_reduce(x, "sum", name))
        g = c10d.wait_tensor(c10d.all_gather_into_tensor(r, 2, name))
        return c10d.wait_tensor(c10d.reduce_scatter_tensor(g, "sum", 2, name))

    gm = make_fx(step)(torch.ones(64, 32))
    h100, whole = PROFILES["h100"], 64 * 32 * 4
    got = {str(n.target).split(".")[1]: node_time(n, h100) for n in gm.graph.nodes
           if n.op == "call_function"}
    return got, {"all_reduce": collective_time(whole, 2, h100, rounds=2),
                 "all_gather_into_tensor": collective_time(2 * whole, 2, h100),
                 "reduce_scatter_tensor": collective_time(2 * whole, 2, h100),
                 "wait_tensor": 0.0}


def test_tensor_parallel_collectives_are_priced_as_rings_over_their_group():
    """They used to be priced as a copy of their bytes at memory bandwidth, leaving out the
    link and its latency."""
    from harness import run_ranks

    for got, want in run_ranks(2, _tp_collectives, None):
        assert got == pytest.approx(want, rel=1e-12), (got, want)


def test_a_group_spanning_nodes_moves_at_the_inter_node_rate():
    """h100: 8 GPUs per node; a ring over 16 consecutive ranks, or over 2 ranks 8 apart (a
    replicate dimension), crosses nodes and moves at ``inter_beta``; a ring over 8 ranks, or
    2 ranks 4 apart, stays within one; an hpZ group of k within a node costs
    (k-1)/k * S * beta. The CPU profile (ranks_per_node 0) prices every group at beta."""
    p, S = PROFILES["h100"], 8 * 2**20
    assert p.ranks_per_node == 8 and p.inter_beta == 1 / 50e9 and "400 Gb/s" in p.source
    assert collective_time(S, 16, p) == 15 * p.alpha + 15 / 16 * S * p.inter_beta
    assert collective_time(S, 2, p, stride=8) == p.alpha + S / 2 * p.inter_beta
    assert collective_time(S, 8, p) == 7 * p.alpha + 7 / 8 * S * p.beta
    assert collective_time(S, 2, p, stride=4) == p.alpha + S / 2 * p.beta
    assert collective_time(S, 2, p) == p.alpha + S / 2 * p.beta  # hpZ, k = 2
    cpu = PROFILES["cpu"]
    assert collective_time(S, 16, cpu) == 15 * cpu.alpha + 15 / 16 * S * cpu.beta
    same = dataclasses.replace(p, inter_beta=0.0)  # 0: the same as beta
    assert collective_time(S, 16, same) == 15 * p.alpha + 15 / 16 * S * p.beta


def test_profiles_cite_their_sources():
    for p in PROFILES.values():
        assert p.source and p.matmul_flops > 0 and p.memory > 0


NONSENSE = [("matmul_flops", 0), ("mem_bandwidth", -1.0), ("mem_bandwidth", float("inf")),
            ("alpha", float("nan")), ("beta", -1e-9), ("memory", 0), ("memory", 2**63),
            ("efficiency", 0.0), ("efficiency", 1.5), ("comm_overlap", -0.1),
            ("comm_overlap", 2.0), ("collective_scratch", float("inf")),
            ("host_bandwidth", -1), ("matmul_flops", 10**400), ("memory", True),
            ("ranks_per_node", -1), ("ranks_per_node", 2.5), ("inter_beta", float("nan")),
            ("host_memory", -1)]


@pytest.mark.parametrize("field,value", NONSENSE, ids=[f"{f}={v!r}"[:40] for f, v in NONSENSE])
def test_a_nonsense_profile_is_refused_naming_the_field(field, value):
    with pytest.raises(ValueError) as info:
        dataclasses.replace(PROFILES["h100"], name="mine", **{field: value})
    assert f"DeviceProfile('mine').{field}={value!r} is not accepted: it must be" in str(
        info.value)
    with pytest.raises(ValueError, match=f"DeviceProfile\\('mine'\\).{field}="):
        autoshard.Config.from_dict({"device_profile": dict(PROFILES["h100"].to_dict(),
                                                           name="mine", **{field: value})})


def test_edge_profiles_are_accepted_and_unknown_names_list_the_known():
    free = dataclasses.replace(PROFILES["cpu"], alpha=0.0, beta=0.0, efficiency=1.0,
                               comm_overlap=0.0, host_bandwidth=0.0, collective_scratch=0.0)
    assert get_profile(free) is free
    with pytest.raises(ValueError,
                       match="unknown device profile 'tpu'; known: h100, h200, a100, cpu"):
        get_profile("tpu")
    with pytest.raises(ValueError, match="unknown device profile"):
        get_profile(["h100"])  # not a name: no TypeError about hashing


def test_calibrate_measures_this_machine():
    prof = calibrate()
    assert prof.matmul_flops > 1e8 and prof.mem_bandwidth > 1e8 and prof.efficiency == 1.0


def test_calibrate_with_a_group_before_init_process_group_is_refused():
    """In a process of its own: this one may hold a default group an earlier test made."""
    import subprocess
    import sys

    code = """
import pytest
import torch.distributed as dist
from autoshard.core.cost import calibrate
assert not dist.is_initialized()
for group in (dist.group.WORLD, None, object()):  # WORLD is None before the group exists
    with pytest.raises(ValueError, match=r"after torch\\.distributed\\.init_process_group"):
        calibrate(group=group)
print("refused")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0 and out.stdout.strip() == "refused", out.stderr


def _plan():
    return autoshard.plan(GPT(), (torch.randint(0, 96, (2, 16)),), world_size=4,
                          config=autoshard.Config(policy="module"))


def test_plan_summary_and_time_breakdown():
    plan = _plan()
    p = plan.predicted
    assert abs(p["step_s"] - (p["compute_s"] + p["exposed_comm_s"])) < 1e-12
    assert p["comm_bytes"] == plan.comm_bytes()
    assert p["sent_bytes"] == sum(e.bytes * 3 // 4 for e in plan.schedule
                                  if e.op in ("all_gather", "reduce_scatter"))
    text = str(plan)
    for part in ("predicted step time", "exposed communication", "peak memory per rank"):
        assert part in text


def test_chrome_trace_has_compute_comm_lanes_and_a_memory_counter(tmp_path):
    plan = _plan()
    path = tmp_path / "trace.json"
    plan.to_chrome_trace(path)
    events = json.loads(path.read_text())["traceEvents"]
    lanes = {e["tid"] for e in events if e["ph"] == "X"}
    assert lanes == {0, 1}
    counters = [e for e in events if e["ph"] == "C"]
    assert counters and max(e["args"]["MiB"] for e in counters) * 2**20 == \
        plan.predicted["peak_bytes"]
    comm = [e for e in events if e["ph"] == "X" and e["tid"] == 1]
    assert len(comm) == sum(e.op in ("all_gather", "reduce_scatter") for e in plan.schedule)


def test_memory_plot_writes_an_image(tmp_path):
    plan = _plan()
    plan.memory_plot(tmp_path / "mem.png")
    assert (tmp_path / "mem.png").read_bytes()[:4] == b"\x89PNG"


def test_gpu_profile_takes_the_device_kind_and_its_memory(monkeypatch):
    """On CUDA, with no profile named, an H200 is planned as an H200 and every card for the
    memory it reports, not the datasheet's 80 GB."""
    import types

    from autoshard.core.cost import PROFILES, device_profile

    for name, total, kind in (("NVIDIA H200", 150_000_000_000, "h200"),
                              ("NVIDIA H100 80GB HBM3", 85_520_000_000, "h100"),
                              ("NVIDIA L4", 23_000_000_000, "h100")):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None, n=name: n)
        monkeypatch.setattr(torch.cuda, "get_device_properties",
                            lambda d=None, t=total: types.SimpleNamespace(total_memory=t))
        p = device_profile(None, torch.device("cuda", 0))
        assert (p.name, p.memory) == (kind, total)
        assert p.matmul_flops == PROFILES[kind].matmul_flops
    assert device_profile("a100", torch.device("cuda", 0)) is PROFILES["a100"]
    assert device_profile(None, torch.device("cpu")) is PROFILES["cpu"]
    assert PROFILES["h200"].mem_bandwidth > PROFILES["h100"].mem_bandwidth

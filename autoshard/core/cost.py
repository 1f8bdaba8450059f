"""The cost model: device profiles, per-node compute time, collective time.

Plain data and small functions, so a plan can be costed for any device on any machine.

- Compute: a node's time is ``max(flops / (peak * efficiency), bytes_moved / bandwidth)``.
  FLOPs come from torch's own formulas (``torch.utils.flop_counter``: matmuls, convolutions,
  attention) applied to the fake tensors' shapes; bytes moved are the node's input and output
  bytes (views move nothing).
- Collectives: ring all-gather / reduce-scatter of a buffer of ``S`` bytes over ``N`` ranks
  takes ``(N - 1) * alpha + (N - 1) / N * S * beta``; the fraction ``comm_overlap`` of it
  can run while the rank computes, the rest holds compute up. Each collective is priced by
  its own group: one whose ranks span more than one node (``ranks_per_node``) moves at the
  inter-node rate ``inter_beta`` (the ring's slowest link), one within a node at ``beta``.
"""

from __future__ import annotations

import dataclasses
import numbers
import sys
import time
from typing import Optional

import torch
import torch.fx as fx

from autoshard.core import _compat, meta
from autoshard.core.options import INT64_MAX
from autoshard.core.graph import aliased_arg


@dataclasses.dataclass(frozen=True)
class DeviceProfile:
    name: str
    matmul_flops: float  # peak dense FLOP/s at the training dtype
    mem_bandwidth: float  # device memory bytes/s
    alpha: float  # seconds of latency per collective step
    beta: float  # seconds per byte on the link between ranks
    memory: int  # bytes of memory per device
    efficiency: float = 0.6  # achieved fraction of peak matmul rate
    # extra bytes a collective holds while in flight, as a fraction of its full buffer (gloo
    # copies the buffer into a scratch tensor of its own; NCCL works in place)
    collective_scratch: float = 0.0
    # the fraction of a collective's time that can pass while the rank computes: GPUs move
    # data with engines of their own; gloo's threads copy and reduce on the very cores the
    # compute runs on
    comm_overlap: float = 1.0
    # bytes/s each way between host and device memory (an offloaded shard's copies); 0: the
    # host is the device, and such a copy costs what any copy does
    host_bandwidth: float = 0.0
    # ranks per node, sharing the link ``beta`` prices; a collective whose group spans more
    # than one node moves at ``inter_beta``. 0: every rank on that one link
    ranks_per_node: int = 0
    # seconds per byte between nodes, per rank (its network card); 0: the same as ``beta``
    inter_beta: float = 0.0
    # bytes of host memory per device (the machine's share per GPU) that offloaded
    # activations may take; 0: not bounded (where the host is the device, the device's
    # memory bounds them)
    host_memory: int = 0
    source: str = ""

    def __post_init__(self):
        """Refuse numbers no device has: a zero rate divides by zero in the cost model, and
        an infinite one or a fraction outside its range predicts nonsense."""
        for field in ("name", "source"):
            if not isinstance(getattr(self, field), str):
                raise TypeError(f"DeviceProfile.{field} must be a str, got "
                                f"{getattr(self, field)!r}")
        for field, (ok, what) in _PROFILE_NUMBERS.items():
            value = getattr(self, field)
            # NaN fails every comparison, so each check refuses it
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not ok(value):
                raise ValueError(f"DeviceProfile({self.name!r}).{field}={value!r} is not "
                                 f"accepted: it must be {what}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


MAX_FINITE = sys.float_info.max  # the largest finite float: a larger number overflows the model
# each number of a DeviceProfile: (whether a value is accepted, what it must be)
_PROFILE_NUMBERS = {
    "matmul_flops": (lambda v: 0 < v <= MAX_FINITE, "a positive, finite number of FLOP/s"),
    "mem_bandwidth": (lambda v: 0 < v <= MAX_FINITE, "a positive, finite number of bytes/s"),
    "alpha": (lambda v: 0 <= v <= MAX_FINITE,
              "a finite number of seconds per collective step, 0 or more"),
    "beta": (lambda v: 0 <= v <= MAX_FINITE, "a finite number of seconds per byte, 0 or more"),
    "memory": (lambda v: 0 < v <= INT64_MAX, "a positive number of bytes, at most 2**63 - 1"),
    "efficiency": (lambda v: 0 < v <= 1, "a fraction of the peak FLOP/s above 0 and at most 1"),
    "collective_scratch": (lambda v: 0 <= v <= MAX_FINITE,
                           "a finite fraction of a collective's buffer, 0 or more"),
    "comm_overlap": (lambda v: 0 <= v <= 1, "a fraction of a collective's time from 0 to 1"),
    "host_bandwidth": (lambda v: 0 <= v <= MAX_FINITE,
                       "a finite number of bytes/s, 0 or more (0: the host is the device)"),
    "ranks_per_node": (lambda v: 0 <= v <= INT64_MAX and v == int(v),
                       "a whole number of ranks per node, 0 or more (0: all on one link)"),
    "inter_beta": (lambda v: 0 <= v <= MAX_FINITE,
                   "a finite number of seconds per byte between nodes, 0 or more (0: beta)"),
    "host_memory": (lambda v: 0 <= v <= INT64_MAX,
                    "a number of bytes from 0 (not bounded) to 2**63 - 1"),
}

GiB = 2**30


HOST_MEMORY = 250 * 10**9  # per GPU: a DGX H100 (and DGX A100 640GB) holds 2 TB for 8 GPUs


def _nvidia_sxm(name: str, datasheet: str, *, tflops: int, hbm: float, hbm_note: str,
                nvlink: float, pcie: tuple, host: float, nic_gbit: int,
                memory: float = 80e9) -> DeviceProfile:
    """An NVIDIA SXM GPU of ``memory`` bytes (80 GB unless given) from its datasheet:
    ``tflops`` dense BF16, ``hbm`` bytes/s of memory (``hbm_note`` says which), ``nvlink``
    bytes/s each way, a host link of PCIe (generation, GB/s each way) of which ``host``
    bytes/s are reached; NCCL's ~10 us per ring step as alpha, half the matmul peak reached;
    8 GPUs per node (an HGX board), each with an InfiniBand card of ``nic_gbit`` Gb/s
    between nodes."""
    gen, link = pcie
    source = (f"NVIDIA {datasheet} datasheet: {tflops} TFLOP/s dense BF16, {hbm / 1e12:g} TB/s "
              f"{hbm_note}, NVLink {2 * nvlink / 1e9:g} GB/s total ({nvlink / 1e9:g} GB/s each "
              f"way); alpha: NCCL's ~10 us per ring step; host link PCIe Gen{gen} x16, {link} "
              f"GB/s each way, ~{host / 1e9:g} GB/s reached; 8 GPUs per node (HGX), between "
              f"nodes one {nic_gbit} Gb/s InfiniBand card per GPU ({nic_gbit / 8:g} GB/s)")
    return DeviceProfile(name, matmul_flops=tflops * 1e12, mem_bandwidth=hbm, alpha=10e-6,
                         beta=1 / nvlink, memory=int(memory), efficiency=0.5,
                         host_bandwidth=host, ranks_per_node=8,
                         inter_beta=8 / (nic_gbit * 1e9), host_memory=HOST_MEMORY,
                         source=source + "; host memory: a DGX's 2 TB over its 8 GPUs")


PROFILES = {
    "h100": _nvidia_sxm("h100", "H100 SXM5", tflops=989, hbm=3.35e12, hbm_note="HBM3, 80 GB",
                        nvlink=450e9, pcie=(5, 64), host=50e9, nic_gbit=400),
    "h200": _nvidia_sxm("h200", "H200 SXM", tflops=989, hbm=4.8e12, hbm_note="HBM3e, 141 GB",
                        nvlink=450e9, pcie=(5, 64), host=50e9, nic_gbit=400, memory=141e9),
    "a100": _nvidia_sxm("a100", "A100 SXM4 80GB", tflops=312, hbm=2.039e12, hbm_note="HBM2e",
                        nvlink=300e9, pcie=(4, 32), host=25e9, nic_gbit=200),
    "cpu": DeviceProfile(
        "cpu", matmul_flops=100e9, mem_bandwidth=24e9, alpha=250e-6, beta=1 / 1.4e9,
        memory=24 * GiB, efficiency=0.9, collective_scratch=1.0, comm_overlap=0.1,
        source="measured with autoshard.core.cost.calibrate() on the project's 2-core CI machine, "
               "one thread per rank (fp32 1024^2 matmul ~100 GFLOP/s, 64 MiB copy, gloo "
               "all-gather between 2 processes: alpha ~250 us, ~1.4 GB/s, overlap with "
               "matmuls ~0.1 for 0.25-1 MiB buffers); gloo's scratch copy "
               "of each collective's buffer read off torch.profiler's allocation events",
    ),
}


def device_profile(config_profile, device: torch.device) -> DeviceProfile:
    """The profile a plan on ``device`` uses: ``Config.device_profile`` when set, else "cpu"
    on the CPU and, on a GPU, the named profile of its kind ("h200" for an H200, "h100"
    otherwise) with the memory this device reports, so a card with more or less memory than
    the datasheet's is planned for the memory it has."""
    if config_profile is not None:
        return get_profile(config_profile)
    if device.type != "cuda":
        return PROFILES["cpu"]
    name = torch.cuda.get_device_name(device)
    base = PROFILES["h200" if "H200" in name.upper() else "h100"]
    memory = torch.cuda.get_device_properties(device).total_memory
    return dataclasses.replace(base, memory=memory,
                               source=f"{base.source}; memory: {memory} bytes, as {name} "
                               "reports")


def get_profile(profile) -> DeviceProfile:
    if isinstance(profile, DeviceProfile):
        return profile
    if not isinstance(profile, str) or profile not in PROFILES:
        raise ValueError(f"unknown device profile {profile!r}; known: {', '.join(PROFILES)}, "
                         "or pass autoshard.core.cost.calibrate()")
    return PROFILES[profile]


def collective_time(nbytes: int, world_size: int, profile: DeviceProfile,
                    rounds: int = 1, stride: int = 1) -> float:
    """Ring all-gather or reduce-scatter of an ``nbytes`` (full) buffer over a group of
    ``world_size`` ranks ``stride`` apart (1: consecutive ranks, as the shard dimension's and
    an hpZ group's; a replicate dimension's: the shard size); ``rounds=2``: a ring all-reduce
    (a reduce-scatter, then an all-gather). A group spanning more than one node
    (``spans_nodes``) moves at ``inter_beta``, one within a node at ``beta``."""
    if world_size <= 1:
        return profile.alpha
    n = world_size
    beta = (profile.inter_beta or profile.beta) if spans_nodes(n, stride, profile) else (
        profile.beta)
    return rounds * ((n - 1) * profile.alpha + (n - 1) / n * nbytes * beta)


def spans_nodes(world_size: int, stride: int, profile: DeviceProfile) -> bool:
    """Whether a group of ``world_size`` ranks ``stride`` apart, starting at a multiple of
    its extent (as mesh groups do), reaches past one node of ``profile.ranks_per_node``
    ranks; never when that is 0 (unknown: one link)."""
    rpn = profile.ranks_per_node
    return rpn > 0 and world_size > 1 and (world_size - 1) * stride >= rpn


def ring_rounds(kind: str) -> int:
    """Ring passes of a collective kind (``meta.COMM``): 2 for an all-reduce, else 1."""
    return 2 if kind == meta.AR_ISSUE else 1


# ops torch's flop formulas do not name, counted as the op they compute alike: a graph traced
# on a CPU holds the CPU kernel of flash attention (forward and backward)
_aten = torch.ops.aten
_FLOP_ALIASES = {
    _aten._scaled_dot_product_flash_attention_for_cpu: _aten._scaled_dot_product_flash_attention,
    _aten._scaled_dot_product_flash_attention_for_cpu_backward:
        _aten._scaled_dot_product_efficient_attention_backward,
}


def _flops(node: fx.Node) -> int:
    from torch.utils.flop_counter import flop_registry

    target = node.target
    if not isinstance(target, _compat.OpOverload):
        return 0
    packet = target.overloadpacket
    fn = flop_registry.get(_FLOP_ALIASES.get(packet, packet))
    if fn is None:
        return 0
    args = fx.node.map_arg(node.args, lambda n: n.meta.get("val"))
    kwargs = fx.node.map_arg(node.kwargs, lambda n: n.meta.get("val"))
    try:
        return int(fn(*args, **kwargs, out_val=node.meta.get("val")))
    except Exception:  # noqa: BLE001 - a formula that does not fit these args: memory-bound
        return 0


def tensor_bytes(v) -> int:
    """Bytes of a tensor, or of the tensors in a list or tuple."""
    if isinstance(v, torch.Tensor):
        return v.numel() * v.element_size()
    if isinstance(v, (list, tuple)):
        return sum(tensor_bytes(x) for x in v)
    return 0


# ops that only allocate: their memory is written by the op that fills it
_NO_WORK = {_aten.empty.memory_format, _aten.empty_strided.default, _aten.new_empty.default}


def node_time(node: fx.Node, profile: DeviceProfile) -> float:
    """Predicted seconds of one compute node (0 for views, placeholders and comm steps).
    Kept with the node per profile: its op, tags and values' shapes do not change (a copy of
    the node shares the entry, as it shares the rest of ``meta``)."""
    known = node.meta.get(_TIME)
    if known is None:
        known = node.meta[_TIME] = {}
    hit = known.get(id(profile))
    if hit is not None and hit[0] is profile:  # the profile itself is held: ids stay unique
        return hit[1]
    t = _node_time(node, profile)
    known[id(profile)] = (profile, t)
    return t


def share_node_times(nodes) -> None:
    """Give each of ``nodes`` its (empty) entry of kept times, so that every copy made of it
    from now on shares the entry (a copy shares ``meta``'s values): a time is then computed
    once, on whichever copy asks first, for all. The planner calls it on the captured graph
    before the search copies it: at GPT-175B each recomputation choice's copy computed every
    node's time again, a tenth of planning."""
    for n in nodes:
        if _TIME not in n.meta:
            n.meta[_TIME] = {}


def _node_time(node: fx.Node, profile: DeviceProfile) -> float:
    if node.op != "call_function" or meta.is_collective_issue(node) or meta.is_wait(node):
        return 0.0
    if meta.is_free(node) or aliased_arg(node) is not None or node.target in _NO_WORK:
        return 0.0
    if not isinstance(node.target, _compat.OpOverload):  # getitem: picks an output
        return 0.0
    if node.target in meta.TP_COLLECTIVES:
        return _tp_time(node, profile)
    if meta.tag(node, meta.COMM) == meta.AG_CHUNK:  # reads and writes its chunk only
        return 2 * tensor_bytes(node.meta.get("val")) / profile.mem_bandwidth
    if meta.tag(node, meta.COMM) in (meta.ACT_D2H, meta.ACT_H2D) and profile.host_bandwidth:
        return 0.0  # an offloaded activation's copy: on a copy stream (autoshard.core.simulate)
    if meta.tag(node, meta.COMM) in (meta.H2D, meta.D2H) and profile.host_bandwidth:
        # on the compute stream, as a CPU and a compiled program run it; on a GPU the executor
        # runs it on a copy stream (runtime.streams) and this is an upper bound
        return tensor_bytes(node.meta.get("val")) / profile.host_bandwidth
    work = node.meta.get(_WORK)
    if work is None:  # kept with the node: its op and its values' shapes do not change
        moved = tensor_bytes(node.meta.get("val")) + sum(
            tensor_bytes(a.meta.get("val")) for a in node.all_input_nodes)
        work = node.meta[_WORK] = (_flops(node), moved)
    flops, moved = work
    return max(flops / (profile.matmul_flops * profile.efficiency), moved / profile.mem_bandwidth)


def _tp_time(node: fx.Node, profile: DeviceProfile) -> float:
    """A tensor-parallel collective on the compute stream (the next op reads its result): a
    ring over the "tp" group, consecutive ranks inside a node (the mesh's last dimension), of
    the whole buffer (an all-gather's output, the others' input); its wait adds nothing. With
    no group to size it by, a copy of its bytes."""
    kind, n = meta.TP_COLLECTIVES[node.target], meta.tp_group_size(node)
    if kind == "wait":
        return 0.0
    whole = tensor_bytes((node if kind == "all_gather" else node.args[0]).meta.get("val"))
    if n is None:
        return 2 * whole / profile.mem_bandwidth
    return collective_time(whole, n, profile, rounds=2 if kind == "all_reduce" else 1)


_WORK = "autoshard_work"  # node.meta key: (flops, bytes moved), computed once per node
_TIME = "autoshard_time"  # node.meta key: {id(profile): (profile, seconds)}


# --- calibration ------------------------------------------------------------------------------


def _time(fn, reps: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


class _NoGroup:
    """``calibrate()``'s default group: measure no collective."""

    def __repr__(self) -> str:
        return "no group"


def calibrate(device: Optional[torch.device] = None, group=_NoGroup(),
              name: str = "calibrated") -> DeviceProfile:
    """Measure this machine: matmul rate, memory bandwidth and, given a process group of two
    or more ranks (call it on every rank), the collective alpha and beta; with a group every
    rank gets the same profile, the slowest rank's numbers. ``group=None`` or
    ``dist.group.WORLD`` is the default group, as in torch's collectives; it and any group
    need ``init_process_group`` first (ValueError otherwise, naming what to do). Without a
    group alpha and beta are copied from the matching named profile."""
    if isinstance(group, _NoGroup):
        group = None
    else:
        group = _calibration_group(group)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    n = 4096 if device.type == "cuda" else 1024
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    t = _time(lambda: (a @ b, sync()))
    flops = 2 * n**3 / t
    x = torch.empty(64 * 2**20 // 4, device=device)
    y = torch.empty_like(x)
    t = _time(lambda: (y.copy_(x), sync()))
    bandwidth = 2 * x.numel() * 4 / t
    base = PROFILES["h100" if device.type == "cuda" else "cpu"]
    alpha, beta, overlap = base.alpha, base.beta, base.comm_overlap
    if group is not None and torch.distributed.get_world_size(group) > 1:
        alpha, beta = _collective_alpha_beta(device, group, sync)
        overlap = _comm_overlap(device, group, sync)
        # one profile for every rank (the ranks must plan alike): the slowest rank's rates,
        # exact under MIN / MAX, whatever the backend's summation order
        slow = torch.tensor([-flops, -bandwidth, alpha, beta, -overlap], dtype=torch.float64,
                            device=device)
        torch.distributed.all_reduce(slow, op=torch.distributed.ReduceOp.MAX, group=group)
        flops, bandwidth, alpha, beta, overlap = (-slow[0].item(), -slow[1].item(),
                                                  slow[2].item(), slow[3].item(),
                                                  -slow[4].item())
    memory = (torch.cuda.get_device_properties(device).total_memory if device.type == "cuda"
              else base.memory)
    return DeviceProfile(name, flops, bandwidth, alpha,
                         beta, memory, efficiency=1.0, comm_overlap=overlap,
                         collective_scratch=base.collective_scratch,
                         host_bandwidth=base.host_bandwidth,
                         source=f"measured by calibrate() on {device.type}")


def _calibration_group(group):
    """The process group ``calibrate(group=...)`` measures: it must exist on this rank."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(
            f"calibrate(group={group!r}) measures the collectives between the ranks, but "
            "torch.distributed is not initialised, so there is no group yet "
            "(dist.group.WORLD is None until then). Call calibrate(group=...) on every rank "
            "after torch.distributed.init_process_group(...) (or after autoshard() made the "
            "group), or call calibrate() without group to measure this machine alone")
    if group is None:
        group = dist.group.WORLD
    if group is dist.GroupMember.NON_GROUP_MEMBER or dist.get_world_size(group) < 1:
        raise ValueError(
            "calibrate(group=...) was given a group this rank is not a member of; call it "
            "on the group's own ranks with their group, or with dist.group.WORLD")
    return group


def _collective_alpha_beta(device, group, sync):
    import torch.distributed as dist

    n = dist.get_world_size(group)
    times = []
    sizes = (1024, 16 * 2**20)
    for size in sizes:
        inp = torch.empty(size // 4 // n, device=device)
        out = torch.empty(inp.numel() * n, device=device)
        times.append(_time(lambda: (dist.all_gather_into_tensor(out, inp, group=group), sync())))
    # t = (n-1) alpha + (n-1)/n S beta at the two sizes
    beta = (times[1] - times[0]) / ((n - 1) / n * (sizes[1] - sizes[0]))
    alpha = max((times[0] - (n - 1) / n * sizes[0] * beta) / (n - 1), 0.0)
    return alpha, max(beta, 0.0)


def _comm_overlap(device, group, sync) -> float:
    """How much of a 1 MiB all-gather passes while this rank runs matmuls, from 0 to 1."""
    import torch.distributed as dist

    n = dist.get_world_size(group)
    inp = torch.empty(2**20 // 4 // n, device=device)
    out = torch.empty(inp.numel() * n, device=device)
    a = torch.randn(256, 256, device=device)

    def compute():
        for _ in range(20):
            a @ a

    def both():
        work = dist.all_gather_into_tensor(out, inp, group=group, async_op=True)
        compute()
        work.wait()
        sync()

    comp = _time(lambda: (compute(), sync()))
    comm = _time(lambda: (dist.all_gather_into_tensor(out, inp, group=group), sync()))
    hidden = comp + comm - _time(both)
    return min(max(hidden / min(comp, comm), 0.0), 1.0)

"""How each parameter is stored and moved: one description, read by capture, the passes, the
cost model, the simulator and the runtime.

A ``ParamSpec`` says where a parameter's shard lives (its DTensor placements over the mesh,
and whether it sits on the accelerator or the host), the dtype it is stored in (the shard, its
gradient shard and the optimizer state), the dtype it is gathered and computed in, and the
dtype its gradient is reduce-scattered in. Every size the planner counts (the shard, the
gathered buffer, the reduce-scatter's send buffer, the model state) comes from here, so there
is one answer to "how many bytes is this parameter on this rank".
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

DEVICES = ("device", "host")
# how the parameters, gradients and optimizer state are spread over the ranks
# (Config.strategy): "ddp" replicates all three; the others store one Shard(0) slice per rank
STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "auto")


class ShardLayout:
    """The row arithmetic of Shard(0) over ``shards`` ranks: rows of ceil(dim0 / N), padded on
    the last ranks (FSDP2's and ``torch.chunk``'s layout), or no sharding when the tensor has
    no dim 0 (a scalar, replicated)."""

    def __init__(self, shape, shards: int):
        self.shape = tuple(shape)
        self.world_size = shards
        self.sharded = len(self.shape) > 0
        if self.sharded:
            self.rows = math.ceil(self.shape[0] / shards) if self.shape[0] else 0
            self.inner = self.shape[1:]
            self.local_shape = (self.rows, *self.inner)
        else:
            self.rows, self.inner, self.local_shape = 0, (), ()
        self.padded_rows = self.rows * shards
        self.local_numel = math.prod(self.local_shape)

    def local_range(self, rank: int) -> tuple:
        """The rows of the full parameter rank ``rank`` stores (possibly empty)."""
        start = min(rank * self.rows, self.shape[0])
        return start, min(start + self.rows, self.shape[0])


def placements_for(shape, mesh_ndim: int = 1, strategy: str = "zero3", dtype=None) -> tuple:
    """FSDP's placements: dim 0 sharded over the mesh's last dimension (replicated over any
    before it, as HSDP does); a scalar is replicated, and so is a complex vector (``dtype``):
    optimizers step a complex parameter through ``torch.view_as_real``, which on a DTensor
    sharded unevenly along its last dimension returns a replicated copy, so the step would
    never reach the shard. ``strategy="ddp"``: replicated over every dimension."""
    vector = len(shape) == 1 and dtype is not None and dtype.is_complex
    last = Shard(0) if len(shape) > 0 and not vector and strategy != "ddp" else Replicate()
    return (Replicate(),) * (mesh_ndim - 1) + (last,)


@dataclasses.dataclass
class ParamSpec:
    """How one parameter is stored and moved.

    ``shape``: the full (unsharded) shape. ``dtype``: the dtype the shard, its gradient shard
    and its optimizer state are stored in. ``compute_dtype``: gathered and computed in
    (default: ``dtype``). ``reduce_dtype``: its gradient is reduce-scattered in (default:
    ``compute_dtype``). ``mesh_shape`` and ``placements``: the DTensor placement of the shard
    over the mesh (default: one rank). ``device``: where the shard and its optimizer state
    live between uses, ``"device"`` (the accelerator) or ``"host"``. ``replica``: every rank
    also keeps the full parameter in the compute dtype from one step to the next, which the
    step reads without an all-gather; the shards are gathered into it after the optimizer
    updated them (ZeRO-1). A parameter replicated over every mesh dimension (DDP) is read as
    it is stored.

    Its gradient is reduced over every mesh dimension once per synchronised step
    (``reduction``): reduce-scattered over the dimension it is sharded over, then all-reduced
    over each it is replicated over; averaged over all those ranks, or, with
    ``grad_divide``, summed and divided by it, as FSDP2's ``set_gradient_divide_factor``
    (``force_sum``: its ``set_force_sum_reduction_for_comms``; see ``scaling``).

    With tensor parallelism (``tp``: its placement on the mesh's "tp" dimension as
    ``parallelize_module`` put it, ``"Shard(0)"`` column-wise, ``"Shard(1)"`` row-wise,
    ``"Replicate()"``; None: not placed by tensor parallelism), ``shape`` is this rank's
    tensor-parallel piece, the tensor the step computes with, and everything above (the
    mesh, the rows, the gathers and reductions) is over the data-parallel dimensions only;
    ``global_shape`` is the parameter's own."""

    fqn: str
    shape: tuple
    dtype: torch.dtype
    requires_grad: bool
    compute_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None
    mesh_shape: tuple = (1,)
    placements: Optional[tuple] = None
    device: str = "device"
    replica: bool = False
    grad_divide: Optional[float] = None
    force_sum: bool = False
    tp: Optional[str] = None
    tp_size: int = 1

    def __post_init__(self):
        self.shape = tuple(self.shape)
        self.mesh_shape = tuple(self.mesh_shape)
        self.compute_dtype = self.compute_dtype or self.dtype
        self.reduce_dtype = self.reduce_dtype or self.compute_dtype
        if self.placements is None:
            self.placements = placements_for(self.shape, len(self.mesh_shape),
                                             dtype=self.dtype)
        self.placements = tuple(self.placements)
        if len(self.placements) != len(self.mesh_shape):
            raise ValueError(f"{self.fqn}: {len(self.placements)} placements for a mesh of "
                             f"shape {self.mesh_shape}; give one per mesh dimension")
        if any(isinstance(p, Shard) and p.dim != 0 for p in self.placements):
            raise ValueError(f"{self.fqn}: only Shard(0) and Replicate() placements are "
                             f"supported, got {self.placements}")
        if self.device not in DEVICES:
            raise ValueError(f"{self.fqn}: device must be one of {DEVICES}, got "
                             f"{self.device!r}")
        if self.tp is not None and self.tp not in _PLACEMENTS:
            raise ValueError(f"{self.fqn}: tp must be one of {sorted(_PLACEMENTS)}, got "
                             f"{self.tp!r}")
        self.layout = ShardLayout(self.shape, self.shards)

    @property
    def global_shape(self) -> tuple:
        """The parameter's full shape: ``shape`` times the tensor-parallel split."""
        if self.tp is None or not self.tp.startswith("Shard"):
            return self.shape
        d = _PLACEMENTS[self.tp].dim
        return tuple(n * self.tp_size if i == d else n for i, n in enumerate(self.shape))

    def to_dict(self) -> dict:
        """Every field as plain JSON data: dtypes by name (``"bfloat16"``), shapes as lists,
        placements as ``"Shard(0)"`` or ``"Replicate()"``; ``from_dict`` reads it back into
        an equal ParamSpec."""
        return {f.name: _CODECS.get(f.name, (_plain, None))[0](getattr(self, f.name))
                for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, d: dict) -> "ParamSpec":
        """The ParamSpec ``to_dict`` wrote. ValueError naming what is wrong for a field
        missing, one it does not know, or a dtype or placement it cannot read."""
        if not isinstance(d, dict):
            raise ValueError(f"a ParamSpec is read from a dict, got {type(d).__name__}")
        names = [f.name for f in dataclasses.fields(cls)]
        who = f"ParamSpec {d.get('fqn', '?')!r}"
        missing = [n for n in names if n not in d]
        unknown = sorted(set(d) - set(names))
        if missing or unknown:
            raise ValueError(f"{who}: " + "; ".join(
                [f"no field {', '.join(missing)}"] * bool(missing)
                + [f"unknown field {', '.join(unknown)}"] * bool(unknown))
                + " (write it with ParamSpec.to_dict)")
        try:
            return cls(**{n: _CODECS[n][1](d[n]) if n in _CODECS else d[n] for n in names})
        except (KeyError, TypeError) as e:
            raise ValueError(f"{who}: {e.args[0] if e.args else e}") from None

    @property
    def shards(self) -> int:
        """How many ranks hold a distinct piece of it: the mesh dimensions it is sharded
        over (the reduce-scatter's and all-gather's group size)."""
        return math.prod(n for n, p in zip(self.mesh_shape, self.placements)
                         if isinstance(p, Shard))

    @property
    def sharded(self) -> bool:
        return self.layout.sharded

    @property
    def gathers(self) -> bool:
        """Whether the step all-gathers it before reading it: it is sharded and has no
        replica."""
        return self.sharded and not self.replica and any(
            isinstance(p, Shard) for p in self.placements)

    @property
    def reduction(self) -> tuple:
        """How its gradient is reduced, in order: ``("rs", mesh dim, ranks)`` over the
        dimension it is sharded over, then ``("ar", mesh dim, ranks)`` over each it is
        replicated over (innermost first); dimensions of one rank are skipped, except that a
        one-rank mesh still reduce-scatters a sharded parameter (a local copy)."""
        dims = list(reversed(list(enumerate(zip(self.mesh_shape, self.placements)))))
        out = [("rs", d, n) for d, (n, p) in dims if isinstance(p, Shard) and self.sharded]
        out += [("ar", d, n) for d, (n, p) in dims
                if n > 1 and not (isinstance(p, Shard) and self.sharded)]
        return tuple(out)

    @property
    def scaling(self) -> tuple:
        """How its reduction makes one gradient of the ranks' gradients, by FSDP2's rule
        (``_fsdp_collectives._get_gradient_divide_factors``): ``(op, before, after)``, the
        collectives' reduce op, ``"avg"`` or ``"sum"``, and what the gradient is divided by
        before the first collective and after the last (None: nothing).

        By default the mean over every rank it is reduced over: ``avg`` collectives. With
        ``grad_divide`` f, the sum over them divided by f (f = 1: the sum); with
        ``force_sum`` (and no f, f = those ranks), the same with sum collectives only. The
        division comes after the sum, in the reduce dtype, as FSDP2's sum-only path does
        it (its other path has NCCL multiply by 1/f first, which gloo cannot; the results
        differ by rounding, not at all for f = 1); in float16, whose range is small, it is
        split around the sum into a power of two and the rest, as FSDP2 splits it. Applied
        also where nothing is reduced (one rank), as FSDP2 does."""
        if self.grad_divide is None and not self.force_sum:
            return "avg", None, None
        f = float(self.grad_divide if self.grad_divide is not None
                  else math.prod(n for _, _, n in self.reduction))
        before = 1.0
        if self.reduce_dtype not in (torch.float32, torch.bfloat16):
            while f % before == 0 and f / before > before:
                before *= 2
        after = f / before
        return "sum", (before if before != 1 else None), (after if after != 1 else None)

    @property
    def group_size(self) -> int:
        """The ranks its all-gather and reduce-scatter run over: those it is sharded over."""
        return self.shards

    @property
    def shard_numel(self) -> int:
        """Elements this rank stores (padded rows; a scalar is 1)."""
        return self.layout.local_numel if self.sharded else 1

    @property
    def shard_bytes(self) -> int:
        """Bytes of this rank's shard, in the storage dtype (also its gradient shard's, and
        each optimizer state tensor's)."""
        return self.shard_numel * self.dtype.itemsize

    def gathered_bytes(self, dtype: Optional[torch.dtype] = None) -> int:
        """Bytes of the full padded parameter as gathered, in ``dtype`` (default: the compute
        dtype); a scalar is read as it is stored, one element."""
        n = self.layout.local_numel * self.shards if self.sharded else 1
        return n * (dtype or self.compute_dtype).itemsize

    @property
    def reduced_bytes(self) -> int:
        """Bytes of its gradient in the first reduction's send buffer (reduce dtype)."""
        if self.sharded:
            return self.gathered_bytes(self.reduce_dtype)
        return self.reduce_dtype.itemsize

    @property
    def replica_bytes(self) -> int:
        """Bytes of the full copy kept between steps (``replica``), else 0."""
        return self.gathered_bytes() if self.replica else 0


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise KeyError(f"{name!r} is not a torch dtype")
    return dtype


_PLACEMENTS = {"Shard(0)": Shard(0), "Shard(1)": Shard(1), "Replicate()": Replicate()}


def placement_name(p) -> str:
    return f"Shard({p.dim})" if isinstance(p, Shard) else "Replicate()"


def _placement(name: str):
    if name not in _PLACEMENTS:
        raise KeyError(f"placement {name!r} is not one of {sorted(_PLACEMENTS)}")
    return _PLACEMENTS[name]


def _plain(value):
    """A field stored as it is: it must already be JSON data (a new field of another type
    needs a codec of its own)."""
    assert value is None or isinstance(value, (bool, int, float, str)), value
    return value


# field -> (to JSON data, from JSON data), for the fields that are not stored as they are
_CODECS = {
    "shape": (list, tuple),
    "dtype": (_dtype_name, _dtype),
    "compute_dtype": (_dtype_name, _dtype),
    "reduce_dtype": (_dtype_name, _dtype),
    "mesh_shape": (list, tuple),
    "placements": (lambda ps: [placement_name(p) for p in ps],
                   lambda names: tuple(_placement(n) for n in names)),
}


def shards_over_mesh(placements) -> bool:
    """Whether placements shard a tensor over some mesh dimension (a replicated one, a
    scalar or a complex vector, has nothing to gather)."""
    return any(isinstance(p, Shard) for p in placements)


def group_size(specs) -> int:
    """The ranks one collective over these parameters runs over (they must agree; scalars
    and replicated parameters, never gathered, do not count)."""
    sizes = {s.group_size for s in specs if s.sharded and shards_over_mesh(s.placements)}
    if len(sizes) > 1:
        raise ValueError(f"one collective over parameters sharded over different numbers of "
                         f"ranks: {sorted(sizes)} ({[s.fqn for s in specs]})")
    return sizes.pop() if sizes else 1


def hosted(params, fraction: float) -> set:
    """The parameters whose shard, gradient shard and optimizer state live in host memory
    when ``fraction`` of the sharded state is offloaded. ``params``: ``[(fqn, shape)]`` in
    the model's order. The last parameters are taken first, whole, until ``fraction`` of the
    elements is covered: their copies in come late in the forward and their gradients' copies
    out early in the backward, where compute hides them. 1.0: every one but the scalars (read
    whole by the step, never gathered), which stay on the device; 0.0: none."""
    sizes = [(f, math.prod(shape)) for f, shape in params if len(shape) > 0]
    goal, out, covered = fraction * sum(n for _, n in sizes), set(), 0
    for f, n in reversed(sizes):
        if covered >= goal:
            break
        out.add(f)
        covered += n
    return out


# set on a sharded parameter whose shard lives in host memory (``stage_shards`` for a
# CPUOffloadPolicy, ``autoshard.runtime.storage.place`` for a plan that chose offload): where a
# parameter is stored is decided once, and every later plan reads it from here
ON_HOST = "_autoshard_on_host"
# set on a parameter stored on a mesh with a "tp" dimension that tensor parallelism's plan left
# alone: replicated over "tp", and read by the step as a plain tensor, as the model read it
NOT_PLACED = "_autoshard_not_tensor_parallel"


def param_specs(model: torch.nn.Module, mp_policy=None, mesh_shape=(1,),
                offload: float = 0.0, strategy: str = "zero3", grad_divide=None,
                force_sum: bool = False) -> list:
    """ParamSpec per (deduplicated) parameter of ``model``, sharded over ``mesh_shape``'s
    last dimension (replicated over the others) as ``strategy`` says; ``mp_policy``: a
    MixedPrecisionPolicy, applied to floating parameters as FSDP2 applies it; ``offload``: the
    fraction of the sharded state kept in host memory (``hosted``), besides the parameters
    already stored there (``ON_HOST``); ``grad_divide`` and ``force_sum``: how every
    gradient's reduction divides (``ParamSpec.scaling``)."""
    named = [(fqn, p, tensor_parallel_of(p)) for fqn, p in model.named_parameters()]
    host = hosted([(f, shape) for f, _, (shape, _, _) in named], offload)
    specs = []
    for fqn, p, (shape, tp, tp_size) in named:
        compute = reduce = None
        if mp_policy is not None and p.dtype.is_floating_point:
            compute, reduce = mp_policy.param_dtype, mp_policy.reduce_dtype
        placements = placements_for(shape, len(mesh_shape), strategy, p.dtype)
        specs.append(ParamSpec(fqn, shape, p.dtype, p.requires_grad, compute, reduce,
                               mesh_shape=tuple(mesh_shape), placements=placements,
                               device=("host" if fqn in host or getattr(p, ON_HOST, False)
                                       else "device"),
                               replica=strategy == "zero1" and shards_over_mesh(placements),
                               grad_divide=grad_divide, force_sum=force_sum, tp=tp,
                               tp_size=tp_size))
    return specs


def tensor_parallel_of(p: torch.Tensor) -> tuple:
    """``(shape, tp, tp_size)`` of a parameter for its ParamSpec: for a DTensor on a mesh
    whose last dimension is "tp" (placed by ``parallelize_module``, or stored by autoshard
    beside the data-parallel dimensions), its tensor-parallel piece's shape, its placement's
    name on "tp" and the dimension's size; else (``NOT_PLACED`` too) its shape, None, 1."""
    mesh = p.device_mesh if isinstance(p, DTensor) else None
    if (mesh is None or tuple(mesh.mesh_dim_names or ())[-1:] != ("tp",)
            or getattr(p, NOT_PLACED, False)):
        return tuple(p.shape), None, 1
    placement, size = p.placements[-1], mesh.shape[-1]
    shape = list(p.shape)
    if isinstance(placement, Shard):
        shape[placement.dim] //= size
    return tuple(shape), placement_name(placement), size


def model_state_bytes(specs, optimizer_states: int) -> dict:
    """Per-rank bytes of parameter shards (and replicas), gradient shards and optimizer state
    on the device (padded), and what of it lives on the host (``host``, of which
    ``host_grads`` are the gradient shards)."""
    out = {"params": 0, "grads": 0, "optimizer": 0, "host": 0, "host_grads": 0}
    for p in specs:
        out["params"] += p.replica_bytes
        b = p.shard_bytes
        grads = b if p.requires_grad else 0
        held = b + grads + grads * optimizer_states
        if p.device == "host":
            out["host"] += held
            out["host_grads"] += grads
            continue
        out["params"] += b
        out["grads"] += grads
        out["optimizer"] += grads * optimizer_states
    return out

"""Sharded storage: parameters become DTensor Shard(0) on the mesh, FSDP2's layout."""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
from torch.distributed.tensor import DTensor

from autoshard.core import _compat
from autoshard.core.spec import NOT_PLACED, ON_HOST, param_specs
from autoshard.runtime import optim, tensor_parallel
from autoshard.runtime.init_order import Slot, slots_of
from autoshard.runtime.materialize import materialize


def fqn_aliases(model: torch.nn.Module) -> dict:
    """Every parameter name (tied ones too) -> the canonical (first) FQN."""
    first = {}
    out = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        first.setdefault(id(p), name)
        out[name] = first[id(p)]
    return out


def _contiguous_stride(shape) -> tuple:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(stride))


# --- what else already distributes a model ------------------------------------------------


def _other_wrappers() -> list:
    """(class, what users call it, what to do instead) for the wrappers autoshard replaces."""
    out = []
    try:
        from torch.distributed.fsdp import FSDPModule

        out.append((FSDPModule, "FSDP2's fully_shard()",
                    "build the model again without fully_shard() and call autoshard(model) "
                    "alone: autoshard shards every parameter itself and chooses the units "
                    "that fully_shard() would wrap"))
    except ImportError:  # pragma: no cover - torch builds without distributed
        pass
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel

        out.append((FullyShardedDataParallel, "FSDP1 (FullyShardedDataParallel)",
                    "pass the unwrapped model (no FullyShardedDataParallel anywhere in it) "
                    "to autoshard()"))
    except ImportError:  # pragma: no cover
        pass
    out.append((torch.nn.parallel.DistributedDataParallel, "DistributedDataParallel",
                "autoshard replaces DDP: pass the wrapped module (ddp.module) to autoshard()"))
    return out


def check_shardable(model: torch.nn.Module) -> None:
    """Raise ``ValueError`` if something else already distributes part of ``model``: FSDP2's
    ``fully_shard`` (the module's class became ``FSDP<Name>``), FSDP1, DDP, or DTensor
    parameters from tensor parallelism. The message names the module or parameter and the
    wrapper. (An earlier ``autoshard`` of a submodule is the front door's to refuse, first.)"""
    wrappers = _other_wrappers()
    for name, mod in model.named_modules():
        where = f"module '{name}'" if name else "the model"
        cls = type(mod).__name__
        for kind, what, advice in wrappers:
            if isinstance(mod, kind):
                raise ValueError(
                    f"{where} ({cls}) is already distributed by {what}, which owns its "
                    f"parameters; autoshard cannot share them with another wrapper: {advice}.")
    for fqn, p in model.named_parameters():
        if isinstance(p, DTensor):
            placements = ", ".join(str(x) for x in p.placements)
            raise ValueError(
                f"parameter '{fqn}' is already a DTensor ({placements} on a "
                f"{p.device_mesh.ndim}-D mesh of {p.device_mesh.size()} ranks), placed by "
                "something other than autoshard: tensor parallelism (parallelize_module), "
                "distribute_module or distribute_tensor. autoshard takes a model of plain "
                "tensors and shards every parameter itself; combining it with tensor "
                "parallelism is not supported. Pass the model before it was distributed.")


# --- staging: every new tensor built first, swapped in at once --------------------------------


_MISSING = object()


@dataclasses.dataclass
class StagedShards:
    """The sharded model's new parameters and buffers, built without touching the model."""

    model: torch.nn.Module
    params: dict  # id(old parameter) -> new DTensor parameter
    buffers: dict  # id(old buffer) -> new buffer (on the mesh device)
    flags: list  # (module, attribute, value) to set (Hugging Face's _is_hf_initialized)
    names: dict = dataclasses.field(default_factory=dict)  # id(old parameter) -> its FQN

    def commit(self) -> Callable[[], None]:
        """Put the new tensors in place (every reference of a tied one) and return ``undo()``,
        which puts back the very objects that were there before."""
        saved = [(m, dict(m._parameters), dict(m._buffers)) for m in self.model.modules()]
        old_flags = [(m, a, m.__dict__.get(a, _MISSING)) for m, a, _ in self.flags]
        for m, params, buffers in saved:
            for name, p in params.items():
                if p is not None:
                    m._parameters[name] = self.params[id(p)]
            for name, b in buffers.items():
                if b is not None and id(b) in self.buffers:
                    m._buffers[name] = self.buffers[id(b)]
        for m, a, v in self.flags:
            m.__dict__[a] = v
        olds = {id(p): p for _, params, _ in saved for p in params.values() if p is not None}
        for p in olds.values():  # an optimizer built over them is refused at its first step
            optim.mark_replaced(p, f"'{self.names[id(p)]}' of {type(self.model).__name__}")

        def undo():
            for p in olds.values():
                optim.unmark_replaced(p)
            for m, params, buffers in saved:
                m._parameters.clear()
                m._parameters.update(params)
                m._buffers.clear()
                m._buffers.update(buffers)
            for m, a, v in old_flags:
                if v is _MISSING:
                    m.__dict__.pop(a, None)
                else:
                    m.__dict__[a] = v

        return undo


def stage_shards(model: torch.nn.Module, mesh, device: torch.device, specs=None, *,
                 param_init_fn=None, pin_memory: bool = True, whole=None) -> StagedShards:
    """Build this rank's DTensor parameters (its rows of each) and the buffers on ``device``,
    without changing ``model``; ``commit()`` swaps them in.

    Rows are split as ``torch.chunk`` does (ceil(dim0/N) per rank; the last ranks may hold
    fewer or none), exactly as DTensor and FSDP2 store uneven shards. Scalars are replicated.
    Tied parameters stay tied (one DTensor, every reference).

    Tensors on the meta device are materialised module by module: a module's own parameters
    and buffers are allocated full size on ``device``, initialised, sliced to this rank's rows
    and freed before the next module, so host/device memory peaks near this rank's shards plus
    the largest module. They are initialised as building the model on ``device`` would
    (``init_order.init_steps``: the ops a constructor run under ``deferred_init()``
    recorded, or each layer's ``reset_parameters()`` and a Hugging Face model's
    ``_init_weights``), then by ``param_init_fn(module)`` if given, children first; with the
    same seed, the shards are bitwise the rows of the model built on ``device``. A meta
    tensor nothing initialises, or whose constructor's writes cannot be replayed, raises
    ``ValueError`` naming it.

    ``specs`` (``autoshard.core.spec.param_specs``, by FQN; default: sharded over the mesh's last
    dimension) decide each parameter's placement: rows split over the mesh's last dimension
    and replicated over the others (a 2-D ("replicate", "shard") mesh, HSDP), or replicated
    whole (DDP); a spec on the "host" keeps the shard in host memory, pinned when the device
    is a GPU and ``pin_memory``, and marks it ``ON_HOST``. A parameter tensor parallelism
    placed (a spec's ``tp``) is cut from its tensor-parallel piece; given ``whole``, the
    mesh with a "tp" dimension, every parameter is stored on it
    (``autoshard.runtime.tensor_parallel.storage``).
    """
    last = mesh.get_local_rank(mesh.ndim - 1)
    slots = slots_of(model)
    if specs is None:
        specs = param_specs(model, mesh_shape=tuple(mesh.shape))
    specs = {s.fqn: s for s in specs}

    def local(slot: Slot, full: torch.Tensor) -> torch.Tensor:
        if not slot.is_param:
            return full.detach()
        lay = specs[slot.fqn].layout
        if not lay.sharded:
            return full.detach()
        a, b = lay.local_range(_index(specs[slot.fqn], last))
        if a == 0 and b == full.shape[0] and full.is_contiguous():
            return full.detach()
        return full.detach()[a:b].clone(memory_format=torch.contiguous_format)

    flags, values = [], {}
    if any(s.meta for s in slots.values()):
        values, steps = materialize(model, slots, device, local, param_init_fn)
        flags = [(s.module, "_is_hf_initialized", True) for s in steps
                 if s.label.endswith("._init_weights")]

    params, buffers = {}, {}
    for sid, slot in slots.items():
        t = slot.tensor
        if slot.is_param:
            spec = specs[slot.fqn]
            params[sid] = _shard(slot, values.get(sid), spec, (mesh, whole),
                                 _index(spec, last), device, pin_memory)
        elif sid in values:
            buffers[sid] = values[sid]
        elif t.device != device:
            buffers[sid] = t.to(device)
    names = {sid: slot.fqn for sid, slot in slots.items() if slot.is_param}
    return StagedShards(model, params, buffers, flags, names)


def _index(spec, last: int) -> int:
    """Which of ``spec``'s row blocks this rank holds: its rank along the mesh's last
    dimension, which a sharded parameter is split over; 0 for one stored whole (DDP)."""
    return last if spec.shards > 1 else 0


def _shard(slot: Slot, value, spec, meshes: tuple, rank: int, device: torch.device,
           pin_memory: bool) -> torch.nn.Parameter:
    """The new DTensor parameter of ``slot``: this rank's rows of ``value`` (the materialised
    shard) or of the tensor, placed as ``spec`` says."""
    t, lay = slot.tensor, spec.layout
    t = t.to_local() if isinstance(t, DTensor) else t  # tensor parallelism's piece
    mesh, placements, shape = tensor_parallel.storage(spec, *meshes)
    if value is not None:
        local_t = value
    elif lay.sharded:
        a, b = lay.local_range(rank)
        local_t = t.detach()[a:b].to(device, copy=True).contiguous()
    else:
        local_t = t.detach().to(device, copy=True)
    if spec.device == "host":
        local_t = local_t.to("cpu")
        if device.type == "cuda" and pin_memory:
            local_t = local_t.pin_memory()
    if spec.device == "host":
        dt = _compat.dtensor_here(local_t, mesh, placements, shape, _contiguous_stride(shape))
    else:
        dt = DTensor.from_local(local_t, mesh, placements, run_check=False,
                                shape=shape, stride=_contiguous_stride(shape))
    new = torch.nn.Parameter(dt, requires_grad=t.requires_grad)
    optim.mark(new)
    if spec.device == "host":
        setattr(new, ON_HOST, True)
    if meshes[1] is not None and spec.tp is None:
        setattr(new, NOT_PLACED, True)
    return new


def move_to_host(model: torch.nn.Module, specs, device: torch.device, *,
                 pin: bool = True) -> list:
    """Store the shard of every parameter ``specs`` places in host memory there, in place
    (``param.data``: an optimizer already built over the parameters keeps them), marked
    ``ON_HOST`` so every later plan keeps it there; pinned on a GPU when ``pin``. What a plan
    that chose offload applies before it first runs. Returns the FQNs moved."""
    moved = []
    for spec in specs:
        if spec.device != "host":
            continue
        p = model.get_parameter(spec.fqn)
        if getattr(p, ON_HOST, False):
            continue
        if device.type == "cpu":
            # in host memory already: marked, the tensor kept. A swap would poison the
            # parameter's AccumulateGrad in the graph of a forward whose backward is pending
            # (a submodule called directly, planned after the model's forward in one step)
            setattr(p, ON_HOST, True)
            moved.append(spec.fqn)
            continue
        with torch.no_grad():
            local = p.to_local().to("cpu", copy=True)
            if device.type == "cuda" and pin:
                local = local.pin_memory()
            host = torch.nn.Parameter(
                _compat.dtensor_here(local, p.device_mesh, p.placements, p.shape, p.stride()),
                requires_grad=p.requires_grad)
        # the whole tensor is swapped, not ``p.data``: assigning ``.data`` keeps a DTensor's
        # device (it is fixed when the wrapper is made), so a host shard would report the GPU
        # and its host gradient could not be assigned. The object, and so every reference to
        # it (an optimizer's), and its attributes stay.
        host.__dict__.update(p.__dict__)
        torch.utils.swap_tensors(p, host)
        setattr(p, ON_HOST, True)
        moved.append(spec.fqn)
    return moved


def shard_module(model: torch.nn.Module, mesh, device: torch.device, *,
                 param_init_fn=None) -> Callable[[], None]:
    """Replace every parameter by a DTensor parameter holding this rank's rows and move the
    buffers to ``device`` (``stage_shards``, then ``commit``), materialising meta-device
    tensors on the way. Everything is built before anything is replaced, so an error leaves
    the model as it was. Returns ``undo()``, which puts the original tensors back."""
    check_shardable(model)
    return stage_shards(model, mesh, device, param_init_fn=param_init_fn).commit()


def full_state_dict(model: torch.nn.Module, *, cpu_offload: bool = False,
                    rank0_only: bool = False) -> dict:
    """The model's ``state_dict()`` with every DTensor gathered to a full tensor (one
    all-gather per sharded tensor, in the state dict's order), under the same keys: what the
    unsharded model's ``state_dict()`` holds and ``load_state_dict`` takes. Every rank calls
    it. ``cpu_offload`` moves each tensor to host memory as soon as it is gathered, so the
    device holds at most one full tensor; ``rank0_only`` keeps the tensors on global rank 0
    and returns an empty dict on the others (the two together are what DCP's
    ``get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
    cpu_offload=True))`` gives). Gathered from ``state_dict()`` itself rather than through
    ``get_model_state_dict``, which maps every key back to a module attribute and so fails
    (under FSDP2 too) on a model whose state-dict hooks save other keys than its attributes,
    as torchtitan's fused QKV projection saves ``wq``/``wk``/``wv`` for its ``wqkv``."""
    import torch.distributed as dist

    keep = not rank0_only or not dist.is_initialized() or dist.get_rank() == 0
    out = {}
    for k, v in model.state_dict().items():
        if isinstance(v, DTensor):
            v = v.full_tensor()  # a collective: every rank gathers every tensor, in order
        if keep:
            out[k] = v.cpu() if cpu_offload and isinstance(v, torch.Tensor) else v
    return out

"""Tensor parallelism beside FSDP: a plan in ``torch.distributed.tensor.parallel``'s own
vocabulary (``{"layers.*.attention.wq": ColwiseParallel(), ...}``, as torchtitan writes it)
applied with torch's ``parallelize_module`` over the mesh's "tp" dimension, and the 2-D layouts
of the parameters it places.

The styles' input and output redistributions run inside the module hooks
``parallelize_module`` registers; capture traces them (each tensor-parallel parameter enters
the traced step as a DTensor on the "tp" dimension), so their all-reduces, all-gathers and
reduce-scatters of activations are ``_c10d_functional`` nodes of the captured graph. FSDP
then shards each parameter's tensor-parallel piece over the data-parallel dimensions only, and
stores it as torch stores FSDP2 + TP: a DTensor on the whole mesh whose "tp" placement is the
style's (``Shard(0)`` column-wise, ``Shard(1)`` row-wise) and whose data-parallel placement is
``Shard(0)`` (``_StridedShard(0)`` over a column-wise ``Shard(0)``, as FSDP2 writes it).
"""

from __future__ import annotations

import fnmatch
from typing import Callable, Mapping

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from autoshard.core import _compat
from autoshard.core.errors import AutoshardError
from autoshard.core.spec import NOT_PLACED

# the styles whose layouts autoshard stores under FSDP, and the modules each may place
_LAYOUTS = {ColwiseParallel: (torch.nn.Linear, torch.nn.Embedding),
            RowwiseParallel: (torch.nn.Linear, torch.nn.Embedding)}


def split_mesh(mesh: DeviceMesh) -> tuple:
    """``(data-parallel mesh, tp mesh)`` of a mesh whose last dimension is "tp": the
    dimensions before it (one, or hybrid sharding's two) and "tp"."""
    names = tuple(mesh.mesh_dim_names)
    dp = mesh[names[0]] if len(names) == 2 else mesh[names[:-1]]
    return dp, mesh["tp"]


def _matches(name: str, key: str) -> bool:
    """Whether module ``name`` is one ``parallelize_module`` places for plan ``key``: each
    dotted atom matched as ``fnmatch`` matches it."""
    parts, atoms = name.split("."), key.split(".")
    return len(parts) == len(atoms) and all(fnmatch.fnmatchcase(p, a)
                                            for p, a in zip(parts, atoms))


# the attribute an attention module keeps its head size in: Llama, Qwen, Mistral and most
# decoders; BERT and ViT; T5
_HEAD_SIZES = ("head_dim", "attention_head_size", "key_value_proj_dim")


def _head_size(model: torch.nn.Module, name: str) -> int | None:
    """The head size of the attention module holding module ``name``, if it keeps one."""
    parent = model.get_submodule(name.rpartition(".")[0])
    size = next((getattr(parent, a) for a in _HEAD_SIZES if hasattr(parent, a)), None)
    return size if isinstance(size, int) and size > 0 else None


def _dividing(mod, style, tp: int, head: int | None) -> str | None:
    """What ``tp`` does not divide that ``style`` would split on ``mod`` (the features, or
    the heads of an attention projection, ``head`` features each), else None."""
    if isinstance(mod, torch.nn.Linear):
        dim, n = (("out_features", mod.out_features) if isinstance(style, ColwiseParallel)
                  else ("in_features", mod.in_features))
    else:
        dim, n = (("embedding_dim", mod.embedding_dim) if isinstance(style, ColwiseParallel)
                  else ("num_embeddings", mod.num_embeddings))
    if n % tp:
        return f"its {dim} ({n})"
    if isinstance(mod, torch.nn.Linear) and head and n % head == 0 and (n // head) % tp:
        return f"the {n // head} heads of its {dim} ({n} = {n // head} x head size {head})"
    return None


def check_plan(model: torch.nn.Module, plan: Mapping, tp: int) -> dict:
    """Refuse a plan ``parallelize_module`` would fail on, or would place in a layout
    autoshard does not store, naming the module and the fix: a key no module matches, a
    style other than ``ColwiseParallel`` / ``RowwiseParallel``, one on a module that is not
    a Linear or an Embedding, a size ``tp`` does not divide (features, or an attention
    projection's heads). Returns module name -> style."""
    names = [n for n, _ in model.named_modules() if n]
    placed = {}
    for key, style in plan.items():
        found = [n for n in names if _matches(n, key)]
        if not found:
            near = ", ".join(n for n in names if n.split(".")[-1] == key.split(".")[-1])[:200]
            raise AutoshardError(
                f"Config.tensor_parallel names {key!r}, and no module of the model matches "
                f"it{f' (modules of that name: {near})' if near else ''}; name modules as "
                "model.named_modules() does ('*' for one level, e.g. 'layers.*.mlp.up')")
        kinds = next((k for s, k in _LAYOUTS.items() if type(style) is s), None)
        if kinds is None:
            raise AutoshardError(
                f"Config.tensor_parallel[{key!r}] is {type(style).__name__}: this version "
                "stores the layouts of ColwiseParallel and RowwiseParallel under FSDP; give "
                "one of those, or leave the module out")
        if not getattr(style, "use_local_output", True):
            raise AutoshardError(
                f"Config.tensor_parallel[{key!r}] has use_local_output=False: the modules "
                "after it would read DTensors, which this version does not trace; leave it "
                "True (the default)")
        for n in found:
            mod = model.get_submodule(n)
            if not isinstance(mod, kinds):
                fix = ("name the Linear layers inside it instead"
                       if any(isinstance(m, torch.nn.Linear) for m in mod.modules()) else
                       "it holds no Linear layer (a mixture of experts keeps its experts as "
                       "stacked weights, and tensor parallelism inside experts is not built "
                       "in this version): leave it out of the plan, and FSDP alone shards it")
                raise AutoshardError(
                    f"Config.tensor_parallel[{key!r}] places module '{n}', a "
                    f"{type(mod).__name__}: {type(style).__name__} splits the weight of an "
                    f"nn.Linear or nn.Embedding; {fix}")
            bad = _dividing(mod, style, tp, _head_size(model, n))
            if bad is not None:
                raise AutoshardError(
                    f"Config.tensor_parallel[{key!r}]: the tp dimension's {tp} ranks do not "
                    f"divide {bad} of module '{n}' ({type(mod).__name__}); each rank must "
                    "hold whole rows and whole heads: leave it out of the plan, or use a tp "
                    "size that divides it (grouped-query attention's key/value heads too)")
            _refuse_tied(model, n, key)
            placed[n] = style
    return placed


def _refuse_tied(model: torch.nn.Module, name: str, key: str) -> None:
    """Refuse placing module ``name`` whose parameter is also another module's (a head tied
    to the embedding): ``parallelize_module`` would replace it in one of them only."""
    own = {id(p) for p in model.get_submodule(name).parameters()}
    for fqn, p in model.named_parameters(remove_duplicate=False):
        if id(p) in own and not fqn.startswith(name + "."):
            raise AutoshardError(
                f"Config.tensor_parallel[{key!r}] places module '{name}', whose parameter is "
                f"also '{fqn}' (tied): parallelize_module would untie them; leave '{name}' "
                "out of the plan")


def apply(model: torch.nn.Module, mesh: DeviceMesh, plan: Mapping) -> Callable[[], None]:
    """``parallelize_module(model, mesh["tp"], plan)`` after ``check_plan``; returns
    ``undo()``, which puts back every parameter object and hook it replaced or added."""
    tp_mesh = split_mesh(mesh)[1]
    check_plan(model, plan, tp_mesh.size())
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t.is_meta:
            raise AutoshardError(
                f"'{name}' is on the meta device: Config.tensor_parallel places a model "
                "built on its device in this version; build it there (or load its weights) "
                "before autoshard()")
    saved = [(m, dict(m._parameters), dict(m._forward_pre_hooks),
              dict(m._forward_hooks)) for m in model.modules()]

    def undo():
        for m, params, pre, post in saved:
            m._parameters.clear()
            m._parameters.update(params)
            m._forward_pre_hooks.clear()
            m._forward_pre_hooks.update(pre)
            m._forward_hooks.clear()
            m._forward_hooks.update(post)

    try:
        from torch.distributed.tensor.parallel import parallelize_module

        parallelize_module(model, tp_mesh, dict(plan))
    except BaseException:
        undo()
        raise
    return undo


def storage(spec, mesh: DeviceMesh, whole=None) -> tuple:
    """``(mesh, placements, global shape)`` a parameter of ``spec`` is stored with: on the
    data-parallel ``mesh`` as ``spec.placements`` say, or in a model tensor parallelism
    placed on the ``whole`` mesh, its "tp" placement last (FSDP2 + TP's layout: ``Replicate``
    for a parameter the plan left alone, which is marked ``NOT_PLACED``)."""
    if whole is None:
        return mesh, spec.placements, spec.shape
    tp = _placement(spec) if spec.tp is not None else Replicate()
    strided = isinstance(tp, Shard) and tp.dim == 0
    dp = tuple(_compat.StridedShard(0, split_factor=spec.tp_size)
               if strided and isinstance(p, Shard) else p for p in spec.placements)
    return whole, (*dp, tp), spec.global_shape


def _placement(spec):
    """The placement on "tp" of a parameter tensor parallelism placed."""
    return Shard(int(spec.tp[6])) if spec.tp.startswith("Shard") else Replicate()


def trace_layouts(model: torch.nn.Module, specs) -> dict:
    """FQN -> (the "tp" mesh, placement, global shape, stride) of each parameter of
    ``specs`` tensor parallelism placed: how the traced step reads it (``traced_values``).
    Taken before tracing: a sub-mesh made while tracing reads the mesh's ranks as a traced
    tensor (torch 2.11)."""
    out = {}
    for spec in specs:
        if spec.tp is not None:
            shape = spec.global_shape
            out[spec.fqn] = (model.get_parameter(spec.fqn).device_mesh["tp"], _placement(spec),
                             shape, torch.empty(shape, device="meta").stride())
    return out


def traced_values(layouts: dict, specs, tensors) -> dict:
    """FQN -> what the traced step reads for each parameter of ``specs``: its traced tensor
    (of ``tensors``), or for one tensor parallelism placed (``layouts``: ``trace_layouts``)
    a DTensor of it on "tp", laid out as the style placed it, which the style's hooks
    redistribute."""
    out = {}
    for spec, t in zip(specs, tensors):
        if spec.fqn in layouts:
            mesh, placement, shape, stride = layouts[spec.fqn]
            t = DTensor.from_local(t, mesh, (placement,), run_check=False, shape=shape,
                                   stride=stride)
        out[spec.fqn] = t
    return out


def check_same_inputs(agreement, tensors: list, tp: int, what: str) -> None:
    """Refuse a step whose "tp" ranks of one data-parallel rank were given different
    inputs: tensor parallelism splits one batch's computation over them, so each must hold
    the same batch, and with different ones the all-reduces would sum halves of different
    samples, silently. A sampler over the world (``DistributedSampler``, the Trainer's,
    accelerate's) gives each rank its own. Checked when a step is captured: a digest of
    every tensor input's bytes, all-gathered over the whole mesh (whose last dimension is
    "tp", so each run of ``tp`` ranks shares a data-parallel rank)."""
    import hashlib

    if tp == 1:  # one rank per data-parallel rank: nothing to compare
        return
    digest = hashlib.sha256()
    for t in tensors:
        t = t.detach()
        digest.update(repr((tuple(t.shape), t.dtype)).encode())
        digest.update(t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    notes = agreement.notes(what, digest.hexdigest()[:32])
    for start in range(0, len(notes), tp):
        if len(set(notes[start:start + tp])) > 1:
            ranks = agreement.ranks[start:start + tp]
            raise AutoshardError(
                f"the 'tp' ranks {ranks} of one data-parallel rank were given different "
                "inputs: tensor parallelism splits one batch over them, so each must get the "
                "same batch (a sampler over every rank, such as DistributedSampler's default, "
                "the Trainer's or accelerate's, gives each rank its own). Sample over the "
                "data-parallel dimension only: DistributedSampler(data, num_replicas="
                "mesh['dp'].size(), rank=mesh['dp'].get_local_rank()), the same on every "
                "'tp' rank")

"""ZeRO-1 replicas: every rank keeps the full parameter in the compute dtype from one call to
the next (``ParamSpec.replica``), gathered again from the shards where anything wrote them."""

from __future__ import annotations

import weakref

import torch

from autoshard.core import _compat
from autoshard.runtime import optim


def refresh_replicas(replicas: dict, mesh, agreement, prog, params: list) -> dict:
    """Each replica (``ParamSpec.replica``) the program reads, gathered again from the shards
    where anything wrote them since (``_written``): per unit and compute dtype one all-gather
    over the mesh's shard dimension, as the plan's "after step" entries say. Whether a group
    is gathered is agreed on first (``Agreement.any``, one 32-byte all-gather): a write on
    some ranks only still changes the full parameter every rank reads, as FSDP2's gather of
    the shards would, and every rank issues the same all-gathers. Returns FQN -> replica."""
    if not prog.replica_slots:
        return {}
    specs = prog.captured.params
    at = {s.fqn: i for i, s in enumerate(specs)}
    group = mesh.get_group(mesh.ndim - 1)
    groups = []  # (compute dtype, parameter indices) per unit, in plan order
    for unit in prog.plan.units:
        by_dtype = {}
        for f in unit.fqns:
            if specs[at[f]].replica:
                by_dtype.setdefault(specs[at[f]].compute_dtype, []).append(at[f])
        groups += by_dtype.items()
    written = [any(_written(replicas.get(specs[i].fqn), params[i]) for i in idx)
               for _, idx in groups]
    written = agreement.any(f"step {agreement.step}: replicas", written)
    out = {}
    for (dtype, idx), stale in zip(groups, written):
        if stale:
            _gather_replicas(replicas, prog, params, idx, dtype, group)
        out.update((specs[i].fqn, replicas[specs[i].fqn][0]) for i in idx)
    return out


def _stamp(param) -> tuple:
    """What a replica gathered from ``param`` stays valid for: its local tensor (by identity:
    ``swap_tensors``, a new parameter object) and that tensor's version (a write to
    ``to_local()``), the DTensor's own version (in-place ops on the parameter, which do not
    advance the local tensor's), and its last noted update (an optimizer step, whose foreach
    ops through DTensor's dispatch advance neither version; ``runtime.optim.note_update``)."""
    local = _compat.local_tensor(param)
    return weakref.ref(local), local._version, param._version, optim.updated(param)


def _written(entry, param) -> bool:
    """Whether ``param`` may have changed since its replica ``entry`` was gathered."""
    if entry is None:
        return True
    ref, *versions = entry[1]
    now = _stamp(param)
    return ref() is not _compat.local_tensor(param) or versions != list(now[1:])


def _gather_replicas(replicas: dict, prog, params, idx, dtype, group) -> None:
    """One all-gather (the c10d functional op the graphs use) of these parameters' shards,
    cast to ``dtype``, into their replicas."""
    funcol = torch.ops._c10d_functional
    specs = prog.captured.params
    # never an inference tensor (gathered within torch.inference_mode): the next training
    # step reuses the replica and saves it for backward
    with torch.inference_mode(False), torch.no_grad():
        flat = torch.cat([prog.pad(i, _compat.local_tensor(params[i])).reshape(-1).to(dtype)
                          for i in idx])
        n = specs[idx[0]].shards
        buf = torch.empty(n * flat.numel(), dtype=dtype, device=flat.device)
        # complex as its real view: gloo has no complex collectives (the graphs' gathers
        # send it so too, passes/collectives._real)
        send, into = ((torch.view_as_real(flat).reshape(-1), torch.view_as_real(buf).reshape(-1))
                      if dtype.is_complex else (flat, buf))
        funcol.wait_tensor.default(funcol.all_gather_into_tensor_out.default(
            send, n, group.group_name, out=into))
        cols, off = buf.view(n, -1), 0
        for i in idx:
            lay = specs[i].layout
            full = cols[:, off:off + lay.local_numel].reshape(lay.padded_rows, *lay.inner)
            off += lay.local_numel
            replicas[specs[i].fqn] = (full[:lay.shape[0]].clone(), _stamp(params[i]))

"""Bytes per rank for every Config.strategy and for hybrid sharding, measured against the
textbook formulas, in one run.

    python -m bench.strategies --model gpt-small --world-size 4 --steps 3

Spawns ``world-size`` gloo ranks. Each system trains ``steps`` steps (AdamW, fp32); then, on
rank 0:
- sent: bytes this rank sends in one step (the last), counted at each c10d functional
  collective it calls (the graphs' and ZeRO-1's after-step all-gather): a ring all-gather or
  reduce-scatter of S bytes over a group of n sends S (n-1)/n, an all-reduce 2 S (n-1)/n;
- stored: the bytes of this rank's parameters, gradients and optimizer state after the
  backward, before the optimizer step (each storage once, ZeRO-1's replicas included);
- the textbook formulas for P parameter bytes (fp32: gradients P, AdamW 2P) on N ranks,
  hybrid as R x S (replicate x shard): DDP sends 2P(N-1)/N and stores 4P; ZeRO-1 sends the
  same (a reduce-scatter and an all-gather) and stores 2P + 2P/N (full parameters and
  gradients, sharded state); ZeRO-2 sends the same and stores P + 3P/N; ZeRO-3 sends
  3P(N-1)/N and stores 4P/N; HSDP sends 3P(S-1)/S + 2(P/S)(R-1)/R and stores 4P/S.
  autoshard's ZeRO-1 and ZeRO-2 reduce each unit's gradients as soon as they are complete
  and free the full ones, so after the backward they hold sharded gradients: P + 3P/N for
  ZeRO-1 (whose parameters stay whole), 4P/N for ZeRO-2 (whose units were gathered for the
  step and are freed at its end). "-reshard": every unit resharded after the forward (by
  default the unit gathered last in the forward is kept for the backward and is not
  gathered twice, which sends less than the formula).
- hpZ, "zero3-hpzK" (``reshard_after_forward=K``): every unit resharded after the forward to
  groups of K consecutive ranks, so the backward all-gathers within the group. Textbook:
  P(N-1)/N forward all-gather, P(K-1)/K backward all-gather, P(N-1)/N reduce-scatter, in all
  2P(N-1)/N + P(K-1)/K (N = 4, K = 2: 2P, against ZeRO-3's 2.25P); stored 4P/N as ZeRO-3
  (the chunks, P/K, live from forward to backward only).
- across: of the bytes sent, those for ranks outside this rank's K-group (hpZ rows only). A
  collective over the K-group sends none across. A collective over a group of n ranks
  (the shard dimension) is counted by where its bytes must arrive, whatever the algorithm
  routes: each rank's 1/n of an all-gather (or of a reduce-scatter's result) reaches the
  n - K ranks outside its group, so of S (n-1)/n sent, S (n-K)/n count as across (an
  all-reduce twice that). Textbook: 2P(N-K)/N; the backward all-gather adds nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tabulate import tabulate
from torch.distributed.device_mesh import init_device_mesh
from torch.utils._python_dispatch import TorchDispatchMode

from bench.compare import MODELS, VOCAB, _loss

SYSTEMS = ("ddp", "zero1", "zero2", "zero3", "zero3-reshard", "zero3-hpz2", "auto", "hsdp",
           "hsdp-reshard")
_F = torch.ops._c10d_functional


class _Sent(TorchDispatchMode):
    """Bytes sent per rank by the c10d functional collectives called inside it."""

    def __init__(self, sizes: dict, k: int = 0):
        """``sizes``: group name -> its ranks; ``k``: the hpZ group size (0: none), for the
        bytes sent across groups (the module docstring says how they are counted)."""
        super().__init__()
        self.sizes, self.k, self.bytes, self.calls, self.across = sizes, k, 0, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is _F.all_gather_into_tensor_out.default:
            self._add(out, args[2], 1)
        elif func is _F.reduce_scatter_tensor.default:
            self._add(args[0], args[3], 1)
        elif func is _F.all_reduce.default:
            self._add(args[0], args[2], 2)
        return out

    def _add(self, t, group, rounds):
        n = self.sizes[group]
        nbytes = t.numel() * t.element_size()
        self.calls += 1
        self.bytes += rounds * nbytes * (n - 1) // n
        if self.k and n > self.k:  # a K-group's own collective sends nothing across
            self.across += rounds * nbytes * (n - self.k) // n


def _stored(model, opt) -> int:
    seen, total = set(), 0
    tensors = [p.to_local() for p in model.parameters()]
    tensors += [p.grad.to_local() for p in model.parameters() if p.grad is not None]
    tensors += [t.to_local() if hasattr(t, "to_local") else t
                for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
    tensors += [r for r, _ in model._autoshard.replicas.values()]
    for t in tensors:
        if t.dim() and t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            total += t.untyped_storage().nbytes()
    return total


def _system(name, system, world, args):
    from autoshard import Config, autoshard

    torch.manual_seed(0)
    model = MODELS[args.model]()
    hybrid = system.startswith("hsdp")
    mesh = (init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
            if hybrid else init_device_mesh("cpu", (world,)))
    sizes = {mesh.get_group(d).group_name: mesh.size(d) for d in range(mesh.ndim)}
    strategy = "zero3" if hybrid else system.partition("-")[0]
    k = _hpz(system)
    reshard = True if system.endswith("-reshard") else k or "auto"
    if k:
        from autoshard.runtime.dist import reshard_groups

        sizes.update({g: k for g in reshard_groups(mesh, (k,)).values()})
    sharded = autoshard(model, mesh=mesh,
                        config=Config(strategy=strategy, reshard_after_forward=reshard))
    opt = torch.optim.AdamW(sharded.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, VOCAB, (args.batch, args.seq + 1), generator=gen)
    for step in range(args.steps):
        last = step == args.steps - 1
        sent = _Sent(sizes, k)
        with sent if last else contextlib.nullcontext():
            loss = _loss(sharded(x[:, :-1]), x[:, 1:])
            loss.backward()
            stored = _stored(sharded, opt)
            opt.step()
            opt.zero_grad()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"system": system, "strategy": sharded.plan.strategy, "sent": sent.bytes,
            "calls": sent.calls, "across": sent.across if k else None, "stored": stored,
            "P": params,
            "predicted_sent": sharded.plan.predicted["sent_bytes"],
            "mesh": tuple(mesh.shape)}


def _hpz(system: str) -> int:
    """K of a "zero3-hpzK" system; 0 for the others."""
    head, _, k = system.partition("-hpz")
    return int(k) if k else 0


def textbook(system, P, mesh) -> tuple:
    """(sent, stored, sent across K-groups or None) per rank per step, fp32 AdamW, for P
    parameter bytes."""
    k = _hpz(system)
    if k:
        n = mesh[0]
        return 2 * P * (n - 1) / n + P * (k - 1) / k, 4 * P / n, 2 * P * (n - k) / n
    return _textbook(system, P, mesh) + (None,)


def _textbook(system, P, mesh) -> tuple:
    system = system.partition("-")[0]
    if system == "hsdp":
        r, s = mesh
        return 3 * P * (s - 1) / s + 2 * (P / s) * (r - 1) / r, 4 * P / s
    n = mesh[0]
    ring = P * (n - 1) / n
    return {"ddp": (2 * ring, 4 * P), "zero1": (2 * ring, 2 * P + 2 * P / n),
            "zero2": (2 * ring, P + 3 * P / n), "zero3": (3 * ring, 4 * P / n)}[system]


def _rank(rank, world, args, store_dir, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    rows = [_system(args.model, s, world, args) for s in args.systems.split(",")]
    if rank == 0:
        torch.save(rows, out)
    dist.destroy_process_group()


def run(args) -> list:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.pt")
        mp.spawn(_rank, args=(args.world_size, args, tmp, out), nprocs=args.world_size)
        return torch.load(out)


def table(rows) -> str:
    out = []
    for r in rows:
        kind = r["strategy"] if r["system"] == "auto" else r["system"]
        sent, stored, across = textbook(kind, r["P"], r["mesh"])
        name = "auto -> " + r["strategy"] if r["system"] == "auto" else r["system"]
        if r["system"].startswith("hsdp"):
            name = r["system"].replace("hsdp", f"hsdp {r['mesh'][0]}x{r['mesh'][1]}")
        cross = (r["across"], round(across), f"{r['across'] / across:.3f}") if across else (
            "-", "-", "-")
        out.append((name, r["sent"], round(sent), f"{r['sent'] / sent:.3f}", *cross,
                    r["calls"], r["stored"], round(stored), f"{r['stored'] / stored:.3f}"))
    return tabulate(out, headers=["strategy", "sent B/rank/step", "textbook", "ratio",
                                  "across groups", "textbook", "ratio", "collectives",
                                  "stored B/rank", "textbook", "ratio"],
                    tablefmt="github")


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.strategies")
    ap.add_argument("--model", default="gpt-small", choices=list(MODELS))
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=4, help="per rank")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--port", type=int, default=29533)
    args = ap.parse_args(argv)
    rows = run(args)
    P = rows[0]["P"]
    print(f"{args.model}: P = {P} parameter bytes (fp32), world size {args.world_size}")
    print(table(rows))


if __name__ == "__main__":
    main()

"""What each rank runs in the fault tests: every rank returns what it saw, errors included."""

from __future__ import annotations

import time

import torch
import torch.nn as nn

from autoshard import AutoshardError, Config, Module, Prefetch, autoshard

_lib = torch.library.Library("autoshard_test", "DEF")
_lib.define("stall(Tensor x, float seconds) -> Tensor")
_lib.impl("stall", lambda x, seconds: (time.sleep(seconds), x.clone())[1],
          "CompositeExplicitAutograd")
torch.library.register_fake("autoshard_test::stall", lambda x, seconds: torch.empty_like(x),
                            lib=_lib)


class Net(nn.Module):
    def __init__(self, stall_s: float = 0.0):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4)
        self.stall_s = stall_s

    def forward(self, x):
        h = torch.tanh(self.a(x))
        if self.stall_s:  # a rank that hangs between two units' all-gathers
            h = h + torch.ops.autoshard_test.stall(h.detach(), self.stall_s)
        return self.b(h)


def _model(timeout=None, stall_s=0.0, compile=False):
    torch.manual_seed(0)
    cfg = Config(policy=Module(classes=["Linear"]), prefetch=False, compile=compile,
                 **({"timeout": timeout} if timeout else {}))
    return autoshard(Net(stall_s), config=cfg)


def _step(model, batch):
    x = torch.randn(batch, 8, generator=torch.Generator().manual_seed(batch))
    model(x).pow(2).mean().backward()


def _outcome(fn):
    try:
        fn()
        return "ok"
    except AutoshardError as e:
        return str(e)


def fault_worker(rank, world, cases):
    """The cases in turn on one model: after each error the ranks are still in step (the
    group is intact), except after the last case."""
    model = _model()
    _step(model, 4)  # step 1 compiles and runs on every rank
    out = {}
    for case in cases:
        r = out[case] = {}
        if case == "partial_batch":  # the last batch is smaller on one rank
            r["error"] = _outcome(lambda: _step(model, 3 if rank == world - 1 else 4))
            r["after"] = _outcome(lambda: _step(model, 4))  # nothing broke: go on
        elif case == "eval_on_rank0":
            def call():
                if rank == 0:
                    model.eval()
                    with torch.no_grad():
                        model(torch.randn(4, 8))
                else:
                    _step(model, 4)
            r["error"] = _outcome(call)
            model.train()
        elif case == "dtype_on_rank1":  # a cast on one rank only: named, not a peer's hang
            if rank == 1:
                model.double()
            r["error"] = _outcome(lambda: _step(model, 4))
            model.float()
            r["after"] = _outcome(lambda: _step(model, 4))
        elif case == "skipped_backward":  # rank 0 runs forward twice, the others once
            def call():
                if rank == 0:
                    model(torch.randn(4, 8))
                _step(model, 4)
            r["error"] = _outcome(call)
            r["after"] = _outcome(lambda: _step(model, 4))  # the counts agree again
        elif case == "refused_sync":
            r.update(_refused_sync(rank))
    return out


def _refused_sync(rank):
    """Two steps accumulate without gradient sync; the synchronised step is refused (rank 1
    runs a second forward where rank 0 runs its backward); the next matching step reduces
    all three batches' gradients, as a run without the refusal does."""
    grads, errors = [], []
    for refuse in (True, False):
        model = _model()
        model.set_requires_gradient_sync(False)
        _step(model, 4)
        _step(model, 5)
        model.set_requires_gradient_sync(True)
        if refuse:
            errors.append(_outcome(lambda: _step(model, 6) if rank == 0 else
                                   [model(torch.ones(6, 8)) for _ in range(2)]))
        _step(model, 6)
        grads.append([p.grad.full_tensor() for p in model.parameters()])
    same = all(torch.equal(a, b) for a, b in zip(*grads))
    return {"error": errors[0], "after": "ok" if same else f"gradients differ: {grads}"}


def hang_worker(rank, world, case):
    """Rank 1 stops answering: before a step (it sleeps) or inside one (the stall op).
    Inside: rank 1 also starts late, past the timeout, which bounds collectives, not the
    ranks meeting; "inside-compiled": the same in inductor's code (Config(compile=True)).
    "own-group:<case>": the ranks make the process group themselves, with a timeout of 3 s,
    and leave Config.timeout at its default (300 s)."""
    import torch.distributed as dist

    from autoshard.core import _compat

    timeout = 3.0
    own = case.startswith("own-group:")
    if own:
        case = case.split(":")[1]
        _own_group(rank, world, timeout)
    if case.startswith("inside"):
        if rank == 1 and not own:
            time.sleep(timeout + 2)
        model = _model(None if own else timeout, stall_s=6.0 if rank == 1 else 0.0,
                       compile=case == "inside-compiled")
        t0 = time.perf_counter()
        err = _outcome(lambda: _step(model, 4))
    else:
        model = _model(None if own else timeout)
        _step(model, 4)
        if rank == 1:
            time.sleep(6.0)
        t0 = time.perf_counter()
        err = _outcome(lambda: _step(model, 4))
    return {"error": err, "seconds": time.perf_counter() - t0,
            "group_timeout": _compat.group_timeout_s(dist.group.WORLD, "cpu")}


def _own_group(rank, world, timeout_s):
    """The process group a user makes before autoshard(), with a timeout of its own; its
    store waits longer, so that ranks may start at different times."""
    import datetime
    import os

    import torch.distributed as dist

    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=rank == 0, timeout=datetime.timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))


class Stack(nn.Module):
    def __init__(self, layers: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(layers))
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


def _loss(model, x):
    return model(x).pow(2).mean()


def _grads(model) -> dict:
    """The full gradient of every parameter (a sharded model's gathered from its shards)."""
    return {f: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            for f, p in model.named_parameters()}


def _same_as_eager(rank, world, xs, models=1):
    """``models`` sharded models trained interleaved (each forward, then one backward of
    their summed losses, then each optimizer) on this rank's ``xs[step][rank]``, and eager
    copies on the whole batch: each rank's losses, and whether gradients and parameters equal
    eager's (NaN where eager's are NaN). Not ``harness.train``: several models step together
    from one backward of their summed losses, which is the case under test."""
    eager, sharded = [], []
    for k in range(models):
        torch.manual_seed(k)
        eager.append(Net())
        torch.manual_seed(k)
        sharded.append(autoshard(Net(), config=Config(policy=Module(classes=["Linear"]))))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in eager + sharded]
    out = {"losses": [], "eager_losses": [], "equal": True}
    for batch in xs:
        losses = [_loss(m, batch[rank]) for m in sharded]
        sum(losses).backward()
        eager_losses = [_loss(m, torch.cat(batch)) for m in eager]
        sum(eager_losses).backward()
        for e, s in zip(eager, sharded):
            got = _grads(s)
            for f, g in _grads(e).items():
                out["equal"] &= torch.allclose(got[f], g, atol=1e-6, equal_nan=True)
        for opt in opts:
            opt.step()
            opt.zero_grad()
        out["losses"].append([t.item() for t in losses])
        out["eager_losses"].append([t.item() for t in eager_losses])
    for e, s in zip(eager, sharded):
        full = s.full_state_dict()
        out["equal"] &= all(torch.allclose(full[k], v, atol=1e-6, equal_nan=True)
                            for k, v in e.state_dict().items())
    return out


def message_worker(rank, world, cases):
    """Mistakes named by their real cause, and inputs trained as eager trains them; each case
    leaves the process group intact for the next."""
    from torch.distributed.tensor import DTensor

    out = {}
    for case in cases:
        r = out[case] = {}
        if case == "config_differs":
            model = Net()
            cfg = Config(policy=Module(classes=["Linear"]), prefetch=Prefetch(depth=2 + rank))
            r["error"] = _outcome(lambda: autoshard(model, config=cfg))
            r["untouched"] = not any(isinstance(p, DTensor) for p in model.parameters())
        elif case == "extra_layer":
            model = Stack(4 if rank == 0 else 3)
            r["error"] = _outcome(lambda: autoshard(model))
        elif case == "first_difference":
            from torch.distributed.device_mesh import init_device_mesh

            from autoshard.runtime.dist import Agreement

            agreement = Agreement(init_device_mesh("cpu", (world,)), 30)
            items = [f"'p.{i}' float32[8]" for i in range(20000)]
            mine = items[:12345] + ["'q' float32[8]"] + items[12346:] if rank else items
            r["at"] = [agreement.first_difference("t", mine),
                       agreement.first_difference("t", items[:len(items) - rank]),
                       agreement.first_difference("t", items)]
        elif case == "int64_input":
            from autoshard.runtime.executor import Program

            runs, run = [], Program.run
            Program.run = lambda self, *a, **k: (runs.append(1), run(self, *a, **k))[1]
            try:
                model = _model()
                try:
                    model(torch.randint(0, 5, (4, 8)))
                    r["error"] = "ok"
                except Exception as e:  # noqa: BLE001 - which kind of error is the question
                    r["error"] = f"{type(e).__name__}: {e}"
                r["ran"] = len(runs)  # programs run (collectives issued) before the error
                r["after"] = _outcome(lambda: _step(model, 4))
            finally:
                Program.run = run
        elif case == "nan_inputs":  # a NaN on rank 0, an infinity on rank 1, then clean
            x = [torch.randn(4, 8, generator=torch.Generator().manual_seed(r))
                 for r in range(world)]
            bad = [t.clone() for t in x]
            bad[0][0, 0], bad[-1][1, 3] = float("nan"), float("inf")
            r.update(_same_as_eager(rank, world, [bad, x]))
        elif case == "empty_batch":  # every rank's batch holds no row, then a full one
            x = [torch.randn(4, 8, generator=torch.Generator().manual_seed(r))
                 for r in range(world)]
            r.update(_same_as_eager(rank, world, [[t[:0] for t in x], x]))
        elif case == "meta_input":
            model = _model()
            r["error"] = _outcome(lambda: model(torch.randn(4, 8, device="meta")))
            r["after"] = _outcome(lambda: _step(model, 4))
        elif case == "two_models":
            x = [[torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * s + r))
                  for r in range(world)] for s in range(3)]
            r.update(_same_as_eager(rank, world, x, models=2))
        elif case == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            ddp = DistributedDataParallel(Net())
            inner = list(ddp.module.parameters())
            try:
                autoshard(ddp)
                r["error"] = "ok"
            except ValueError as e:
                r["error"] = str(e)
            r["untouched"] = (type(ddp) is DistributedDataParallel
                              and all(a is b for a, b in zip(ddp.module.parameters(), inner))
                              and not any(isinstance(p, DTensor) for p in inner))
            model = autoshard(ddp.module)  # what the error says to do
            r["after"] = _outcome(lambda: _step(model, 4))
        elif case == "group_timeouts":  # the group autoshard makes waits Config.timeout
            from torch.distributed.device_mesh import init_device_mesh

            from autoshard.core import _compat

            mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("replicate", "shard"))
            model = autoshard(Net(), mesh=mesh, config=Config(timeout=7))
            r["agreement"] = _compat.group_timeout_s(model._autoshard.agreement.group, "cpu")
    return out


def sigterm_main():
    """Run under torchrun (``torchrun --nproc-per-node 2 fault_workers.py``): after a step,
    rank 1 gets SIGTERM; rank 0 runs the next step and prints what it saw."""
    import os
    import signal
    import sys

    rank = int(os.environ["RANK"])
    model = _model(timeout=20)
    _step(model, 4)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGTERM)
    t0 = time.monotonic()
    err = _outcome(lambda: _step(model, 4))
    print(f"rank {rank} after {time.monotonic() - t0:.1f} s: {err}", flush=True)
    sys.exit(0 if err == "ok" else 1)


if __name__ == "__main__":
    sigterm_main()

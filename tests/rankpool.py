"""Gloo rank processes started once per test session and reused by ``harness.run_ranks``.

Spawning ranks costs seconds a call (every child imports torch, transformers and autoshard
again), and the suite asks for ranks some hundred times. A pool per world size keeps its
processes for the whole session; each call runs in a process group of its own (a new file
store, destroyed after the call), so group names and counters start as in a new process.

Before each call every rank resets what an earlier call could have left in the process:

- the environment, the working directory and ``sys.path`` become the calling test's (a
  spawned rank inherits them when it starts);
- torch's global random state is the one the process started with, Python's and NumPy's are
  seeded anew (as a new process seeds them);
- torch's defaults (dtype, device, grad mode, deterministic algorithms, anomaly detection,
  matmul precision, threads), the warning filters (and with them the once-only warning
  registries), nn.Module's global hooks are those the process started with;
- autoshard's process-wide state (its trace cache, the optimizer-hook and progress switches,
  the warned-about paths) is emptied, and torch.compile's caches are reset.

Every process the tests start for ranks or for jobs beside each other (``context()``) is forked
from one server process per test process, which has imported what they all import (torch's
distributed packages, dynamo, transformers' model base, autoshard): such a process starts in
a fraction of a second, not the ~5 s a new interpreter takes to import them. Each starts with
its parent's environment, working directory and ``sys.path``, as a spawned one does. The
fuzzer's cases (``autoshard.fuzz``) fork from the same server.

Calls that kill a rank, break or replace their group, or whose point is a new process (an
export loaded where its module was never imported, a resume from a checkpoint alone) ask
``run_ranks`` for fresh processes instead. A rank that raises ends its pool: the other ranks
may wait in a collective, so all are killed and the next call starts a new pool; a patch a
call leaves behind when it raises goes with it.
"""

from __future__ import annotations

import atexit
import gc
import multiprocessing.connection as mpc
import multiprocessing.context
import multiprocessing.forkserver
import os
import random
import sys
import tempfile
import traceback
import warnings

import torch
import torch.distributed as dist


# imported once by the server that forks every rank (torch.multiprocessing's "forkserver" too,
# as harness.run_ranks and the fuzzer start fresh ranks; the fuzzer's own list is a part of
# this one); an import that fails is skipped there
PRELOAD = ["torch", "torch.distributed", "torch.distributed.fsdp", "torch._dynamo",
           "transformers.modeling_utils", "autoshard", "autoshard.fuzz"]
multiprocessing.forkserver.set_forkserver_preload(PRELOAD)


def as_a_new_process(env: dict) -> None:
    """What a forked child takes from its parent when it starts: the parent's environment (a
    forked child would have the server's), and random states of its own."""
    os.environ.clear()
    os.environ.update(env)
    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()


class _Process(multiprocessing.context.ForkServerProcess):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._env = dict(os.environ)

    def run(self):
        as_a_new_process(self._env)
        super().run()


class _Context(multiprocessing.context.ForkServerContext):
    Process = _Process


def context() -> multiprocessing.context.BaseContext:
    """The multiprocessing context of every process the tests start (see the module's doc)."""
    return _Context()


class RankFailed(RuntimeError):
    """A pooled rank raised, or exited, during a call."""


class RankPool:
    """``world`` rank processes that run one call at a time (``run``)."""

    _pools: dict = {}

    @classmethod
    def get(cls, world: int) -> "RankPool":
        pool = cls._pools.get(world)
        if pool is None or not pool.alive():
            pool = cls._pools[world] = cls(world)
        return pool

    @classmethod
    def close_all(cls) -> None:
        for pool in cls._pools.values():
            pool.close()
        cls._pools.clear()

    def __init__(self, world: int):
        ctx = context()
        self.world, self.conns, self.procs = world, [], []
        for rank in range(world):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(rank, world, theirs),
                               name=f"autoshard-rank{rank}of{world}")
            proc.start()
            theirs.close()
            self.conns.append(mine)
            self.procs.append(proc)

    def alive(self) -> bool:
        return bool(self.procs) and all(p.is_alive() for p in self.procs)

    def run(self, fn, payload) -> list:
        """``fn(rank, world, payload)`` on every rank; each rank's result."""
        with tempfile.TemporaryDirectory() as tmp:
            task = (fn, payload, dict(os.environ), os.getcwd(), list(sys.path), tmp)
            for conn in self.conns:
                conn.send(task)
            self._wait()
            return [torch.load(os.path.join(tmp, f"result{r}.pt"), weights_only=False)
                    for r in range(self.world)]

    def _wait(self) -> None:
        pending = dict(zip(self.conns, range(self.world)))
        sentinels = {p.sentinel: r for r, p in enumerate(self.procs)}
        while pending:
            ready = mpc.wait(list(pending) + list(sentinels))
            for conn in [c for c in ready if c in pending]:  # messages before exits
                rank = pending.pop(conn)
                try:
                    status, info = conn.recv()
                except EOFError:
                    status, info = "exited", "its connection closed"
                if status != "ok":
                    self.close()
                    raise RankFailed(f"rank {rank} of {self.world} failed:\n{info}")
            dead = [sentinels[s] for s in ready if s in sentinels]
            if dead:
                codes = {r: self.procs[r].exitcode for r in dead}
                self.close()
                raise RankFailed(f"ranks exited during the call (exit codes {codes})")

    def close(self) -> None:
        """Stop every rank: asked to, killed if it does not stop within seconds."""
        for conn in self.conns:
            try:
                conn.send(None)
            except (OSError, ValueError):
                pass
        for proc in self.procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self.conns:
            conn.close()
        self.conns, self.procs = [], []


atexit.register(RankPool.close_all)


def _serve(rank: int, world: int, conn) -> None:
    """A pooled rank: run each task it is sent, until told to stop (None) or orphaned."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    start = _Start()
    while True:
        try:
            task = conn.recv()
        except EOFError:  # the session ended without closing the pool
            return
        if task is None:
            return
        fn, payload, env, cwd, path, tmp = task
        try:
            start.restore(env, cwd, path)
            dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank,
                                    world_size=world)
            out = fn(rank, world, payload)
            torch.save(out, os.path.join(tmp, f"result{rank}.pt"))
            del out
            _barrier(os.path.join(tmp, "done"), world)
            dist.destroy_process_group()
            gc.collect()  # sharded modules of the call die: autoshard's hooks go with them
        except BaseException:  # noqa: BLE001 - the parent reports it and ends the pool
            conn.send(("error", traceback.format_exc()))
            return
        conn.send(("ok", None))


def _barrier(path: str, world: int) -> None:
    """Wait for every rank through a store of its own, not through the call's process group.

    A call may leave that group failed on purpose (a test of a refused collective), and gloo's
    barrier waits on the group's earlier work, so it would raise that failure again, or not,
    depending on whether the failed work had been retired yet.
    """
    store = dist.FileStore(path, world)
    if store.add("arrived", 1) == world:
        store.set("go", "1")
    store.wait(["go"])


class _Start:
    """What the process held when it started, to give every call the same."""

    def __init__(self):
        import torch.nn.modules.module as nn_module

        self.rng = torch.get_rng_state()
        self.filters = list(warnings.filters)
        self.defaults = [(getter, setter, getter()) for getter, setter in _DEFAULTS]
        self.hooks = {name: dict(getattr(nn_module, name)) for name in _NN_HOOKS}

    def restore(self, env: dict, cwd: str, path: list) -> None:
        import torch.nn.modules.module as nn_module

        os.environ.clear()
        os.environ.update(env)
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        os.chdir(cwd)
        sys.path[:0] = [p for p in path if p not in sys.path]
        torch.set_rng_state(self.rng)
        random.seed()
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()
        for _, setter, value in self.defaults:
            setter(value)
        warnings.filters[:] = self.filters
        warnings._filters_mutated()  # forget which once-only warnings were shown
        for name, saved in self.hooks.items():
            hooks = getattr(nn_module, name)
            hooks.clear()
            hooks.update(saved)
        _reset_autoshard()
        if "torch._dynamo" in sys.modules:
            torch._dynamo.reset()


_DEFAULTS = [
    (torch.get_default_dtype, torch.set_default_dtype),
    # a CPU default device is no default device: setting it would add a TorchFunctionMode
    (torch.get_default_device,
     lambda d: torch.set_default_device(None if d == torch.device("cpu") else d)),
    (torch.is_grad_enabled, torch.set_grad_enabled),
    (torch.are_deterministic_algorithms_enabled, torch.use_deterministic_algorithms),
    (torch.is_anomaly_enabled, torch.set_anomaly_enabled),
    (torch.get_float32_matmul_precision, torch.set_float32_matmul_precision),
    (torch.get_num_threads, torch.set_num_threads),
]
_NN_HOOKS = ("_global_forward_pre_hooks", "_global_forward_hooks",
             "_global_forward_hooks_always_called", "_global_forward_hooks_with_kwargs",
             "_global_backward_pre_hooks", "_global_backward_hooks",
             "_global_module_registration_hooks", "_global_parameter_registration_hooks",
             "_global_buffer_registration_hooks")


def _reset_autoshard() -> None:
    """autoshard's process-wide state as a new process has it (for the modules imported)."""
    mods = sys.modules
    if "autoshard.core.graph" in mods:
        mods["autoshard.core.graph"]._TRACES.clear()
    if "autoshard.core.progress" in mods:
        mods["autoshard.core.progress"]._enabled = None
        mods["autoshard.core.progress"]._stack.clear()
    if "autoshard.runtime.optim" in mods:
        optim = mods["autoshard.runtime.optim"]
        optim._enabled = None
        optim._sync_hooks()
    if "autoshard.runtime.commit" in mods:
        mods["autoshard.runtime.commit"]._warned.clear()

"""The device mesh: the default one, and where a rank's tensors live."""

from __future__ import annotations

import atexit
import datetime
import hashlib
import os
import time
import warnings
import weakref
from collections.abc import Mapping

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401  (before any group exists: see release_at_exit)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from autoshard.core import _compat
from autoshard.core.errors import AutoshardError
from autoshard.runtime.tensor_parallel import split_mesh

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_said_single = False

# What autoshard lets go of at exit (release_at_exit), all weakly held: the process groups it
# created, the agreements holding one, and the meshes it shards over
_made_groups: list = []  # weakref.ref to each group
_agreements = weakref.WeakSet()
_meshes = weakref.WeakValueDictionary()  # id(mesh) -> mesh (a mesh hashes by value)
_at_exit = False
# hpZ groups autoshard created: (the mesh's ranks, k) -> this rank's group of k, destroyed
# by release_at_exit
_reshard: dict = {}
# the default process group DTensor's caches were last emptied under (forget_earlier_meshes)
_cached_under = None


def default_mesh(timeout_s: float = 300) -> DeviceMesh:
    """A 1-D mesh over the default process group, initialising one if needed.

    With no process group but a torchrun environment, the group is initialised (NCCL when
    CUDA is available, gloo otherwise); with neither, a one-rank group is made and autoshard
    says once that it runs as world size 1.
    """
    global _said_single
    cuda = torch.cuda.is_available()
    if not dist.is_initialized():
        present = [v for v in _TORCHRUN_VARS if v in os.environ]
        if present and len(present) < len(_TORCHRUN_VARS):
            missing = [v for v in _TORCHRUN_VARS if v not in os.environ]
            raise AutoshardError(
                f"the distributed environment is incomplete: {', '.join(present)} set but "
                f"{', '.join(missing)} missing. Launch with torchrun --nproc-per-node N "
                "script.py, or call torch.distributed.init_process_group() yourself before "
                "autoshard()."
            )
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        backend = "nccl" if cuda else "gloo"
        if present:
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            dist.init_process_group(backend, store=_rendezvous_store(rank, world, timeout_s),
                                    rank=rank, world_size=world,
                                    timeout=datetime.timedelta(seconds=timeout_s))
            track(group=dist.group.WORLD)
        else:
            if not _said_single:
                warnings.warn(
                    "autoshard: no process group and no torchrun environment; running as world "
                    "size 1. Launch with torchrun --nproc-per-node N to shard across N ranks.",
                    stacklevel=3,
                )
                _said_single = True
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                    timeout=datetime.timedelta(seconds=timeout_s))
            track(group=dist.group.WORLD)
    return init_device_mesh(mesh_device_type(), (dist.get_world_size(),))


def forget_earlier_meshes() -> None:
    """Empty DTensor's caches (``_compat.forget_dtensor_meshes``) when the default process
    group is another one than at the last call: destroyed and initialised again since (a
    notebook that starts over, a process that runs one job after another). The caches
    compare meshes by value, so what they kept names the meshes of the earlier group, whose
    groups are gone: a model sharded now would get such a mesh back from the first DTensor
    op on its parameters (making them), and fail at its first collective on them
    (``full_tensor()``, the optimizer's, a checkpoint's)."""
    global _cached_under
    if not dist.is_initialized():
        return
    world = dist.group.WORLD
    if _cached_under is None or _cached_under() is not world:
        _compat.forget_dtensor_meshes()
        _cached_under = weakref.ref(world)


def mesh_device_type(group=None) -> str:
    """Where a mesh over ``group`` (default: the world) keeps its ranks' tensors: on the GPU
    when CUDA is there and the group moves GPU tensors (NCCL, or torch's fake process group,
    whose collectives take any tensor and which faked worlds use to measure a GPU's memory at
    a larger world size), else on the CPU (gloo)."""
    backend = str(dist.get_backend(group))
    return "cuda" if torch.cuda.is_available() and ("nccl" in backend or backend == "fake") \
        else "cpu"


def track(*, group=None, mesh=None, agreement=None) -> None:
    """Note a process group autoshard created, a mesh it shards over, or an agreement, for
    ``release_at_exit`` (registered with ``atexit`` on the first call)."""
    global _at_exit
    if not _at_exit:
        atexit.register(release_at_exit)
        _at_exit = True
    if group is not None:
        _made_groups.append(weakref.ref(group))
    if mesh is not None:
        _meshes[id(mesh)] = mesh
    if agreement is not None:
        _agreements.add(agreement)


def release_at_exit() -> None:
    """Destroy the process groups autoshard created, and let go of every group destroyed by
    then (by this or by the user), while the interpreter still runs (``atexit``).

    A gloo worker thread frees what its collective held (the tensors, and the Python state
    captured with it: the context torch keeps in thread-local state during backward) after
    the collective completes, and freeing it takes the GIL. Once Python has begun to
    finalise, a thread that takes the GIL is ended by ``pthread_exit``, whose unwinding
    through the worker's C++ frames calls ``std::terminate``: the process aborts
    ("terminate called without an active exception") although the script ended normally.
    Freeing a group joins its worker threads; so each group is freed here, before
    finalisation, which needs every reference to it gone: an agreement's and a mesh's
    (``_compat.drop_destroyed_groups``), and ``torch.distributed.nn``'s, whose functions take
    the default group as a default argument when imported after it exists (this module
    imports it first). A group the user created is the user's to destroy
    (``dist.destroy_process_group()`` at the end of the script, as torch asks); autoshard
    then lets go of it here. A broken group (a timed-out peer) is freed as any other.

    Nothing is freed while a collective of a step is still unwaited (an error interrupted
    the step): freeing its group would wait for it, up to the group's timeout, and a rank
    that failed must exit at once, so that torchrun stops the others."""
    if _compat.collectives_in_flight():
        return
    for agreement in list(_agreements):
        own, agreement._own = agreement._own, None
        if own is not None and _compat.group_alive(own):
            _destroy(own)
    for key, group in list(_reshard.items()):
        del _reshard[key]
        if _compat.group_alive(group):
            _destroy(group)
    world = dist.group.WORLD if dist.is_initialized() else None
    if world is not None and any(r() is world for r in _made_groups):
        _destroy(None)
    for mesh in list(_meshes.values()):
        _compat.drop_destroyed_groups(mesh)


def _destroy(group) -> None:
    try:
        dist.destroy_process_group(group)
    except Exception as e:  # noqa: BLE001  (at exit: say so, free the rest)
        warnings.warn(f"autoshard: destroying a process group at exit failed: {e}")


RENDEZVOUS_S = 600  # how long ranks may take to start and meet, whatever Config.timeout is


def _rendezvous_store(rank: int, world: int, timeout_s: float):
    """torchrun's store (MASTER_ADDR:MASTER_PORT), as ``env://`` makes it: a client of the
    elastic agent's store where torchrun hosts one, else hosted by rank 0. Its timeout is
    the rendezvous's, not the collectives': with ``Config(timeout=3)`` a rank that takes
    longer than 3 s to import and start must still find the others."""
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    return dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
        is_master=rank == 0 and not agent,
        timeout=datetime.timedelta(seconds=max(timeout_s, RENDEZVOUS_S)),
        **({} if agent else {"multi_tenant": True}))


def mesh_device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def spawn_ranks(world: int, fn, *args) -> None:
    """``fn(rank, world, *args)`` on ``world`` gloo ranks spawned on this machine (the
    command line's multi-rank commands); ``fn`` writes what it returns to files. Each rank
    destroys its process group when ``fn`` returns, and exits as a script does."""
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_spawned, args=(world, fn, args, tmp), nprocs=world, join=True)


def _spawned(rank: int, world: int, fn, args, tmp: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank,
                            world_size=world)
    fn(rank, world, *args)
    dist.barrier()
    dist.destroy_process_group()


def group_name(mesh: DeviceMesh):
    """The process group name of a 1-D mesh, or a tuple of one per dimension."""
    if mesh.ndim == 1:
        return mesh.get_group().group_name
    return tuple(mesh.get_group(d).group_name for d in range(mesh.ndim))


def reshard_groups(mesh: DeviceMesh, sizes) -> dict:
    """hpZ: for each group size k in ``sizes`` (each dividing the shard dimension's size),
    the name of this rank's group of k consecutive ranks of the mesh's shard dimension, as
    FSDP2 lays out its post-forward mesh (``mesh.mesh.view(-1, k)``: on a 2-D mesh, within
    each replica). Each group is made once per mesh and k (then reused) by the ranks in it
    alone (``use_local_synchronization``: ranks outside the mesh, or in other groups, take no
    part), every rank asking for the sizes in the same order; they are destroyed at exit."""
    names = {}
    if not sizes:
        return names
    ranks = mesh.mesh.flatten().tolist()
    me = dist.get_rank()
    for k in sorted(sizes):
        key = (tuple(ranks), k, mesh.device_type)
        group = _reshard.get(key)
        if group is None or not _compat.group_alive(group):
            row = next(r for r in mesh.mesh.reshape(-1, k).tolist() if me in r)
            group = _reshard[key] = dist.new_group(row, use_local_synchronization=True)
            track()
        names[k] = group.group_name
    return names


def shard_rank(mesh: DeviceMesh) -> int:
    """This rank's coordinate on the mesh's last (shard) dimension: which rows it stores."""
    return mesh.get_local_rank(mesh.ndim - 1)


# the meshes autoshard takes, by their dimension names: hybrid sharding's (FSDP2's, and
# torchtitan's spelling), and those with a tensor-parallel dimension after the data-parallel ones
HYBRID = (("replicate", "shard"), ("dp_replicate", "dp_shard"))
WITH_TP = (("dp", "tp"), ("dp_shard", "tp"), ("shard", "tp"), ("replicate", "shard", "tp"),
           ("dp_replicate", "dp_shard", "tp"))


def _accepted_meshes() -> str:
    return ("a 1-D mesh (sharding), a 2-D one named " + " or ".join(map(str, HYBRID)) +
            " (hybrid sharding: shard within a group, replicate across groups), or one with "
            "a tensor-parallel dimension last: " + ", ".join(map(str, WITH_TP)))


def check_mesh(mesh: DeviceMesh, partial_ok: bool) -> None:
    """Refuse a mesh autoshard cannot shard over, saying what to pass instead: a 1-D mesh,
    a 2-D hybrid one (``HYBRID``'s names), or one with a "tp" dimension (``WITH_TP``); a 1-D
    mesh over fewer ranks than the world unless ``partial_ok`` (``Config.partial_mesh``)."""
    names = tuple(mesh.mesh_dim_names or ())
    if mesh.ndim > 1 and names not in HYBRID + WITH_TP:
        raise ValueError(
            f"autoshard takes {_accepted_meshes()}; got a {mesh.ndim}-D mesh "
            f"{tuple(mesh.shape)} named {mesh.mesh_dim_names}. Build it with "
            "init_device_mesh(device, shape, mesh_dim_names=...), e.g. (groups, "
            "ranks_per_group) named ('replicate', 'shard'); for pipeline parallelism pass "
            "only the data-parallel dimensions")
    world = dist.get_world_size() if dist.is_initialized() else mesh.size()
    if mesh.ndim == 1 and mesh.size() < world and not partial_ok:
        raise ValueError(
            f"the 1-D mesh covers {mesh.size()} of the {world} ranks: the ranks outside it "
            "would train their own copy, and nothing would keep the copies equal. To "
            "replicate across groups pass the 2-D mesh init_device_mesh(device, "
            f"({world // mesh.size()}, {mesh.size()}), mesh_dim_names=('replicate', 'shard')) "
            "(hybrid sharding); if separate copies are intended (e.g. pipeline stages), "
            "pass Config(partial_mesh=True)")


def data_parallel_mesh(mesh: DeviceMesh, tensor_parallel) -> DeviceMesh:
    """The mesh autoshard shards over: ``mesh`` itself; for one with a "tp" dimension and a
    tensor-parallel plan (``Config.tensor_parallel`` as a dict), the dimensions before "tp";
    with ``"off"``, the same ranks with the "tp" dimension folded into
    the shard dimension: ("dp", "tp") becomes one dimension over all its ranks, and
    ("replicate", "shard", "tp") the hybrid mesh ("replicate", "shard") with groups of
    shard x tp ranks. Every rank of ``mesh`` calls it (a folded mesh makes its groups)."""
    if tuple(mesh.mesh_dim_names or ())[-1:] != ("tp",):
        if not isinstance(tensor_parallel, str):
            raise ValueError(
                "Config.tensor_parallel is a tensor-parallel plan, and the mesh has no 'tp' "
                f"dimension (it is named {mesh.mesh_dim_names}); pass a mesh whose last "
                "dimension is 'tp', e.g. init_device_mesh(device, (dp, tp), "
                "mesh_dim_names=('dp', 'tp'))")
        return mesh
    if isinstance(tensor_parallel, Mapping):  # the data-parallel dimensions, "tp" beside
        return split_mesh(mesh)[0]
    if tensor_parallel != "off":
        raise ValueError(
            f"Config.tensor_parallel={tensor_parallel!r} on a mesh with a 'tp' dimension "
            f"({dict(zip(mesh.mesh_dim_names, mesh.shape))}): the planner does not choose "
            "tensor parallelism in this version of autoshard. Pass a plan, e.g. "
            "Config(tensor_parallel={'mlp.up': ColwiseParallel(), 'mlp.down': "
            "RowwiseParallel()}), or Config(tensor_parallel='off'): the 'tp' "
            "dimension then shards as FSDP does (the parameters sharded over all "
            f"{mesh.size()} ranks), training as the same model does on a mesh without it")
    groups = mesh.mesh.reshape(-1, mesh.shape[-2] * mesh.shape[-1])
    if mesh.ndim == 2:
        return DeviceMesh(mesh.device_type, groups.reshape(-1), mesh_dim_names=("shard",))
    return DeviceMesh(mesh.device_type, groups, mesh_dim_names=HYBRID[0])


_NOTE_BYTES = 2048  # on a mismatch, each rank's description (UTF-8, truncated)


class Agreement:
    """Every collective autoshard runs outside its compiled graphs goes through here: in
    ``autoshard()`` (the Config and the parameters), before a forward (its input signature),
    before a backward, after compiling (the schedule), and before a ZeRO-1 call, which
    replicas to gather again (``any``).
    All ranks all-gather a digest of what they are about to do; on a mismatch a second
    all-gather exchanges what each rank described, and every rank raises ``AutoshardError``
    naming them. Because every agreement has the same size and kind, a rank that is at
    another one (a rank that compiles while the others run) meets it here, never in a
    collective of a program: a mismatch is an error on every rank, not a process abort.

    On CPU meshes the mesh's own (gloo) group carries it; on CUDA a gloo group over the same
    ranks, so that reading the answer never waits for the GPU stream.
    """

    def __init__(self, mesh: DeviceMesh, timeout_s: float):
        self.mesh, self.world, self.timeout_s = mesh, mesh.size(), timeout_s
        self.ranks = mesh.mesh.flatten().tolist()  # every rank of the mesh, in mesh order
        self.rank = self.ranks.index(dist.get_rank()) if dist.is_initialized() else 0
        self.step = 0  # forward calls so far on this rank
        self._own = None  # the gloo group this agreement created, on a CUDA or 2-D mesh
        # torch's fake process group (memory studies of a large world in one process) has no
        # peers to agree with, and its all-gathers return nothing
        self.fake = dist.is_initialized() and dist.get_backend(mesh.get_group(0)) == "fake"
        track(mesh=mesh)

    @property
    def group(self):
        """The mesh's own group on a 1-D CPU mesh (looked up, not kept: it is not this
        agreement's to hold), else the gloo group this agreement created on first use."""
        if self.mesh.device_type == "cpu" and self.mesh.ndim == 1:
            return self.mesh.get_group()
        if self._own is None:
            self._own = dist.new_group(self.ranks, backend="gloo",
                                       timeout=datetime.timedelta(seconds=self.timeout_s))
            track(agreement=self)
        return self._own

    def __call__(self, what: str, detail: str = "", exact: str = "", explain=None,
                 flag: bool = False) -> bool:
        """Check that every rank is at ``what`` (which names the step and what it runs).
        ``detail`` (shapes and the like) is shown for each rank on a mismatch; ``exact`` is
        compared too but not shown. ``explain``: when every rank is at ``what`` but they
        differ, ``explain(details)`` (each rank's ``detail``, in mesh order) returns the
        error's text in place of the advice about steps; it runs on every rank, so it may
        exchange more (``notes``, ``first_difference``). Returns whether any rank set
        ``flag`` (carried beside the digest, as ``any`` carries its flags: no exchange more).
        ``detail`` and ``exact`` may be functions that return them: with one rank nothing is
        compared, so they are not built (a step's call describes its inputs this way)."""
        if self.world == 1 or self.fake:
            return flag
        detail, exact = (x() if callable(x) else x for x in (detail, exact))
        mine = f"{what}{': ' + detail if detail else ''}"
        head = hashlib.sha256(f"{mine}\0{exact}".encode()).digest()[:16]
        bits = bytes([int(flag)]).ljust(16, b"\0")
        got = self._gather(torch.tensor(list(head + bits), dtype=torch.uint8), what)
        if len({g[:16] for g in got}) > 1:
            self._differ(what, mine, explain)
        return any(g[16] for g in got)

    def any(self, what: str, flags: list) -> list:
        """``flags`` (booleans, the same number on every rank) ORed over the ranks: which
        any rank set. One agreement of the same size and kind as every other: its first 16
        bytes name ``what`` (a rank at another agreement is an error on every rank, as in
        ``__call__``), the other 16 carry flag i in bit i mod 128 (flags sharing a bit are
        set together, which only ever sets more)."""
        if self.world == 1 or self.fake:
            return list(flags)
        bits = bytearray(16)
        for i, f in enumerate(flags):
            if f:
                bits[i % 128 // 8] |= 1 << (i % 8)
        head = hashlib.sha256(what.encode()).digest()[:16]
        got = self._gather(torch.tensor(list(head + bits), dtype=torch.uint8), what)
        if len({g[:16] for g in got}) > 1:
            self._differ(what, what)
        merged = [0] * 16
        for g in got:
            merged = [a | b for a, b in zip(merged, g[16:])]
        return [bool(merged[i % 128 // 8] >> (i % 8) & 1) for i in range(len(flags))]

    def notes(self, what: str, mine: str) -> list:
        """Every rank's ``mine`` (its first 2048 bytes of UTF-8), in mesh order: one
        all-gather, which every rank must reach with the same ``what``."""
        note = mine.encode()[:_NOTE_BYTES].ljust(_NOTE_BYTES, b"\0")
        got = self._gather(torch.tensor(list(note), dtype=torch.uint8), what)
        return [n.rstrip(bytes(1)).decode(errors="replace") for n in got]

    def first_difference(self, what: str, items: list):
        """The first index at which the ranks' ``items`` (strings) differ, a list that ends
        there counting as different; the same answer on every rank, or None where none
        differ. Each round compares digests of up to 128 equal slices of the range still in
        question (one 2048-byte note): two rounds for 16384 items, after one for the
        lengths."""
        hi = max(int(n) for n in self.notes(what, str(len(items))))
        lo, width = 0, 16  # hex digits of a slice's digest
        while hi > lo:
            size = -(-(hi - lo) // (_NOTE_BYTES // width))
            starts = range(lo, hi, size)
            mine = "".join(hashlib.sha256(repr(items[s:s + size]).encode()).hexdigest()[:width]
                           for s in starts)
            notes = self.notes(what, mine)
            k = next((k for k in range(len(starts))
                      if len({n[k * width:(k + 1) * width] for n in notes}) > 1), None)
            if k is None:
                return None
            lo, hi = starts[k], min(starts[k] + size, hi)
            if size == 1:
                return lo
        return None

    def _differ(self, what: str, mine: str, explain=None) -> None:
        """The ranks disagree: exchange what each describes and raise; ``explain``'s text
        where every rank is at ``what``, else the ranks are at different steps."""
        notes = self.notes(what, mine)
        if explain is not None and all(n == what or n.startswith(f"{what}: ") for n in notes):
            raise AutoshardError(explain([n[len(what) + 2:] for n in notes]))
        lines = "\n".join(f"  rank {r}: {n}" for r, n in enumerate(notes))
        raise AutoshardError(
            f"the ranks are not at the same step (rank {self.rank} reports this; nothing of "
            f"the step ran, and the process group is intact):\n{lines}\nEvery rank must call "
            "the model, and backward(), equally often and with inputs of the same shapes, "
            "dtypes and structure, in the same mode (train/eval, grad, autocast): drop or "
            "pad a partial last batch (DataLoader(drop_last=True)), and run evaluation on "
            "every rank or on an unsharded copy.")

    def waited(self, elapsed_s: float, mesh: bool = False) -> str:
        """How long a failed collective waited, as a message says it, from ``elapsed_s``
        measured around it: the timeout of the group it ran on (the agreement's, or with
        ``mesh`` the mesh's, which run the programs' collectives), which ``Config.timeout``
        sets only for the groups autoshard creates; or that it failed sooner."""
        groups = ([self.mesh.get_group(d) for d in range(self.mesh.ndim)] if mesh
                  else [self.group])
        device = self.mesh.device_type if mesh else "cpu"
        found = [_compat.group_timeout_s(g, device) for g in groups]
        if None in found:  # torch does not say: what was measured
            return (f"after {elapsed_s:.1f} s (Config.timeout={self.timeout_s:g} applies if "
                    "autoshard created the process group)")
        timeout = max(found)
        own = ("" if timeout == self.timeout_s else
               f" (the process group's own timeout; Config.timeout={self.timeout_s:g} sets "
               "only a group autoshard creates)")
        if elapsed_s < 0.9 * timeout:
            return f"after {elapsed_s:.1f} s, before the timeout of {timeout:g} s{own}"
        return f"within {timeout:g} s{own}"

    def _gather(self, mine: torch.Tensor, what: str) -> list:
        out = torch.empty(self.world * mine.numel(), dtype=torch.uint8)
        start = time.monotonic()
        try:
            _compat.all_gather_tensor(out, mine, group=self.group)
        except RuntimeError as e:  # DistBackendError too: a timeout or a lost peer
            peers = [r for r in range(self.world) if r != self.rank]
            raise AutoshardError(
                f"rank {self.rank}: no answer from peer ranks {peers} "
                f"{self.waited(time.monotonic() - start)} at the agreement before {what} "
                "(autoshard's check that all ranks are at the same step, before any "
                "collective of it): a rank stopped, hangs, or failed earlier.\n  "
                f"{str(e).splitlines()[0][:300]}") from e
        return [bytes(c.tolist()) for c in out.split(mine.numel())]

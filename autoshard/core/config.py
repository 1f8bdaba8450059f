"""User-facing configuration of a sharded model."""

from __future__ import annotations

import dataclasses
import datetime
import functools
import types
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Optional, Sequence, Union

from torch.distributed.fsdp import CPUOffloadPolicy  # Offload is one

from autoshard.core.config_history import moved_kwargs, offload_from_dict, regrouped
from autoshard.core.cost import PROFILES, DeviceProfile
from autoshard.core.options import (Bucket, Module, Offload, Prefetch, Size, check_flag,
                                    check_one_of, check_size)
from autoshard.core.spec import STRATEGIES

if TYPE_CHECKING:  # the fields' annotations only
    from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy

POLICIES = ("auto", "module", "size", "per-parameter", "whole-model")
OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 1, "none": 0}  # state tensors per parameter
PREFER = ("auto", "balanced", "memory", "speed")  # Config.prefer

# the longest Config.timeout: a week, far below what gloo's and NCCL's timers can hold
# (gloo refuses about 9.2e12 s, where its microseconds pass an int64's range)
MAX_TIMEOUT_S = 7 * 24 * 3600


@dataclasses.dataclass(frozen=True)
class Config:
    """How autoshard shards and schedules a model. Frozen: every field is checked once, here;
    ``dataclasses.replace(config, field=...)`` makes a changed copy, checked again. The names
    it gives (module classes, a module pattern, units' parameters, recompute's blocks) are
    checked against the model by ``autoshard()`` and ``plan()`` (``check_names``). An option
    that matters only when another is on lives inside the value that turns it on:
    ``policy=Module(classes=...)``, ``prefetch=Prefetch(depth=...)``,
    ``bucket=Bucket(bytes=...)``, ``offload_policy=Offload(state=...)``.

    The fields follow, by group: a group is a title underlined with dashes, a field is
    ``name: meaning`` with its continuation lines indented, and ``- `` starts an item of a
    list. ``python -m autoshard.front._reference`` writes docs/config.md from this text.

    Units
    -----
    policy: how units are chosen when ``units`` is None:
        - "auto" (default): minimise predicted step time within ``memory_budget``;
        - "module" or ``Module(classes=None, pattern=None)``: each repeated block of a
          ModuleList/Sequential is a unit, the remaining parameters a root unit. ``classes``:
          the class names (or classes) whose modules are units instead; ``pattern``: a
          regular expression, and every module whose path it matches whole
          (``re.fullmatch``) is a unit instead ("module" is ``Module()``);
        - "size" or ``Size(min_numel=10**8)``: parameters in first-use order, grouped until
          a unit holds ``min_numel`` elements, the last unit perhaps fewer ("size" is
          ``Size()``);
        - "per-parameter": one unit per parameter;
        - "whole-model": one unit.
    units: explicit (pinned) units, each a list of parameter FQNs; the rest form a root unit.
        They override any policy; ``plan.pinned_units()`` gives a plan's units in this form.
    memory_budget: bytes per rank the plan may use ("80GiB", "512MB" and 1e9 are accepted);
        default: the device's memory (the device profile's ``memory``).
    device_profile: cost-model profile name ("h100", "h200", "a100", "cpu") or a
        ``DeviceProfile`` (``autoshard.core.cost.calibrate()`` measures one); default: on CUDA
        "h200" for an H200, else "h100", with the memory the device reports; "cpu"
        otherwise.
    optimizer: whose state the memory model counts ("adamw", "adam", "sgd", "none").
    prefer: what the planner trades when plans differ in speed and memory:
        - "auto" (default): "memory" where the device is the host (the "cpu" profile: its
          memory is the machine's, shared with everything else), "balanced" on a device
          with memory of its own (the GPU profiles), where memory under the budget buys
          nothing;
        - "balanced": among the plans that fit, those predicted no slower than FSDP2's plan
          for the same model (below) and to peak no higher, where one is (a peak above it
          by under 0.1% of ``memory_budget`` counts as no higher: a GPU's own peak moves by
          more); of them the fastest, then the lightest predicted within 2% of its step;
        - "memory": the fastest plan predicted to peak at most 0.82x as high as FSDP2's plan
          (0.85x less the error of that prediction) and to take at most 1.25x its step;
          where none is, the fastest. The plan says why when the fastest plan's peak is above
          that (``plan.choice``);
        - "speed": the fastest plan that fits ``memory_budget``, however heavy.
        FSDP2's plan is one unit per repeated block plus the root, resharded after the
        forward but the root, no recomputation, prefetch of one, predicted once per plan.
        Graphs too big to search whole (``autoshard.passes.auto.BIG_GRAPH`` nodes) are
        planned for speed.

    Strategy and resharding
    -----------------------
    strategy: how parameters, gradients and optimizer state are spread over the mesh's
        shard dimension (every flavour replicates across a 2-D mesh's "replicate" dimension,
        as HSDP does, and keeps the same state-dict keys and global shapes, so a checkpoint
        saved under one loads under another):
        - "zero3" (default): all three sharded; parameters gathered for each use (FSDP);
        - "zero2": all three sharded; each unit gathered once per step and kept until its
          backward (FSDP's SHARD_GRAD_OP); ``reshard_after_forward`` must stay "auto";
        - "zero1": parameters kept whole on every rank from step to step (a replica in the
          compute dtype), gradients reduce-scattered, optimizer state sharded; the shards
          the optimizer updated are gathered into the replica before the next call;
        - "ddp": parameters, gradients and optimizer state replicated (DTensor
          Replicate()), gradients all-reduced once per unit (bucket);
        - "auto": the planner predicts "zero1", "zero2" and "zero3" (whose units it may keep
          gathered from forward to backward one by one, as
          ``reshard_after_forward="search"``) and runs the fastest that fits
          ``memory_budget`` (``plan.strategy``).
    reshard_after_forward: free gathered parameters after their forward use and gather them
        again in backward (ZeRO-3):
        - ``True``: for every unit;
        - ``False``: keep every unit gathered from forward to backward;
        - "auto" (default): keep only the unit gathered last in forward, whose backward
          gather would come right after its forward use (FSDP2 keeps its root the same way);
        - an int ``k`` (hpZ, FSDP2's ``reshard_after_forward=k``): after its forward use each
          unit keeps this rank's 1/k of its gathered parameters, the chunk of its position in
          its group of ``k`` consecutive ranks of the shard dimension, and the backward
          all-gathers within that group only (``k`` must divide the shard dimension's size;
          1 means ``True``, the shard size ``False``);
        - "search": the planner's choice per candidate between "auto", ``False`` and one
          hpZ group size (``planner/__init__.py`` says which), the fastest where it is surely
          within the budget (``plan.reshard`` says which).
    partial_mesh: the 1-D mesh covers only some of the ranks on purpose (for example one
        pipeline stage); the ranks outside it train their own copy, and nothing keeps those
        in step. False (default): such a mesh is refused, since replicas across meshes would
        drift apart silently; use a 2-D ("replicate", "shard") mesh for that.
    tensor_parallel: what the mesh's "tp" dimension does (a mesh without one has none):
        - "auto" (default): the planner chooses tensor parallelism per block; not built in
          this version, so a mesh with a "tp" dimension is refused, naming the other two;
        - "off": the "tp" dimension shards as FSDP does: a ("dp", "tp") mesh shards over
          all its ranks, a ("replicate", "shard", "tp") one is hybrid sharding with groups
          of shard x tp ranks; the model trains as on a mesh without it;
        - ``{module pattern: ParallelStyle}`` in ``torch.distributed.tensor.parallel``'s
          own vocabulary (``{"layers.*.attention.wq": ColwiseParallel(), ...}``), taken as
          given: ``parallelize_module`` applies it over "tp", then FSDP shards over the
          dimensions before it (docs/tensor_parallel.md). ``ColwiseParallel`` and
          ``RowwiseParallel`` on Linear and Embedding layers.

    Communication
    -------------
    prefetch: issue each unit's all-gather ahead of its use, and defer each reduce-scatter's
        wait to the next one:
        - True (default): as ``Prefetch()``;
        - ``Prefetch(depth=2, bytes=None)``: an all-gather is issued up to ``depth`` units
          ahead, at most (as deep as the cost model says hiding it takes), with at most
          ``bytes`` gathered bytes in flight (a size, as ``memory_budget``; None: no byte
          bound);
        - False: neither.
    bucket: merge adjacent small units into one collective:
        - None (default): on, as ``Bucket()``, for the "per-parameter" policy with no
          ``units`` only ("auto" already sizes units for time within the memory budget;
          other policies are the user's choice of units), off otherwise;
        - True: on, as ``Bucket()``;
        - ``Bucket(bytes=None)``: on, merging the units smaller than ``bytes`` (a size, as
          ``memory_budget``); None: the size below which a collective is latency-bound under
          the cost model;
        - False: off.
    gradient_divide_factor: FSDP2's ``set_gradient_divide_factor``: each reduced gradient is
        the sum over the ranks divided by this (1.0: the sum, for a loss summed rather than
        averaged over the global batch) instead of their mean. None (default): the mean.
        ``ShardedModule.set_gradient_divide_factor`` changes it after ``autoshard()``.
    force_sum_reduction_for_comms: FSDP2's switch of the same name: the collectives sum, and
        the division (by the factor, or by the ranks for the mean) is a step of its own.
    timeout: seconds (or a ``datetime.timedelta``) any rank waits for the others at one
        collective before autoshard raises an error naming it: the timeout of the process
        group autoshard creates when there is none (default 300 s, at most a week; torch's
        own default is 30 minutes); ranks still get 10 minutes to start and meet. A group
        you created keeps the timeout you gave it.

    Memory: recomputation and offload
    ---------------------------------
    recompute: which activations cross from forward to backward:
        - True (default): a minimum cut over the forward graph picks what to save, and cheap
          ops (pointwise, views, normalisations) between it and the backward run again
          there; where no plan fits ``memory_budget`` so, the first 1/4, 1/2, 3/4 or all of
          the repeated blocks are also recomputed whole (the fastest of these that fits);
        - False: what eager autograd saves;
        - "blocks": every repeated block is recomputed whole in backward (as if each ran
          under torch.utils.checkpoint): only its input is saved, at the price of its
          forward again;
        - "auto": a plan decision per repeated block among these three, the fastest that
          fits ``memory_budget`` (the plan lists the candidates);
        - {block path: "keep" | "min-cut" | "block" | "offload"}: per block, as
          ``plan.pinned_recompute()`` gives it (blocks not named: the min cut; "offload":
          the min cut, its saved activations kept in host memory, see
          ``offload_activations``; ``"*": "offload"``: every saved activation offloaded).
    offload_activations: whether saved activations may wait for the backward in host
        memory: copied to the host after their last forward read and back before their
        first backward read (graph nodes that prefetch moves, run beside the compute on a
        GPU), per repeated block (its min cut's saved set), the first blocks in forward order
        first:
        - None (default): a plan choice beside recomputation, on a device profile with a
          host link (``DeviceProfile.host_bandwidth`` > 0): the first 1/4, 1/2, 3/4 or all
          of the blocks offloaded (the fastest plan that fits wins; with ``recompute=True``
          tried, as whole-block recomputation is, only when the min cut fits nowhere). Never
          where the host is the device (a CPU): it would save nothing;
        - True: every repeated block's saved activations are offloaded (with the min cut;
          needs ``recompute`` True or "auto");
        - False: never.
    offload_policy: where the sharded state lives:
        - ``torch.distributed.fsdp.CPUOffloadPolicy()``: every sharded parameter, its
          gradient shard and its optimizer state in host memory, as FSDP2 does: each shard is
          copied to the device before its all-gather and each gradient shard back to the host
          after its reduce-scatter (explicit graph nodes), so the optimizer steps on the host.
          Scalars stay on the device. It is ``Offload()``;
        - ``Offload(state=None, params=None, pin_memory=True)``: autoshard's
          ``CPUOffloadPolicy``, with two fractions. ``state``: of the sharded state kept in
          host memory, by elements, the last parameters in the model's order first (their
          copies come where compute hides them); the rest, with its optimizer step, stays on
          the device, as ZeRO-Offload's partial offload does; None: all of it, as FSDP2.
          ``params``: of the units resharded after the forward (the first in forward order),
          those whose shards are copied to the device again for the backward's all-gather;
          the other units hold the forward's copy (in the compute dtype) on the device until
          then: one copy per shard per step, the optimizer state and its step on the host, as
          ZeRO-Offload does. 1.0: every all-gather copies its shards in, as FSDP2's
          CPUOffloadPolicy does; 0.0: none again; rounded to whole units. None: per
          candidate grouping the planner takes the least of 0, 1/4, 1/2, 3/4 and 1 whose
          plan fits (by bisection, as peaks fall along them);
        - ``OffloadPolicy()``: none;
        - None (default): none, unless nothing fits on the device: then the planner keeps
          as little of the state in host memory as fits (the least of 1/4, 1/2, 3/4 and 1
          of it), and the plan records that fraction (``plan.offload``;
          ``Offload(state=plan.offload)`` pins it).

    Precision and execution
    -----------------------
    mp_policy: ``torch.distributed.fsdp.MixedPrecisionPolicy``, read as FSDP2 reads it:
        each shard is cast to ``param_dtype`` before its all-gather and the step computes with
        the gathered ``param_dtype`` parameters; gradients are reduce-scattered in
        ``reduce_dtype`` (default: ``param_dtype``) and land on the shards in their own dtype,
        so the sharded parameters and the optimizer state keep theirs (fp32 masters);
        ``output_dtype`` casts the model's floating outputs; ``cast_forward_inputs`` casts
        its floating tensor inputs to ``param_dtype``. Buffers are not cast. Default: none.
    compile: run the forward and backward graphs through inductor (torch.compile's compiler;
        C++ kernels on CPU, Triton on CUDA), each compiled on its first call, with the
        collectives inside the compiled code in the plan's order (checked on the generated
        code; see ``autoshard.runtime.inductor``). The plan is the same; the first call of
        each input signature takes longer. Default False: the graphs run as fx code.
    verify: run the verifier after every pass (always on in tests and under AUTOSHARD_DEBUG).
    """

    policy: Union[str, Module, Size] = "auto"
    units: Optional[Sequence[Sequence[str]]] = None
    memory_budget: Union[int, str, None] = None
    device_profile: Union[str, DeviceProfile, None] = None
    optimizer: str = "adamw"
    reshard_after_forward: Union[bool, int, str] = "auto"
    bucket: Union[bool, Bucket, None] = None
    prefetch: Union[bool, Prefetch] = True
    recompute: Union[bool, str, dict] = True
    offload_activations: Optional[bool] = None
    verify: bool = False
    timeout: Union[float, int, datetime.timedelta] = 300
    mp_policy: Optional[MixedPrecisionPolicy] = None
    offload_policy: Optional[OffloadPolicy] = None
    strategy: str = "zero3"
    partial_mesh: bool = False
    tensor_parallel: Union[str, Mapping] = "auto"
    compile: bool = False
    gradient_divide_factor: Optional[float] = None
    force_sum_reduction_for_comms: bool = False
    prefer: str = "auto"

    def __post_init__(self):
        """Check every field once, in this order, normalising what it stores."""
        self._check_choices()
        self._check_flags()
        self._check_numbers()
        self._check_offload()
        self._check_profile_and_names()

    @property
    def policy_name(self) -> str:
        """The policy's name: "module" for ``Module(...)``, "size" for ``Size(...)``."""
        return {Module: "module", Size: "size"}.get(type(self.policy), self.policy)

    @property
    def policy_options(self) -> Union[Module, Size, None]:
        """The options of the "module" or "size" policy (``Module()`` for "module", ``Size()``
        for "size"); None for the policies that take none."""
        if isinstance(self.policy, (Module, Size)):
            return self.policy
        return {"module": Module, "size": Size}.get(self.policy, lambda: None)()

    @property
    def prefetch_options(self) -> Optional[Prefetch]:
        """How prefetch runs (``Prefetch()`` for True); None when it is off."""
        if isinstance(self.prefetch, Prefetch):
            return self.prefetch
        return Prefetch() if self.prefetch else None

    @property
    def bucket_options(self) -> Optional[Bucket]:
        """How bucketing runs (``Bucket()`` for True, and for None under the per-parameter
        policy with no explicit units); None when it is off."""
        if isinstance(self.bucket, Bucket):
            return self.bucket
        on = self.bucket if self.bucket is not None else (
            self.units is None and self.policy == "per-parameter")
        return Bucket() if on else None

    @property
    def offload_options(self) -> Optional[Offload]:
        """The offload asked for, as an ``Offload`` (``CPUOffloadPolicy(pin_memory=p)`` is
        ``Offload(pin_memory=p)``); None when ``offload_policy`` keeps the state on the
        device (or leaves it to the planner)."""
        policy = self.offload_policy
        if isinstance(policy, Offload):
            return policy
        if isinstance(policy, CPUOffloadPolicy):
            return Offload(pin_memory=bool(policy.pin_memory))
        return None

    def _check_choices(self) -> None:
        """The fields that take one of a few values, and how they combine."""
        if not isinstance(self.policy, (Module, Size)):
            check_one_of("policy", self.policy, POLICIES,
                    ", Module(classes=..., pattern=...), Size(min_numel=...), or pass "
                    "explicit units=[[fqn, ...], ...]")
        check_one_of("optimizer", self.optimizer, tuple(OPTIMIZER_STATES))
        if isinstance(self.tensor_parallel, Mapping):
            # a read-only copy: the caller's dict may change, and the Config may not
            self._set("tensor_parallel", types.MappingProxyType(dict(self.tensor_parallel)))
        else:
            check_one_of("tensor_parallel", self.tensor_parallel, ("auto", "off"),
                         ", or {module pattern: ParallelStyle} (torch.distributed.tensor."
                         "parallel's vocabulary)")
        check_one_of("prefer", self.prefer, PREFER)
        raf = self.reshard_after_forward
        if not isinstance(raf, int) or isinstance(raf, bool) or raf < 1:
            check_one_of("reshard_after_forward", raf, (True, False, "auto", "search"),
                    ", or an int k >= 1 dividing the shard dimension's size (hpZ: groups of k "
                    "ranks)")

        check_one_of("strategy", self.strategy, STRATEGIES)
        if self.strategy == "zero2" and self.reshard_after_forward != "auto":
            raise ValueError(
                f"Config(strategy='zero2') keeps every unit gathered from forward to backward; "
                f"reshard_after_forward={self.reshard_after_forward!r} says otherwise. Leave "
                "it at 'auto', or use strategy='zero3' to choose per unit")

    def _check_flags(self) -> None:
        """The switches (``prefetch`` and ``bucket`` with their options), and ``recompute``
        (a choice or a per-block dict)."""
        for name in ("verify", "partial_mesh", "compile", "force_sum_reduction_for_comms"):
            check_flag(name, getattr(self, name))
        if not isinstance(self.prefetch, (bool, Prefetch)):
            raise TypeError("Config.prefetch must be True, False or Prefetch(depth=..., "
                            f"bytes=...), got {self.prefetch!r}")
        if self.bucket is not None and not isinstance(self.bucket, (bool, Bucket)):
            raise TypeError("Config.bucket must be True, False, Bucket(bytes=...) or None (on "
                            f"for the per-parameter policy only), got {self.bucket!r}")
        if isinstance(self.recompute, Mapping):
            _recompute_blocks(self.recompute)
            # a read-only copy: the caller's dict may change, and the Config may not
            self._set("recompute", types.MappingProxyType(dict(self.recompute)))
        else:
            check_one_of("recompute", self.recompute, (True, False, "blocks", "auto"),
                    " or {block path: 'keep' | 'min-cut' | 'block' | 'offload'}")
        check_one_of("offload_activations", self.offload_activations, (None, True, False))
        if self.offload_activations and not (self.recompute is True
                                             or self.recompute == "auto"):
            raise ValueError(
                f"Config(offload_activations=True) offloads the activations the min cut saves "
                f"in each block; recompute={self.recompute!r} leaves no such choice. Use "
                "recompute=True or 'auto', or name the blocks to offload in a recompute dict "
                "({path: 'offload'})")

    def _check_numbers(self) -> None:
        """The budget, the timeout and the divide factor: in range, normalised."""
        self._set("memory_budget", check_size("memory_budget", self.memory_budget))
        if isinstance(self.timeout, datetime.timedelta):
            self._set("timeout", self.timeout.total_seconds())
        if isinstance(self.timeout, bool) or not isinstance(self.timeout, (int, float)) or not (
                0 < self.timeout <= MAX_TIMEOUT_S):
            raise ValueError(f"Config.timeout must be a positive number of seconds, at most "
                             f"{MAX_TIMEOUT_S} (a week), or a datetime.timedelta of that, got "
                             f"{self.timeout!r}")
        f = self.gradient_divide_factor
        if f is not None:
            if isinstance(f, bool) or not isinstance(f, (int, float)) or not (
                    0 < f <= sys.float_info.max):  # finite, as a float
                raise ValueError(f"Config.gradient_divide_factor must be a positive number "
                                 f"(each reduced gradient is the ranks' sum divided by it; 1.0: "
                                 f"the sum) or None for the mean, got {f!r}")
            self._set("gradient_divide_factor", float(f))

    def _check_offload(self) -> None:
        """The precision and offload policies (an ``Offload`` checked its fractions when
        built), and offload against the strategy."""
        _mp_policy(self.mp_policy)
        _offload_policy(self.offload_policy)
        if offloads(self) and self.strategy in ("ddp", "zero1"):
            raise ValueError(
                f"Config(strategy={self.strategy!r}) keeps every parameter whole on the device; "
                "offload_policy=CPUOffloadPolicy() moves sharded state to the host. Use "
                "strategy='zero3' or 'zero2' with offload")

    def _check_profile_and_names(self) -> None:
        """The device profile and the units (the module policy checked its names when
        built)."""
        if self.device_profile is not None:
            if not isinstance(self.device_profile, DeviceProfile):
                check_one_of("device_profile", self.device_profile, tuple(PROFILES),
                        ", a DeviceProfile (autoshard.core.cost.calibrate()) or None")
        if self.units is not None:
            self._set("units", _units(self.units))

    def _set(self, name: str, value) -> None:
        """Store a normalised value while ``__post_init__`` checks the fields."""
        object.__setattr__(self, name, value)

    def to_dict(self) -> dict:
        """Plain JSON data (an export's record of how it was planned); ``from_dict`` reads it.
        Policies and options are written by their fields (a policy's with its "name"), a
        device profile by name or by its numbers."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if self.units is not None:
            d["units"] = [list(u) for u in self.units]
        if isinstance(self.policy, Module):
            classes = self.policy.classes
            d["policy"] = {"name": "module", "classes": None if classes is None
                           else list(classes), "pattern": self.policy.pattern}
        elif isinstance(self.policy, Size):
            d["policy"] = {"name": "size", "min_numel": self.policy.min_numel}
        for name in ("bucket", "prefetch"):
            if dataclasses.is_dataclass(d[name]):
                d[name] = dataclasses.asdict(d[name])
        if isinstance(self.recompute, types.MappingProxyType):
            d["recompute"] = dict(self.recompute)
        mp = self.mp_policy
        if mp is not None:
            d["mp_policy"] = {"param_dtype": _dtype_name(mp.param_dtype),
                              "reduce_dtype": _dtype_name(mp.reduce_dtype),
                              "output_dtype": _dtype_name(mp.output_dtype),
                              "cast_forward_inputs": mp.cast_forward_inputs}
        if self.offload_policy is not None:
            d["offload_policy"] = {"cpu": bool(offloads(self)),
                                   "pin_memory": getattr(self.offload_policy, "pin_memory",
                                                         False)}
            if isinstance(self.offload_policy, Offload):
                d["offload_policy"].update(state=self.offload_policy.state,
                                           params=self.offload_policy.params)
        if self.device_profile is not None and not isinstance(self.device_profile, str):
            d["device_profile"] = self.device_profile.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Config":
        """The Config ``to_dict`` wrote; a dict with the flat fields of earlier versions
        (``prefetch_depth``, ``offload_state``, ...) is read in the shape they now have."""
        import torch
        from torch.distributed.fsdp import MixedPrecisionPolicy

        d = regrouped(d)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown Config fields {unknown}: written by a newer autoshard?")
        policy = d.get("policy")
        if isinstance(policy, dict):
            options = {k: v for k, v in policy.items() if k != "name"}
            kind = {"module": Module, "size": Size}.get(policy.get("name"))
            if kind is None:
                raise ValueError(f"Config.policy: a record of {policy!r} names no policy with "
                                 "options ('module' or 'size'): written by a newer autoshard?")
            d["policy"] = kind(**options)
        for name, option in (("bucket", Bucket), ("prefetch", Prefetch)):
            if isinstance(d.get(name), dict):
                d[name] = option(**d[name])
        mp = d.get("mp_policy")
        if mp is not None:
            d["mp_policy"] = MixedPrecisionPolicy(
                **{k: getattr(torch, v) if k.endswith("dtype") and v is not None else v
                   for k, v in mp.items()})
        if d.get("offload_policy") is not None:
            d["offload_policy"] = offload_from_dict(d["offload_policy"])
        prof = d.get("device_profile")
        if isinstance(prof, dict):
            d["device_profile"] = DeviceProfile(**prof)
        return cls(**d)


_dataclass_init = Config.__init__


@functools.wraps(_dataclass_init)
def _init(self, *args, **kwargs):
    _dataclass_init(self, *args, **moved_kwargs(kwargs))


def _frozen(self, name: str, value=None):
    raise dataclasses.FrozenInstanceError(
        f"Config is frozen: Config.{name} cannot change after Config(...) checked it; make a "
        f"changed copy with dataclasses.replace(config, {name}=...)")


# dataclass(frozen=True) writes these itself, so the message that says how to change a field
# replaces them after the class is built
Config.__setattr__ = _frozen
Config.__delattr__ = _frozen
# the flat names of earlier versions are refused naming their new place, not as unknown
Config.__init__ = _init


def _dtype_name(dtype):
    return None if dtype is None else str(dtype).replace("torch.", "")


def _mp_policy(policy) -> None:
    if policy is None:
        return
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if not isinstance(policy, MixedPrecisionPolicy):
        raise TypeError("Config.mp_policy must be a torch.distributed.fsdp.MixedPrecisionPolicy "
                        f"(e.g. MixedPrecisionPolicy(param_dtype=torch.bfloat16, "
                        f"reduce_dtype=torch.float32)) or None, got {policy!r}")
    import torch

    for field in ("param_dtype", "reduce_dtype", "output_dtype"):
        d = getattr(policy, field)
        if d is not None and not (isinstance(d, torch.dtype) and d.is_floating_point):
            raise ValueError(f"Config.mp_policy.{field} must be a floating dtype such as "
                             f"torch.bfloat16, or None, got {d!r}")


def _offload_policy(policy) -> None:
    from torch.distributed.fsdp import OffloadPolicy

    if policy is not None and not isinstance(policy, OffloadPolicy):
        raise TypeError("Config.offload_policy must be a torch.distributed.fsdp "
                        "CPUOffloadPolicy() (or OffloadPolicy() for none), an autoshard "
                        f"Offload(state=..., params=...) or None, got {policy!r}")


def offloads(config) -> float:
    """The fraction of the sharded state ``config`` keeps in host memory (0.0: none)."""
    off = config.offload_options
    if off is None:
        return 0.0
    return 1.0 if off.state is None else float(off.state)


def _recompute_blocks(modes: dict) -> None:
    for path, mode in modes.items():
        if not isinstance(path, str) or mode not in ("keep", "min-cut", "block", "offload"):
            raise ValueError(f"Config.recompute: {path!r}: {mode!r} is not accepted; map "
                             "repeated-block paths (e.g. 'blocks.0') to 'keep', 'min-cut', "
                             "'block' or 'offload'")


def _units(units) -> list:
    shape_msg = ("Config.units must be a list of lists of parameter FQNs, e.g. "
                 "[['layers.0.weight', 'layers.0.bias'], ['layers.1.weight']]")
    if isinstance(units, (str, bytes)) or not isinstance(units, (list, tuple)):
        raise TypeError(f"{shape_msg}; got {units!r}")
    out, seen = [], {}
    for i, u in enumerate(units):
        if isinstance(u, (str, bytes)) or not isinstance(u, (list, tuple)) or not all(
                isinstance(f, str) for f in u):
            raise TypeError(f"{shape_msg}; units[{i}] is {u!r}")
        if not u:
            raise ValueError(f"Config.units[{i}] is empty; every unit names at least one "
                             "parameter (leave parameters out and they form a root unit)")
        for f in u:
            if f in seen:
                raise ValueError(f"Config.units: parameter {f!r} is in units[{seen[f]}] and "
                                 f"units[{i}]; each parameter belongs to one unit")
            seen[f] = i
        out.append(tuple(u))
    return tuple(out)  # tuples: a frozen Config holds nothing that changes in place


def reshard_group_size(setting, shard_size: int):
    """``Config.reshard_after_forward`` on a shard dimension of ``shard_size`` ranks: an int
    ``k`` becomes ``True`` (k = 1), ``False`` (k = the shard size) or stays ``k``; other
    settings are returned as they are. ``ValueError`` naming the value and the shard size
    when ``k`` does not divide it."""
    if isinstance(setting, bool) or not isinstance(setting, int):
        return setting
    if setting < 1 or shard_size % setting:
        divisors = [d for d in range(1, shard_size + 1) if shard_size % d == 0]
        raise ValueError(
            f"Config.reshard_after_forward={setting} must divide the shard dimension's size "
            f"{shard_size} (hpZ groups of k consecutive ranks of it); accepted: "
            f"{', '.join(map(str, divisors))}, True, False, 'auto' or 'search'")
    return True if setting == 1 else False if setting == shard_size else setting


def reshard_group_sizes(setting, shard_size: int, ranks_per_node: int = 0) -> tuple:
    """The hpZ group sizes a plan under ``setting`` may use on a shard dimension of
    ``shard_size`` ranks: an int's own (if neither 1 nor the shard size); for "search",
    every divisor ``k`` with ``1 < k < shard_size`` (and ``k <= ranks_per_node`` when that
    is known, so the backward all-gather stays within a node); none otherwise."""
    k = reshard_group_size(setting, shard_size)
    if not isinstance(k, bool) and isinstance(k, int):
        return (k,)
    if setting != "search":
        return ()
    return tuple(d for d in range(2, shard_size) if shard_size % d == 0
                 and (ranks_per_node <= 0 or d <= ranks_per_node))

"""One case's training, the same calls on both sides: ``drive(run)`` runs the spec's loop on
a ``ShardedRun`` (one gloo rank, the model under autoshard) or a ``ReferenceRun`` (the
unsharded eager model, fed every rank's batch in turn).

The data, the loss, the optimizers, hooks and the Config a spec asks for are made here,
one way for both sides, so that what ``fuzz.compare`` finds is autoshard's difference.
"""

from __future__ import annotations

import contextlib
import copy
import io
import os
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from autoshard import Config, autoshard, load_checkpoint, save
from autoshard.core._compat import tree_leaves
from autoshard.front.factory import default_inputs, load_factory
from autoshard.fuzz.model import FuzzOutput, block_class, build_model, tensor_parallel_plan
from autoshard.fuzz.spec import (LR, MODULE_CLASSES, SEQ, data_rank, data_world,
                                 module_class_kind)
from autoshard.core.options import Module, Offload, Prefetch


# --- data and loss ----------------------------------------------------------------------------


def _seq(loop: dict, step: int) -> int:
    seq = loop["seq"]
    return SEQ if seq is None else seq[min(step, len(seq) - 1)]


def global_batch(spec: dict, model: nn.Module, step: int, micro: int) -> tuple:
    """(inputs, targets) of every rank at (step, micro), rows rank-major; targets None for a
    factory model (its loss is a fixed projection of the outputs)."""
    loop, world = spec["loop"], data_world(spec)
    rows, seq = world * loop["batch"], _seq(loop, max(step, 0))
    seed = (spec["seed"] * 1_000_003 + (step + 7) * 1_009 + micro) % 2**62
    if "factory" in spec["model"]:
        torch.manual_seed(seed)
        inputs = default_inputs(model, load_factory(spec["model"]["factory"]), rows, seq)
        return (tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)), None
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, spec["model"]["vocab"], (rows, seq + 1), generator=gen)
    return (tokens[:, :-1],), tokens[:, 1:]


def rank_batch(spec: dict, batch: tuple, rank: int) -> tuple:
    inputs, targets = batch
    world = data_world(spec)

    def part(x):
        return x.chunk(world)[rank].contiguous() if isinstance(x, torch.Tensor) else x

    return tuple(part(x) for x in inputs), (None if targets is None else part(targets))


def loss_of(out, targets) -> torch.Tensor:
    """Cross-entropy over the targets; for a factory model (no targets) a fixed random
    projection of every floating output (as ``autoshard.check``'s default loss, but also of
    outputs that need no gradient: an evaluation call's), scaled by their size."""
    if isinstance(out, FuzzOutput):  # model "output": "dataclass": both fields
        return loss_of(out.logits, targets) + 0.01 * out.hidden.float().pow(2).mean()
    if targets is None:
        gen = torch.Generator().manual_seed(0)
        leaves = _float_leaves(out)
        total = sum((t.float() * torch.randn(tuple(t.shape), generator=gen)).sum()
                    for t in leaves)
        return total / max(1, sum(t.numel() for t in leaves)) ** 0.5
    return F.cross_entropy(out.float().reshape(-1, out.shape[-1]), targets.reshape(-1))


def with_written(model: nn.Module, loss: torch.Tensor) -> torch.Tensor:
    """``loss`` plus the auxiliary loss a model "writes" forward set on itself; what it set
    must be real tensors, never the fake ones of a capture."""
    aux = getattr(model, "aux_loss", None)
    if aux is None:
        return loss
    for t in (aux, model.last_hidden):
        if type(t) is not torch.Tensor:
            raise AssertionError(f"forward's write left a {type(t).__name__} in the model")
    return loss + 0.1 * aux


def with_entry(model: nn.Module, loss: torch.Tensor, inputs: tuple, loop: dict):
    """``loss`` plus, with loop "entry", the first block called directly (a submodule's
    forward, an entry of its own) on features made from the tokens."""
    if not loop.get("entry"):
        return loss
    d = model.emb.weight.shape[1]
    h = (inputs[0].unsqueeze(-1).float() + torch.arange(d)) / (2 * d)
    if loop.get("penalty") != "inputs":
        return loss + 0.1 * model.blocks[0](h).float().pow(2).mean()
    h.requires_grad_()
    out = model.blocks[0](h).float()
    g, = torch.autograd.grad(out.sum(), h, create_graph=True)  # WGAN-GP's penalty
    return loss + 0.1 * out.pow(2).mean() + 0.01 * (g.square().sum(-1) - 1).square().mean()


def loop_loss(forward, model: nn.Module, inputs: tuple, targets, loop: dict):
    """One rank's micro-batch loss: ``forward(inputs)``'s, plus what forward wrote, the
    entry's and the penalty; with loop "twice": "forwards", plus a second forward's (on the
    tokens rolled by one), both read by one backward."""
    loss = with_written(model, loss_of(forward(inputs), targets))
    if loop.get("twice") == "forwards":
        again = (inputs[0].roll(1, -1),) + tuple(inputs[1:])
        loss = loss + with_written(model, loss_of(forward(again), targets))
    return with_penalty(model, with_entry(model, loss, inputs, loop), loop)


def with_penalty(model: nn.Module, loss: torch.Tensor, loop: dict) -> torch.Tensor:
    """With loop "penalty": "params": ``loss`` plus a penalty on its parameters' gradients,
    taken with ``create_graph=True`` (the rank's own, as eager's; a double backward reaches
    .grad). ("inputs": ``with_entry`` adds it.)"""
    if loop.get("penalty") != "params":
        return loss
    params = [p for p in model.parameters() if p.requires_grad]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # sharded: this rank's own gradients, said once
        grads = torch.autograd.grad(loss, params, create_graph=True, allow_unused=True)
    return loss + 0.01 * sum((g * g.conj()).real.sum() for g in grads if g is not None)


def loop_backward(model: nn.Module, loss: torch.Tensor, loop: dict) -> None:
    """The micro-batch's backward; with loop "twice": "backwards", a first one with
    ``retain_graph=True`` before it (every gradient twice)."""
    if loop.get("twice") == "backwards":
        loss.backward(retain_graph=True)
    backward_by(model, loss, loop.get("autograd"))


def _evaluating(model: nn.Module, mode: str):
    """An evaluation call's context: "no_grad" in training mode, "eval" in eval mode, and
    "inference" in eval mode under ``torch.inference_mode()``."""
    if mode in ("eval", "inference"):
        model.eval()
    return torch.inference_mode() if mode == "inference" else torch.no_grad()


def block_units(model: nn.Module) -> list:
    """Config "units": "blocks": one explicit unit per block holding parameters."""
    return [[f"blocks.{i}.{n}" for n, _ in block.named_parameters()]
            for i, block in enumerate(model.blocks) if next(block.parameters(), None) is not None]


def _clip_norm(loop: dict) -> float:
    return float("inf") if loop.get("clip_norm") == "inf" else 2.0


def backward_by(model: nn.Module, loss: torch.Tensor, how) -> None:
    """The loop's backward: ``loss.backward()``; with loop "autograd", restricted to every
    parameter but the first: ``backward(inputs=...)``, or ``torch.autograd.grad`` of them
    added to their ``.grad`` by hand (as SAM and gradient-surgery loops do)."""
    params = [p for p in model.parameters() if p.requires_grad][1:]
    if how is None or not params:
        loss.backward()
    elif how == "inputs":
        loss.backward(inputs=params)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # sharded: reduced over the ranks, as .grad is
            grads = torch.autograd.grad(loss, params, allow_unused=True)
        for p, g in zip(params, grads):
            if g is not None:
                p.grad = g if p.grad is None else p.grad + g


def _float_leaves(out) -> list:
    return [t for t in tree_leaves(out)
            if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _scalar(out, targets) -> float:
    """One number for an output (an evaluation call's): its loss."""
    return float(loss_of(out, targets).detach())


def _autocast(loop: dict):
    if loop["precision"] == "autocast_bf16":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _synced(sync: str, micro: int, k: int) -> bool:
    return (micro == k - 1 or sync == "always" or (sync == "first_and_last" and micro == 0))


def _hook_target(model: nn.Module, index: int) -> tuple:
    """The module a hook goes on: the index-th (mod count) module a forward calls."""
    mods = [(n, m) for n, m in model.named_modules()
            if n and not isinstance(m, (nn.ModuleList, nn.ModuleDict))]
    return mods[index % len(mods)]


def _make_optimizers(model: nn.Module, loop: dict):
    """One optimizer (or one per parameter, for in_backward) over ``model``'s parameters,
    grouped by name the same way on both sides."""
    kind, lr = loop["optimizer"], LR[loop["optimizer"]]
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]

    def make(params, lr_, wd):
        if kind == "sgd":
            return torch.optim.SGD(params, lr=lr_, momentum=0.9, weight_decay=wd)
        return torch.optim.AdamW(params, lr=lr_, weight_decay=wd)

    def group_of(name, p):
        return 0 if (p.dim() >= 2 and name.endswith("weight")) else 1

    if kind == "in_backward":
        return {p: make([p], lr * (0.5 if loop["param_groups"] and group_of(n, p) else 1),
                        0.01) for n, p in named}
    if not loop["param_groups"]:
        return make([p for _, p in named], lr, 0.01)
    groups = [{"params": [p for n, p in named if group_of(n, p) == g],
               "lr": lr * (1, 0.5)[g], "weight_decay": (0.1, 0.0)[g]} for g in (0, 1)]
    return make([g for g in groups if g["params"]], lr, 0.01)


# --- one training loop, for both sides --------------------------------------------------------


def _check_pickled_state_dict(model: nn.Module) -> None:
    """``torch.save(sharded.state_dict())`` warns exactly when a tensor in it is this rank's
    shard only (the file then lacks the other ranks' rows), and writes every key."""
    state = model.state_dict()
    partial = any(isinstance(v, DTensor) and v.to_local().shape != v.shape
                  for v in state.values())
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        buf = io.BytesIO()
        torch.save(state, buf)
    said = any("this rank's shards only" in str(w.message) for w in seen)
    if said != partial:
        raise AssertionError(f"torch.save of a state_dict holding shards ({partial}) warned: "
                             f"{said}")
    buf.seek(0)
    if list(torch.load(buf, weights_only=True)) != list(state):
        raise AssertionError("torch.save of a sharded state_dict lost keys")


@contextlib.contextmanager
def _anomaly(loop: dict):
    """With loop "anomaly": ``torch.autograd.detect_anomaly()`` (its checks read values)."""
    if not loop.get("anomaly"):
        yield
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Anomaly Detection has been enabled"
        with torch.autograd.detect_anomaly():
            yield


def drive(run) -> None:
    """The case's training loop, the same calls in the same order on the sharded ranks and
    the reference (``run`` is a ``ShardedRun`` or a ``ReferenceRun``)."""
    loop = run.spec["loop"]
    k = loop["accumulate"]
    if loop["warmup"]:
        run.evaluate(-1, loop["warmup"])
    for step in range(loop["steps"]):
        if loop["hook"] is not None and loop["hook"]["at"] == step:
            run.add_hook(loop["hook"])
        for micro in range(k):
            with _anomaly(loop):
                run.micro(step, micro, _synced(loop["sync"], micro, k))
        if loop["optimizer"] != "in_backward":
            if loop["clip"] is not None:
                run.clip(loop["clip"])
            run.step()
        if loop["eval"]:
            run.evaluate(step, loop["eval"])
        ck = loop["checkpoint"]
        if ck is not None and step == ck["at"]:
            run.save()
        if ck is not None and step == ck["at"] + 1:
            run.load()
        rank_local = loop.get("rank_local")  # absent from specs older than it
        if rank_local is not None and step == rank_local["at"]:
            run.note(step)
    # the probe: one synchronised backward whose gradients are compared, with no step after
    # (an optimizer stepped in backward steps in it, on both sides)
    run.micro(loop["steps"], 0, True)


class ShardedRun:
    def __init__(self, spec: dict, rank: int, tmp: str):
        self.spec, self.rank, self.tmp = spec, rank, tmp
        self.records = []
        self.hook_values = []
        model = build_model(spec)
        mesh = None
        kwargs = config_kwargs(spec)
        if spec["mesh"] == "hsdp":
            mesh = init_device_mesh("cpu", (2, spec["world"] // 2),
                                    mesh_dim_names=("replicate", "shard"))
        elif spec["mesh"] in ("dp-tp", "tp-plan"):
            mesh = init_device_mesh("cpu", (spec["world"] // 2, 2), mesh_dim_names=("dp", "tp"))
            # its "tp" dimension sharded over as FSDP does, or a plan over it
            kwargs["tensor_parallel"] = "off" if spec["mesh"] == "dp-tp" else \
                tensor_parallel_plan(model, spec["seed"])
        if spec["config"].get("units") == "blocks":
            kwargs["units"] = block_units(model)
        self.model = autoshard(model, mesh=mesh, config=Config(**kwargs))
        self.opt = _make_optimizers(self.model, spec["loop"])
        if spec["loop"]["optimizer"] == "in_backward":
            for p, opt in self.opt.items():
                p.register_post_accumulate_grad_hook(_step_in_backward(opt))

    def _batch(self, step, micro):
        return rank_batch(self.spec, global_batch(self.spec, self.model, step, micro),
                          data_rank(self.spec, self.rank))

    def micro(self, step, micro, sync):
        if self.spec["loop"]["accumulate"] > 1:
            self.model.set_requires_gradient_sync(sync)
        inputs, targets = self._batch(step, micro)
        loop = self.spec["loop"]
        with _autocast(loop):
            loss = loop_loss(lambda x: self.model(*x), self.model, inputs, targets, loop)
        loop_backward(self.model, loss, loop)
        _no_graph_in_grads(self.model)
        self.records.append(("loss", step, micro, loss.item()))

    def evaluate(self, step, mode):
        inputs, targets = self._batch(step, 97)
        with _evaluating(self.model, mode), _autocast(self.spec["loop"]):
            value = _scalar(self.model(*inputs), targets)
        self.model.train()
        self.records.append((mode, step, 0, value))

    def clip(self, max_norm):
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm,
                                              norm_type=_clip_norm(self.spec["loop"]))
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        self.records.append(("clip", -1, 0, float(norm)))

    def step(self):
        self.opt.step()
        self.opt.zero_grad(set_to_none=self.spec["loop"]["zero_grad"] == "none")

    def add_hook(self, hook):
        _, module = _hook_target(self.model, hook["target"])
        module.register_forward_hook(_forward_hook(hook["kind"], self.hook_values))

    def save(self):
        opt = None if isinstance(self.opt, dict) else self.opt
        save(os.path.join(self.tmp, "ckpt"), self.model, opt)
        _check_pickled_state_dict(self.model)

    def note(self, step):
        """Rank 0 alone changes a plain attribute forward reads, computing nothing with it:
        every rank must capture the step again and train on as before."""
        if self.rank == 0:
            self.model.notes.append(step)

    def load(self):
        opt = None if isinstance(self.opt, dict) else self.opt
        load_checkpoint(os.path.join(self.tmp, "ckpt"), self.model, opt)

    def finish(self) -> dict:
        full = {k: v.detach().clone() for k, v in self.model.full_state_dict().items()}
        grads = {}
        for name, p in self.model.named_parameters():
            g = p.grad
            if g is not None and hasattr(g, "full_tensor"):
                g = g.full_tensor()
            grads[name] = None if g is None else g.detach().clone()
        buffers = {n: b.detach().clone() for n, b in self.model.named_buffers()}
        return {"records": self.records, "hooks": self.hook_values,
                "params": full if self.rank == 0 else None,
                "grads": grads if self.rank == 0 else None, "buffers": buffers}


def _no_graph_in_grads(model: nn.Module) -> None:
    """A gradient never carries an autograd graph after backward (as eager's never does);
    one that did would keep the step's activations alive until ``zero_grad``."""
    for name, p in model.named_parameters():
        g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
        if g is not None and (g.requires_grad or g.grad_fn is not None):
            raise AssertionError(f"the gradient of {name} carries an autograd graph after "
                                 "backward")


def _step_in_backward(opt):
    def hook(p):
        opt.step()
        opt.zero_grad()
    return hook


def _forward_hook(kind: str, values: list):
    """"observe": records the output's norm on every call, returns None; "modify": returns
    the output halved, and records nothing (a hook that returns a value is traced into the
    step, where its Python side effects run at capture only, and a Python float of a tensor
    is refused there)."""
    def hook(module, args, output):
        if not isinstance(output, torch.Tensor):
            return None
        if kind == "modify":
            return output * 0.5
        values.append(float(output.detach().float().norm()))
        return None
    return hook


class ReferenceRun:
    """The unsharded eager twin: every micro-batch runs each rank's rows in turn, with that
    rank's buffers, and backpropagates the ranks' losses summed and divided as the reduction
    does (their mean, or by ``gradient_divide_factor``)."""

    def __init__(self, spec: dict):
        self.spec = spec
        self.world = data_world(spec)
        self.model = build_model(spec)
        self.records = []
        self.hook_values = [[] for _ in range(self.world)]
        self.current = 0
        self.buffers = [{n: b.detach().clone() for n, b in self.model.named_buffers()}
                        for _ in range(self.world)]
        self.opt = _make_optimizers(self.model, spec["loop"])
        self.divide = spec["config"]["gradient_divide_factor"] or float(self.world)
        self.mp = spec["config"]["mp"] == "bf16"

    def _forward(self, rank, inputs):
        """The model on one rank's inputs with that rank's buffers; under the bf16 policy
        with its parameters cast to bf16 as the all-gather does (gradients flow back to the
        float32 parameters through the cast)."""
        self.current = rank
        for name, value in self.buffers[rank].items():
            mod, _, attr = name.rpartition(".")
            self.model.get_submodule(mod)._buffers[attr] = value
        if not self.mp:
            return self.model(*inputs)
        params = {n: (p.to(torch.bfloat16) if p.is_floating_point() else p)
                  for n, p in self.model.named_parameters()}
        return torch.func.functional_call(self.model, params, inputs)

    def _batches(self, step, micro):
        batch = global_batch(self.spec, self.model, step, micro)
        return [rank_batch(self.spec, batch, r) for r in range(self.world)]

    def micro(self, step, micro, sync):
        total, values, loop = 0.0, [], self.spec["loop"]
        for rank, (inputs, targets) in enumerate(self._batches(step, micro)):
            with _autocast(loop):
                loss = loop_loss(lambda x: self._forward(rank, x), self.model, inputs, targets,
                                 loop)
            values.append(loss.item())
            total = total + loss
        loop_backward(self.model, total / self.divide, loop)
        self.records.append(("loss", step, micro, values))
        if self.spec["loop"]["optimizer"] == "in_backward" and sync:
            for p, opt in self.opt.items():
                if p.grad is not None:
                    opt.step()
                    opt.zero_grad()

    def evaluate(self, step, mode):
        values = []
        for rank, (inputs, targets) in enumerate(self._batches(step, 97)):
            with _evaluating(self.model, mode), _autocast(self.spec["loop"]):
                values.append(_scalar(self._forward(rank, inputs), targets))
        self.model.train()
        self.records.append((mode, step, 0, values))

    def clip(self, max_norm):
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm,
                                              norm_type=_clip_norm(self.spec["loop"]))
        self.records.append(("clip", -1, 0, [float(norm)] * self.world))

    def step(self):
        self.opt.step()
        self.opt.zero_grad(set_to_none=self.spec["loop"]["zero_grad"] == "none")

    def add_hook(self, hook):
        _, module = _hook_target(self.model, hook["target"])
        run = self

        values = [[] for _ in range(self.world)]
        self.hook_values = values if hook["kind"] == "observe" else self.hook_values

        class _Current(list):  # the list of the rank whose rows run now
            def append(self, v):
                values[run.current].append(v)

        module.register_forward_hook(_forward_hook(hook["kind"], _Current()))

    def note(self, step):
        """Nothing: rank 0's change computes nothing, so eager trains on as before."""

    def save(self):
        self.saved = (copy.deepcopy(self.model.state_dict()),
                      None if isinstance(self.opt, dict) else copy.deepcopy(self.opt.state_dict()),
                      [{n: b.clone() for n, b in mine.items()} for mine in self.buffers])

    def load(self):
        """Back to the saved state; each rank loads its own buffers (a checkpoint holds each
        rank's copy, and the load is at the world size that saved it)."""
        model_state, opt_state, buffers = self.saved
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                p.copy_(model_state[name])
        if opt_state is not None:
            self.opt.load_state_dict(opt_state)
        self.buffers = [{n: b.clone() for n, b in mine.items()} for mine in buffers]

    def finish(self) -> dict:
        params = {k: v.detach().clone() for k, v in self.model.state_dict().items()
                  if k not in dict(self.model.named_buffers())}
        grads = {n: None if p.grad is None else p.grad.detach().clone()
                 for n, p in self.model.named_parameters()}
        return {"records": self.records, "hooks": self.hook_values, "params": params,
                "grads": grads, "buffers": self.buffers}


def config_kwargs(spec: dict) -> dict:
    """The spec's Config fields as ``Config(**...)`` takes them."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

    c = dict(spec["config"])
    out = {k: c[k] for k in ("strategy", "policy", "recompute", "bucket",
                             "reshard_after_forward", "gradient_divide_factor",
                             "force_sum_reduction_for_comms", "verify")}
    prefetch = c["prefetch"]
    if isinstance(prefetch, str):  # a byte bound
        out["prefetch"] = Prefetch(bytes=prefetch)
    elif isinstance(prefetch, int) and not isinstance(prefetch, bool):  # a depth
        out["prefetch"] = Prefetch(depth=prefetch)
    else:
        out["prefetch"] = prefetch
    if c["policy"] == MODULE_CLASSES:
        out["policy"] = Module(classes=[block_class(module_class_kind(spec["model"]))])
    out["offload_policy"] = {None: None, "cpu": CPUOffloadPolicy(pin_memory=False),
                             "half": Offload(state=0.5, pin_memory=False)}[c["offload"]]
    out["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                            reduce_dtype=torch.float32) if c["mp"] else None
    out["timeout"] = 120
    return out

"""The fuzzer's cases as data: ``generate(seed)`` makes a JSON spec, ``problems(spec)`` says
which rules it breaks, ``features(spec)`` what it exercises.

A spec names a model (blocks of ``fuzz_model``), a training loop and a Config; nothing
here builds or runs one, so the generator and the shrinker (``fuzz.py``) can make and
check specs without torch.distributed.
"""

from __future__ import annotations

import random
from typing import Optional


# --- the spec ---------------------------------------------------------------------------------

DRAWN_BLOCKS = ("linear", "linear_nobias", "layernorm", "rmsnorm", "attention", "conv", "moe",
                "frozen", "twice", "running", "row1", "complex", "float64")
# blocks drawn after every other draw (``_draw_crash_classes``), inserted into the stack:
# Linear -> transpose -> BatchNorm1d over the features -> transpose -> Linear, with a
# momentum of 0.1 or None (a cumulative average, by num_batches_tracked)
LATE_BLOCKS = ("batchnorm", "batchnorm_cumulative")
BLOCKS = DRAWN_BLOCKS + LATE_BLOCKS
# relative odds of each block kind drawn with the others; complex parameters are rarer (one
# known failure class must not drown the others in a sample)
BLOCK_ODDS = {k: 1.0 for k in DRAWN_BLOCKS} | {"complex": 0.4, "float64": 0.6}
# block kinds whose modules hold no trained parameter (no unit of their own to name)
NO_TRAINED = ("running", "frozen")
HEADS = ("tied", "untied", "untied_bias")

LOOP_DEFAULTS = {
    "steps": 2,            # optimizer steps
    "batch": 2,            # rows per rank per micro-batch
    "seq": None,           # sequence length per step (None: 8 each)
    "accumulate": 1,       # micro-batches per step
    "sync": "last",        # which micro-batches reduce: last, always, first_and_last
    "warmup": None,        # a call before the first step: None, "eval", "no_grad"
    "precision": "fp32",   # or "autocast_bf16"
    "optimizer": "adamw",  # adamw, sgd, in_backward (AdamW per parameter, stepped in its hook)
    "param_groups": False,
    "clip": None,          # clip_grad_norm_ max norm
    "zero_grad": "none",   # set_to_none: "none"; zeros: "zeros"
    "eval": None,          # after each step: None, "eval" (eval mode, no_grad), "no_grad",
                           # "inference" (eval mode, torch.inference_mode())
    "hook": None,          # {"kind": "observe" | "modify", "at": step, "target": index}
    "checkpoint": None,    # {"at": s}: save after step s, load after step s + 1
    "rank_local": None,    # {"at": s}: after step s rank 0 alone changes what forward reads
    "autograd": None,      # "inputs": backward(inputs=all parameters but the first);
                           # "grad": autograd.grad of them, added to .grad by the loop
    "clip_norm": None,     # "inf": clip's norm_type is the infinity norm (None: 2)
    "entry": False,        # the loss also calls the first block directly (its own entry)
    "twice": None,         # each micro-batch: "forwards" (its loss is two forwards' losses),
                           # "backwards" (backward twice, the first with retain_graph=True)
    "penalty": None,       # the loss adds a penalty on gradients taken with create_graph=True
                           # (a double backward): "params", its parameters'; "inputs", those
                           # of the features of the entry's block call (WGAN-GP's)
    "anomaly": False,      # each micro-batch under torch.autograd.detect_anomaly()
}
CONFIG_DEFAULTS = {
    "strategy": "zero3", "policy": "auto", "recompute": True, "offload": None,
    "bucket": None, "prefetch": True, "reshard_after_forward": "auto", "mp": None,
    "gradient_divide_factor": None, "force_sum_reduction_for_comms": False, "verify": False,
    "units": None,  # "blocks": explicit Config.units, one per block holding parameters
}
# Config "policy" beyond Config's own names: Module(classes=[the first block's class that
# holds trained parameters]); Config "prefetch" as a string: Prefetch(bytes=it)
MODULE_CLASSES = "module:classes"
DIM, VOCAB, SEQ = 16, 32, 8
LR = {"adamw": 1e-2, "in_backward": 1e-2, "sgd": 5e-2}


def generate(seed: int, *, world_sizes=(1, 2, 3, 4), factory: Optional[str] = None) -> dict:
    """The spec of case ``seed``: the same seed gives the same spec. ``factory``
    (``MODULE:FACTORY``): the user's model, and only loops and Configs are drawn."""
    rng = random.Random(seed)
    world = rng.choice(list(world_sizes))
    mesh = "hsdp" if world == 4 and rng.random() < 0.3 else "1d"
    if factory is not None:
        model = {"factory": factory}
    else:
        kinds = list(BLOCK_ODDS)
        model = {"dim": DIM, "vocab": VOCAB, "head": rng.choice(HEADS),
                 "blocks": [{"kind": k} for k in rng.choices(
                     kinds, weights=[BLOCK_ODDS[k] for k in kinds], k=rng.randint(1, 4))]}
    steps = rng.choice([2, 2, 3])
    accumulate = rng.choice([1, 1, 2, 3])
    loop = dict(LOOP_DEFAULTS)
    loop.update(
        steps=steps, accumulate=accumulate,
        sync=rng.choice(["last", "last", "always", "first_and_last"]) if accumulate > 1
        else "last",
        warmup=rng.choice([None, None, "eval", "no_grad"]),
        precision="autocast_bf16" if rng.random() < 0.2 else "fp32",
        optimizer=rng.choice(["adamw", "sgd", "in_backward"]),
        param_groups=rng.random() < 0.3,
        clip=0.5 if rng.random() < 0.3 else None,
        zero_grad=rng.choice(["none", "zeros"]),
        eval=rng.choice([None, None, "eval", "no_grad"]),
        hook={"kind": rng.choice(["observe", "modify"]), "at": rng.randrange(steps),
              "target": rng.randrange(8)} if rng.random() < 0.25 else None,
        seq=[rng.choice([6, 8, 10]) for _ in range(steps)] if (
            factory is None and rng.random() < 0.25) else None,
        checkpoint={"at": rng.randrange(steps - 1)} if rng.random() < 0.2 else None,
    )
    strategies = ["zero3", "zero2"] if mesh == "hsdp" else ["zero3", "zero3", "zero2",
                                                             "zero1", "ddp"]
    strategy = rng.choice(strategies)
    raf = ["auto", True, False, "search"] + ([2] if world == 4 and mesh == "1d" else [])
    config = dict(CONFIG_DEFAULTS)
    config.update(
        strategy=strategy,
        policy=rng.choice(["auto", "module", "size", "per-parameter", "whole-model"]),
        recompute=rng.choice([True, False, "blocks", "auto"]),
        offload=rng.choice(["cpu", "half"]) if strategy in ("zero3", "zero2")
        and rng.random() < 0.2 else None,
        bucket=rng.choice([None, True, False]),
        prefetch=rng.choice([True, False, 1]),
        reshard_after_forward="auto" if strategy == "zero2" else rng.choice(raf),
        mp="bf16" if rng.random() < 0.15 else None,
        gradient_divide_factor=1.0 if rng.random() < 0.15 else None,
        force_sum_reduction_for_comms=rng.random() < 0.15,
        verify=rng.random() < 0.2,
    )
    # drawn last, so that the draws above make for each seed what they made before it
    loop["rank_local"] = {"at": rng.randrange(steps)} if (
        world > 1 and factory is None and rng.random() < 0.3) else None
    if factory is None and rng.random() < 0.3:  # the forward writes tensors to itself
        model["writes"] = True
    if rng.random() < 0.3:  # the autograd API beyond backward()
        hooked = loop["optimizer"] == "in_backward"
        ways = ["inputs"] * (accumulate == 1 or not hooked) + ["grad"] * (
            accumulate == 1 and not hooked)
        loop["autograd"] = rng.choice(ways) if ways else None
    if factory is None:
        _draw_client_patterns(rng, model, loop, config)
        _draw_crash_classes(rng, model, loop, config)
        if rng.random() < 0.5 and not penalty_excluded(model, loop, config):
            # a double backward: a penalty on the gradients of the parameters, or of the
            # features a block called directly reads
            loop["penalty"] = "inputs" if loop.get("entry") and rng.random() < 0.5 else "params"
        # every micro-batch under detect_anomaly(), which cannot check the DTensor gradients
        # autograd.grad of parameters and create_graph hand back (refused, docs/api.md)
        loop["anomaly"] = rng.random() < 0.08 and not anomaly_excluded(loop)
    mesh = _draw_tp_mesh(rng, mesh, world)
    spec = {"seed": seed, "world": world, "mesh": mesh, "model": model, "loop": loop,
            "config": config}
    _fix(spec)
    assert not problems(spec), (problems(spec), spec)
    return spec


def _draw_tp_mesh(rng: random.Random, mesh: str, world: int) -> str:
    """The mesh, drawn last of all: a 1-D one at 2 or 4 ranks may become a ("dp", "tp") mesh
    of 2 tp ranks, its "tp" dimension sharded over as FSDP does (``tensor_parallel="off"``,
    "dp-tp"), or (drawn after it) with a tensor-parallel plan over it
    (``autoshard.fuzz.model.tensor_parallel_plan``, "tp-plan")."""
    if mesh == "1d" and world in (2, 4) and rng.random() < 0.15:
        return "dp-tp" if rng.random() < 0.5 else "tp-plan"
    return mesh


def _draw_client_patterns(rng: random.Random, model: dict, loop: dict, config: dict) -> None:
    """What users' loops do that broke (drawn after every other draw, so that each seed
    keeps what it drew before): a parameter no loss reads (and a resume of its missing
    optimizer state), an infinity-norm clip (an empty shard of a one-row parameter), a
    forward returning a dataclass, explicit units with a block called directly."""
    steps = loop["steps"]
    if rng.random() < 0.15:
        model["unused"] = True
        if loop["checkpoint"] is None and rng.random() < 0.5:
            loop["checkpoint"] = {"at": rng.randrange(steps - 1)} if steps > 1 else None
    if loop["clip"] is not None and rng.random() < 0.5:
        loop["clip_norm"] = "inf"
    if rng.random() < 0.15:
        model["output"] = "dataclass"
    if model["blocks"] and rng.random() < 0.2:
        config["units"] = "blocks"
        loop["entry"] = rng.random() < 0.6
    elif model["blocks"] and rng.random() < 0.1:
        loop["entry"] = True


def _draw_crash_classes(rng: random.Random, model: dict, loop: dict, config: dict) -> None:
    """Classes that crashed (drawn after every other draw): two forwards or two backwards in
    each micro-batch (with accumulation, sync off on some), a prefetch byte bound below a
    unit's bytes under verify, a BatchNorm1d over transposed features (momentum 0.1 or None,
    inserted into the stack), an evaluation under inference_mode (zero1's replicas), zero2
    with Module(classes=[...])."""
    if rng.random() < 0.2:
        ways = ["forwards"] + ["backwards"] * (loop.get("autograd") is None
                                               and loop["optimizer"] != "in_backward")
        loop["twice"] = rng.choice(ways)
    if rng.random() < 0.12:
        config["prefetch"], config["verify"] = "1KB", True
    if rng.random() < 0.2 and config["mp"] is None:
        blocks = model["blocks"]
        blocks.insert(rng.randrange(len(blocks) + 1), {"kind": rng.choice(LATE_BLOCKS)})
    if rng.random() < (0.4 if config["strategy"] == "zero1" else 0.1):
        loop["eval"] = "inference"
    trained = any(b["kind"] not in NO_TRAINED for b in model["blocks"])
    if trained and config["units"] is None and rng.random() < 0.15:  # units override a policy
        config["policy"] = MODULE_CLASSES
        if config["strategy"] == "zero3" and rng.random() < 0.5:
            config["strategy"], config["reshard_after_forward"] = "zero2", "auto"


def module_class_kind(model: dict) -> Optional[str]:
    """Policy "module:classes": the kind of the first block holding trained parameters."""
    return next((b["kind"] for b in model.get("blocks", ()) if b["kind"] not in NO_TRAINED),
                None)


def _fix(spec: dict) -> None:
    """Make the combinations ``problems`` refuses valid (the generator's side of the rules)."""
    loop, config = spec["loop"], spec["config"]
    if precision_of(spec) == "bf16":
        loop["optimizer"] = "sgd"
    if loop["optimizer"] == "in_backward":
        loop["clip"] = None
    if loop["clip"] is None:
        loop["clip_norm"] = None
    if spec["mesh"] == "tp-plan":  # the mesh is drawn last: what it excludes goes
        loop["penalty"] = None
        if any(b["kind"] == "moe" for b in spec["model"].get("blocks", ())):
            config["mp"] = None  # bf16 routing (see ``problems``)
            loop["precision"] = "fp32"
    if config["mp"] is not None:  # the reference casts for forward only, not for an entry
        loop["entry"] = False
    if any(b["kind"] == "float64" for b in spec["model"].get("blocks", ())):
        config["mp"] = None
    blocks = spec["model"].get("blocks", [])
    if precision_of(spec) == "bf16" and _norm_before_routing(blocks):
        blocks.sort(key=lambda b: b["kind"] in LATE_BLOCKS)  # the batch norms after it


def _routing_flips(spec: dict) -> list:
    """Why a MoE block is not drawn here: under bf16, the argmax over bf16 router logits turns
    a legitimate rounding difference from eager into another expert."""
    blocks, out = spec["model"].get("blocks", ()), []
    if precision_of(spec) != "bf16":
        return out
    if spec["mesh"] == "tp-plan" and any(b["kind"] == "moe" for b in blocks):
        out.append("under bf16 a tensor-parallel plan is not drawn with a MoE block: a "
                   "row-wise layer sums its halves in another order than eager's matmul, and "
                   "the argmax over bf16 router logits can turn that rounding into another "
                   "expert (seed 31031, where the reference's own gradients move as far under "
                   "a 1e-4 relative change of its parameters)")
    if _norm_before_routing(blocks):
        out.append("under bf16 a batch norm is not drawn before a MoE block: the captured "
                   "graph's decomposed batch norm rounds otherwise than eager's kernel, and the "
                   "MoE's argmax over bf16 router logits turns that rounding into another "
                   "expert (seed 10272)")
    return out


def _norm_before_routing(blocks: list) -> bool:
    """A batch norm block before a MoE block (see ``problems``)."""
    kinds = [b["kind"] for b in blocks]
    return "moe" in kinds and any(k in LATE_BLOCKS for k in kinds[:len(kinds) - 1
                                                                  - kinds[::-1].index("moe")])


def problems(spec: dict) -> list:
    """Why ``spec`` is not a case to run (empty: it is). These are combinations autoshard
    refuses by design or that have no eager meaning; the generator never makes them, and the
    shrinker skips them."""
    out = []
    world, loop, config = spec["world"], spec["loop"], spec["config"]
    model = spec["model"]
    if not 1 <= world <= 8:
        out.append("world size from 1 to 8")
    if spec["mesh"] == "hsdp" and world != 4:
        out.append("the 2 x 2 HSDP mesh needs 4 ranks")
    if spec["mesh"] in ("dp-tp", "tp-plan") and world not in (2, 4):
        out.append("the (dp, tp) mesh of 2 tp ranks needs 2 or 4 ranks")
    if spec["mesh"] == "hsdp" and config["strategy"] not in ("zero3", "zero2"):
        out.append("a 2-D mesh takes zero3 or zero2")
    raf = config["reshard_after_forward"]
    shard = 2 if spec["mesh"] == "hsdp" else world
    if isinstance(raf, int) and not isinstance(raf, bool) and (raf < 1 or shard % raf):
        out.append(f"reshard_after_forward={raf} must divide the shard size {shard}")
    if config["strategy"] == "zero2" and raf != "auto":
        out.append("zero2 keeps reshard_after_forward at auto")
    if config["offload"] and config["strategy"] in ("ddp", "zero1"):
        out.append("offload needs zero3 or zero2")
    if precision_of(spec) == "bf16" and loop["optimizer"] != "sgd":
        out.append("bf16 cases use SGD (AdamW's first step is sign(g): rounding near zero "
                   "would become lr-sized differences)")
    if loop["optimizer"] == "in_backward" and loop["clip"] is not None:
        out.append("an optimizer stepped in backward leaves nothing to clip")
    how, hooked = loop.get("autograd"), loop["optimizer"] == "in_backward"
    if how == "grad" and (hooked or loop["accumulate"] > 1):
        out.append("autograd.grad of parameters runs no post-accumulate-grad hook to step an "
                   "optimizer in, and is refused without gradient sync (docs/api.md)")
    if how == "inputs" and hooked and loop["accumulate"] > 1:
        out.append("without gradient sync a hooked parameter is no input of the step's graph "
                   "for backward(inputs=...) to name (docs/api.md)")
    if loop.get("penalty") and (why := penalty_excluded(model, loop, config, spec["mesh"])):
        out.append(why)
    if loop.get("anomaly") and anomaly_excluded(loop):
        out.append("detect_anomaly() is refused with autograd.grad of parameters and "
                   "create_graph (it cannot check DTensor gradients for NaN)")
    if loop.get("penalty") == "inputs" and not loop.get("entry"):
        out.append("a penalty on input gradients takes those of the entry's features")
    if loop["steps"] < 1 or loop["accumulate"] < 1:
        out.append("at least one step and one micro-batch")
    if loop["seq"] is not None and len(loop["seq"]) != loop["steps"]:
        out.append("one sequence length per step")
    if loop["hook"] is not None and loop["hook"]["at"] >= loop["steps"]:
        out.append("the hook is registered at a step that runs")
    if loop["checkpoint"] is not None and loop["checkpoint"]["at"] + 1 >= loop["steps"]:
        out.append("a checkpoint is loaded one step after it is saved")
    if loop.get("clip_norm") is not None and loop["clip"] is None:
        out.append("clip_norm is the norm of a clip")
    if (loop.get("entry") or config.get("units")) and not model.get("blocks"):
        out.append("a block called directly, or a unit per block, needs a block")
    if config["policy"] == MODULE_CLASSES and ("factory" in model
                                                or module_class_kind(model) is None):
        out.append("policy module:classes names the class of a block holding trained "
                   "parameters, and the model has none")
    if loop.get("twice") == "backwards" and (how is not None or hooked):
        out.append("a second backward of one loss (retain_graph=True) is drawn with plain "
                   "backward() and a step after backward, never with the autograd API or an "
                   "optimizer stepped in backward (it would step twice)")
    out += _routing_flips(spec)
    if config["mp"] is not None and any(b["kind"] in LATE_BLOCKS
                                        for b in model.get("blocks", ())):
        out.append("a MixedPrecisionPolicy casts the batch norm's weight to bf16 and leaves its "
                   "running statistics float32, which torch's batch norm refuses in eager too "
                   "(\"expected scalar type BFloat16 but found Float\"; FSDP2's cast as well)")
    if "factory" not in model and any(b["kind"] not in BLOCKS for b in model["blocks"]):
        out.append("unknown block kind")
    if config["mp"] is not None and any(b["kind"] == "float64" for b in model.get("blocks", ())):
        out.append("a MixedPrecisionPolicy casts the float64 block's parameter to its "
                   "param_dtype, which the block's float64 matmul cannot take (FSDP2's cast "
                   "too); autoshard refuses it at capture, naming the dtypes")
    return out


def same_value(a, b) -> bool:
    """Equal and of one type: ``prefetch=1`` (a depth) is not ``prefetch=True``."""
    return type(a) is type(b) and a == b


def penalty_excluded(model: dict, loop: dict, config: dict, mesh: str = "1d") -> Optional[str]:
    """Why loop "penalty" (``create_graph=True``) is not drawn with this case: what
    autoshard refuses for it (docs/api.md), what would step or reduce twice, and what eager
    cannot differentiate twice. ``mesh``: drawn after the penalty (``_fix`` drops it)."""
    if mesh == "tp-plan":
        return "a double backward is refused with tensor parallelism (docs/api.md)"
    if any(b["kind"] == "attention" for b in model.get("blocks", ())):
        return ("eager's CPU attention kernel has no double backward (derivative for "
                "_scaled_dot_product_flash_attention_for_cpu_backward is not implemented)")
    if config["mp"] is not None or loop["precision"] != "fp32" or config["offload"]:
        return "a double backward is refused under mixed precision and offload"
    if config["gradient_divide_factor"] is not None or config["force_sum_reduction_for_comms"]:
        return "a double backward builds the mean over the ranks only"
    if loop["accumulate"] > 1:
        return "a double backward is refused without gradient sync"
    if loop["hook"] is not None or loop["optimizer"] == "in_backward":
        return ("a double backward is refused with module backward hooks, and an optimizer "
                "stepped in backward would step on gradients still growing")
    if loop.get("autograd") is not None or loop.get("twice") is not None:
        return "a penalty is drawn with one plain backward of each micro-batch"
    return None


def anomaly_excluded(loop: dict) -> bool:
    return bool(loop.get("penalty")) or loop.get("autograd") == "grad"


def data_world(spec: dict) -> int:
    """The data-parallel ranks: each reads its own rows of a batch. A tensor-parallel plan's
    2 tp ranks read the same ones."""
    return spec["world"] // 2 if spec["mesh"] == "tp-plan" else spec["world"]


def data_rank(spec: dict, rank: int) -> int:
    """Whose rows rank ``rank`` reads: its rank on the data-parallel dimension."""
    return rank // 2 if spec["mesh"] == "tp-plan" else rank


def precision_of(spec: dict) -> str:
    return "bf16" if (spec["loop"]["precision"] == "autocast_bf16"
                      or spec["config"]["mp"] == "bf16") else "fp32"


def features(spec: dict) -> list:
    """What a case exercises, as ``name=value`` strings (defaults left out), for coverage
    counts."""
    out = [f"world={spec['world']}", f"mesh={spec['mesh']}"]
    model = spec["model"]
    if "factory" in model:
        out.append("model=factory")
    else:
        out.append(f"head={model['head']}")
        out += [f"block={k}" for k in sorted({b["kind"] for b in model["blocks"]})]
        if model.get("writes"):
            out.append("model=writes")
        out += [f"model={k}" for k in ("unused",) if model.get(k)]
        out += [f"output={model['output']}"] if model.get("output") else []
    for part, defaults in (("loop", LOOP_DEFAULTS), ("config", CONFIG_DEFAULTS)):
        for key, default in defaults.items():
            value = spec[part].get(key, default)  # a spec older than the feature: default
            if key in ("batch",) or same_value(value, default):
                continue
            if key == "seq":
                value = "changes" if len(set(value)) > 1 else "fixed"
            elif isinstance(value, dict):
                value = value.get("kind", "on")
            out.append(f"{key}={value}")
    return out

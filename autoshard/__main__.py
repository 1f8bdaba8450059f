"""Command line: ``python -m autoshard demo``, ``plan``, ``check``, ``export``, ``inspect``
and ``fuzz``."""

from __future__ import annotations

import argparse
import os
import sys
import time

import autoshard
from autoshard.core import progress
from autoshard.check import run_factory
from autoshard.core.config import Config, POLICIES
from autoshard.core.cost import PROFILES
from autoshard.core.errors import AutoshardError
from autoshard.front.factory import export_factory, load_factory
from autoshard.core.options import Offload
from autoshard.runtime import commit
from autoshard.runtime.dist import spawn_ranks
from autoshard.runtime.export import describe, stored_plan
from autoshard.runtime.export_format import MANIFEST
from autoshard.core.spec import STRATEGIES


def _plan(args) -> int:
    import torch

    t0 = time.perf_counter()

    def progress(msg):
        if not args.quiet:
            print(f"[{time.perf_counter() - t0:6.1f}s] {msg}", file=sys.stderr, flush=True)

    config, world = _plan_config(args)  # the arguments' mistakes before any work
    factory = load_factory(args.factory)
    progress(f"building {args.factory} on the meta device")
    with torch.device("meta"):
        model = factory()
    make = getattr(factory, "example_inputs", None) or (
        lambda b, s: (torch.zeros(b, s, dtype=torch.long),))
    if args.symbolic:
        plan = autoshard.plan(model, world_size=world, config=config,
                              make_inputs=make, batch=args.batch, seq=args.seq,
                              progress=progress)
    else:
        plan = autoshard.plan(model, make(args.batch, args.seq), world_size=world,
                              config=config, progress=progress)
    progress("done")
    print(plan.render(schedule=not args.summary_only, frees=args.frees))
    if args.json:
        with open(args.json, "w") as f:
            f.write(plan.to_json())
    if args.trace:
        plan.to_chrome_trace(args.trace)
    if args.plot:
        plan.memory_plot(args.plot)
    return 0


def _reshard(args):
    """--reshard-after-forward as Config takes it: true/false, auto/search, or an int k."""
    value = args.reshard_after_forward
    named = {"true": True, "false": False, "auto": "auto", "search": "search"}
    if value.lower() in named:
        return named[value.lower()]
    if not value.isdigit():
        raise ValueError(f"--reshard-after-forward {value} is not accepted; use true, false, "
                         "auto, search or an int k dividing the shard size (hpZ)")
    return int(value)


def _plan_config(args) -> tuple:
    """The plan's Config and world size (a pair under --replicate) from the arguments."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    _world_size(args)
    if args.replicate < 1 or args.world_size % args.replicate:
        raise ValueError(f"--replicate {args.replicate} must divide --world-size "
                         f"{args.world_size}")
    offload = (Offload(state=args.offload_state) if args.offload_state is not None
               else CPUOffloadPolicy() if args.offload else None)
    config = Config(policy=args.policy, memory_budget=args.memory_budget,
                    device_profile=args.device_profile, mp_policy=_mp_policy(args),
                    recompute=RECOMPUTE[args.recompute], offload_policy=offload,
                    strategy=args.strategy, reshard_after_forward=_reshard(args))
    world = (args.world_size if args.replicate == 1
             else (args.replicate, args.world_size // args.replicate))
    return config, world


def _world_size(args) -> None:
    if args.world_size < 1:
        raise ValueError(f"--world-size must be at least 1, got {args.world_size}")


DTYPES = ("float32", "bfloat16", "float16")
RECOMPUTE = {"auto": "auto", "min-cut": True, "blocks": "blocks", "none": False}


def _mp_policy(args):
    """--param-dtype / --reduce-dtype as FSDP2's MixedPrecisionPolicy (None when neither)."""
    if args.param_dtype is None and args.reduce_dtype is None:
        return None
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    def dtype(name):
        return None if name is None else getattr(torch, name)

    return MixedPrecisionPolicy(param_dtype=dtype(args.param_dtype),
                                reduce_dtype=dtype(args.reduce_dtype))


def _check(args) -> int:
    load_factory(args.factory)  # a bad MODULE:FACTORY is named before any rank starts
    _world_size(args)
    text, ok = run_factory(args.factory, batch=args.batch, seq=args.seq,
                           world_size=args.world_size, policy=args.policy, atol=args.atol,
                           rtol=args.rtol)
    print(text)
    return 0 if ok else 1


def _export(args) -> int:
    load_factory(args.factory)  # a bad MODULE:FACTORY is named before any rank starts
    _world_size(args)
    out = os.path.abspath(args.out)
    found = commit.state(out, "manifest.json", ("checkpoint.json",))
    if found not in ("free", "complete", "interrupted"):  # an earlier export is replaced whole
        raise ValueError(f"cannot export to {args.out}: it is {found}, not an export; choose "
                         "a new path or remove it first")
    opts = {"batch": args.batch, "seq": args.seq, "out": out, "inference": not args.training_only,
            "config": Config(policy=args.policy, mp_policy=_mp_policy(args))}
    t0 = time.perf_counter()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun: this rank
        export_factory(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args.factory,
                       opts)
        if os.environ["RANK"] != "0":
            return 0
    else:
        spawn_ranks(args.world_size, export_factory, args.factory, opts)
    print(f"exported to {args.out} in {time.perf_counter() - t0:.1f} s")
    if not args.quiet:
        print("\n" + describe(out, verify=False))
    return 0


def _inspect(args) -> int:
    # one reader lock over both reads: the plan drawn is of the export described
    with commit.reading(args.path, MANIFEST):
        print(describe(args.path, verify=not args.no_verify))
        plan = stored_plan(args.path, args.program) if args.trace or args.plot else None
    if args.trace:
        plan.to_chrome_trace(args.trace)
    if args.plot:
        plan.memory_plot(args.plot)
    return 0


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's formatter that shows each option's default, unless its help names it."""

    def _get_help_string(self, action):
        if "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


FACTORY_HELP = ("MODULE:FACTORY returning a (real, not meta) nn.Module; FACTORY.example_inputs("
                "batch, seq) if present makes the inputs, else integer tokens (batch, seq)")


def _version() -> str:
    """autoshard's version and torch's, as ``--version`` prints them."""
    import importlib.metadata

    import torch

    version = getattr(autoshard, "__version__", None)
    if version is None:
        try:
            version = importlib.metadata.version("autoshard")
        except importlib.metadata.PackageNotFoundError:
            version = "unknown (not installed)"
    return f"autoshard {version} (torch {torch.__version__})"


def _prog() -> str:
    """The command's name as it was run: the ``autoshard`` script or ``python -m``."""
    return "autoshard" if os.path.basename(sys.argv[0]) == "autoshard" else "python -m autoshard"


def parser() -> argparse.ArgumentParser:
    """The command line's parser: one subcommand per job."""
    top = argparse.ArgumentParser(
        prog=_prog(), formatter_class=_Formatter,
        description="Plan, check, export and inspect fully sharded training steps.",
        epilog="A mistake in the arguments or the model is one line on stderr; "
        "AUTOSHARD_DEBUG=1 shows its traceback. AUTOSHARD_PROGRESS=0 turns off the progress "
        "lines of long phases (capture, inductor, checkpoints).")
    top.add_argument("--version", action="version", version=_version(),
                     help="print autoshard's version and torch's, and exit")
    sub = top.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_demo(sub)
    _add_plan(sub)
    _add_check(sub)
    _add_export(sub)
    _add_inspect(sub)
    _add_fuzz(sub)
    return top


def _add_demo(sub) -> None:
    demo = sub.add_parser("demo", formatter_class=_Formatter,
                          help="train a small GPT on 2 gloo ranks beside a reference")
    demo.add_argument("--steps", type=int, default=8, help="training steps")
    demo.add_argument("--world-size", type=int, default=2, help="gloo ranks on this machine")
    demo.add_argument("--layers", type=int, default=2, help="transformer blocks of the GPT")


def _add_plan(sub) -> None:
    pl = sub.add_parser("plan", formatter_class=_Formatter,
                        help="plan a model for any world size on this machine")
    pl.add_argument("factory", help="MODULE:FACTORY returning an nn.Module")
    pl.add_argument("--world-size", type=int, default=8, help="ranks to plan for")
    pl.add_argument("--batch", type=int, default=1, help="per-rank batch")
    pl.add_argument("--seq", type=int, default=2048, help="sequence length")
    pl.add_argument("--device-profile", default="h100", choices=list(PROFILES),
                    help="the cost model's device")
    pl.add_argument("--memory-budget", default=None,
                    help="per rank, e.g. 80GiB (default: the device profile's memory)")
    pl.add_argument("--policy", default="auto", choices=POLICIES, help="how units are chosen")
    _add_dtypes(pl)
    pl.add_argument("--recompute", choices=list(RECOMPUTE), default="auto",
                    help="activation recomputation: the planner's choice per repeated block "
                    "(auto), the min cut, whole blocks, or none")
    pl.add_argument("--offload", action="store_true",
                    help="keep parameter shards, gradient shards and optimizer state in host "
                    "memory (CPUOffloadPolicy): the optimizer steps on the host")
    pl.add_argument("--offload-state", type=float, default=None, metavar="FRACTION",
                    help="with --offload (implied), keep only this fraction of that state in "
                    "host memory, the last parameters' (Config(offload_policy=Offload(state="
                    "FRACTION)); default: all)")
    pl.add_argument("--strategy", choices=list(STRATEGIES), default="zero3",
                    help="Config.strategy")
    pl.add_argument("--reshard-after-forward", default="auto", metavar="WHICH",
                    help="Config.reshard_after_forward: true, false, auto, search, or an int "
                         "k (hpZ: groups of k ranks)")
    pl.add_argument("--replicate", type=int, default=1, metavar="R",
                    help="hybrid sharding: R replica groups of world-size / R ranks")
    pl.add_argument("--trace", help="write a Chrome/Perfetto trace here (default: none)")
    pl.add_argument("--json", help="write the plan as JSON here (default: none)")
    pl.add_argument("--plot", help="write the memory timeline as an image here (matplotlib; "
                    "default: none)")
    pl.add_argument("--symbolic", action="store_true",
                    help="fit memory and time in batch and seq (two more traces)")
    pl.add_argument("--summary-only", action="store_true", help="no schedule table")
    pl.add_argument("--frees", action="store_true",
                    help="list the schedule's free rows too (folded into a count otherwise)")
    pl.add_argument("--quiet", action="store_true", help="no progress lines")


def _add_dtypes(p) -> None:
    p.add_argument("--param-dtype", choices=DTYPES, default=None,
                   help="gather and compute parameters in this dtype (MixedPrecisionPolicy "
                   "param_dtype); the shards and optimizer state keep the model's dtype "
                   "(default: the model's dtype)")
    p.add_argument("--reduce-dtype", choices=DTYPES, default=None,
                   help="reduce-scatter gradients in this dtype (default: --param-dtype)")


def _add_check(sub) -> None:
    ck = sub.add_parser("check", formatter_class=_Formatter,
                        help="one training step eagerly and compiled, compared: "
                        "per-parameter gradients and the first graph node that differs")
    ck.add_argument("factory", help=FACTORY_HELP)
    ck.add_argument("--batch", type=int, default=2, help="per-rank batch")
    ck.add_argument("--seq", type=int, default=16, help="sequence length")
    ck.add_argument("--world-size", type=int, default=1,
                    help="gloo ranks on this machine (spawned processes)")
    ck.add_argument("--policy", default=None, choices=POLICIES,
                    help="unit policy (default: Config's, auto)")
    ck.add_argument("--atol", type=float, default=None, help="default: by dtype")
    ck.add_argument("--rtol", type=float, default=None, help="default: by dtype")


def _add_export(sub) -> None:
    ex = sub.add_parser("export", formatter_class=_Formatter,
                        help="build a model from a factory, shard it over N gloo "
                        "ranks here (or the torchrun ranks), compile it and export it")
    ex.add_argument("factory", help=FACTORY_HELP)
    ex.add_argument("--out", required=True, help="the export directory (new or empty)")
    ex.add_argument("--world-size", type=int, default=1,
                    help="gloo ranks on this machine (spawned processes; under torchrun, "
                    "its ranks)")
    ex.add_argument("--batch", type=int, default=2, help="per-rank batch")
    ex.add_argument("--seq", type=int, default=16, help="sequence length")
    ex.add_argument("--policy", default="auto", choices=POLICIES, help="how units are chosen")
    _add_dtypes(ex)
    ex.add_argument("--training-only", action="store_true",
                    help="no eval-mode, no-gradient program beside the training one")
    ex.add_argument("--quiet", action="store_true", help="do not print the export afterwards")


def _add_inspect(sub) -> None:
    ins = sub.add_parser("inspect", formatter_class=_Formatter,
                         help="an export's manifest, units, schedule and predicted memory")
    ins.add_argument("path", help="a directory sharded.export() wrote")
    ins.add_argument("--program", type=int, default=0,
                     help="which program --trace and --plot draw")
    ins.add_argument("--trace", help="write that program's Chrome/Perfetto trace here "
                     "(default: none)")
    ins.add_argument("--plot", help="write its memory timeline as an image here (matplotlib; "
                     "default: none)")
    ins.add_argument("--no-verify", action="store_true",
                     help="do not check the files' SHA-256 (faster for a large export)")


def _add_fuzz(sub) -> None:
    fz = sub.add_parser("fuzz", formatter_class=_Formatter,
                        help="train a model under random loops and Configs on fresh gloo "
                        "ranks beside an unsharded reference, and report what differs")
    fz.add_argument("factory", help=FACTORY_HELP)
    fz.add_argument("--cases", type=int, default=10, help="how many seeds to run")
    fz.add_argument("--seed", type=int, default=0, help="the first seed")
    fz.add_argument("--world-sizes", default="1,2,3,4", help="comma-separated rank counts")
    fz.add_argument("--shrink", action="store_true",
                    help="shrink each failure to the smallest spec that still fails")
    fz.add_argument("--timeout", type=float, default=300.0, help="seconds per case")


def _fuzz(args) -> int:
    from autoshard import fuzz

    load_factory(args.factory)  # a bad MODULE:FACTORY is named before any rank starts
    try:
        worlds = tuple(int(w) for w in args.world_sizes.split(","))
    except ValueError:
        raise ValueError(f"--world-sizes {args.world_sizes}: write rank counts such as "
                         "1,2,4") from None
    for w in worlds:
        _world_size(argparse.Namespace(world_size=w))
    summary = fuzz.fuzz(range(args.seed, args.seed + args.cases), world_sizes=worlds,
                        factory=args.factory, do_shrink=args.shrink, timeout=args.timeout,
                        log=lambda m: print(m, flush=True))
    print(summary.render())
    return 0 if all(r.ok for r in summary.results) else 1


def _demo(args) -> int:
    from autoshard.front.demo import main as demo_main

    demo_main(steps=args.steps, world=args.world_size, layers=args.layers)
    return 0


COMMANDS = {"demo": _demo, "plan": _plan, "check": _check, "export": _export,
            "inspect": _inspect, "fuzz": _fuzz}


def main(argv=None) -> int:
    """Runs one command; a user's mistake (``AutoshardError``, ``ValueError``, ``OSError``)
    is one line on stderr and exit status 1, its traceback only under ``AUTOSHARD_DEBUG``."""
    top = parser()
    args = top.parse_args(argv)
    if args.command == "plan" and args.quiet:
        progress.enable(False)
    try:
        return COMMANDS[args.command](args)
    except (AutoshardError, ValueError, OSError) as e:
        if os.environ.get("AUTOSHARD_DEBUG", "0").strip() not in ("", "0"):
            raise
        lines = [line.strip() for line in str(e).splitlines()]
        message = " ".join(line for line in lines if line) or type(e).__name__
        print(f"{top.prog} {args.command}: error: {message}", file=sys.stderr, flush=True)
        return 1


def cli() -> None:
    """The command's entry: ``main``, and after a plan an exit that leaves the planner's
    objects to the operating system (its output flushed first): tearing down the 10^6 graph
    objects that planning GPT-175B leaves took 2 s of the command's time."""
    argv = sys.argv[1:]
    code = main(argv)
    if argv[:1] == ["plan"]:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    cli()

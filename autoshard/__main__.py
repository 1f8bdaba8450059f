"""Command line: ``python -m autoshard demo``."""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m autoshard")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train a small GPT on 2 gloo ranks beside a reference")
    demo.add_argument("--steps", type=int, default=8)
    demo.add_argument("--world-size", type=int, default=2)
    demo.add_argument("--layers", type=int, default=2)
    args = parser.parse_args(argv)
    if args.command == "demo":
        from autoshard.demo import main as demo_main

        demo_main(steps=args.steps, world=args.world_size, layers=args.layers)
    return 0


if __name__ == "__main__":
    sys.exit(main())

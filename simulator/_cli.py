"""``python -m twinrpc.simulator``: the simulator's command line.

Each subcommand lives in its own module, which provides ``register(subparsers)``: it adds its parser
and sets ``func`` (called with the parsed namespace, returning the exit status) as a default.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

#: the modules (relative to this package) that provide a subcommand each, in the order help lists them
COMMAND_MODULES: tuple[str, ...] = ("_launch", "_explore_cli", "_replay_cli", "_trace_cli")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m twinrpc.simulator",
        description="Run, explore and look at RPC programs in twinrpc's deterministic simulator.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(f"{__package__}.{name}").register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help(sys.stderr)
        return 2
    return int(func(args))

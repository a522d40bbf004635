"""``python -m twinrpc.simulator``: the simulator's command line.

Each subcommand lives in its own module, which provides ``register(subparsers)``: it adds its parser
and sets ``func`` (called with the parsed namespace, returning the exit status) as a default.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

_SIMULATOR = __name__.rsplit(".", 2)[0]  # twinrpc.simulator

#: the modules (relative to ``twinrpc.simulator``) that provide a subcommand each, in the order help
#: lists them
COMMAND_MODULES: tuple[str, ...] = ("._cli._run", "._cli._explore", "._cli._replay", "._cli._trace")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m twinrpc.simulator",
        description="Run, explore and look at RPC programs in twinrpc's deterministic simulator.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name, _SIMULATOR).register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help(sys.stderr)
        return 2
    return int(func(args))

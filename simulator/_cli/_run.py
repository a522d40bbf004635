"""``python -m twinrpc.simulator run``'s command line: its flags, and the run (``_launch/_launch.py``)
or the determinism check (``_launch/_determinism.py``) they ask for."""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from typing import Any

from .._errors import LaunchError
from .._launch._determinism import launch_twice
from .._launch._launch import DEFAULT_PREFIX_TEMPLATE, LaunchOptions, launch


def _ranks(text: str) -> frozenset[int] | None:
    if not text:
        return None
    try:
        return frozenset(int(r) for r in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--local-ranks-filter must be a comma-separated list of integers e.g. 0,1,2; got {text!r}"
        ) from None


def _nproc(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--nproc-per-node must be an integer, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"--nproc-per-node must be at least 1, got {n}")
    return n


def register(subparsers: Any) -> None:
    """Add the ``run`` subcommand."""
    p = subparsers.add_parser(
        "run",
        allow_abbrev=False,  # the program's own options (--n=3) must not match ours by prefix
        help="run a program as N simulated workers, as torchrun runs real ones",
        description=(
            "Run PROGRAM as N simulated workers of one deterministic simulation, with torchrun's "
            "environment per worker and torch.distributed.rpc served by twinrpc. {rank}, {local_rank} "
            "and {world_size} in ARGS are replaced per worker (twinrpc's extension)."
        ),
    )
    p.add_argument("--nproc-per-node", "--nproc_per_node", type=_nproc, default=1, metavar="N")
    p.add_argument("--seed", type=int, default=0, help="the simulation's seed (default 0)")
    p.add_argument("--network", metavar="FILE", help="a NetworkModel as JSON or TOML")
    p.add_argument(
        "--compute", metavar="FILE", help="a ComputeModel as JSON or TOML: virtual time for torch operators"
    )
    p.add_argument("--faults", metavar="FILE", help="a FaultPlan as JSON or TOML")
    p.add_argument("--trace", metavar="OUT", help="write the run's trace to OUT")
    p.add_argument("--max-time", type=float, metavar="T", help="fail once virtual time passes T seconds")
    p.add_argument(
        "--check-determinism",
        action="store_true",
        help="run twice with the same seed; print the first difference and exit 1 if the runs differ",
    )
    p.add_argument("--master-addr", "--master_addr", default="127.0.0.1", help="MASTER_ADDR the workers see")
    p.add_argument(
        "--master-port", "--master_port", type=int, default=29500, help="MASTER_PORT the workers see"
    )
    p.add_argument(
        "--log-line-prefix-template",
        default=os.environ.get("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", DEFAULT_PREFIX_TEMPLATE),
        help="prefix of each output line ($rank, $local_rank, $role_name; default %(default)s)",
    )
    p.add_argument(
        "--local-ranks-filter",
        "--local_ranks_filter",
        type=_ranks,
        default=None,
        help="show only these ranks' output, e.g. 0,1",
    )
    p.add_argument("program", metavar="PROGRAM")
    p.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS")
    p.set_defaults(func=run_command)


def run_command(args: argparse.Namespace) -> int:
    """``run``'s entry point: returns the exit status."""
    options = LaunchOptions(
        program=args.program,
        args=tuple(args.args),
        nproc_per_node=args.nproc_per_node,
        seed=args.seed,
        network=args.network,
        compute=args.compute,
        faults=args.faults,
        trace=args.trace,
        max_time=args.max_time,
        master_addr=args.master_addr,
        master_port=args.master_port,
        log_line_prefix_template=args.log_line_prefix_template,
        local_ranks_filter=args.local_ranks_filter,
    )
    try:
        if args.check_determinism:
            return launch_twice(options)
        return launch(options).status
    except LaunchError as exc:
        print(f"python -m twinrpc.simulator run: error: {exc}", file=sys.stderr)
        return 2
    except SyntaxError:
        traceback.print_exc(limit=0)
        return 1

"""``python -m twinrpc.simulator trace``: export a saved trace for a viewer, or diff two traces.

::

    python -m twinrpc.simulator trace export --format html run.jsonl -o run.html
    python -m twinrpc.simulator trace diff a.jsonl b.jsonl            # exit 1 at a divergence
    python -m twinrpc.simulator trace diff --structural sim.jsonl gloo-trace-dir/

A trace file is what ``Trace.save`` (or ``run --trace OUT``) writes; a directory is a gloo run
recorded with ``TWINRPC_TRACE=dir``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from twinrpc._message import Kind

from .._errors import TraceFormatError
from .._traces._diff import diff_traces
from .._traces._export import EXPORT_FORMATS
from .._traces._trace import Trace


def register(subparsers: Any) -> None:
    """Add the ``trace`` subcommand (``export``, ``diff``)."""
    parser = subparsers.add_parser(
        "trace",
        help="export a saved trace (Perfetto, ShiViz, text, HTML) or diff two traces",
        description="Look at traces saved by Trace.save / run --trace, or recorded on gloo with TWINRPC_TRACE=dir.",
    )
    actions = parser.add_subparsers(dest="trace_command", metavar="ACTION")
    parser.set_defaults(func=lambda _args: _usage(parser))

    exp = actions.add_parser(
        "export",
        help="write a trace in a viewer's format",
        description="Formats: "
        + "; ".join(f"{name}: {what}" for name, (_suffix, what) in EXPORT_FORMATS.items()),
    )
    exp.add_argument("--format", "-f", required=True, choices=sorted(EXPORT_FORMATS), help="output format")
    exp.add_argument("trace", metavar="IN", help="a trace file (or a recorded gloo run's directory)")
    exp.add_argument("-o", "--output", metavar="OUT", help="output file (default: standard output)")
    exp.set_defaults(func=_export)

    diff = actions.add_parser(
        "diff",
        help="point at the first difference between two traces (exit 1 if they differ)",
        description="Exit status: 0 identical, 1 they differ, 2 an input could not be read.",
    )
    diff.add_argument("a", metavar="A", help="a trace file or recorded gloo run directory")
    diff.add_argument("b", metavar="B", help="the trace to compare it with")
    diff.add_argument(
        "--structural",
        action="store_true",
        help="compare each worker's sends and deliveries only, ignoring times and ids (sim vs gloo)",
    )
    diff.add_argument(
        "--kinds",
        metavar="KIND,...",
        help="with --structural: compare only these message kinds (e.g. CALL,RESPONSE)",
    )
    diff.add_argument("--context", type=int, default=3, help="events of context around the difference")
    diff.set_defaults(func=_diff)


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return 2


class _BadInput(Exception):
    pass


def _load(path: str) -> Trace:
    p = Path(path)
    if not p.exists():
        raise _BadInput(f"{path}: no such trace file or directory")
    try:
        return Trace.load(p)
    except (TraceFormatError, FileNotFoundError) as exc:
        raise _BadInput(str(exc))


def _export(args: argparse.Namespace) -> int:
    try:
        trace = _load(args.trace)
    except _BadInput as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    text = trace.export(args.format, args.output)
    if args.output is None:
        sys.stdout.write(text)
    else:
        print(f"wrote {args.output} ({args.format}, {len(trace)} events)", file=sys.stderr)
    return 0


def _diff(args: argparse.Namespace) -> int:
    try:
        if args.context < 0:
            raise _BadInput(f"--context must be >= 0, got {args.context}")
        kinds = [k.strip().upper() for k in args.kinds.split(",") if k.strip()] if args.kinds else None
        if kinds is not None and not args.structural:
            raise _BadInput("--kinds filters a structural comparison: add --structural")
        unknown = sorted(set(kinds or ()) - {k.name for k in Kind})
        if unknown:
            raise _BadInput(
                f"--kinds: unknown message kind(s) {', '.join(unknown)}; known: {', '.join(k.name for k in Kind)}"
            )
        a, b = _load(args.a), _load(args.b)
    except _BadInput as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    divergence = diff_traces(a, b, structural=args.structural, kinds=kinds, context=args.context)
    if divergence is None:
        what = "message sequences of every worker" if args.structural else f"{len(a)} events"
        print(f"identical: {what} (A {args.a}, B {args.b})")
        return 0
    print(divergence.describe((f"A ({args.a})", f"B ({args.b})")))
    return 1

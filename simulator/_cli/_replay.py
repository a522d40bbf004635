"""``python -m twinrpc.simulator replay``: run a program function once under one case, as explore found it.

::

    python -m twinrpc.simulator replay package.module:program --world-size 3 --seed 7 \\
        --faults '{"actions": [...]}' [--network '{...}'] [--compute '{...}'] [--args '[...]'] \\
        [--check module:function]

``TARGET`` is ``module:function`` (an importable module) or ``path/to/file.py:function``. The run is
:func:`twinrpc.simulator.replay`: the exit status is 0 when it passes and 1 when it fails, printing the
error and which worker raised it. This is the command :func:`twinrpc.simulator.explore` prints for a
program it can name; an unchanged script is replayed with ``run`` instead.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import sys
import traceback
from pathlib import Path
from typing import Any

from .._errors import ReplayError
from .._exploration._case import replay
from .._model._files import compute_from_text, network_from_text, plan_from_text


def load_target(target: str) -> Any:
    """The function ``module:qualname`` or ``file.py:qualname`` names."""
    where, sep, qualname = target.rpartition(":")
    if not sep or not where or not qualname:
        raise ReplayError(f"{target!r}: expected module:function or path/to/file.py:function")
    if where.endswith(".py"):
        path = Path(where)
        if not path.is_file():
            raise ReplayError(f"{target!r}: no file {where}")
        spec = importlib.util.spec_from_file_location(path.stem, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules.setdefault(path.stem, module)
        sys.path.insert(0, str(path.resolve().parent))
        spec.loader.exec_module(module)
        found: Any = module
    else:
        if "" not in sys.path:
            sys.path.insert(0, "")  # as python -m does: modules of the current directory import
        try:
            found = importlib.import_module(where)
        except ImportError as exc:
            raise ReplayError(f"{target!r}: cannot import {where}: {exc}") from exc
    for part in qualname.split("."):
        try:
            found = getattr(found, part)
        except AttributeError as exc:
            raise ReplayError(f"{target!r}: {where} has no {qualname}") from exc
    if not callable(found):
        raise ReplayError(f"{target!r} is not a function")
    return found


def _json_arg(text: str, flag: str) -> Any:
    source = text
    if not text.lstrip().startswith(("{", "[")):
        path = Path(text)
        if not path.is_file():
            raise ReplayError(f"{flag} {text!r}: neither JSON nor a file")
        source = path.read_text(encoding="utf-8")
    try:
        return json.loads(source)
    except ValueError as exc:
        raise ReplayError(f"{flag}: not JSON: {exc}") from exc


def register(subparsers: Any) -> None:
    """Add the ``replay`` subcommand."""
    p = subparsers.add_parser(
        "replay",
        help="run a program function once under one seed and fault plan (what explore prints)",
        description=__doc__.splitlines()[0] if __doc__ else None,
    )
    p.add_argument("target", metavar="TARGET", help="module:function or path/to/file.py:function")
    p.add_argument("--world-size", type=int, required=True, metavar="N")
    p.add_argument("--seed", type=int, default=0, help="the simulation's seed (default 0)")
    p.add_argument("--faults", metavar="PLAN", help="the fault plan: JSON text, or a JSON/TOML file")
    p.add_argument("--network", metavar="MODEL", help="the network model's fields: JSON text or file")
    p.add_argument("--compute", metavar="MODEL", help="the compute model's fields: JSON text or file")
    p.add_argument("--args", metavar="JSON", help="extra arguments of every worker's program, a JSON list")
    p.add_argument("--check", metavar="TARGET", help="module:function judging the run's result")
    p.set_defaults(func=replay_command)


def replay_command(args: argparse.Namespace) -> int:
    """``replay``'s entry point: 0 when the run passes, 1 when it fails, 2 on bad input."""
    try:
        if args.world_size < 1:
            raise ReplayError(f"--world-size {args.world_size}: at least one worker")
        program = load_target(args.target)
        check = load_target(args.check) if args.check else None
        faults = plan_from_text(args.faults, "--faults") if args.faults else None
        network = network_from_text(args.network, "--network") if args.network else None
        compute = compute_from_text(args.compute, "--compute") if args.compute else None
        extra = _json_arg(args.args, "--args") if args.args else []
        if not isinstance(extra, list):
            raise ReplayError(f"--args must be a JSON list, got {args.args}")
    except (ReplayError, ValueError, TypeError, OSError) as exc:
        print(f"python -m twinrpc.simulator replay: {exc}", file=sys.stderr)
        return 2
    plan = faults.describe() if faults is not None else "no faults"
    print(f"replay: {args.target} on {args.world_size} workers, seed {args.seed}, {plan}", flush=True)
    try:
        result = replay(
            program,
            args.world_size,
            seed=args.seed,
            faults=faults,
            network=network,
            compute=compute,
            args=extra,
            check=check,
        )
    except Exception:
        traceback.print_exc()
        print("replay: the run failed (see above)", file=sys.stderr)
        return 1
    print(
        f"replay: the run passed (virtual time {result.virtual_time:.6f} s, trace digest {result.digest[:16]})"
    )
    return 0

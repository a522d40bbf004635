"""``python -m twinrpc.simulator explore``: explore an unchanged program over seeds and fault plans.

::

    python -m twinrpc.simulator explore --nproc-per-node 3 [--runs 200] [--swarm] [--seed S]
        [--network FILE] [--compute FILE] [--max-time T] [--shrink-runs N] [--out DIR]
        [--jobs J] [--shard I/N] prog.py ARGS...
    python -m twinrpc.simulator explore merge [--out DIR] SHARD_DIR...

Each run is what ``python -m twinrpc.simulator run`` does (:mod:`twinrpc.simulator._launch._launch`), under a
seed and a fault plan drawn as :func:`twinrpc.simulator.explore` draws them (``--swarm``: the seed
draws the faults too). A run fails when any of its processes, children included, ends with an
uncaught exception, when a worker exits non-zero, or when the simulation hangs; the first exception
to happen is the failure, and hypothesis shrinks the run to the smallest one that fails the same way.
The minimal plan is written to ``DIR/faults.json``, a regression test to ``DIR/test_<program>_regression.py``,
and the ``run`` command that replays the minimal run is printed. Both carry the environment variables
the program read (:func:`~twinrpc.simulator._launch._launch.replay_environment`, over all the runs: each run
starts from the same environment), set or unset as they were. Exit status 0 when every run passed,
1 when one failed, 2 on bad input.

The runs are searched in blocks by ``--jobs`` worker processes (:mod:`.._exploration._parallel`); the
failure with the lowest run index is reported, so the number of jobs does not change it.
``--shard I/N`` and ``merge`` spread the blocks over machines (:mod:`._shards`).
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import os
import shlex
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .._errors import LaunchError, ProgramError, SimulationDeadlock, SimulationError
from .._exploration._case import Case, _Outcome
from .._exploration._failure import Failure
from .._exploration._parallel import ExplorationPlan, Found, default_jobs, explore_blocks, prepare_jobs
from .._exploration._reproduce import regression_header
from .._launch._launch import LaunchOptions, environment_prefix, launch, load_compute, load_network
from .._model._network import NetworkModel


def parse_traceback(text: str) -> tuple[str, str]:
    """(exception type name, message) of the last exception a printed traceback shows."""
    lines = text.rstrip("\n").splitlines()
    start = 0
    for i, line in enumerate(lines):
        if line.startswith("  File "):
            start = i + 1
    while start < len(lines) and (lines[start].startswith(" ") or not lines[start].strip()):
        start += 1  # the last frame's source line and carets
    tail = lines[start:] or lines[-1:] or [""]
    head, sep, rest = tail[0].partition(": ")
    name = head.strip() if sep or ":" not in head else head.rstrip(":")
    message = "\n".join([rest, *tail[1:]]) if sep else "\n".join(tail[1:])
    if "." not in name:
        name = f"builtins.{name}"
    return name, message.strip()


def _outcome(
    options: LaunchOptions, case: Case, workdir: Path, environment: dict[str, str | None]
) -> _Outcome:
    """Run ``case``; what it read of the environment is added to ``environment``."""
    plan_file = workdir / "faults.json"
    plan_file.write_text(case.faults.to_json(), encoding="utf-8")
    opts = dataclasses.replace(options, seed=case.seed, faults=str(plan_file))
    if case.network is not None:
        net_file = workdir / "network.json"
        net_file.write_text(json.dumps(case.network.to_dict()), encoding="utf-8")
        opts = dataclasses.replace(opts, network=str(net_file))
    sink = io.StringIO()
    result = launch(opts, stdout=sink, stderr=sink)
    environment.update(result.environment)
    if result.tracebacks:
        when, rank, _pid, text = result.tracebacks[0]
        name, message = parse_traceback(text)
        then: BaseException | None = result.error
        if then is None and len(result.tracebacks) > 1:
            later = result.tracebacks[1]
            then = ProgramError(*parse_traceback(later[3]), later[3])
        return _Outcome(
            None, ProgramError(name, message, text), rank, when, then=then, duration=result.virtual_time
        )
    if result.error is not None:
        return _Outcome(None, result.error, None, result.virtual_time, duration=result.virtual_time)
    if result.status != 0:
        codes = ", ".join(f"rank {r}: {c}" for r, c in enumerate(result.exitcodes) if c != 0)
        return _Outcome(
            None, ProgramError("builtins.SystemExit", f"exit codes {codes}", ""), duration=result.virtual_time
        )
    return _Outcome(None, duration=result.virtual_time)


def run_command_line(
    options: LaunchOptions,
    case: Case,
    plan_path: str,
    network_path: str | None,
    environment: Mapping[str, str | None] | None = None,
) -> str:
    """The ``run`` command that replays ``case`` (its plan written to ``plan_path``), after the
    environment the program read (:func:`~twinrpc.simulator._launch._launch.environment_prefix`)."""
    cmd = ["python", "-m", "twinrpc.simulator", "run", "--nproc-per-node", str(options.nproc_per_node)]
    cmd += ["--seed", str(case.seed), "--faults", plan_path]
    if network_path is not None:
        cmd += ["--network", network_path]
    if options.compute is not None:
        cmd += ["--compute", options.compute]
    if options.max_time is not None:
        cmd += ["--max-time", repr(options.max_time)]
    return environment_prefix(environment or {}) + shlex.join([*cmd, options.program, *options.args])


def export_program_test(
    failure: Failure,
    options: LaunchOptions,
    out_dir: Path,
    name: str,
    expect: str,
    environment: Mapping[str, str | None] | None = None,
) -> str:
    """A pytest file that runs the program under the minimal case with ``run`` in a fresh interpreter,
    and asserts it passes (or, ``expect="fail"``, that it fails the known way). The interpreter gets
    the test's own environment with ``environment`` applied: the variables the program read, set
    (``ENVIRONMENT``) or unset (``UNSET``) as they were in the failing run."""
    environment = environment or {}
    setenv = {k: v for k, v in environment.items() if v is not None}
    unset = [k for k, v in environment.items() if v is None]
    program = os.path.relpath(os.path.abspath(options.program), os.path.abspath(out_dir))
    network = None if failure.network is None else failure.network.to_dict()
    compute = None if options.compute is None else load_compute(options.compute).to_dict()
    args = [
        "--nproc-per-node",
        str(options.nproc_per_node),
        "--seed",
        str(failure.seed),
    ]
    if options.max_time is not None:
        args += ["--max-time", repr(options.max_time)]
    body = [
        "plan = tmp_path / 'faults.json'",
        "plan.write_text(json.dumps(FAULTS), encoding='utf-8')",
        "extra = []",
        "if NETWORK is not None:",
        "    (tmp_path / 'network.json').write_text(json.dumps(NETWORK), encoding='utf-8')",
        "    extra = ['--network', str(tmp_path / 'network.json')]",
        "if COMPUTE is not None:",
        "    (tmp_path / 'compute.json').write_text(json.dumps(COMPUTE), encoding='utf-8')",
        "    extra += ['--compute', str(tmp_path / 'compute.json')]",
        "env = {k: v for k, v in os.environ.items() if k not in UNSET}",
        "env.update(ENVIRONMENT)",
        "run = subprocess.run(",
        "    [sys.executable, '-m', 'twinrpc.simulator', 'run', *RUN_ARGS, '--faults', str(plan), *extra,",
        "     str(PROGRAM), *PROGRAM_ARGS],",
        "    cwd=PROGRAM.parent, env=env, capture_output=True, text=True, timeout=600,",
        ")",
    ]
    if expect == "pass":
        doc = "The run that failed now passes: no process ends with an exception, every rank exits 0."
        body += [
            "assert run.returncode == 0 and 'Traceback (most recent call last)' not in run.stderr, (",
            "    run.stdout + run.stderr",
            ")",
        ]
    else:
        doc = "The run still fails the known way (remove this test, or switch it to passing, once fixed)."
        type_name = failure.exception_type.rpartition(".")[2]
        body += [
            f"assert {type_name + ': '!r} in run.stderr, run.stdout + run.stderr",
            "assert re.search(PATTERN, run.stderr), run.stdout + run.stderr",
        ]
    return "\n".join(
        [
            *regression_header(failure),
            "",
            "from __future__ import annotations",
            "",
            "import json",
            "import os",
            *(["import re"] if expect == "fail" else []),
            "import subprocess",
            "import sys",
            "from pathlib import Path",
            "",
            f"PROGRAM = Path(__file__).parent / {program!r}",
            f"PROGRAM_ARGS = {list(options.args)!r}",
            f"RUN_ARGS = {args!r}",
            f"FAULTS = {failure.faults_data!r}",
            f"NETWORK = {network!r}",
            f"COMPUTE = {compute!r}",
            f"PATTERN = {failure.pattern!r}",
            "#: the environment variables the program read, as the failing run had them (set, or unset)",
            f"ENVIRONMENT = {setenv!r}",
            f"UNSET = {unset!r}",
            "",
            "",
            f"def {name}(tmp_path: Path) -> None:",
            f'    """{doc}"""',
            *(f"    {line}" for line in body),
            "",
        ]
    )


def register(subparsers: Any) -> None:
    """Add the ``explore`` subcommand."""
    p = subparsers.add_parser(
        "explore",
        help="run a program over many seeds and fault plans; shrink the first failure",
        description=(
            "Run PROGRAM as N simulated workers (as 'run' does) under seeds and fault plans drawn by "
            "hypothesis; shrink the first failing run, write its plan and a regression test, and print "
            "the command that replays it."
        ),
    )
    p.add_argument("--nproc-per-node", "--nproc_per_node", type=int, default=1, metavar="N")
    p.add_argument("--runs", type=int, default=200, metavar="R", help="runs before giving up (default 200)")
    p.add_argument(
        "--swarm", action="store_true", help="each run's seed draws its faults too (swarm testing)"
    )
    p.add_argument(
        "--seed", type=int, default=0, help="the exploration's seed: same seed, same runs (default 0)"
    )
    p.add_argument("--network", metavar="FILE", help="a NetworkModel as JSON or TOML, for every run")
    p.add_argument(
        "--compute",
        metavar="FILE",
        help="a ComputeModel as JSON or TOML, for every run: virtual time for torch operators",
    )
    p.add_argument(
        "--max-time", type=float, metavar="T", help="fail a run once virtual time passes T seconds"
    )
    p.add_argument(
        "--shrink-runs", type=int, default=200, metavar="N", help="at most N runs to shrink (default 200)"
    )
    p.add_argument(
        "--out", default="explore-out", metavar="DIR", help="where the plan and test go (explore-out)"
    )
    p.add_argument(
        "--expect",
        choices=("pass", "fail"),
        default="pass",
        help="the regression test asserts the run passes (commit it with the fix, the default) or still "
        "fails the known way (pin a bug not fixed yet)",
    )
    p.add_argument(
        "--jobs",
        "-j",
        type=_jobs,
        metavar="J",
        help="worker processes searching at once (default: this machine's cores); the same --seed "
        "finds the same first failure whatever J",
    )
    p.add_argument(
        "--shard",
        type=_shard,
        metavar="I/N",
        help="run only the I-th of N disjoint parts of the exploration (I from 0), without shrinking, "
        "and write its results to DIR/shard-I-of-N.json; 'explore merge DIR...' gathers the parts",
    )
    p.add_argument("program", metavar="PROGRAM")
    p.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS")
    p.set_defaults(func=explore_command)


class ProgramRunner:
    """Runs one case of a program file as ``run`` does (:func:`_outcome`), in a working directory of
    its own: one per process of a parallel exploration (it is pickled into each)."""

    #: what the server the worker processes fork from imports first: what a run imports (torch, the
    #: launcher, and torch.distributed.nn and .optim, which it serves twinrpc's in place of), so that a
    #: job imports nothing before its first run
    preload = ("torch", __name__, "twinrpc.simulator._launch._torch")

    def __init__(self, options: LaunchOptions, network: NetworkModel | None) -> None:
        self.options = options
        #: ``--network``: every run's model
        self.network = network
        self.environment: dict[str, str | None] = {}
        self._workdir: tempfile.TemporaryDirectory[str] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"options": self.options, "network": self.network, "environment": {}, "_workdir": None}

    def run(self, case: Case) -> _Outcome:
        if self._workdir is None:
            self._workdir = tempfile.TemporaryDirectory(prefix="twinrpc-explore-")
        if self.network is not None and case.network is None:
            case = Case(case.seed, case.faults, self.network)
        return _outcome(self.options, case, Path(self._workdir.name), self.environment)

    def close(self) -> None:
        if self._workdir is not None:
            self._workdir.cleanup()
            self._workdir = None


def _jobs(text: str) -> int:
    jobs = int(text)
    if jobs < 1:
        raise argparse.ArgumentTypeError(f"--jobs {text}: at least 1")
    return jobs


def _shard(text: str) -> tuple[int, int]:
    index, sep, count = text.partition("/")
    try:
        shard = (int(index), int(count))
    except ValueError:
        shard = (-1, 0)
    if not sep or not 0 <= shard[0] < shard[1]:
        raise argparse.ArgumentTypeError(f"--shard {text}: expected I/N with 0 <= I < N (e.g. 3/16)")
    return shard


def explore_command(args: argparse.Namespace) -> int:
    """``explore``'s entry point: the exit status."""
    if args.program == "merge":
        from ._shards import merge_command  # _shards builds on this module: imported when used

        return merge_command(args.args)
    err = sys.stderr
    if args.nproc_per_node < 1 or args.runs < 1 or args.shrink_runs < 0:
        print("explore: --nproc-per-node and --runs must be at least 1, --shrink-runs at least 0", file=err)
        return 2
    options = LaunchOptions(
        program=args.program,
        args=tuple(args.args),
        nproc_per_node=args.nproc_per_node,
        compute=args.compute,
        max_time=args.max_time,
    )
    try:
        network = load_network(args.network) if args.network else None
        if args.compute:
            load_compute(args.compute)  # bad input is reported before the first run
        if not Path(args.program).is_file():
            raise LaunchError(f"can't open file {args.program!r}: no such file")
    except (LaunchError, ValueError) as exc:
        print(f"python -m twinrpc.simulator explore: {exc}", file=err)
        return 2
    plan = ExplorationPlan(
        ProgramRunner(options, network),
        args.nproc_per_node,
        seed=args.seed,
        runs=args.runs,
        swarm=args.swarm,
        max_shrink_runs=args.shrink_runs,
        shrink=args.shard is None,
    )
    jobs = default_jobs() if args.jobs is None else args.jobs
    try:
        if args.shard is not None:
            from ._shards import run_shard  # _shards builds on this module: imported when used

            return run_shard(plan, args, jobs)
        prepare_jobs(plan, jobs)
        calibration = plan.calibration()
        if calibration.run_baseline():  # seed 0 without faults fails: nothing is smaller
            environment = dict(plan.runner.environment)
            plan.runner.close()
            return report(Found.of_calibration(calibration), plan, args, environment)
        plan.runner.close()
        outcome = explore_blocks(plan, plan.blocks(), calibration.horizon, jobs=jobs)
    except (LaunchError, SimulationError) as exc:
        print(f"python -m twinrpc.simulator explore: {exc}", file=err)
        return 2
    if outcome.found is None:
        print(f"explore: {args.runs} runs of {args.program} passed (exploration seed {args.seed})")
        return 0
    environment = {**plan.runner.environment, **outcome.environment}
    return report(outcome.found, plan, args, environment)


def report(
    found: Found,
    plan: ExplorationPlan,
    args: argparse.Namespace,
    environment: Mapping[str, str | None],
) -> int:
    """Write the minimal plan and the regression test to ``args.out``, print the failure: status 1."""
    runner = plan.runner
    assert isinstance(runner, ProgramRunner)
    options, network = runner.options, runner.network
    case = found.best[0]
    if network is not None and case.network == network:
        case = Case(case.seed, case.faults, None)  # --network gives it on the command line
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    plan_path = out_dir / "faults.json"
    plan_path.write_text(case.faults.to_json() + "\n", encoding="utf-8")
    environment = dict(sorted(environment.items()))
    command = run_command_line(options, case, str(plan_path), args.network, environment)
    failure = found.failure(
        world_size=plan.world_size,
        program=None,
        args=(),
        check=None,
        command=lambda c: command,
        exporter=lambda f, name, expect: export_program_test(f, options, out_dir, name, expect, environment),
        case=case,
    )
    stem = "".join(ch if ch.isalnum() else "_" for ch in Path(options.program).stem)
    test_path = out_dir / f"test_{stem}_regression.py"
    test_path.write_text(failure.to_pytest(f"test_{stem}_regression", expect=args.expect), encoding="utf-8")
    print(failure.describe())
    error = failure.minimal_error
    if isinstance(error, ProgramError) and error.traceback_text:
        print("  traceback of the minimal run:\n" + error.traceback_text.rstrip())
    elif isinstance(error, SimulationDeadlock):
        print(f"  the simulation hung:\n{error}")
    print(f"  minimal plan written to {plan_path}; regression test written to {test_path}")
    return 1

"""``python -m twinrpc.simulator run``: run an unchanged program as N simulated workers, as torchrun does.

::

    python -m twinrpc.simulator run --nproc-per-node 3 [--seed S] [--network FILE] [--compute FILE] [--faults FILE]
        [--trace OUT] [--max-time T] [--check-determinism] prog.py ARGS...

Each worker is a simulated process (:mod:`twinrpc.simulator._launch._program`) that runs ``prog.py`` as
``__main__`` with torchrun's environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``...),
its own copy of the program's modules, and ``torch.distributed.rpc``/``.autograd``/
``DistributedOptimizer`` served by twinrpc (:mod:`twinrpc.simulator._launch._torch`). Time follows the
virtual clock (:mod:`twinrpc.simulator._kernel._virtual_time`). Output lines carry torchrun's rank prefix; the
exit status is 0 iff every worker exits 0, and a failure prints torchrun's ``ChildFailedError``
summary plus the command that replays the run.

That command carries the environment the program read (:func:`replay_environment`): each worker's
``os.environ`` records the variables the program's own code reads (:class:`~._program.EnvironmentReads`),
and those whose value is not what the command's own flags give them are written before it as
``VAR=value`` (or, for a variable that was unset, ``env -u VAR``, so that a replay does not see one the
replaying shell happens to export).

twinrpc's extension to torchrun's arguments: ``{rank}``, ``{local_rank}`` and ``{world_size}`` in the
program's arguments are replaced per worker (torchrun itself only knows ``${local_rank}``, also
replaced), so a program that takes its rank as an argument runs unchanged.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO, TypeVar, cast

import torch
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from .._config import SimConfig
from .._errors import LaunchError, SimulationDeadlock, SimulationError
from .._kernel._virtual_time import VIRTUAL_EPOCH, simulated_time
from .._model._compute import ComputeModel
from .._model._files import load_faults as read_faults
from .._model._network import NetworkModel
from .._model._plan import FaultPlan
from .._model._swarm import Swarm
from .._traces._trace import Trace
from ._processes import ProcessLauncher, simulated_processes
from ._program import ProcessImage, ProcessImages, RankStream, encode_environ, prefix_for

DEFAULT_PREFIX_TEMPLATE = "[rank${rank}]:"
DEFAULT_MASTER_ADDR = "127.0.0.1"
DEFAULT_MASTER_PORT = 29500
_PLACEHOLDER = re.compile(r"\{(rank|local_rank|world_size)\}|\$\{local_rank\}")


@dataclass(frozen=True)
class LaunchOptions:
    """Everything ``run`` needs (the parsed command line)."""

    program: str
    args: tuple[str, ...] = ()
    nproc_per_node: int = 1
    seed: int = 0
    network: str | None = None
    compute: str | None = None
    faults: str | None = None
    trace: str | None = None
    max_time: float | None = None
    master_addr: str = DEFAULT_MASTER_ADDR
    master_port: int = DEFAULT_MASTER_PORT
    log_line_prefix_template: str = DEFAULT_PREFIX_TEMPLATE
    local_ranks_filter: frozenset[int] | None = None

    def replay_command(self, environment: Mapping[str, str | None] | None = None) -> str:
        """The command line that runs exactly this run again: ``environment`` (the variables the
        program read, :attr:`LaunchResult.environment`) goes before it (:func:`environment_prefix`)."""
        cmd = ["python", "-m", "twinrpc.simulator", "run", "--nproc-per-node", str(self.nproc_per_node)]
        cmd += ["--seed", str(self.seed)]
        for flag, value in (
            ("--network", self.network),
            ("--compute", self.compute),
            ("--faults", self.faults),
        ):
            if value is not None:
                cmd += [flag, value]
        if self.max_time is not None:
            cmd += ["--max-time", repr(self.max_time)]
        if self.master_addr != DEFAULT_MASTER_ADDR:
            cmd += ["--master-addr", self.master_addr]
        if self.master_port != DEFAULT_MASTER_PORT:
            cmd += ["--master-port", str(self.master_port)]
        return environment_prefix(environment or {}) + shlex.join([*cmd, self.program, *self.args])


@dataclass(frozen=True)
class LaunchResult:
    """What a run ended with."""

    #: each rank's exit code (None: the rank never exited, the run hung or failed)
    exitcodes: tuple[int | None, ...]
    #: the status the command exits with: 0 iff every worker exited 0
    status: int
    virtual_time: float
    trace: Trace
    #: the simulation's own failure (a hang, max_time passed), if any
    error: SimulationError | None = None
    #: the uncaught exceptions of the run's processes (children included) in the order they exited:
    #: (virtual time, rank, pid, the traceback as Python prints it); what ``explore`` judges runs by
    tracebacks: tuple[tuple[float, int, int, str], ...] = ()
    #: the environment a replay needs (:func:`replay_environment`): variable -> value, None for unset
    environment: Mapping[str, str | None] = dataclasses.field(default_factory=dict)


def substitute(args: Sequence[str], rank: int, local_rank: int, world_size: int) -> list[str]:
    """``{rank}``, ``{local_rank}``, ``{world_size}`` and torchrun's ``${local_rank}`` replaced."""
    values = {"rank": rank, "local_rank": local_rank, "world_size": world_size}

    def one(m: re.Match[str]) -> str:
        return str(values[m.group(1)] if m.group(1) else local_rank)

    return [_PLACEHOLDER.sub(one, a) for a in args]


def torchrun_environment(options: LaunchOptions, rank: int, error_file: str) -> dict[str, str]:
    """The variables torchrun's local agent sets for worker ``rank`` (one node: local = global)."""
    n = options.nproc_per_node
    env = {
        "RANK": str(rank),
        "GROUP_RANK": "0",
        "ROLE_RANK": str(rank),
        "ROLE_NAME": "default",
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(n),
        "WORLD_SIZE": str(n),
        "GROUP_WORLD_SIZE": "1",
        "ROLE_WORLD_SIZE": str(n),
        "MASTER_ADDR": options.master_addr,
        "MASTER_PORT": str(options.master_port),
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_RUN_ID": "none",
        "TORCHELASTIC_USE_AGENT_STORE": "False",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
        "TORCHELASTIC_ERROR_FILE": error_file,
    }
    if "OMP_NUM_THREADS" in os.environ:
        env["OMP_NUM_THREADS"] = os.environ["OMP_NUM_THREADS"]
    elif n > 1:
        env["OMP_NUM_THREADS"] = "1"  # torchrun's default for more than one process per node
    return env


#: the launcher's variables a user's environment overrides: name -> the launcher's default (None: unset)
_OVERRIDABLE: dict[str, Callable[[LaunchOptions], str | None]] = {
    "OMP_NUM_THREADS": lambda options: "1" if options.nproc_per_node > 1 else None,
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": lambda options: "1",
}

#: variables the launcher reads on every worker's behalf, whether the program does or not (torch reads
#: OMP_NUM_THREADS at startup; here the launcher sets torch's threads from it)
READ_BY_THE_LAUNCHER = ("OMP_NUM_THREADS",)


def replay_environment(
    options: LaunchOptions, read: Sequence[str], environ: Mapping[str, str]
) -> dict[str, str | None]:
    """The variables a replay of the run must set (name -> value) or unset (name -> None).

    ``read``: the variables the program read (:class:`~._program.EnvironmentReads`);
    ``environ``: the launcher's environment the run started from. The *default* environment is what a
    fresh ``run`` gives a worker from an empty one: the torchrun variables of
    :func:`torchrun_environment`, and nothing else. So

    - a variable the launcher sets from its flags (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
      ``TORCHELASTIC_*``...) is left out: the command's flags (``--nproc-per-node``,
      ``--master-addr``, ``--master-port``) give it again;
    - ``OMP_NUM_THREADS`` (read by the launcher itself, whether the program reads it or not) and
      ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` are in when ``environ`` set them to something other than the
      launcher's default;
    - any other variable read is in: with its value when it was set, as None (unset it) when not.
    """
    launcher = torchrun_environment(options, 0, "")
    replay: dict[str, str | None] = {}
    for name in dict.fromkeys([*READ_BY_THE_LAUNCHER, *read]):
        value = environ.get(name)
        if name in _OVERRIDABLE:
            default = _OVERRIDABLE[name](options)
            if value is None or value == default:
                continue  # the launcher's default, which a replay gets again
        elif name in launcher:
            continue  # from the command's flags (or a temporary file: TORCHELASTIC_ERROR_FILE)
        replay[name] = value
    return dict(sorted(replay.items()))


def environment_prefix(environment: Mapping[str, str | None]) -> str:
    """What goes before a command to give it ``environment``: ``VAR=value `` assignments, or
    ``env -u VAR VAR=value `` when a variable must be unset or a name is not a shell identifier."""
    if not environment:
        return ""
    plain = all(v is not None and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k) for k, v in environment.items())
    if plain:
        return "".join(f"{k}={shlex.quote(v or '')} " for k, v in environment.items())
    words = ["env"]
    for name, value in environment.items():
        if value is None:
            words += ["-u", name]
    words += [f"{k}={v}" for k, v in environment.items() if v is not None]
    return shlex.join(words) + " "


# -- --network / --compute / --faults files --------------------------------------------------------
_T = TypeVar("_T")


def _read(flag: str, load: Callable[[str], _T], path: str) -> _T:
    """``load(path)`` (a reader of ``simulator/_model/``), its errors as bad input to ``flag``."""
    try:
        return load(path)
    except (OSError, ValueError) as exc:
        raise LaunchError(f"{flag}: {exc}") from exc


def load_network(path: str) -> NetworkModel:
    """A :class:`NetworkModel` from a JSON or TOML file of its fields."""
    return _read("--network", NetworkModel.load, path)


def load_compute(path: str) -> ComputeModel:
    """A :class:`ComputeModel` from a JSON or TOML file of its fields."""
    return _read("--compute", ComputeModel.load, path)


def load_faults(path: str) -> FaultPlan | Swarm:
    """A :class:`FaultPlan` (or a :class:`Swarm`) from a JSON or TOML file
    (:doc:`/howto/fault-plan`)."""
    return _read("--faults", read_faults, path)


# -- the run -------------------------------------------------------------------------------------------
def launch(
    options: LaunchOptions, *, stdout: TextIO | None = None, stderr: TextIO | None = None
) -> LaunchResult:
    """Run the program as ``options.nproc_per_node`` simulated workers and report as torchrun does."""
    # heavy: torch.distributed.nn and .optim, which _torch serves twinrpc's in place of, take seconds
    # to import; only a run needs them, not the other subcommands that load this module
    from ._torch import serve_torch_rpc

    out = stdout if stdout is not None else sys.stdout
    err = stderr if stderr is not None else sys.stderr
    n = options.nproc_per_node
    if n < 1:
        raise LaunchError(f"--nproc-per-node must be at least 1, got {n}")
    path = os.path.abspath(options.program)
    try:
        source = Path(path).read_bytes()
    except OSError as exc:
        raise LaunchError(f"can't open file {path!r}: [Errno {exc.errno}] {exc.strerror}") from exc
    network = load_network(options.network) if options.network else None
    compute = load_compute(options.compute) if options.compute else None
    faults = load_faults(options.faults) if options.faults else None
    code = compile(source, path, "exec")
    try:
        sim = SimConfig(
            n, seed=options.seed, network=network, faults=faults, compute=compute, max_time=options.max_time
        ).build()
    except ValueError as exc:  # a plan naming a worker the run does not have, a bad max_time
        raise LaunchError(str(exc)) from exc
    images = ProcessImages(os.path.dirname(path), seed=options.seed)
    environ = dict(os.environ)  # what the run starts from, before the program changes anything
    launcher = ProcessLauncher(sim, images, path, code)
    shown = options.local_ranks_filter
    error: SimulationError | None = None
    with tempfile.TemporaryDirectory(prefix="twinrpc-sim-") as logs:
        error_files = []
        for rank in range(n):
            error_file = os.path.join(logs, "attempt_0", str(rank), "error.json")
            os.makedirs(os.path.dirname(error_file))
            error_files.append(error_file)
            prefix = prefix_for(options.log_line_prefix_template, rank, rank)
            show = shown is None or rank in shown
            env = torchrun_environment(options, rank, error_file)
            launcher.add_main(
                ProcessImage(
                    pid=images.new_pid(),
                    rank=rank,
                    local_rank=rank,
                    environ=images.environment.environ(
                        encode_environ(os.environ._data, env)  # type: ignore[attr-defined]
                    ),
                    argv=[options.program, *substitute(options.args, rank, rank, n)],
                    stdout=cast(TextIO, RankStream(out, prefix, show=show)),
                    stderr=cast(TextIO, RankStream(err, prefix, show=show)),
                )
            )
        threads = int(os.environ.get("OMP_NUM_THREADS", "1" if n > 1 else "0") or 0)
        with (
            _process_globals(threads),
            simulated_time(virtual=True),
            serve_torch_rpc(),
            simulated_processes(launcher),
            images,
        ):
            try:
                sim.run(lambda rank: launcher.run_main(launcher.main_image(rank)))
            except SimulationError as exc:
                error = exc
        exitcodes = tuple(launcher.main_image(r).exitcode for r in range(n))
        failed = error is not None or any(c != 0 for c in exitcodes)
        replay = replay_environment(options, images.environment.names(), environ)
        if failed:
            _report_failure(options, launcher, exitcodes, error_files, error, err, replay)
    if options.trace is not None:
        sim.trace.save(options.trace)
    tracebacks = tuple(
        sorted((p.exit_time or 0.0, p.rank, p.pid, p.error) for p in launcher.processes if p.error)
    )
    return LaunchResult(exitcodes, 1 if failed else 0, sim.now, sim.trace, error, tracebacks, replay)


@contextmanager
def _process_globals(threads: int) -> Iterator[None]:
    """What every worker process would set up for itself, for the run: torch's intra-op threads as
    ``OMP_NUM_THREADS`` says (torchrun's default is 1 with more than one process per node). Restored
    afterwards. (Each process's random generators are its own: ``_random_state``.)"""
    saved = torch.get_num_threads()
    if threads > 0:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def _report_failure(
    options: LaunchOptions,
    launcher: ProcessLauncher,
    exitcodes: tuple[int | None, ...],
    error_files: list[str],
    error: SimulationError | None,
    err: TextIO,
    environment: Mapping[str, str | None],
) -> None:
    if error is not None:
        what = "hung" if isinstance(error, SimulationDeadlock) else "failed"
        print(f"twinrpc.simulator: the simulation {what} at t={launcher.sim.now:.6f} s:\n{error}", file=err)
        for process in launcher.processes:  # what a program's own launcher may not have shown
            if process.error is not None and process.parent is not None:
                print(
                    f"twinrpc.simulator: before that, simulated process pid {process.pid} (rank "
                    f"{process.rank}, started by pid {process.parent.pid}) failed at "
                    f"t={process.exit_time or 0.0:.6f} s:\n{process.error}",
                    file=err,
                )
    failures: dict[int, ProcessFailure] = {}
    for rank, code in enumerate(exitcodes):
        if code is None or code == 0:
            continue
        image = launcher.main_image(rank)
        failure = ProcessFailure(local_rank=rank, pid=image.pid, exitcode=code, error_file=error_files[rank])
        if failure.error_file_data.get("message") == "<NONE>" or not os.path.isfile(error_files[rank]):
            failure.timestamp = VIRTUAL_EPOCH + (image.exit_time or 0.0)  # type: ignore[assignment]
        failures[rank] = failure
    if failures:
        summary = ChildFailedError(name=options.program, failures=failures)
        print(f"{type(summary).__module__}.{type(summary).__name__}: {summary}", file=err)
    hung = [r for r, c in enumerate(exitcodes) if c is None]
    if hung:
        print(f"twinrpc.simulator: rank(s) {hung} did not exit", file=err)
    print(f"twinrpc.simulator: replay this run with: {options.replay_command(environment)}", file=err)
    err.flush()


# -- the subcommand --------------------------------------------------------------------------------------

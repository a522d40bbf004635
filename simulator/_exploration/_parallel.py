"""An exploration cut into blocks of runs, so that worker processes (``explore --jobs``) and machines
(``explore --shard``) can search it in parallel and still report what one process would.

Runs are numbered from 1; run 1 is the calibration run (seed 0, no faults), made before any block.
Block ``b`` holds runs ``b * BLOCK_RUNS + 1`` to ``(b + 1) * BLOCK_RUNS`` and is one hypothesis search
of its own, seeded with :func:`block_seed` and tuned as an exploration of :data:`TUNED_FOR` runs. So
run ``i`` of an exploration is the same case whatever the number of jobs or shards, and the failure
reported is the one with the lowest run index: a block that finds one stops the blocks above it, and
the blocks below it still running are waited for. Block 0's seed is the exploration's own, so that an
exploration of up to :data:`BLOCK_RUNS` runs is the sequential one's (:class:`._search._Search`).

The block that reports the failure shrinks it in its own process (a block's search goes on from the
failing run to shrinking), within the shrink budget; a shard does not shrink, and ``explore merge``
runs the failing block again, in order, to reach the same failing run and shrink it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import multiprocessing
import os
import pickle
import queue
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TextIO

from .._errors import ProgramError, SimulationError
from ._case import Case, _Outcome
from ._failure import Failure
from ._search import _Search, cases, failure_of
from ._signature import _Signature, _type_name

if TYPE_CHECKING:
    from hypothesis.strategies import SearchStrategy

#: runs in a block: the unit of work a job takes, and of what a block's search explores on its own
BLOCK_RUNS = 20
#: what every job imports to search: the server the jobs fork from imports it once, before they fork
#: (a run does not depend on what its process imported before: tests/sim/test_trace_determinism.py)
SEARCH_MODULES = ("hypothesis", "hypothesis.strategies", __name__)
#: the exploration length a block's hypothesis search is tuned for (the ``explore`` default's), so
#: that block 0 draws the cases the sequential exploration draws first
TUNED_FOR = 200


class CaseRunner(Protocol):
    """Runs one case of the explored program; pickled into every worker process."""

    #: the environment variables the runs read, set or unset (see ``explore``'s replay command)
    environment: dict[str, str | None]

    def run(self, case: Case) -> _Outcome: ...

    # optional: ``run_drawn(draw)``, a run that draws its case itself with ``draw(world_size)`` (a
    # pytest test, which knows its world size only when it runs)

    # optional: ``preload``, the modules the server the worker processes fork from imports first
    # (forkserver), besides the search's own (:data:`SEARCH_MODULES`): whatever the runs import, so
    # that a job starts searching as soon as it is forked instead of importing them again

    def close(self) -> None: ...


@dataclass(frozen=True)
class ExplorationPlan:
    """What every block of one exploration shares."""

    runner: CaseRunner
    world_size: int
    #: the exploration's seed
    seed: int
    #: runs in all, the calibration run included
    runs: int
    swarm: bool = False
    max_shrink_runs: int = 200
    #: shrink a failure where it is found (``explore --shard`` leaves that to ``explore merge``)
    shrink: bool = True
    #: the strategy of cases for a world size and the program's length (None: the default fault
    #: plans, or with ``swarm`` the seeds' swarm plans); must pickle unless the jobs fork
    cases: Callable[[int, float | None], SearchStrategy[Case]] | None = None
    #: whether run 1 is the calibration run (else the blocks' default fault plans span one second)
    calibrate: bool = True
    #: the calibration run's case
    baseline: Case = dataclasses.field(default_factory=lambda: Case(0))

    def blocks(self) -> range:
        """The block indices of the whole exploration."""
        return range(-(-self.runs // BLOCK_RUNS))

    def calibration(self) -> _Search:
        """The search that makes the calibration run (run 1): ``run_baseline()`` runs it."""
        return _Search(
            _body(self, self.runner),
            self.strategy,
            runs=self.runs,
            seed=self.seed,
            shrink=False,
            calibrate=self.calibrate,
            baseline=self.baseline,
        )

    def strategy(self, world_size: int, horizon: float | None) -> SearchStrategy[Case]:
        if self.cases is not None:
            return self.cases(world_size, horizon)
        return cases(world_size, None, None, None, horizon, self.swarm)

    def block_search(
        self,
        block: int,
        runner: CaseRunner,
        horizon: float | None,
        *,
        cancelled: Callable[[], bool] = lambda: False,
        on_run: Callable[[], None] = lambda: None,
        on_found: Callable[[], None] = lambda: None,
    ) -> _Search:
        """Block ``block``'s search (its runs numbered from the block's start). ``cancelled`` ends it
        before any run; ``on_found`` is called once, before the first run after it found a failure (so
        that the blocks above can stop while it shrinks)."""
        first = block * BLOCK_RUNS
        told: list[bool] = []

        def stop() -> bool:
            if search.found_at is not None and not told:
                told.append(True)
                on_found()
            # its budget spent: end it, where hypothesis would go on drawing (cached) cases
            return cancelled() or (search.found_at is None and search.calls >= search.runs)

        search = _Search(
            _body(self, runner, on_run),
            self.strategy,
            runs=min(BLOCK_RUNS, self.runs - first),
            seed=block_seed(self.seed, block),
            shrink=self.shrink and not self.swarm,
            max_shrink_runs=self.max_shrink_runs,
            minimize=self.shrink and self.swarm,
            tuned_for=TUNED_FOR,
            stop=stop,
        )
        search.after_baseline(horizon, counted=block == 0 and self.calibrate)
        return search


def block_seed(seed: int, block: int) -> int:
    """The seed of block ``block``'s search: the exploration's own for block 0, else derived from both."""
    if block == 0:
        return seed
    digest = hashlib.sha256(f"twinrpc.simulator.explore:{seed}:{block}".encode()).digest()
    return int.from_bytes(digest[:8], "big")


def _body(
    plan: ExplorationPlan, runner: CaseRunner, on_run: Callable[[], None] = lambda: None
) -> Callable[[Callable[[int], Case]], _Outcome]:
    drawn = getattr(runner, "run_drawn", None)

    def body(draw: Callable[[int], Case]) -> _Outcome:
        outcome = drawn(draw) if drawn is not None else runner.run(draw(plan.world_size))
        on_run()
        return outcome

    return body


@dataclass(frozen=True)
class Found:
    """A failure a block found (and shrank, unless the plan says not to), in plain picklable parts."""

    block: int
    first: tuple[Case, _Outcome]
    best: tuple[Case, _Outcome]
    signature: _Signature
    #: the failing run's index in the whole exploration
    found_at: int
    #: the index the block's last run (shrinking included) would have
    calls: int

    def failure(self, **how: Any) -> Failure:
        """The :class:`Failure` it is; ``how`` as for :meth:`_Search.failure`."""
        return failure_of(
            self.first, self.best, self.signature, found_at=self.found_at, calls=self.calls, **how
        )

    @classmethod
    def of_calibration(cls, search: _Search) -> Found:
        """The failure of the calibration run (run 1): minimal already."""
        assert search.first is not None and search.signature is not None
        return cls(0, _portable(search.first), _portable(search.first), search.signature, 1, 1)


@dataclass(frozen=True)
class BlockResult:
    block: int
    #: runs the block made (shrinking included; block 0's calibration run not)
    runs: int
    found: Found | None = None


def run_block(
    plan: ExplorationPlan,
    block: int,
    runner: CaseRunner,
    horizon: float | None,
    *,
    cancelled: Callable[[], bool] = lambda: False,
    on_run: Callable[[], None] = lambda: None,
    on_found: Callable[[], None] = lambda: None,
) -> BlockResult:
    """Search block ``block`` (in this process) until its budget is spent or it finds a failure, which
    it then shrinks as far as the plan says."""
    search = plan.block_search(block, runner, horizon, cancelled=cancelled, on_run=on_run, on_found=on_found)
    start = 1 if block == 0 and plan.calibrate else 0
    search.run()
    runs = search.calls - start
    if search.first is None or cancelled():
        return BlockResult(block, runs)
    assert search.best is not None and search.signature is not None and search.found_at is not None
    offset = block * BLOCK_RUNS
    found = Found(
        block,
        _portable(search.first),
        _portable(search.best),
        search.signature,
        offset + search.found_at,
        offset + search.calls,
    )
    return BlockResult(block, runs, found)


def _portable(run: tuple[Case, _Outcome]) -> tuple[Case, _Outcome]:
    """A run whose errors survive pickling (to the parent process): any error that does not is sent
    as a :class:`ProgramError` with its type's name, message and traceback."""
    case, outcome = run
    return case, dataclasses.replace(
        outcome, result=None, error=_portable_error(outcome.error), then=_portable_error(outcome.then)
    )


def _portable_error(exc: BaseException | None) -> BaseException | None:
    if exc is None:
        return None
    try:
        copy = pickle.loads(pickle.dumps(exc))
        if type(copy) is type(exc) and str(copy) == str(exc):
            return exc
    except Exception:
        pass
    text = "".join(traceback.format_exception(exc))
    return ProgramError(_type_name(exc), str(exc), text)


@dataclass
class Progress:
    """Runs done, runs per second and failures, on one line of a terminal (nothing elsewhere)."""

    stream: TextIO = dataclasses.field(default_factory=lambda: sys.stderr)
    jobs: int = 1
    runs: int = 0
    failures: int = 0

    def __post_init__(self) -> None:
        self._start = time.monotonic()
        self._shown = 0.0
        isatty = getattr(self.stream, "isatty", None)
        self.enabled = bool(isatty and isatty())

    def add(self, runs: int = 1, failures: int = 0, job: int = 0) -> None:
        """``runs`` more runs done (by job ``job``), ``failures`` of them failed."""
        self.runs += runs
        self.failures += failures
        now = time.monotonic()
        if self.enabled and (now - self._shown > 0.2 or failures):
            self._shown = now
            rate = self.runs / max(now - self._start, 1e-9)
            jobs = f" in {self.jobs} jobs" if self.jobs > 1 else ""
            failed = f"{self.failures} failure{'' if self.failures == 1 else 's'}"
            self.stream.write(f"\rexplore: {self.runs} runs{jobs}, {rate:.1f} runs/s, {failed}\x1b[K")
            self.stream.flush()

    def close(self) -> None:
        if self.enabled and self._shown:
            self.stream.write("\r\x1b[K")
            self.stream.flush()


@dataclass
class BlocksOutcome:
    """What a search of some blocks did: the failure with the lowest run index, if any."""

    runs: int
    found: Found | None
    environment: dict[str, str | None]
    #: the job that found the failure (0 when one process searched)
    job: int = 0


def default_jobs() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def explore_blocks(
    plan: ExplorationPlan,
    blocks: Sequence[int],
    horizon: float | None,
    *,
    jobs: int = 1,
    progress: Progress | None = None,
    fork: bool = False,
) -> BlocksOutcome:
    """Search ``blocks`` (in increasing order) with ``jobs`` worker processes (1: in this process);
    stop at the failure with the lowest run index. ``fork``: the workers are forks of this process,
    which carry what cannot be pickled (a pytest test's fixtures); else they are forked from a
    fresh server (forkserver) or spawned, and the plan is pickled to them."""
    progress = progress or Progress(jobs=jobs)
    blocks = sorted(blocks)
    try:
        if jobs <= 1 or len(blocks) <= 1:
            return _sequential(plan, blocks, horizon, progress)
        return _parallel(plan, blocks, horizon, min(jobs, len(blocks)), progress, fork)
    finally:
        progress.close()


def _sequential(
    plan: ExplorationPlan, blocks: Sequence[int], horizon: float | None, progress: Progress
) -> BlocksOutcome:
    runs = 0
    try:
        for block in blocks:
            result = run_block(plan, block, plan.runner, horizon, on_run=progress.add)
            runs += result.runs
            if result.found is not None:
                progress.add(0, failures=1)
                return BlocksOutcome(runs, result.found, dict(plan.runner.environment))
    finally:
        plan.runner.close()
    return BlocksOutcome(runs, None, dict(plan.runner.environment))


#: the stop mark's value while no block has failed: no block is cancelled
_NONE_FAILED = 2**62


def _job(
    plan: ExplorationPlan,
    job: int,
    tasks: Any,
    results: Any,
    stop: Any,
    horizon: float | None,
) -> None:
    """A worker process: search the blocks it takes from ``tasks`` while no lower block has failed."""
    runner = plan.runner
    try:
        while (block := tasks.get()) is not None:
            if block > stop.value:
                results.put(("block", job, BlockResult(block, 0)))
                continue

            def found(b: int = block) -> None:
                with stop.get_lock():
                    stop.value = min(stop.value, b)

            result = run_block(
                plan,
                block,
                runner,
                horizon,
                cancelled=lambda b=block: b > stop.value,
                on_run=lambda: results.put(("run", job, None)),
                on_found=found,
            )
            if result.found is not None:
                found()
            results.put(("block", job, result))
    except BaseException as exc:
        results.put(("error", job, _portable_error(exc)))
        with stop.get_lock():
            stop.value = -1
    finally:
        runner.close()
        results.put(("exit", job, dict(runner.environment)))


def _context(preload: Sequence[str]) -> multiprocessing.context.BaseContext:
    """forkserver where there is one: the workers fork from a server that imported ``preload`` (the
    simulator, torch) once, instead of each importing them again. Else spawn; never plain fork, which
    would copy this process's threads' locks mid-use."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(preload))
    return ctx


def prepare_jobs(plan: ExplorationPlan, jobs: int, *, wait: bool = False) -> None:
    """Start the server the worker processes fork from now (when there will be some), so that its
    imports overlap with what this process does first (the calibration run). ``wait``: return only
    once it has imported them and forked a first process (a benchmark times that)."""
    ctx = _context(_preload(plan))
    if jobs > 1 and len(plan.blocks()) > 1 and ctx.get_start_method() == "forkserver":
        from multiprocessing import forkserver  # POSIX only, and only with several jobs

        forkserver.ensure_running()
        if wait:
            first = ctx.Process(target=_nothing)
            first.start()
            first.join()


def _nothing() -> None:
    pass


def _preload(plan: ExplorationPlan) -> list[str]:
    return [*getattr(plan.runner, "preload", ()), *SEARCH_MODULES]


def _parallel(
    plan: ExplorationPlan,
    blocks: Sequence[int],
    horizon: float | None,
    jobs: int,
    progress: Progress,
    fork: bool = False,
) -> BlocksOutcome:
    ctx = multiprocessing.get_context("fork") if fork else _context(_preload(plan))
    tasks = ctx.Queue()
    results = ctx.Queue()
    stop = ctx.Value("q", _NONE_FAILED)
    for block in blocks:
        tasks.put(block)
    for _ in range(jobs):
        tasks.put(None)
    workers = [
        ctx.Process(target=_job, args=(plan, j, tasks, results, stop, horizon), daemon=True)
        for j in range(jobs)
    ]
    for worker in workers:
        worker.start()
    runs = 0
    found: dict[int, tuple[int, Found]] = {}
    environment: dict[str, str | None] = {}
    error: BaseException | None = None
    exited: set[int] = set()
    try:
        while len(exited) < jobs:
            for kind, job, payload in _messages(results, workers, exited):
                if kind == "run":
                    progress.add(job=job)
                elif kind == "block":
                    runs += payload.runs
                    if payload.found is not None:
                        found[payload.block] = (job, payload.found)
                        progress.add(0, failures=1)
                elif kind == "error":
                    error = error or payload
                elif kind == "exit":
                    exited.add(job)
                    environment.update(payload)
    finally:
        for worker in workers:
            worker.join(timeout=5)
            if worker.is_alive():
                worker.terminate()
                worker.join()
    if error is not None:
        raise error
    if not found:
        return BlocksOutcome(runs, None, environment)
    job, first = found[min(found)]
    return BlocksOutcome(runs, first, environment, job)


def _messages(results: Any, workers: Sequence[Any], exited: set[int]) -> Iterator[tuple[str, int, Any]]:
    """The next messages from the jobs; a job that died without saying so is an error."""
    try:
        yield results.get(timeout=1.0)
    except queue.Empty:
        for job, worker in enumerate(workers):
            if job not in exited and worker.exitcode is not None:
                # its last messages may still be in the pipe: drain before judging
                with contextlib.suppress(queue.Empty):
                    while True:
                        yield results.get(timeout=0.5)
                if job not in exited:
                    raise SimulationError(
                        f"explore: job {job} ended with exit code {worker.exitcode} before it finished "
                        "(out of memory? run with --jobs 1 to see the error in this process)"
                    ) from None

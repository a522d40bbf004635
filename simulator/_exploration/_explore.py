"""Exploration: run a program under many seeds and fault plans, shrink the first failure, replay it.

:func:`explore` is a search with hypothesis over *cases* (a simulation seed, a fault plan and a
network model). The search is seeded, and writes no example database, so the same call explores the
same cases in the same order on every machine. The first run that fails (a worker raises, a monitor
fires, the run deadlocks, or ``check(result)`` fails) fixes what "the same failure" means: the same
exception type and a message that matches the first one's pattern (numbers, addresses and times may
differ). Hypothesis then shrinks the case to the smallest one it can find that still fails that way:
fewer faults, smaller delays, a smaller seed. The :class:`Failure` it raises carries the minimal case,
the original error, a one-line replay command and :meth:`Failure.to_pytest`, the source of a
regression test that replays exactly that run.

Why hypothesis: its shrinker works on the choices that produced a case, so it shrinks any strategy a
user composes (their own fault vocabulary, their own network models) without a hand-written
minimizer, and it is deterministic under a fixed seed.

A run is a pure function of (program, world size, args, case): that is what makes a cache of verdicts
sound during shrinking, and a replay exact.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from .._config import SimConfig
from .._model._compute import ComputeModel
from .._model._network import NetworkModel
from .._model._plan import FaultPlan
from .._simulation import RunResult
from ._case import Case, _Outcome, _run
from ._failure import Exploration
from ._reproduce import replay_command
from ._search import _Search, cases, require_hypothesis

if TYPE_CHECKING:
    from hypothesis.strategies import SearchStrategy


def explore(
    program: Callable[..., Any],
    world_size: int | None = None,
    *,
    args: Sequence[Any] = (),
    runs: int = 200,
    faults: SearchStrategy[FaultPlan] | Callable[[int], SearchStrategy[FaultPlan]] | None = None,
    network: SearchStrategy[NetworkModel] | None = None,
    compute: ComputeModel | None = None,
    config: SimConfig | None = None,
    seeds: SearchStrategy[int] | None = None,
    swarm: bool = False,
    seed: int | None = None,
    check: Callable[[RunResult], object] | None = None,
    match: str | None = None,
    shrink: bool = True,
    max_shrink_runs: int = 500,
    monitors: bool | None = None,
    max_time: float | None = None,
    raise_on_failure: bool = True,
) -> Exploration:
    """Run ``program(rank, *args)`` as ``world_size`` workers under many seeds and fault plans;
    shrink the first failure to a minimal case that still fails the same way.

    A run fails when a worker's program raises, an online monitor fires, the simulation deadlocks or
    fails, or ``check(result)`` raises or returns ``False``. "The same way" is the first failure's
    exception type and message pattern (its head, with numbers and addresses free), or ``match``, a
    regex its message must match (``re.match``) for a failure to count at all.

    Args:
        program: the worker program, as for :meth:`Simulation.run`.
        world_size: number of workers.
        args: extra arguments passed to every worker's program.
        runs: cases to try before giving up (shrinking runs come on top).
        faults: a hypothesis strategy of :class:`FaultPlan` (or a function of the world size returning
            one). ``None``: :func:`twinrpc.simulator.strategies.fault_plans`, faults a correct
            program survives, their windows placed over the program's length as a first fault-free
            run with seed 0 measures it (it counts as a run). To explore seeds only, pass
            ``hypothesis.strategies.just(FaultPlan())``.
        network: a strategy of :class:`NetworkModel`; ``None``: ``config``'s model, else the default.
        compute: the :class:`ComputeModel` of every run (``None``: ``config``'s, else free computing).
        config: the settings every run shares (a :class:`~twinrpc.simulator.SimConfig`: world size,
            network and compute models, monitors, time limit); the keyword arguments override it.
            Each run's seed and fault plan are drawn, so the config must leave them at their defaults.
            Runs record no trace (:func:`replay` one for its trace).
        seeds: a strategy of simulation seeds; ``None``: any 32-bit seed. ``st.just(0)`` explores
            fault plans under one seed (every failure is then explained by its faults alone).
        swarm: swarm testing: each run's faults are its seed's :class:`Swarm` plan (which kinds are
            on, their rates, windows and victims all drawn from the seed), over the program's
            measured length; a failure is then minimized by removing faults one at a time.
        seed: the exploration's seed; the same seed tries the same cases in the same order
            (``None``: 0). No example database is read or written.
        check: judges each passing run's :class:`RunResult`.
        match: only failures whose message matches this regex count.
        shrink: shrink the first failure (else report it as found).
        max_shrink_runs: at most this many runs while shrinking; the smallest failure so far wins.
        monitors: run with the online RRef monitors (:class:`RRefMonitor`); on unless turned off.
        max_time: fail a run whose virtual time passes this many seconds.
        raise_on_failure: raise the :class:`Failure` (else return it in the :class:`Exploration`).

    Raises:
        Failure: the shrunk failure (unless ``raise_on_failure=False``).
    """
    if world_size is None and config is None:
        raise TypeError("explore() needs a world_size (or a config=SimConfig(world_size=...))")
    if world_size is not None and world_size < 1:
        raise ValueError(f"explore(world_size={world_size}): at least one worker")
    if config is not None and config.seed != SimConfig().seed:
        raise ValueError(
            f"explore draws each run's seed: config=SimConfig(seed={config.seed}) would be replaced; "
            "pass seeds=hypothesis.strategies.just(seed) to explore one seed"
        )
    if config is not None and config.faults is not None:
        raise ValueError(
            "explore draws each run's fault plan: config.faults would be replaced; pass "
            "faults=hypothesis.strategies.just(plan) to explore one plan, or swarm=True"
        )
    if network is not None and config is not None and config.network is not None:
        raise ValueError("explore(network=...) draws the network model: do not give config.network too")
    base = SimConfig.merged(
        config, world_size=world_size, compute=compute, monitors=monitors, max_time=max_time, trace=False
    )
    world_size = base.world_size
    if swarm and faults is not None:
        raise ValueError("explore(swarm=True) draws its plans from the seeds: do not pass faults= too")
    if runs < 1:
        raise ValueError(f"explore(runs={runs}): at least one run")
    if not callable(program):
        raise TypeError(f"explore(program={program!r}): expected a function program(rank, *args)")
    args = tuple(args)
    seed = 0 if seed is None else seed

    networks = network
    if networks is None and base.network is not None:
        networks = require_hypothesis().strategies.just(base.network)

    def body(draw: Callable[[int], Case]) -> _Outcome:
        return _run(program, draw(base.world_size).config(base), args, check=check)

    search = _Search(
        body,
        lambda n, horizon: cases(n, faults, networks, seeds, horizon, swarm, base.compute),
        runs=runs,
        seed=seed,
        shrink=shrink and not swarm,
        max_shrink_runs=max_shrink_runs,
        match=match,
        calibrate=faults is None,
        baseline_counts=seeds is None,
        minimize=shrink and swarm,
        baseline=Case(0, network=base.network, compute=base.compute),
    )
    if not search.run():
        return Exploration(search.calls, seed)
    failure = search.failure(
        world_size=world_size,
        program=program,
        args=args,
        check=check,
        command=lambda c: replay_command(program, world_size, c, args=args, check=check),
    )
    if raise_on_failure:
        raise failure
    return Exploration(search.calls, seed, failure)

"""``Simulation``: run a program as N workers in one process, deterministically, on virtual time.

``Simulation`` is a facade. What a run is made of lives in collaborators that own their state, each
given what it needs when the simulation is built:

- :class:`~._kernel._scheduler.Scheduler`: virtual time, tasks and events;
- :class:`~._rendezvous.Rendezvous`: the simulated store (static and dynamic groups, ``init_rpc``);
- :class:`~._network._links.Links`: the message path (booked worker time, arrival, bounce);
- :class:`~._crashes.Crashes`: crashes and departures, and how peers learn of them;
- :class:`~._faults._engine.NetworkFaults`: the fault engine behind the fault verbs and plans;
- :class:`~._observers.RunObservers`: the trace observer and the online RRef monitors.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import Any

from twinrpc._future import CURRENT_BLOCKER, Future

from ._checks._monitors import RRefMonitor
from ._config import SimConfig
from ._crashes import Crashes
from ._errors import SimulationDeadlock, SimulationError
from ._faults._engine import NetworkFaults
from ._kernel._blocker import SimBlocker
from ._kernel._compute import ComputeMeter
from ._kernel._current import CURRENT_SIMULATION
from ._kernel._scheduler import Scheduler, Task
from ._kernel._virtual_time import simulated_time
from ._liveness import silence_bound
from ._model._compute import ComputeModel
from ._model._network import NetworkModel
from ._model._plan import (
    DEFAULT_GC_DELAY,
    Crash,
    Delay,
    Drop,
    Duplicate,
    Fault,
    FaultPlan,
    Hold,
    Partition,
    Pause,
)
from ._model._swarm import Swarm
from ._network._link_setup import LinkSetup
from ._network._links import Links
from ._network._process_group import serve_process_groups
from ._observers import RunObservers
from ._parts import RunParts
from ._rendezvous import Rendezvous
from ._traces._observer import TraceObserver
from ._traces._trace import Trace
from ._world import SimWorker, WorkerParts

_GC_GEN0_THRESHOLD = 20_000
#: per simulated worker: what a worker's pending RPCs keep alive (tasks, futures, messages, timers)
#: outlives more allocations the more workers take turns, so a fixed threshold walks it more often
_GC_GEN0_PER_WORKER = 200


@dataclass(frozen=True, slots=True)
class WorkerOutcome:
    """What one worker's program returned or raised (``crashed``: neither, the worker crashed)."""

    rank: int
    value: Any = None
    error: BaseException | None = None
    crashed: bool = False

    def get(self) -> Any:
        """The program's value; re-raises its error; ``None`` for a crashed worker."""
        if self.error is not None:
            raise self.error
        return self.value


@dataclass(frozen=True, slots=True)
class RunResult:
    """The result of :meth:`Simulation.run`."""

    outcomes: tuple[WorkerOutcome, ...]
    trace: Trace
    virtual_time: float
    seed: int

    def values(self) -> list[Any]:
        """Each worker's return value (``None`` for a crashed worker); re-raises the first worker
        error in rank order."""
        return [o.get() for o in self.outcomes]

    @property
    def crashed(self) -> tuple[int, ...]:
        """The ranks that crashed (``Simulation.crash`` or a fault plan's ``Crash``)."""
        return tuple(o.rank for o in self.outcomes if o.crashed)

    @property
    def digest(self) -> str:
        return self.trace.digest()


class Simulation:
    """A deterministic world of ``world_size`` workers in this process.

    ``Simulation(world_size=3, seed=7).run(fn)`` runs ``fn(rank)`` as each worker's program; ``fn``
    calls ``init_rpc``/``shutdown`` itself, exactly as under ``torch.multiprocessing.spawn``. Time is
    virtual: timeouts and sleeps take no wall time. Same seed + same program = the same trace.

    The settings are those of a :class:`~twinrpc.simulator.SimConfig` (``config=``, or
    ``SimConfig(...).build()``); a keyword argument given here overrides the config's value.

    Args:
        world_size: number of workers.
        seed: seeds every choice the simulation makes (latency jitter, ties between events); 0 unless
            given here or by ``config``.
        network: the network model (latency, jitter, bandwidth).
        trace: record a trace (needed for digests and timelines); on unless turned off.
        max_time: fail the run if virtual time passes this many seconds.
        faults: a :class:`~twinrpc.simulator.FaultPlan` (message, link and worker faults, and the
            bound of the seeded delay before a dead user RRef's delete is sent), or a
            :class:`~twinrpc.simulator.Swarm`, resolved into a plan with ``seed``. The fault verbs
            (:meth:`drop`, :meth:`partition`, :meth:`crash`, ...) add faults to a running simulation.
        monitors: check the RRef invariants online (G1, G2, no value freed while a user exists, no
            leak after graceful shutdown); a violation fails the run with ``MonitorViolation``. On
            unless turned off.
        compute: charge virtual time for the torch operators tasks run (see
            :class:`~twinrpc.simulator.ComputeModel`); ``None``, the default: computing is free.
        config: the settings as one value; the keyword arguments above override it.

    Raises:
        TypeError: neither ``world_size`` nor ``config`` is given.
    """

    def __init__(
        self,
        world_size: int | None = None,
        seed: int | None = None,
        network: NetworkModel | None = None,
        *,
        trace: bool | None = None,
        max_time: float | None = None,
        faults: FaultPlan | Swarm | None = None,
        monitors: bool | None = None,
        compute: ComputeModel | None = None,
        config: SimConfig | None = None,
    ) -> None:
        if world_size is None and config is None:
            raise TypeError("Simulation() needs a world_size (or a config=SimConfig(world_size=...))")
        config = SimConfig.merged(
            config,
            world_size=world_size,
            seed=seed,
            network=network,
            trace=trace,
            max_time=max_time,
            faults=faults,
            monitors=monitors,
            compute=compute,
        )
        #: the settings of this run
        self.config = config
        self.world_size = n = config.world_size
        self.seed = config.seed
        self.network = config.network or NetworkModel()
        #: the compute model of this run, or None (computation takes no virtual time)
        self.compute = config.compute
        #: the fault plan of this run (a Swarm resolved with the seed), or None
        self.plan: FaultPlan | None = config.plan()
        self.gc_delay = self.plan.gc_delay if self.plan is not None else DEFAULT_GC_DELAY
        self.sched = Scheduler(self.seed, max_time=config.max_time)
        self.trace = Trace(config.trace, seed=self.seed, world_size=n)
        #: the workers, by rank (filled in below, once what they share exists)
        self.workers: list[SimWorker] = []
        monitor = RRefMonitor(self.sched, self.trace) if config.monitors else None
        #: the trace observer and the RRef monitors (simulator/_observers.py)
        tracer = TraceObserver(self.sched, self.trace, monitor.generation(0) if monitor is not None else None)
        self.observers = RunObservers(monitor, tracer if config.trace else None)
        #: crashes and departures (simulator/_crashes.py)
        self.crashes = Crashes(
            self.sched, self.trace, self.network, self.workers, self.observers.stop_monitors
        )
        #: rank -> virtual time of its crash (see :meth:`crash`)
        self.crashed = self.crashes.crashed
        self.blocker = SimBlocker(self.sched, self.crashed)
        #: the message path (simulator/_network/_links.py)
        self.links = Links(
            n,
            self.sched,
            self.trace,
            self.network,
            self.workers,
            self.crashed,
            booking=bool(self.network.message_cost) or self.compute is not None,
        )
        #: the simulated store: static and dynamic groups (simulator/_rendezvous.py)
        self.rendezvous = Rendezvous(n, self.sched, self.trace, self.workers, self._heartbeats_changed)
        self.heartbeat_options = self.rendezvous.heartbeat_options
        #: what the workers and their worlds are built from (simulator/_world.py)
        self.worker_parts = WorkerParts(
            self,
            self.sched,
            self.trace,
            self.blocker,
            self.gc_delay,
            self.rendezvous.connect,
            self.links.send,
            self.links.bounce,
            self.crashes.world_started,
            self.crashes.announce_departure,
            self.observers.protocol_observers,
            LinkSetup(
                self.sched,
                self.trace,
                self.network,
                self.workers,
                self.crashed,
                lambda rank: silence_bound(self.parts, rank),
                self.crashes.peer_unavailable,
                self._link_made,
            ),
        )
        self.workers.extend(SimWorker(self.worker_parts, r) for r in range(n))
        if self.compute is not None:
            self.sched.meter = ComputeMeter(self.compute, self.links.book)
        #: what the collaborators built after this point are made of (simulator/_parts.py)
        self.parts = RunParts(
            self.seed,
            self.sched,
            self.trace,
            self.network,
            self.workers,
            self.crashes,
            self.heartbeat_options,
            self.links.deliver,
            self.observers.stop_monitors,
        )
        if self.plan is not None:  # the fault engine: installed by a plan or by the first fault verb
            self.links.faults = NetworkFaults(self.parts, self.plan)
        if config.trace:
            self.sched.trace = self.trace  # task switches
        #: which process a task runs in, when processes are not workers (a program's own launcher
        #: under ``python -m twinrpc.simulator run``); None: each worker is one process
        self.process_of: Callable[[Task], Hashable | None] | None = None
        self._used = False

    def _link_made(self, rank: int, peer: int) -> None:
        """``rank`` and ``peer`` are linked now: a silence between them is judged from now on."""
        if self.links.faults is not None:
            self.links.faults.liveness.link_made(rank, peer)

    @property
    def now(self) -> float:
        return self.sched.now

    @property
    def faults(self) -> NetworkFaults | None:
        """The fault engine (its counts: ``sent``, ``dropped``...), or ``None`` before any fault."""
        return self.links.faults

    @property
    def monitor(self) -> RRefMonitor | None:
        """The online RRef monitors, or ``None`` (``monitors=False``)."""
        return self.observers.monitor

    @property
    def trace_observer(self) -> TraceObserver | None:
        """What records RRef and autograd events in the trace, or ``None`` (``trace=False``)."""
        return self.observers.trace_observer

    def run(self, fn: Callable[..., Any], *args: Any, check: bool = True) -> RunResult:
        """Run ``fn(rank, *args)`` on every worker until all return.

        A worker whose ``fn`` raises leaves the way a process does: if its RPC agent is still up, its
        connections close and its peers see it leave (as under the launcher and on gloo). With
        ``check`` (the default), ``run`` then raises the first worker's exception, with notes saying
        what the other workers raised; ``check=False`` returns every outcome instead. A deadlock
        raises :class:`SimulationDeadlock` naming every blocked task and every worker that had
        already failed.
        """
        if self._used:
            raise SimulationError("a Simulation runs once; make a new one (with the same seed to replay)")
        self._used = True
        outcomes: list[WorkerOutcome | None] = [None] * self.world_size
        failed: list[int] = []  # ranks whose fn raised, in the order they raised
        remaining = [self.world_size]
        crashed = self.crashed

        def main(rank: int) -> None:
            try:
                value = fn(rank, *args)
            except BaseException as exc:
                outcomes[rank] = WorkerOutcome(rank, error=exc)
                if rank not in crashed:
                    failed.append(rank)
                    self._leave_like_a_process(rank, exc)
            else:
                outcomes[rank] = WorkerOutcome(rank, value=value)
            finally:
                if rank in crashed:  # unwound by the crash (GreenletExit): no value, no error
                    outcomes[rank] = WorkerOutcome(rank, crashed=True)
                remaining[0] -= 1
                outcome = outcomes[rank]
                status = (
                    "crashed"
                    if rank in crashed
                    else "error"
                    if outcome is not None and outcome.error is not None
                    else "ok"
                )
                self.trace.record(self.sched.now, rank, "exit", status)

        for worker in self.workers:
            worker.spawn(f"main[{worker.rank}]", main, worker.rank)
        # Every RPC makes short-lived tasks, futures and messages; with the default gen-0 threshold the
        # cyclic collector costs as much as the simulation itself (measured: 2x). Raise it for the run,
        # in proportion to the world: each worker's pending work lives until every other worker has
        # had its turn, and a collection that comes before walks all of it (measured at 2,048
        # workers: a fixed 20,000 spent 16% of the run in the collector, this 6%).
        threshold = gc.get_threshold()
        gen0 = max(threshold[0], _GC_GEN0_THRESHOLD, _GC_GEN0_PER_WORKER * len(self.workers))
        gc.set_threshold(gen0, *threshold[1:])
        try:
            # Wall-clock reads, wall-time sleeps and OS threads in the program are reported
            # (SimulationWarning); the CLI's virtual time, installed around this, takes precedence.
            # torch.distributed process groups are simulated per worker (SIM-8).
            with simulated_time(virtual=False), serve_process_groups(self.sched, self, self.process_of):
                self.sched.run(until=lambda: remaining[0] == 0)
        except SimulationDeadlock as deadlock:
            if not failed:
                raise
            raise SimulationDeadlock(f"{deadlock}\n{_failures_text(outcomes, failed)}") from deadlock
        finally:
            gc.set_threshold(*threshold)
        result = RunResult(tuple(o for o in outcomes if o is not None), self.trace, self.sched.now, self.seed)
        if check and failed:
            first = outcomes[failed[0]]
            assert first is not None and first.error is not None
            for rank in failed[1:]:
                other = outcomes[rank]
                assert other is not None and other.error is not None
                _add_note(first.error, f"then rank {rank} raised {type(other.error).__name__}: {other.error}")
            raise first.error
        return result

    def _leave_like_a_process(self, rank: int, exc: BaseException) -> None:
        """Worker ``rank``'s program raised ``exc`` without ``rpc.shutdown()``: like a process that
        exits, its connections close and its peers notice as they notice a crash."""
        if self.workers[rank].slot.agent is None:
            return
        self.trace.record(
            self.sched.now,
            rank,
            "exit",
            f"raised {type(exc).__name__} without rpc.shutdown(): connections close",
        )
        self.sched.schedule(0.0, lambda _: self.crash(rank))

    def add_worker(self) -> SimWorker:
        """A new worker, rank ``world_size``, joining a running simulation.

        For a program run by ``python -m twinrpc.simulator run`` whose own launcher starts more
        processes than the command did (``mp.spawn(fn, nprocs=W)`` under ``--nproc-per-node 1``): a
        process that calls ``init_rpc(rank=k)`` becomes worker ``k``, created here if the world is
        smaller. It has no main program of its own (:meth:`run` waits only for the first ones)."""
        worker = SimWorker(self.worker_parts, self.world_size)
        self.workers.append(worker)
        self.world_size += 1
        self.rendezvous.world_size = self.world_size
        self.links.busy_until.append(0.0)
        self.trace.world_size = max(self.trace.world_size, self.world_size)
        return worker

    def _heartbeats_changed(self, rank: int) -> None:
        """Worker ``rank`` called ``init_rpc``: the silences it listens to are judged by its options."""
        if self.links.faults is not None:
            self.links.faults.liveness.bound_changed(rank)

    # -- fault verbs (callable before run() or from a simulated task; see docs/howto/fault-plan.md) --
    def _engine(self) -> NetworkFaults:
        if self.links.faults is None:
            self.links.faults = NetworkFaults(self.parts, None)
        return self.links.faults

    def apply(self, fault: Fault) -> Fault:
        """Put any fault of a :class:`FaultPlan` in force now (times in it are absolute virtual
        times; message counts start now). Returns it."""
        return self._engine().install(fault)

    def delay(
        self,
        extra: float,
        kind: str | None = None,
        *,
        src: int | None = None,
        dst: int | None = None,
        nth: int = 1,
        count: int | None = 1,
        rate: float = 1.0,
    ) -> Delay:
        """Deliver the ``nth`` message of ``kind`` from ``src`` to ``dst`` sent from now on (and the
        ``count - 1`` after it) ``extra`` seconds late; see :class:`Delay`."""
        return self._engine().install(Delay(extra, kind, src, dst, nth, count, rate))  # type: ignore[return-value]

    def drop(
        self,
        kind: str | None = None,
        *,
        src: int | None = None,
        dst: int | None = None,
        nth: int = 1,
        count: int | None = 1,
        rate: float = 1.0,
    ) -> Drop:
        """Lose the ``nth`` message of ``kind`` from ``src`` to ``dst`` sent from now on (and the
        ``count - 1`` after it); see :class:`Drop` for what a loss does."""
        return self._engine().install(Drop(kind, src, dst, nth, count, rate))  # type: ignore[return-value]

    def duplicate(
        self,
        kind: str | None = None,
        *,
        extra: float = 0.0,
        src: int | None = None,
        dst: int | None = None,
        nth: int = 1,
        count: int | None = 1,
        rate: float = 1.0,
    ) -> Duplicate:
        """Deliver the ``nth`` message of ``kind`` from ``src`` to ``dst`` sent from now on twice, the
        copy ``extra`` seconds after it; see :class:`Duplicate`."""
        return self._engine().install(Duplicate(extra, kind, src, dst, nth, count, rate))  # type: ignore[return-value]

    def hold(self, src: int, dst: int) -> Hold:
        """Hold every message ``src`` sends to ``dst`` from now on, until :meth:`release`."""
        return self._engine().install(Hold(src, dst, self.sched.now))  # type: ignore[return-value]

    def release(self, src: int | None = None, dst: int | None = None) -> int:
        """End the holds on ``src -> dst`` (``None`` = any), delivering what they held (each message
        after its normal delay from now). Returns how many messages were released."""
        engine = self._engine()
        blocks = [
            b
            for b in engine.blocks_of(Hold)
            if (src is None or b.fault.src == src) and (dst is None or b.fault.dst == dst)  # type: ignore[union-attr]
        ]
        return engine.remove_blocks(blocks, "released")

    def partition(
        self,
        a: int | Iterable[int],
        b: int | Iterable[int] | None = None,
        *,
        oneway: bool = False,
        mode: str = "hold",
    ) -> Partition:
        """Cut ``a`` from ``b`` (``None`` = everyone else) from now on, until :meth:`heal`; see
        :class:`Partition` (``mode="hold"`` delivers late on heal, ``"drop"`` loses the messages)."""
        fault = Partition(a, b, self.sched.now, None, oneway, mode)  # type: ignore[arg-type]
        return self._engine().install(fault)  # type: ignore[return-value]

    def heal(self) -> int:
        """End every partition in force; held messages are delivered. Returns how many were."""
        engine = self._engine()
        return engine.remove_blocks(engine.blocks_of(Partition), "healed")

    def pause(self, rank: int, duration: float, *, at: float | None = None) -> Pause:
        """Stop worker ``rank`` for ``duration`` seconds, now or at virtual time ``at``; see
        :class:`Pause`. Called from the paused worker's own task, it returns after the pause."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"pause({rank}): no such worker in a world of {self.world_size}")
        when = self.sched.now if at is None else at
        if when < self.sched.now:
            raise ValueError(f"pause({rank}, at={when}): virtual time is already {self.sched.now}")
        return self._engine().install(Pause(rank, duration, when))  # type: ignore[return-value]

    def crash(
        self,
        rank: int,
        *,
        at: float | None = None,
        on_receive: str | None = None,
        on_send: str | None = None,
        nth: int = 1,
    ) -> None:
        """Crash worker ``rank`` now, at virtual time ``at``, or when the ``nth`` message of a kind
        arrives at it (``on_receive``) or leaves it (``on_send``) from now on (a fault verb, like a
        SIGKILL; kinds as for :class:`Crash`).

        The worker's tasks stop forever (its program's outcome is ``crashed``), messages to it are
        dropped, messages it already sent are still delivered, and each peer's agent gets
        ``on_peer_failed`` with a :class:`~twinrpc.WorkerUnavailableError` naming it after
        ``network.failure_detection`` seconds: the very path the gloo world takes when a peer's
        connection closes (ERR-7). Called from the crashing worker's own task, it does not return.
        RRef monitors stop at the first crash: their invariants assume no worker dies (ERR-7 says
        RRefs spanning a dead worker are not repaired).
        """
        if not 0 <= rank < self.world_size:
            raise ValueError(f"crash({rank}): no such worker in a world of {self.world_size}")
        if on_receive is not None or on_send is not None:
            self._engine().install(Crash(rank, at, on_receive, on_send, nth))
            return
        self.crashes.crash_at(rank, at)


def current() -> Simulation | None:
    """The :class:`Simulation` the calling task belongs to, or ``None`` outside a simulation.

    A program run by ``python -m twinrpc.simulator run`` (or any function under :meth:`Simulation.run`)
    never sees the :class:`Simulation` object; this hands it over, so the program can put faults on its
    own run with the fault verbs (``current().pause(1, 0.5)``, ``current().crash(2)``), e.g. at an exact
    point of its own code rather than at a virtual time.

    Any task of a simulated worker sees it: its program (under ``run``, its simulated processes too),
    its RPC handlers, its callbacks. Code outside every simulation, and the scheduler's own callbacks
    between tasks, get ``None``, so a program can test ``current() is None`` to run unchanged in the
    real world.
    """
    simulation: Simulation | None = CURRENT_SIMULATION.get()
    return simulation


def sleep(seconds: float) -> None:
    """Sleep on the current world's clock: virtual time inside a simulation, wall time outside."""
    blocker = CURRENT_BLOCKER.get()
    if not isinstance(blocker, SimBlocker):
        time.sleep(seconds)
        return
    fut: Future[None] = Future()
    blocker.sched.call_later(max(0.0, float(seconds)), lambda: fut.set_result(None))
    fut.wait()


def now() -> float:
    """The current world's clock: virtual seconds inside a simulation, ``time.monotonic()`` outside."""
    blocker = CURRENT_BLOCKER.get()
    if isinstance(blocker, SimBlocker):
        return blocker.sched.now
    return time.monotonic()


def _failures_text(outcomes: list[WorkerOutcome | None], failed: list[int]) -> str:
    lines = ["workers that had already failed (their programs raised):"]
    for rank in failed:
        outcome = outcomes[rank]
        assert outcome is not None and outcome.error is not None
        lines.append(f"  rank {rank}: {type(outcome.error).__name__}: {outcome.error}")
    return "\n".join(lines)


def _add_note(exc: BaseException, note: str) -> None:
    """``exc.add_note(note)``, also on Python 3.10 (where tracebacks do not show notes)."""
    if hasattr(exc, "add_note"):
        exc.add_note(note)
    else:  # pragma: no cover - Python 3.10
        exc.__notes__ = [*getattr(exc, "__notes__", []), note]  # type: ignore[attr-defined]

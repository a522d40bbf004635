"""``Simulation``: run a program as N workers in one process, deterministically, on virtual time."""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import greenlet

from twinrpc._departure import Departure
from twinrpc._future import Future
from twinrpc._membership import MIXED_GROUP_ERROR
from twinrpc._message import REQUEST_KINDS, Message
from twinrpc._worker_info import WorkerInfo
from twinrpc.rpc.options import DEFAULT_HEARTBEAT_INTERVAL, DEFAULT_HEARTBEAT_MISSES

from ._checks._monitors import RRefMonitor
from ._dynamic_group import DynamicGroup, DynamicMember
from ._errors import SimulationError
from ._faults._engine import NetworkFaults
from ._faults._plan import (
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
from ._faults._swarm import Swarm
from ._kernel._compute import ComputeMeter, ComputeModel
from ._kernel._scheduler import Scheduler
from ._kernel._virtual_time import simulated_time
from ._network._model import NetworkModel
from ._network._process_group import serve_process_groups
from ._traces._observer import TraceObserver
from ._traces._trace import Trace
from ._world import SimBlocker, SimWorker, SimWorld

_RENDEZVOUS_DELAY = 1e-3  # a store round trip at init
_GC_GEN0_THRESHOLD = 20_000


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

    Args:
        world_size: number of workers.
        seed: seeds every choice the simulation makes (latency jitter, ties between events).
        network: the network model (latency, jitter, bandwidth).
        trace: record a trace (needed for digests and timelines).
        max_time: fail the run if virtual time passes this many seconds.
        faults: a :class:`~twinrpc.simulator.FaultPlan` (message, link and worker faults, and the
            bound of the seeded delay before a dead user RRef's delete is sent), or a
            :class:`~twinrpc.simulator.Swarm`, resolved into a plan with ``seed``. The fault verbs
            (:meth:`drop`, :meth:`partition`, :meth:`crash`, ...) add faults to a running simulation.
        monitors: check the RRef invariants online (G1, G2, no value freed while a user exists, no
            leak after graceful shutdown); a violation fails the run with ``MonitorViolation``.
        compute: charge virtual time for the torch operators tasks run (see
            :class:`~twinrpc.simulator.ComputeModel`); ``None``, the default: computing is free.
    """

    def __init__(
        self,
        world_size: int,
        seed: int = 0,
        network: NetworkModel | None = None,
        *,
        trace: bool = True,
        max_time: float | None = None,
        faults: FaultPlan | Swarm | None = None,
        monitors: bool = True,
        compute: ComputeModel | None = None,
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {world_size}")
        self.world_size = world_size
        self.seed = seed
        self.network = network or NetworkModel()
        self.sched = Scheduler(seed, max_time=max_time)
        #: rank -> virtual time of its crash (see :meth:`crash`)
        self.crashed: dict[int, float] = {}
        self.blocker = SimBlocker(self.sched, self.crashed)
        self.trace = Trace(trace, seed=seed, world_size=world_size)
        self.workers = [SimWorker(self, r) for r in range(world_size)]
        #: rank -> virtual time until which its message handling (``network.message_cost``) and its
        #: computation (``compute``) are booked
        self.busy_until = [0.0] * world_size
        #: the compute model of this run, or None (computation takes no virtual time)
        self.compute = compute
        if compute is not None:
            self.sched.meter = ComputeMeter(self, compute)
        #: workers' time is booked (message_cost or a compute model); False: the hot path skips it
        self.booking = bool(self.network.message_cost) or compute is not None
        self._rendezvous: dict[int, dict[int, str]] = {}
        self._rendezvous_done: dict[int, Future[None]] = {}
        #: generation -> (members when built, the static group's workers, or the error of a name
        #: two members share): see _roster
        self._rosters: dict[int, tuple[int, list[WorkerInfo], str | None]] = {}
        #: generation -> its dynamic group (init_rpc without world_size, LIFE-5)
        self._dynamic: dict[int, DynamicGroup] = {}
        #: rank -> (heartbeat_interval, heartbeat_misses) of its latest init_rpc's options: how long it
        #: lets a silent peer be before declaring it dead (simulator/_faults/_engine.py, silence_bound)
        self.heartbeat_options: dict[int, tuple[float, int]] = {}
        self._used = False
        if isinstance(faults, Swarm):
            faults = faults.plan(seed, world_size)
        #: the fault plan of this run (a Swarm resolved with the seed), or None
        self.plan: FaultPlan | None = faults
        # Fault hooks (simulator/_faults/_engine.py; installed by a plan or the first fault verb) and
        # RRef monitors (simulator/_checks/_monitors.py); None = off, no cost.
        self.faults = NetworkFaults(self, faults) if faults is not None else None
        self.gc_delay = faults.gc_delay if faults is not None else DEFAULT_GC_DELAY
        self.monitor = RRefMonitor(self) if monitors else None
        #: records RRef and autograd events (and forwards RRef events to the monitors); None: trace off
        self.trace_observer = TraceObserver(self, self.monitor) if trace else None
        if trace:
            self.sched.trace = self.trace  # task switches

    @property
    def now(self) -> float:
        return self.sched.now

    def run(self, fn: Callable[..., Any], *args: Any) -> RunResult:
        """Run ``fn(rank, *args)`` on every worker until all return; a deadlock raises
        :class:`SimulationDeadlock` naming every blocked task."""
        if self._used:
            raise SimulationError("a Simulation runs once; make a new one (with the same seed to replay)")
        self._used = True
        outcomes: list[WorkerOutcome | None] = [None] * self.world_size
        remaining = [self.world_size]

        def main(rank: int) -> None:
            try:
                value = fn(rank, *args)
            except BaseException as exc:
                outcomes[rank] = WorkerOutcome(rank, error=exc)
            else:
                outcomes[rank] = WorkerOutcome(rank, value=value)
            finally:
                if rank in self.crashed:  # unwound by the crash (GreenletExit): no value, no error
                    outcomes[rank] = WorkerOutcome(rank, crashed=True)
                remaining[0] -= 1
                outcome = outcomes[rank]
                status = (
                    "crashed"
                    if rank in self.crashed
                    else "error"
                    if outcome is not None and outcome.error is not None
                    else "ok"
                )
                self.trace.record(self.sched.now, rank, "exit", status)

        for worker in self.workers:
            worker.spawn(f"main[{worker.rank}]", main, worker.rank)
        # Every RPC makes short-lived tasks, futures and messages; with the default gen-0 threshold the
        # cyclic collector costs as much as the simulation itself (measured: 2x). Raise it for the run.
        threshold = gc.get_threshold()
        gc.set_threshold(max(threshold[0], _GC_GEN0_THRESHOLD), *threshold[1:])
        try:
            # Wall-clock reads, wall-time sleeps and OS threads in the program are reported
            # (SimulationWarning); the CLI's virtual time, installed around this, takes precedence.
            # torch.distributed process groups are simulated per worker (SIM-8).
            with simulated_time(virtual=False), serve_process_groups(self):
                self.sched.run(until=lambda: remaining[0] == 0)
        finally:
            gc.set_threshold(*threshold)
        return RunResult(tuple(o for o in outcomes if o is not None), self.trace, self.sched.now, self.seed)

    # -- fault verbs (callable before run() or from a simulated task; see docs/howto/fault-plan.md) --
    def _engine(self) -> NetworkFaults:
        if self.faults is None:
            self.faults = NetworkFaults(self, None)
        return self.faults

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

    def _stop_monitors(self, why: str) -> None:
        """The RRef monitors stop checking (a fault outside the protocol's assumptions happened: a
        crash, a peer declared dead, a non-graceful shutdown); RRef events still reach the trace."""
        if self.monitor is None or self.monitor.stopped is not None:
            return
        self.monitor.stop(why)  # a stopped monitor reports no violation
        if self.trace_observer is not None:
            self.trace_observer.monitor = None

    # -- rendezvous (the simulated store) -----------------------------------------------------------
    def _connect(
        self,
        worker: SimWorker,
        *,
        name: str,
        rank: int,
        world_size: int | None,
        options: Any,
        generation: int,
    ) -> tuple[SimWorld, WorkerInfo, list[WorkerInfo]]:
        if rank not in (-1, worker.rank):
            raise ValueError(
                f"init_rpc(rank={rank}) on simulated worker {worker.rank}: in a Simulation each program's "
                "rank is the rank it was started with (pass that rank, or -1)"
            )
        if not world_size:
            return self._join_dynamic(worker, name=name, options=options, generation=generation)
        if not 0 <= worker.rank < world_size <= self.world_size:
            raise ValueError(
                f"init_rpc(world_size={world_size}) on simulated worker {worker.rank} in a Simulation of "
                f"world_size={self.world_size}: a static group's ranks run from 0 to world_size - 1"
            )
        group = self._dynamic.get(generation)
        if group is not None and group.members:
            raise RuntimeError(MIXED_GROUP_ERROR)
        joined = self._rendezvous.setdefault(generation, {})
        done = self._rendezvous_done.setdefault(generation, Future())
        joined[worker.rank] = name
        self.trace.name_worker(worker.rank, name)
        self.trace.record(self.sched.now, worker.rank, "init", f"{name} generation {generation}")
        if len(joined) == world_size:
            self.sched.call_later(_RENDEZVOUS_DELAY, lambda: done.set_result(None))
        done.wait()
        infos = self._roster(generation, joined)
        world = SimWorld(worker, options.num_worker_threads)
        worker.world = world
        self._heartbeats_of(worker.rank, options)
        return world, infos[worker.rank], infos

    def _roster(self, generation: int, joined: dict[int, str]) -> list[WorkerInfo]:
        """The workers of a static group (by rank), once for all its members: each member building
        its own took N^2 time and kept N^2 WorkerInfo objects alive. Raises, for each member, when
        two share a name."""
        cached = self._rosters.get(generation)
        if cached is None or cached[0] != len(joined):
            by_name: dict[str, int] = {}
            error = None
            for r in sorted(joined):
                other = by_name.setdefault(joined[r], r)
                if other != r:
                    error = (
                        f"RPC worker name {joined[r]} is not unique. Workers {other} and {r} share the "
                        "same name."
                    )
                    break
            infos = [WorkerInfo(joined[r], r) for r in sorted(joined)] if error is None else []
            cached = self._rosters[generation] = (len(joined), infos, error)
        if cached[2] is not None:
            raise RuntimeError(cached[2])
        return cached[1]

    def _join_dynamic(
        self, worker: SimWorker, *, name: str, options: Any, generation: int
    ) -> tuple[SimWorld, WorkerInfo, list[WorkerInfo]]:
        """Join generation ``generation``'s dynamic group (LIFE-5); returns holding its token, which
        ``init_rpc`` gives back once every member knows this worker (twinrpc._membership)."""
        group = self._dynamic.setdefault(generation, DynamicGroup(self.sched))
        self.trace.name_worker(worker.rank, name)
        self.trace.record(self.sched.now, worker.rank, "init", f"{name} generation {generation} (dynamic)")
        group.lock(f"the membership token of dynamic group {generation}")
        try:
            sleep(_RENDEZVOUS_DELAY)  # the store round trips of the token and the names
            if self._rendezvous.get(generation):
                raise RuntimeError(MIXED_GROUP_ERROR)
            group.check_unique(name, worker.rank)
        except BaseException:
            group.unlock()
            raise
        group.members[worker.rank] = name
        for other in self.workers:  # a departure of an earlier worker of this rank no longer applies
            if other is not worker and other.world is not None:
                other.world.peer_joined(worker.rank)
        infos = [WorkerInfo(n, r) for r, n in sorted(group.members.items())]
        world = SimWorld(worker, options.num_worker_threads)
        world.membership = DynamicMember(group, worker.rank)
        worker.world = world
        self._heartbeats_of(worker.rank, options)
        return world, WorkerInfo(name, worker.rank), infos

    def _heartbeats_of(self, rank: int, options: Any) -> None:
        """Worker ``rank`` is up with ``options``: from now on it declares a peer dead after
        ``heartbeat_interval * heartbeat_misses`` seconds of virtual silence (never with an interval of
        0), as a gloo worker judges with its own options, unless ``network.heartbeat_timeout`` is set."""
        self.heartbeat_options[rank] = (
            float(getattr(options, "heartbeat_interval", DEFAULT_HEARTBEAT_INTERVAL)),
            int(getattr(options, "heartbeat_misses", DEFAULT_HEARTBEAT_MISSES)),
        )
        if self.faults is not None:
            self.faults.bound_changed(rank)

    # -- crashes --------------------------------------------------------------------------------------
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
        sched = self.sched
        if at is not None or sched.hub is None:  # scheduled (or before run(): at t=0 of the run)
            when = sched.now if at is None else float(at)
            if when < sched.now:
                raise ValueError(f"crash({rank}, at={when}): virtual time is already {sched.now}")
            sched.call_later(when - sched.now, lambda: self.crash(rank))
            return
        if rank in self.crashed:
            return
        self.crashed[rank] = sched.now
        worker = self.workers[rank]
        worker.crashed = True
        self.trace.record(sched.now, rank, "fault", f"crash worker {rank}")
        self.trace.record(sched.now, rank, "crash", f"worker {rank} crashed")
        self._stop_monitors(f"worker {rank} crashed at t={sched.now:.6f}")
        for other in self.workers:
            if other.rank != rank:
                sched.call_later(
                    self.network.failure_detection, functools.partial(self._detect, other.rank, rank)
                )
        current = sched.current_task()
        if current is None:
            self._reap(rank)
            return
        sched.schedule(0.0, self._reap, rank)
        if current.worker == rank:
            sched.park(f"crash of worker {rank}")  # _reap throws GreenletExit into this task
            raise greenlet.GreenletExit()

    def _reap(self, rank: int) -> None:
        """Stop every task of a crashed worker (runs on the hub): each parked task gets GreenletExit,
        unwinding with no visible effect (its sends are dropped, its waits fail at once)."""
        sched = self.sched
        for task in [t for t in sched.tasks.values() if t.worker == rank and not t.done]:
            g = task.g
            task.done = True
            sched.tasks.pop(task.id, None)
            if g is not None and not g.dead:
                g.throw(greenlet.GreenletExit())

    def _detect(self, observer: int, dead: int) -> None:
        world = self.workers[observer].world
        if world is None or observer in self.crashed or world.stopped:
            return
        self._peer_unavailable(
            world,
            observer,
            dead,
            Departure.CRASHED,
            f"connection lost (simulated crash at t={self.crashed[dead]:.6f} s, detected at "
            f"t={self.sched.now:.6f} s)",
        )

    def _peer_unavailable(
        self, world: SimWorld, observer: int, dead: int, departure: Departure, detail: str = ""
    ) -> None:
        """Tell ``observer`` that ``dead`` departed (a crash detected, heartbeat silence, an announced
        shutdown) and trace it: one report for all; the core builds the error (twinrpc._departure)."""
        if departure.shut_down:  # it announced its shutdown: not a failure the trace shows in red
            self.trace.record(self.sched.now, observer, "peer-left", f"rank {dead} ({departure.value})")
        else:
            self.trace.record(self.sched.now, observer, "peer-failed", f"rank {dead}")
        world.peer_failed(dead, departure, detail)

    def _announce_departure(self, world: SimWorld, departure: Departure) -> None:
        """``world``'s worker shut down RPC: each peer learns it after the network's delay, and after
        the messages the worker sent it before (gloo's close frame goes after what is queued). A
        non-graceful shutdown also stops the RRef monitors, as a crash does (their invariants
        assume every worker completes the protocol)."""
        rank, sched = world.rank, self.sched
        if not departure.orderly:
            self._stop_monitors(
                f"worker {rank} shut down RPC without a graceful shutdown at t={sched.now:.6f}"
            )
        # One event per peer, in the order and with the random draws of one call_later each; held
        # in the heap one at a time, and those to peers that stop meanwhile (nearly all, when the
        # whole world shuts down) are dropped unrun (Scheduler.schedule_many).
        delay_of, rng, now, crashed = self.network.delay, sched.rng, sched.now, self.crashed
        last_arrival, reserve, departed = world.last_arrival, sched.reserve, self._departed
        events: list[tuple[float, float, int, Callable[[Any], None], Any]] = []
        for other in self.workers:
            target = other.world
            if other.rank == rank or target is None or target.stopped or other.rank in crashed:
                continue
            delay = delay_of(rank, other.rank, 0, rng)
            delay = max(delay, last_arrival.get(other.rank, 0.0) - now)
            events.append((*reserve(delay), departed, (target, rank, departure)))
        sched.schedule_many(events, self._departure_moot)

    def _departure_moot(self, item: tuple[SimWorld, int, Departure]) -> bool:
        """An announcement to ``observer`` that can no longer do anything: it stopped, crashed or
        was replaced by a new init_rpc (each for good)."""
        observer = item[0]
        return (
            observer.stopped
            or observer.rank in self.crashed
            or observer is not self.workers[observer.rank].world
        )

    def _departed(self, item: tuple[SimWorld, int, Departure]) -> None:
        if self._departure_moot(item):
            return
        observer, rank, departure = item
        self._peer_unavailable(observer, observer.rank, rank, departure)

    # -- network --------------------------------------------------------------------------------------
    def _book(self, rank: int, cost: float) -> float:
        """Book ``cost`` seconds of ``rank``'s time (message handling, computation) after what is
        already booked; returns when it ends. Deterministic: a worker does one thing at a time, first
        come first served."""
        now = self.sched.now
        busy = self.busy_until[rank]
        end = (busy if busy > now else now) + cost
        self.busy_until[rank] = end
        return end

    def _deliver(self, msg: Message) -> None:
        """``msg`` arrives at its destination (it is handled now, or after ``network.message_cost``)."""
        if msg.dst in self.crashed:
            self.trace.message(self.sched.now, msg.dst, "lost", msg, f": worker {msg.dst} crashed")
            return
        if self.faults is not None and self.faults.on_arrival(msg):
            return
        if self.booking:  # the receiver first finishes what it is doing, then unpickles and
            # dispatches this message: one thing at a time
            ready = self._book(msg.dst, self.network.message_cost)
            if ready > self.sched.now:
                self.sched.schedule(ready - self.sched.now, self._handle, msg)
                return
        dst = self.workers[msg.dst].world  # _handle, inlined: this runs for every message
        if dst is None:
            self._bounce(msg, Departure.SHUT_DOWN, "it has not initialised RPC")
            return
        dst.deliver(msg)

    def _handle(self, msg: Message) -> None:
        if msg.dst in self.crashed:  # crashed while the message waited to be handled
            self.trace.message(self.sched.now, msg.dst, "lost", msg, f": worker {msg.dst} crashed")
            return
        dst = self.workers[msg.dst].world
        if dst is None:
            self._bounce(msg, Departure.SHUT_DOWN, "it has not initialised RPC")
            return
        dst.deliver(msg)

    def _bounce(self, msg: Message, departure: Departure, detail: str = "") -> None:
        """``msg`` reached a worker that is not running RPC: a request fails as one to a departed
        worker (``detail``: why, unless it shut down)."""
        why = detail or f"worker {msg.dst} has shut down"
        self.trace.message(self.sched.now, msg.dst, "bounce", msg, f": {why}")
        if msg.src in self.crashed:
            return
        src = self.workers[msg.src].world
        if src is not None and msg.kind in REQUEST_KINDS:
            src.fail_send(msg, departure, detail)


def sleep(seconds: float) -> None:
    """Sleep on the current world's clock: virtual time inside a simulation, wall time outside."""
    from twinrpc._future import CURRENT_BLOCKER

    blocker = CURRENT_BLOCKER.get()
    if not isinstance(blocker, SimBlocker):
        import time

        time.sleep(seconds)
        return
    fut: Future[None] = Future()
    blocker.sched.call_later(max(0.0, float(seconds)), lambda: fut.set_result(None))
    fut.wait()


def now() -> float:
    """The current world's clock: virtual seconds inside a simulation, ``time.monotonic()`` outside."""
    from twinrpc._future import CURRENT_BLOCKER

    blocker = CURRENT_BLOCKER.get()
    if isinstance(blocker, SimBlocker):
        return blocker.sched.now
    import time

    return time.monotonic()

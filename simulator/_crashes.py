"""How workers leave a simulation and how their peers learn it: crashes and announced shutdowns.

:class:`Crashes` owns which workers crashed and when. A crash stops the worker's tasks (its reaper,
replaceable: a program run kills only the process that owned the worker's agent), and each peer
linked to it detects it ``network.failure_detection`` seconds later, as a gloo peer sees the
connection close. A worker that shuts down RPC announces it to each peer it has a link to after the
network's delay, behind what it sent that peer before (gloo's close frame). Only links carry this
news, and only to peers running RPC (the registry :attr:`Crashes.live`): a peer with no link learns
of a crash or a shutdown when it tries to make one (simulator/_network/_link_setup.py). Every such
news reaches the observer's world through one path, :meth:`Crashes.peer_unavailable`, which the
fault engine also takes for a peer declared dead after heartbeat silence.
"""

from __future__ import annotations

import functools
import math
from array import array
from collections.abc import Callable
from typing import TYPE_CHECKING

import greenlet

from twinrpc._departure import Departure

from ._model._network import NetworkModel
from ._network._link_setup import linked

if TYPE_CHECKING:
    from ._kernel._scheduler import Scheduler
    from ._traces._trace import Trace
    from ._world import SimWorker, SimWorld


class Crashes:
    """The crashes and departures of one simulation.

    Args:
        sched: the simulation's scheduler.
        trace: its trace (crashes, departures and failure reports are recorded).
        network: its network model (``failure_detection``, the delay of a departure's news).
        workers: its workers, by rank.
        stop_monitors: stops the RRef monitors, saying why (a crash or a non-graceful shutdown is
            outside the protocol's assumptions).
    """

    def __init__(
        self,
        sched: Scheduler,
        trace: Trace,
        network: NetworkModel,
        workers: list[SimWorker],
        stop_monitors: Callable[[str], None],
    ) -> None:
        self.sched = sched
        self.trace = trace
        self.network = network
        self.workers = workers
        self.stop_monitors = stop_monitors
        #: rank -> virtual time of its crash
        self.crashed: dict[int, float] = {}
        #: rank -> its world, for every worker running RPC (started, not stopped, not crashed): who
        #: hears of a departure
        self.live: dict[int, SimWorld] = {}
        #: how many worlds started so far (``world_started``)
        self._worlds_started = 0
        #: stops a crashed worker's tasks (runs on the hub); a program run replaces it to kill only the
        #: process that owned the worker's agent (simulator/_launch/_processes.py)
        self.reaper: Callable[[int], None] = self.reap

    # -- crashes --------------------------------------------------------------------------------------
    def crash_at(self, rank: int, at: float | None) -> None:
        """Crash worker ``rank`` now, or at virtual time ``at`` (see ``Simulation.crash``)."""
        sched = self.sched
        if at is not None or sched.hub is None:  # scheduled (or before run(): at t=0 of the run)
            when = sched.now if at is None else float(at)
            if when < sched.now:
                raise ValueError(f"crash({rank}, at={when}): virtual time is already {sched.now}")
            sched.call_later(when - sched.now, lambda: self.crash(rank))
            return
        self.crash(rank)

    def crash(self, rank: int) -> None:
        """Crash worker ``rank`` now. Called from the crashing worker's own task, it does not return."""
        sched = self.sched
        if rank in self.crashed:
            return
        self.crashed[rank] = sched.now
        self.live.pop(rank, None)
        worker = self.workers[rank]
        worker.crashed = True
        self.trace.record(sched.now, rank, "fault", f"crash worker {rank}")
        self.trace.record(sched.now, rank, "crash", f"worker {rank} crashed")
        self.stop_monitors(f"worker {rank} crashed at t={sched.now:.6f}")
        # only a link carries the news, and only to a peer running RPC (one with no link learns it
        # when it tries to make one: simulator/_network/_link_setup.py)
        live = self.live
        for other in sorted(live):
            if linked(live[other], rank):
                sched.call_later(self.network.failure_detection, functools.partial(self.detect, other, rank))
        current = sched.current_task()
        if current is None:
            self.reaper(rank)
            return
        sched.schedule(0.0, self.reaper, rank)
        if current.worker == rank:
            sched.park(f"crash of worker {rank}")  # the reaper throws GreenletExit into this task
            raise greenlet.GreenletExit()

    def reap(self, rank: int) -> None:
        """Stop every task of a crashed worker (runs on the hub): each parked task gets GreenletExit,
        unwinding with no visible effect (its sends are dropped, its waits fail at once)."""
        sched = self.sched
        for task in sched.tasks_of(rank):
            sched.kill(task)

    def detect(self, observer: int, dead: int) -> None:
        """``observer`` finds its connection to the crashed ``dead`` lost."""
        world = self.workers[observer].world
        if world is None or observer in self.crashed or world.stopped:
            return
        self.peer_unavailable(
            world,
            observer,
            dead,
            Departure.CRASHED,
            f"connection lost (simulated crash at t={self.crashed[dead]:.6f} s, detected at "
            f"t={self.sched.now:.6f} s)",
        )

    # -- departures -----------------------------------------------------------------------------------
    def peer_unavailable(
        self, world: SimWorld, observer: int, dead: int, departure: Departure, detail: str = ""
    ) -> None:
        """Tell ``observer`` that ``dead`` departed (a crash detected, heartbeat silence, an announced
        shutdown) and trace it: one report for all; the core builds the error (twinrpc._departure)."""
        if departure.shut_down:  # it announced its shutdown: not a failure the trace shows in red
            self.trace.record(self.sched.now, observer, "peer-left", f"rank {dead} ({departure.value})")
        else:
            self.trace.record(self.sched.now, observer, "peer-failed", f"rank {dead}")
        world.peer_failed(dead, departure, detail)

    def world_started(self, world: SimWorld) -> int:
        """``world`` is its worker's world from now on (``init_rpc``): it hears of departures.
        Returns its serial number: a departure announced later is news to it, one announced earlier
        is not."""
        self._worlds_started += 1
        self.live[world.rank] = world
        return self._worlds_started

    def announce_departure(self, world: SimWorld, departure: Departure) -> None:
        """``world``'s worker shut down RPC: each peer learns it after the network's delay, and after
        the messages the worker sent it before (gloo's close frame goes after what is queued). A
        non-graceful shutdown also stops the RRef monitors, as a crash does (their invariants
        assume every worker completes the protocol).

        The news can reach no peer before the network's least delay; only then are its peers
        picked (those running RPC then that already were at the departure) and their delays
        drawn. When a whole world shuts down, nearly every peer has stopped by then: one event per
        departure instead of one per pair of workers (N^2 of them, which made the simulator's cost
        per message grow with the world's size)."""
        rank, sched = world.rank, self.sched
        if not departure.orderly:
            self.stop_monitors(
                f"worker {rank} shut down RPC without a graceful shutdown at t={sched.now:.6f}"
            )
        if self.live.get(rank) is world:
            del self.live[rank]
        sched.schedule(
            _least_delay(self.network),
            self._send_departure,
            (world, departure, sched.now, self._worlds_started),
        )

    def _send_departure(self, item: tuple[SimWorld, Departure, float, int]) -> None:
        """The departure's news can first arrive now: one event for each peer linked to the departed
        worker (a close frame goes over a link; the others read the store when they try to make one)
        and still running RPC that already was at the departure (``world_started`` serials up to
        ``started``), at the departure's time plus its delay, in rank order; one of them in the heap
        at a time, and those to peers that stop meanwhile dropped unrun
        (Scheduler.schedule_spread_at)."""
        world, departure, since, started = item
        rank, sched = world.rank, self.sched
        live = self.live
        # a static group's world knows its links; a dynamic group's member is linked to every member
        peers = sorted(world.links) if world.membership is None else sorted(live)
        targets = [live[r] for r in peers if r != rank and r in live and live[r].serial <= started]
        if not targets:
            return

        def announce(target: SimWorld) -> None:
            self._departed((target, rank, departure))

        network, rng, last_arrival = self.network, sched.rng, world.last_arrival
        times, ties = array("d"), array("d")
        if type(network).delay is not NetworkModel.delay or network.placed:
            # a model of the user's (its own delays), or workers on hosts (two kinds of link)
            for target in targets:
                d = network.delay(rank, target.rank, 0, rng)
                arrival = last_arrival.get(target.rank)
                times.append(
                    since + (d if arrival is None or since + d > arrival else _delay_after(since, arrival))
                )
                ties.append(rng.random())
        else:
            # NetworkModel.delay of a 0-byte message to another worker, inlined. (Its size term,
            # 0 bytes / bandwidth, adds 0.0: left out.)
            latency, jitter = network.latency, network.jitter
            draw, arrival_of = rng.random, last_arrival.get
            for target in targets:
                due = since + latency + draw() * jitter
                last = arrival_of(target.rank)
                # strictly after the last message: at the same time, the tie-break could put it first
                times.append(due if last is None or due > last else math.nextafter(last, math.inf))
                ties.append(draw())
        sched.schedule_spread_at(announce, targets, times, ties, self._moot)

    def _moot(self, observer: SimWorld) -> bool:
        """An announcement to ``observer`` that can no longer do anything: it stopped, crashed or
        was replaced by a new init_rpc (each for good)."""
        return (
            observer.stopped
            or observer.rank in self.crashed
            or observer is not self.workers[observer.rank].world
        )

    def _departed(self, item: tuple[SimWorld, int, Departure]) -> None:
        if self._moot(item[0]):
            return
        observer, rank, departure = item
        self.peer_unavailable(observer, observer.rank, rank, departure)


def _least_delay(network: NetworkModel) -> float:
    """The least delay of a 0-byte message between two workers in ``network`` (0 for a model of
    the user's, whose delays are its own)."""
    if type(network).delay is not NetworkModel.delay:
        return 0.0
    return min(network.latency, network.same_host_latency) if network.placed else network.latency


def _delay_after(now: float, arrival: float) -> float:
    """The smallest delay from ``now`` that ends strictly after ``arrival``: an event at the same
    time as a message's delivery could run before it (ties are broken at random)."""
    delay = arrival - now
    while now + delay <= arrival:
        delay = math.nextafter(delay, math.inf)
    return delay

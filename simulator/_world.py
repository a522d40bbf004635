"""One simulated worker's world: the simulator's implementation of ``twinrpc._world.World``.

A worker and its worlds are built from :class:`WorkerParts`, the parts of the run they use and the
callbacks of the collaborators above them (the links, the crashes, the observers, the rendezvous),
never from the ``Simulation``: the worlds stand below the collaborators, which name ``SimWorker``.
"""

from __future__ import annotations

import collections
import contextvars
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import greenlet

from twinrpc._current import CURRENT_SLOT, WorkerSlot
from twinrpc._departure import Departure
from twinrpc._future import CALLBACK_ROLE, CURRENT_BLOCKER
from twinrpc._message import Kind, Message
from twinrpc._serialize import copy_storages
from twinrpc._world import (
    Connection,
    GroupMembership,
    JoinOptions,
    ProtocolObservers,
    TimerHandle,
    World,
    WorldEvents,
)

from ._kernel._current import CURRENT_SIMULATION

if TYPE_CHECKING:
    from ._kernel._blocker import SimBlocker
    from ._kernel._scheduler import Scheduler
    from ._network._link_setup import LinkSetup
    from ._traces._trace import Trace

_log = logging.getLogger("twinrpc.simulator")
_getcurrent = greenlet.getcurrent
_DELIVER = "deliver"
_REPLY_KINDS = (Kind.RESPONSE, Kind.EXCEPTION)


class Join(Protocol):
    """How a worker joins its group (``Rendezvous.connect``, simulator/_rendezvous.py)."""

    def __call__(
        self,
        worker: SimWorker,
        *,
        name: str,
        rank: int,
        world_size: int | None,
        options: JoinOptions,
        generation: int,
    ) -> Connection: ...


@dataclass(frozen=True, slots=True)
class WorkerParts:
    """What every worker of one run and its worlds are built from (see the module docstring)."""

    #: what ``twinrpc.simulator.current()`` returns in the worker's tasks (the kernel carries it opaque)
    simulation: object
    sched: Scheduler
    trace: Trace
    blocker: SimBlocker
    #: the seeded bound of the delay before a dead user RRef's delete is sent
    gc_delay: float
    #: joins a group (``Rendezvous.connect``)
    join: Join
    #: puts a message a world sends on its way (``Links.send``): returns nothing, it may not return
    #: at all (a fault crashes the sender)
    send: Callable[[SimWorld, Message], None]
    #: a message reached a worker not running RPC (``Links.bounce``)
    bounce: Callable[[Message, Departure], None]
    #: a world starts (``init_rpc``): it hears of departures from now on; returns its serial number
    #: (``Crashes.world_started``)
    world_started: Callable[[SimWorld], int]
    #: a world's worker shut down RPC: its peers learn it (``Crashes.announce_departure``)
    announce_departure: Callable[[SimWorld, Departure], None]
    #: what the agents of a group of a generation report to (``RunObservers.protocol_observers``)
    protocol_observers: Callable[[int], ProtocolObservers]
    #: makes a link on first use (simulator/_network/_link_setup.py)
    link_setup: LinkSetup


class SimWorker:
    """The per-worker state a simulation keeps across init_rpc/shutdown cycles."""

    def __init__(self, parts: WorkerParts, rank: int) -> None:
        self.parts = parts
        self.rank = rank
        self.slot = WorkerSlot(connect=self.connect)
        self.context = contextvars.Context()
        self.context.run(CURRENT_SLOT.set, self.slot)
        self.context.run(CURRENT_BLOCKER.set, parts.blocker)
        self.context.run(CURRENT_SIMULATION.set, parts.simulation)
        self.world: SimWorld | None = None
        self.crashed = False

    def spawn(self, name: str, fn: Callable[..., Any], *args: Any) -> None:
        if self.crashed:
            return  # a crashed worker starts nothing (its timers and deliveries included)
        self.parts.sched.spawn(self.rank, self.context, name, self._run_unless_crashed, (fn, args))

    def _run_unless_crashed(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        if not self.crashed:  # the worker may have crashed between spawn and start
            fn(*args)

    def connect(
        self, *, name: str, rank: int, world_size: int | None, options: JoinOptions, generation: int
    ) -> Connection:
        """This worker's ``twinrpc._world.Connect``: ``init_rpc`` joins the simulated world through the
        simulation's store (simulator/_rendezvous.py)."""
        return self.parts.join(
            self, name=name, rank=rank, world_size=world_size, options=options, generation=generation
        )


class SimWorld(World):
    """Sends through the simulated network, runs tasks on the scheduler, keeps virtual time."""

    clock_name = "simulated"
    #: every simulated task runs on the simulating thread, whatever the process it is in went through
    threaded = False
    owns_process = False  # every simulated worker, and every simulation, shares this process

    def __init__(self, worker: SimWorker, num_worker_threads: int, generation: int = 0) -> None:
        parts = worker.parts
        self.worker = worker
        #: the worker's k-th init_rpc joins generation k's group (simulator/_rendezvous.py)
        self.generation = generation
        self.sched = parts.sched
        self.trace = parts.trace
        #: the message path every send takes (``Links.send``, simulator/_network/_links.py)
        self._send = parts.send
        self._parts = parts
        self.rank = worker.rank
        self.agent: WorldEvents | None = None
        self.stopped = False
        #: how this worker left (set by stop): what a message that reaches it afterwards bounces with
        self.departure: Departure | None = None
        #: peers this worker knows to have departed: rank -> (how, the world's words for it)
        self.dead_peers: dict[int, tuple[Departure, str]] = {}
        #: peer rank -> the latest virtual time a message this worker sent it arrives (a departure is
        #: announced after them, as gloo's close frame goes after the frames queued before it)
        self.last_arrival: dict[int, float] = {}
        self._early: list[Message] = []
        self._pool_size = num_worker_threads
        self._pool_busy = 0
        self._pool_queue: collections.deque[tuple[Callable[..., Any], tuple[Any, ...]]] = collections.deque()
        #: this worker's handle on its dynamic group (LIFE-5); None in a static group
        self.membership: GroupMembership | None = None
        #: peers this world has a link to (a static group's links are made on first use)
        self.links: set[int] = set()
        #: peers whose link is being made, with the messages waiting for it, in order
        self.connecting: dict[int, list[Message]] = {}
        #: this world's place among the simulation's worlds: who hears of which departure
        self.serial = parts.world_started(self)

    # -- World interface ---------------------------------------------------------------------------
    def now(self) -> float:
        return self.sched.now

    def send(self, msg: Message) -> None:
        if self.worker.crashed:
            return  # a crashed worker's unwinding code sends nothing
        if self.stopped:
            # A worker that has left sends nothing more (twinrpc._departure), as gloo's closed links
            self.trace.message(self.sched.now, self.rank, "send-failed", msg, ": sender shut down")
            return
        dead = self.dead_peers.get(msg.dst) if self.dead_peers else None
        if dead is not None:  # a known-dead peer: fail the call at once, as a closed link does
            self.trace.message(self.sched.now, self.rank, "send-failed", msg, ": peer dead")
            agent = self.agent
            if agent is not None:
                err = agent.departure_error(msg.dst, *dead)
                self.worker.spawn("send-failed", agent.on_send_failed, msg, err)
            return
        if msg.tensors:
            msg.tensors = copy_storages(msg.tensors)
        dst = msg.dst
        if dst in self.connecting or not (
            dst in self.links or self.membership is not None or dst == self.rank
        ):
            self._parts.link_setup.send(self, msg)  # made on first use (simulator/_network/_link_setup.py)
            return
        self._send(self, msg)

    def send_waiting(self, peer: int) -> None:
        """The link to ``peer`` is made: send what waited for it, in order."""
        for msg in self.connecting.pop(peer, []):
            if self.stopped or self.worker.crashed:
                return
            dead = self.dead_peers.get(peer)
            if dead is not None:
                self.fail_send(msg, *dead)
            else:
                self._send(self, msg)

    def reach(self, peers: Iterable[int]) -> None:
        """Make the links to ``peers`` now (``World.reach``): a peer that crashed before any link to it
        was made is then reported, as in the gloo world."""
        if self.membership is not None or self.stopped:
            return
        for peer in peers:
            if peer != self.rank and peer not in self.links:
                self._parts.link_setup.reach(self, peer)

    def spawn(self, fn: Callable[..., Any], *args: Any) -> None:
        self.worker.spawn(getattr(fn, "__name__", "task"), fn, *args)

    def submit(self, fn: Callable[..., Any], *args: Any, brief: bool = False) -> None:
        # ``brief`` does not matter here: a simulated pool task never blocks a receiver
        task = getattr(_getcurrent(), "task", None)  # sched.current_task(), inlined: every request
        if self._pool_busy < self._pool_size and task is not None and task.name is _DELIVER:
            # The delivery task has nothing else to do: it becomes the pool task (saves a task switch;
            # the pool accounting is the same).
            task.name = "request"
            self._pool_busy += 1
            self._pool_task(fn, args)
            return
        if self._pool_busy < self._pool_size:
            self._pool_busy += 1
            self.worker.spawn("request", self._pool_task, fn, args)
        else:
            self._pool_queue.append((fn, args))

    def _pool_task(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        # One simulated pool thread: it keeps taking queued requests, as a real pool thread does.
        while True:
            fn(*args)
            if not self._pool_queue:
                self._pool_busy -= 1
                return
            fn, args = self._pool_queue.popleft()

    def call_later(self, delay: float, fn: Callable[[], Any]) -> TimerHandle:
        return self.sched.call_later(delay, lambda: self.worker.spawn("timer", fn))

    def observers(self) -> ProtocolObservers:
        """The trace (simulator/_traces/_observer.py), which forwards RRef events to the online monitors
        (simulator/_checks/_monitors.py); the monitors alone when the trace is off."""
        return self._parts.protocol_observers(self.generation)

    def schedule_rref_delete(self, fn: Callable[[], Any]) -> None:
        """Run ``fn()`` on a task after a seeded delay in [0, gc_delay): when a dead user RRef's
        delete is sent is a scheduling choice of the simulation (twinrpc._rref_context)."""
        delay = self.sched.rng.random() * self._parts.gc_delay
        self.sched.call_later(delay, lambda: self.worker.spawn("rref-delete", fn))

    def start(self, agent: WorldEvents) -> None:
        self.agent = agent
        early, self._early = self._early, []
        for msg in early:
            self.trace.message(self.sched.now, self.rank, "deliver", msg)
            self.worker.spawn("deliver", agent.on_message, msg)
        for peer, (departure, detail) in self.dead_peers.items():  # departed before this agent started
            self.worker.spawn("peer-failed", agent.on_peer_failed, peer, departure, detail)

    def stop(self, graceful: bool = False) -> None:
        """Stop delivering and announce the departure to every peer, each after the network's delay
        and after the messages sent to it before (gloo's close frame): orderly (``Departure.LEFT``)
        when ``graceful`` (the graceful protocol completed), else ``Departure.SHUT_DOWN``."""
        if self.stopped:
            return
        self.stopped = True
        self.agent = None
        self.departure = Departure.LEFT if graceful else Departure.SHUT_DOWN
        self._parts.announce_departure(self, self.departure)

    # -- deliveries (called by the Simulation) -------------------------------------------------------
    def deliver(self, msg: Message) -> None:
        agent = self.agent
        if agent is not None:
            self.trace.message(self.sched.now, self.rank, "deliver", msg)
            sched = self.sched
            if _getcurrent() is not sched.hub or self.worker.crashed:  # a fault verb's release, from a task
                self.worker.spawn(_DELIVER, agent.on_message, msg)
            elif msg.kind in _REPLY_KINDS and sched.meter is None and not sched.paused:
                self._receive_reply(agent, msg)
            else:  # the delivery's task starts now: this event decided it (no second event)
                sched.start_now(self.rank, self.worker.context, _DELIVER, agent.on_message, (msg,))
        elif not self.stopped:
            self._early.append(msg)
        else:
            self._parts.bounce(msg, self.departure or Departure.SHUT_DOWN)

    def _receive_reply(self, agent: WorldEvents, msg: Message) -> None:
        """Handle a reply right here, on no task of its own, as the gloo world's link receiver does:
        handling a reply never blocks (it completes a future: its waiters and the protocol's own
        callbacks run at once), and user callbacks go to a task of their own (``CALLBACK_ROLE``),
        which may block. Saves a task, two switches and a scheduler event per RPC.

        Not with a compute model (what handling costs is booked on a task's worker) or while any
        worker is paused (its deliveries are held back as task starts)."""
        worker = self.worker
        role = CALLBACK_ROLE
        role.defer = self._defer_callbacks
        try:
            worker.context.copy().run(agent.on_message, msg)
        except BaseException as exc:  # as a task's failure: it stops the simulation
            self.sched.fail(f"handling a reply on worker {self.rank}", exc)
        finally:
            role.defer = None

    def _defer_callbacks(self, fn: Callable[[], None]) -> None:
        self.worker.spawn("callbacks", fn)

    def peer_failed(self, peer: int, departure: Departure, detail: str = "") -> None:
        """A peer departed (crashed, fell silent, or announced its shutdown): the agent fails what is
        pending on it (ERR-7, SHUT-3); sends to it fail at once from now on."""
        self.dead_peers[peer] = (departure, detail)
        agent = self.agent
        if agent is not None:
            self.worker.spawn("peer-failed", agent.on_peer_failed, peer, departure, detail)

    def peer_joined(self, peer: int) -> None:
        """A worker joined this dynamic group under ``peer``'s rank: a departure of an earlier
        worker of that rank no longer applies (gloo connects a new link)."""
        self.dead_peers.pop(peer, None)

    def fail_send(self, msg: Message, departure: Departure, detail: str) -> None:
        agent = self.agent
        if agent is None:
            return
        exc = agent.departure_error(msg.dst, departure, detail)
        self.worker.spawn("send-failed", agent.on_send_failed, msg, exc)

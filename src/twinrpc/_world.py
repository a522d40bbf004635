"""The seam between the protocol core and a world (docs/explanation/architecture.md).

The protocol core (the agent, RRefs, dist-autograd) never touches threads, sockets or the clock: it
asks its :class:`World` to send messages, run tasks and set timers, and the world reports back through
the :class:`WorldEvents` the agent implements. The simulator (``simulator/_world.py``) and the gloo
world (``impl/_world.py``) are the two implementations, so the simulator runs the very code that runs
multiprocess. Both subclass :class:`World` and so inherit the defaults of its optional hooks; nothing
crosses the seam that is not declared here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from ._departure import Departure
    from ._dist_autograd import AutogradObserver
    from ._errors import WorkerUnavailableError
    from ._membership import GroupMembership
    from ._message import Message
    from ._rref_context import RRefObserver


class Timer(Protocol):
    def cancel(self) -> None:
        """Stop the timer; a no-op once it fired."""


class TimerHandle:
    """The ``Timer`` both worlds hand out: a flag their timer loop checks before firing."""

    __slots__ = ("cancelled",)

    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


@dataclass(frozen=True, slots=True)
class ProtocolObservers:
    """Who the protocol core reports its RRef and autograd events to. The simulator's trace and
    online monitors observe them; the real world has none (``None`` costs one test per event)."""

    rrefs: RRefObserver | None = None
    autograd: AutogradObserver | None = None


NO_OBSERVERS = ProtocolObservers()


class WorldEvents(Protocol):
    """What a world calls on its agent (``twinrpc._agent.RpcAgent``), each on a task of the worker.

    The world only reports what happened; what it means for calls, collectives and RRefs is the
    agent's to decide (twinrpc._departure)."""

    def on_message(self, msg: Message) -> None:
        """``msg`` arrived. Runs on a task that may block; requests that run user code are handed on
        to :meth:`World.submit` by the agent."""

    def on_send_failed(self, msg: Message, exc: BaseException) -> None:
        """``msg`` could not be delivered; ``exc`` is the agent's :meth:`departure_error`."""

    def on_peer_failed(self, peer: int, departure: Departure, detail: str = "") -> None:
        """``peer`` departed (``detail``: the world's words for a crash or silence)."""

    def departure_error(self, peer: int, departure: Departure, detail: str = "") -> WorkerUnavailableError:
        """The error a call to ``peer`` fails with after it departed: the world uses it for sends
        that fail, so every failure names the departure in the core's words."""

    def on_request_copies(self, msg: Message, copies: int) -> None:
        """The world delivers request ``msg`` ``copies`` times instead of once (0: lost for good; 2 or
        more: duplicated). Only the simulator's fault plans do this; a real link delivers a message
        once or fails. Graceful shutdown counts requests sent against requests served, so it must
        know."""


class World(Protocol):
    """One worker's view of its world. Thread-safe.

    What may block, and for how long (everything else returns at once):

    - :meth:`send` may block the calling thread in the gloo world while the link to the peer is
      busy or the peer has not posted a receive for a large frame: at most the heartbeat bound
      (``heartbeat_interval * heartbeat_misses``; ``rpc_timeout`` when heartbeats are off), after
      which the link fails and so does the send (through ``on_send_failed``). A thread that must
      never block (a link's receiver, the timer) is never made to: the gloo world hands its send to
      an outbox. The simulator's send never blocks (it schedules the delivery).
    - :meth:`stop` blocks until the world's threads are gone: in gloo at most about 16 s, when a peer
      does not close its side (10 s for the peer's close, then 2 s for the abandoned link's threads
      to leave gloo, 2 s for the pool and the timer, 2 s for a dynamic group's watcher); in the
      simulator never.
    - :meth:`start` runs the messages that arrived before the agent existed, on the calling task in
      gloo (they may block as ``on_message`` may).
    """

    #: "simulated" or "wall-clock": how error messages describe durations.
    clock_name: str
    #: this worker's handle on its dynamic group's store (LIFE-5, ``twinrpc._membership``); None in a
    #: static group. A world made by a dynamic join returns holding the group's membership token.
    membership: GroupMembership | None

    def now(self) -> float:
        """Seconds on this world's clock (virtual in the simulator)."""

    def send(self, msg: Message) -> None:
        """Hand ``msg`` to the network (may block: see the class docstring). Failures surface through
        ``agent.on_send_failed`` with the error ``agent.departure_error`` builds. After :meth:`stop`,
        drops ``msg``: a worker that has left sends nothing more (twinrpc._departure)."""

    def spawn(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on a new task of this worker (protocol-internal work, unbounded)."""

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the worker's request pool (``num_worker_threads`` tasks at most)."""

    def call_later(self, delay: float, fn: Callable[[], Any]) -> Timer:
        """Run ``fn()`` on a task of this worker after ``delay`` seconds of this world's clock."""

    def start(self, agent: WorldEvents) -> None:
        """Begin delivering incoming messages to ``agent.on_message`` (each on a task)."""

    def stop(self, graceful: bool = False) -> None:
        """Stop delivering; release the world's resources for this worker; tell every peer that this
        worker shut down RPC, after what was sent to it before (gloo: a close frame on each link; the
        simulator: an announcement with the network's delay). Each peer's world then reports
        ``agent.on_peer_failed(rank, Departure.LEFT if graceful else Departure.SHUT_DOWN)``; a crash
        or silence is reported as ``Departure.CRASHED`` / ``Departure.SILENT`` (a link refused by the job
        key's check as ``Departure.REFUSED``) with the transport's
        words. ``graceful``: the graceful shutdown protocol completed, so the departure is orderly."""

    # -- optional hooks: the defaults are what the real world does ------------------------------------
    def observers(self) -> ProtocolObservers:
        """Who observes this worker's protocol events (read once, when the agent is made)."""
        return NO_OBSERVERS

    def schedule_rref_delete(self, fn: Callable[[], Any]) -> None:
        """Run ``fn()`` (sending a dead user RRef's delete) on a task soon. Called from
        ``UserState.__del__``, which may run inside any allocation holding any lock, so it must only
        schedule. The simulator delays it by a seeded amount: *when* garbage collection triggers a
        delete is a scheduling choice it explores."""
        self.spawn(fn)

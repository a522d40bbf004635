"""The seam between the protocol core and a world (docs/explanation/architecture.md).

The protocol core (the agent, RRefs, dist-autograd) never touches threads, sockets or the clock: it
asks its ``World`` to send messages, run tasks and set timers. The simulator and the gloo world are two
implementations of this small interface, so the simulator runs the very code that runs multiprocess.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from ._agent import RpcAgent
    from ._membership import GroupMembership
    from ._message import Message


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


class World(Protocol):
    """One worker's view of its world. Every method is non-blocking and thread-safe."""

    #: "simulated" or "wall-clock": how error messages describe durations.
    clock_name: str
    #: this worker's handle on its dynamic group's store (LIFE-5, ``twinrpc._membership``); None in a
    #: static group. A world made by a dynamic join returns holding the group's membership token.
    membership: GroupMembership | None

    def now(self) -> float:
        """Seconds on this world's clock (virtual in the simulator)."""

    def send(self, msg: Message) -> None:
        """Hand ``msg`` to the network. Failures surface through ``agent.on_send_failed`` with the
        error ``agent.departure_error`` builds. After :meth:`stop`, drops ``msg``: a worker that has
        left sends nothing more (twinrpc._departure)."""

    def spawn(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on a new task of this worker (protocol-internal work, unbounded)."""

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the worker's request pool (``num_worker_threads`` tasks at most)."""

    def call_later(self, delay: float, fn: Callable[[], Any]) -> Timer:
        """Run ``fn()`` on a task of this worker after ``delay`` seconds of this world's clock."""

    def start(self, agent: RpcAgent) -> None:
        """Begin delivering incoming messages to ``agent.on_message`` (each on a task)."""

    def stop(self, graceful: bool = False) -> None:
        """Stop delivering; release the world's resources for this worker; tell every peer that this
        worker shut down RPC, after what was sent to it before (gloo: a close frame on each link; the
        simulator: an announcement with the network's delay). Each peer's world then reports
        ``agent.on_peer_failed(rank, Departure.LEFT if graceful else Departure.SHUT_DOWN)``; a crash
        or silence is reported as ``Departure.CRASHED`` / ``Departure.SILENT`` with the transport's
        words. ``graceful``: the graceful shutdown protocol completed, so the departure is orderly."""

"""The simulated links: what happens to a message between ``SimWorld.send`` and the receiving agent.

:class:`Links` owns each worker's booked time (``NetworkModel.message_cost`` and the compute model
put a worker's work on one timeline, first come first served), the arrival of a message (lost at a
crashed worker, consumed by the fault engine, queued behind the receiver's booked time, handed to
its world), and the bounce of a message that reaches a worker not running RPC. It runs for every
message: it reads everything through attributes it was given at construction, not through the
simulation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from twinrpc._departure import Departure
from twinrpc._message import REQUEST_KINDS, Message

if TYPE_CHECKING:
    from .._faults._engine import NetworkFaults
    from .._kernel._scheduler import Scheduler
    from .._model._network import NetworkModel
    from .._traces._trace import Trace
    from .._world import SimWorker, SimWorld


class Links:
    """The message path of one simulation.

    Args:
        world_size: the simulation's number of workers (``busy_until`` grows with a worker added later).
        sched: the simulation's scheduler (virtual time, events).
        trace: its trace (lost and bounced messages are recorded).
        network: its network model (``message_cost``).
        workers: its workers, by rank (their current world receives a message).
        crashed: rank -> time of its crash, shared with the simulation's crashes (read only here).
        booking: book the workers' time: ``network.message_cost`` is set or a compute model runs.
    """

    __slots__ = ("booking", "busy_until", "crashed", "faults", "network", "sched", "trace", "workers")

    def __init__(
        self,
        world_size: int,
        sched: Scheduler,
        trace: Trace,
        network: NetworkModel,
        workers: list[SimWorker],
        crashed: dict[int, float],
        *,
        booking: bool,
    ) -> None:
        self.sched = sched
        self.trace = trace
        self.network = network
        self.workers = workers
        self.crashed = crashed
        #: workers' time is booked (message_cost or a compute model); False: the hot path skips it
        self.booking = booking
        #: rank -> virtual time until which its message handling (``network.message_cost``) and its
        #: computation (the compute model) are booked
        self.busy_until = [0.0] * world_size
        #: the fault engine every message goes through (simulator/_faults/_engine.py), once a plan or
        #: the first fault verb installs it; None: no faults, no cost
        self.faults: NetworkFaults | None = None

    def book(self, rank: int, cost: float) -> float:
        """Book ``cost`` seconds of ``rank``'s time (message handling, computation) after what is
        already booked; returns when it ends. Deterministic: a worker does one thing at a time, first
        come first served."""
        now = self.sched.now
        busy = self.busy_until[rank]
        end = (busy if busy > now else now) + cost
        self.busy_until[rank] = end
        return end

    def send(self, sender: SimWorld, msg: Message) -> None:
        """``sender`` sends ``msg`` (``SimWorld.send``, once it knows the message goes out): the network
        delays it, the fault engine may delay, drop, duplicate or hold it, and it is due to arrive."""
        nbytes = msg.nbytes
        network = self.network
        sched = self.sched
        rank = sender.rank
        delay = network.delay(msg.src, msg.dst, nbytes, sched.rng)
        if self.booking:  # the sender's time: what its task computed before this send, then pickling
            meter = sched.meter
            if meter is not None:
                meter.charge(rank)
            delay += self.book(rank, network.message_cost) - sched.now
        self.trace.sent(sched.now, rank, msg, nbytes)
        due = sched.now + delay
        last_arrival = sender.last_arrival
        if due > last_arrival.get(msg.dst, 0.0):
            last_arrival[msg.dst] = due
        faults = self.faults
        if faults is None:
            sched.schedule(delay, self.deliver, msg)
        else:  # fault hook (simulator/_faults/_engine.py): delay, drop, duplicate, hold
            faults.route(msg, delay)

    def deliver(self, msg: Message) -> None:
        """``msg`` arrives at its destination (it is handled now, or after ``network.message_cost``)."""
        if msg.dst in self.crashed:
            self.trace.message(self.sched.now, msg.dst, "lost", msg, f": worker {msg.dst} crashed")
            return
        faults = self.faults
        if faults is not None and faults.on_arrival(msg):
            return
        if self.booking:  # the receiver first finishes what it is doing, then unpickles and
            # dispatches this message: one thing at a time
            ready = self.book(msg.dst, self.network.message_cost)
            if ready > self.sched.now:
                self.sched.schedule(ready - self.sched.now, self.handle, msg)
                return
        dst = self.workers[msg.dst].world  # handle(), inlined: this runs for every message
        if dst is None:
            self.bounce(msg, Departure.SHUT_DOWN, "it has not initialised RPC")
            return
        dst.deliver(msg)

    def handle(self, msg: Message) -> None:
        """``msg``'s receiver is done with what it was doing: its world takes the message."""
        if msg.dst in self.crashed:  # crashed while the message waited to be handled
            self.trace.message(self.sched.now, msg.dst, "lost", msg, f": worker {msg.dst} crashed")
            return
        dst = self.workers[msg.dst].world
        if dst is None:
            self.bounce(msg, Departure.SHUT_DOWN, "it has not initialised RPC")
            return
        dst.deliver(msg)

    def bounce(self, msg: Message, departure: Departure, detail: str = "") -> None:
        """``msg`` reached a worker that is not running RPC: a request fails as one to a departed
        worker (``detail``: why, unless it shut down)."""
        why = detail or f"worker {msg.dst} has shut down"
        self.trace.message(self.sched.now, msg.dst, "bounce", msg, f": {why}")
        if msg.src in self.crashed:
            return
        src = self.workers[msg.src].world
        if src is not None and msg.kind in REQUEST_KINDS:
            src.fail_send(msg, departure, detail)

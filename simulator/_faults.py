"""Network faults as plain data, and the narrow hook that applies them to the simulated network.

A :class:`FaultPlan` is a value (it prints, compares and shrinks): a sequence of per-message
``actions`` applied to the messages in the order they are sent (the i-th action to the i-th message
the simulation sends), link ``holds``, and the bound of the seeded delay before a dead user RRef's
delete is sent. Hypothesis strategies for plans live in :mod:`twinrpc.simulator.strategies`.

Which messages may be lost or duplicated: only RRef control messages (user delete, fork request,
child accept) and their acks. These are the messages PyTorch sends with retries (its faulty agent's
``retryable_message_types``) and whose handlers are idempotent; twinrpc resends them until acked and
deduplicates them on receipt. For any other message a ``Drop``/``Duplicate`` action falls back to
plain delivery (documented, so a shrunk plan means what it says). ``Delay`` and holds apply to every
message: together with jitter they reorder messages freely (PyTorch promises no ordering, RPC-11).

Crashes (:class:`Crash`) kill a worker at a virtual time or when the n-th message of a kind arrives at
it (the message is lost with it): its tasks stop forever, messages to it are dropped, and every peer
sees ``WorkerUnavailableError`` after the network model's ``failure_detection`` delay, as a real
process sees a closed connection (ERR-7). ``Simulation.crash(rank)`` is the same verb, called live.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from twinrpc._message import RREF_CONTROL_KINDS, Kind, Message

if TYPE_CHECKING:
    from ._simulation import Simulation

#: default bound of the seeded delay between a user RRef's death and the send of its delete message
DEFAULT_GC_DELAY = 50e-6


@dataclass(frozen=True, slots=True)
class Deliver:
    """Deliver normally."""

    def __str__(self) -> str:
        return "deliver"


@dataclass(frozen=True, slots=True)
class Delay:
    """Deliver ``extra`` seconds later than the network model says."""

    extra: float

    def __str__(self) -> str:
        return f"delay {self.extra:g}s"


@dataclass(frozen=True, slots=True)
class Drop:
    """Lose the message (control messages and acks only; the sender's retry recovers)."""

    def __str__(self) -> str:
        return "drop"


@dataclass(frozen=True, slots=True)
class Duplicate:
    """Deliver the message, and a copy ``extra`` seconds after it (control messages and acks only)."""

    extra: float

    def __str__(self) -> str:
        return f"duplicate +{self.extra:g}s"


Action = Deliver | Delay | Drop | Duplicate


@dataclass(frozen=True, slots=True)
class Crash:
    """Crash ``worker`` at virtual time ``at``, or when the ``nth`` message of kind ``on_receive``
    arrives at it (that message is lost). Exactly one of ``at`` and ``on_receive`` is given."""

    worker: int
    at: float | None = None
    on_receive: Kind | None = None
    nth: int = 1

    def __post_init__(self) -> None:
        if (self.at is None) == (self.on_receive is None):
            raise ValueError(f"{self!r}: give exactly one of at=<virtual time> and on_receive=<Kind>")
        if self.at is not None and self.at < 0:
            raise ValueError(f"{self!r}: at must be >= 0")
        if self.nth < 1:
            raise ValueError(f"{self!r}: nth must be >= 1")
        if self.on_receive is not None and not isinstance(self.on_receive, Kind):
            raise TypeError(f"{self!r}: on_receive must be a twinrpc._message.Kind")

    def __str__(self) -> str:
        if self.at is not None:
            return f"crash worker {self.worker} at t={self.at:g}s"
        assert self.on_receive is not None
        return f"crash worker {self.worker} when message #{self.nth} of kind {self.on_receive.name} arrives"


@dataclass(frozen=True, slots=True)
class Hold:
    """Hold every message sent from ``src`` to ``dst`` during [start, end) and release it at ``end``
    (plus its normal delay): a one-way partition that heals."""

    src: int
    dst: int
    start: float
    end: float

    def __post_init__(self) -> None:
        if self.end < self.start:
            raise ValueError(f"Hold({self.src}->{self.dst}): end {self.end} is before start {self.start}")

    def __str__(self) -> str:
        return f"hold {self.src}->{self.dst} during [{self.start:g}, {self.end:g})s"


@dataclass(frozen=True, slots=True)
class FaultPlan:
    """What the network does to the messages of one simulation (see the module docstring).

    Args:
        actions: the i-th action applies to the i-th message sent; messages past the end are
            delivered normally.
        holds: link holds.
        gc_delay: a dead user RRef's delete is sent after a seeded delay drawn from [0, gc_delay).
        crashes: workers that crash, at a time or on a message arriving (see :class:`Crash`).
    """

    actions: tuple[Action, ...] = ()
    holds: tuple[Hold, ...] = ()
    gc_delay: float = DEFAULT_GC_DELAY
    crashes: tuple[Crash, ...] = ()

    def __post_init__(self) -> None:
        if self.gc_delay < 0:
            raise ValueError(f"FaultPlan.gc_delay must be >= 0, got {self.gc_delay}")
        for a in self.actions:
            if not isinstance(a, (Deliver, Delay, Drop, Duplicate)):
                raise TypeError(f"FaultPlan.actions holds {a!r}; expected Deliver, Delay, Drop or Duplicate")
            if isinstance(a, (Delay, Duplicate)) and a.extra < 0:
                raise ValueError(f"{a!r}: the extra delay must be >= 0")
        for c in self.crashes:
            if not isinstance(c, Crash):
                raise TypeError(f"FaultPlan.crashes holds {c!r}; expected Crash")

    def describe(self) -> str:
        acts = ", ".join(f"#{i}: {a}" for i, a in enumerate(self.actions) if not isinstance(a, Deliver))
        holds = ", ".join(str(h) for h in self.holds)
        text = f"FaultPlan(actions=[{acts}], holds=[{holds}], gc_delay={self.gc_delay:g}"
        if self.crashes:
            text += ", crashes=[" + ", ".join(str(c) for c in self.crashes) + "]"
        return text + ")"


class NetworkFaults:
    """Applies a :class:`FaultPlan` inside one simulation (installed by ``Simulation(faults=...)``)."""

    def __init__(self, sim: Simulation, plan: FaultPlan) -> None:
        self.sim = sim
        self.plan = plan
        self.sent = 0
        self.dropped = 0
        self.duplicated = 0
        self.held = 0
        #: (sender rank, message id) of control requests, so their acks are recognised
        self._control_requests: set[tuple[int, int]] = set()
        #: crashes triggered by arrivals, and how many messages of each (rank, kind) arrived so far
        self._crash_on_receive = [c for c in plan.crashes if c.on_receive is not None]
        self._arrivals: dict[tuple[int, Kind], int] = {}
        for c in plan.crashes:
            if not 0 <= c.worker < sim.world_size:
                raise ValueError(f"{c}: no worker {c.worker} in a world of {sim.world_size}")
            if c.at is not None:
                sim.crash(c.worker, at=c.at)

    def crash_on_arrival(self, msg: Message) -> bool:
        """Count ``msg`` arriving at its destination; crash that worker if a :class:`Crash` says so.

        Returns True when the destination crashed (the message is lost with it)."""
        if not self._crash_on_receive:
            return False
        key = (msg.dst, msg.kind)
        n = self._arrivals[key] = self._arrivals.get(key, 0) + 1
        for c in self._crash_on_receive:
            if c.worker == msg.dst and c.on_receive is msg.kind and c.nth == n:
                self.sim.trace.record(self.sim.sched.now, msg.dst, "fault", f"{c}: {msg.describe()} lost")
                self.sim.crash(msg.dst)
                return True
        return False

    def _retryable(self, msg: Message) -> bool:
        if msg.kind in RREF_CONTROL_KINDS:
            self._control_requests.add((msg.src, msg.id))
            return True
        return msg.kind is Kind.RESPONSE and (msg.dst, msg.id) in self._control_requests

    def route(self, msg: Message, delay: float) -> None:
        """Schedule the delivery (or not) of ``msg``, which the network model delays by ``delay``."""
        sim = self.sim
        sched = sim.sched
        index = self.sent
        self.sent += 1
        retryable = self._retryable(msg)
        action = self.plan.actions[index] if index < len(self.plan.actions) else None
        for hold in self.plan.holds:
            if hold.src == msg.src and hold.dst == msg.dst and hold.start <= sched.now < hold.end:
                delay += hold.end - sched.now
                self.held += 1
                sim.trace.message(sched.now, msg.src, "hold", msg, f" until t={hold.end:g}")
                break
        if isinstance(action, Delay):
            delay += action.extra
        elif isinstance(action, Drop) and retryable:
            self.dropped += 1
            sim.trace.message(sched.now, msg.src, "drop", msg)
            return
        elif isinstance(action, Duplicate) and retryable:
            self.duplicated += 1
            sim.trace.message(sched.now, msg.src, "duplicate", msg)
            sched.schedule(delay + action.extra, sim._deliver, msg)
        sched.schedule(delay, sim._deliver, msg)

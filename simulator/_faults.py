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
    """

    actions: tuple[Action, ...] = ()
    holds: tuple[Hold, ...] = ()
    gc_delay: float = DEFAULT_GC_DELAY

    def __post_init__(self) -> None:
        if self.gc_delay < 0:
            raise ValueError(f"FaultPlan.gc_delay must be >= 0, got {self.gc_delay}")
        for a in self.actions:
            if not isinstance(a, (Deliver, Delay, Drop, Duplicate)):
                raise TypeError(f"FaultPlan.actions holds {a!r}; expected Deliver, Delay, Drop or Duplicate")
            if isinstance(a, (Delay, Duplicate)) and a.extra < 0:
                raise ValueError(f"{a!r}: the extra delay must be >= 0")

    def describe(self) -> str:
        acts = ", ".join(f"#{i}: {a}" for i, a in enumerate(self.actions) if not isinstance(a, Deliver))
        holds = ", ".join(str(h) for h in self.holds)
        return f"FaultPlan(actions=[{acts}], holds=[{holds}], gc_delay={self.gc_delay:g})"


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
                sim.trace.record(sched.now, msg.src, "hold", f"{msg.describe()} until t={hold.end:g}")
                break
        if isinstance(action, Delay):
            delay += action.extra
        elif isinstance(action, Drop) and retryable:
            self.dropped += 1
            sim.trace.record(sched.now, msg.src, "drop", msg.describe())
            return
        elif isinstance(action, Duplicate) and retryable:
            self.duplicated += 1
            sim.trace.record(sched.now, msg.src, "duplicate", msg.describe())
            sched.schedule(delay + action.extra, sim._deliver, msg)
        sched.schedule(delay, sim._deliver, msg)

"""A trace's plain data: its events, their messages, a trace read back whole, and where two differ.

Frozen values that import nothing else of the simulator: the trace (``_trace``) makes them, its
exports (``_export*``) render them, the diff (``_diff``) finds a :class:`Divergence` between two of
them, and ``NondeterminismError`` carries one, all without a circle of imports.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class MessageInfo:
    """The message a trace event is about.

    Attributes:
        kind: the message kind's name (``"CALL"``, ``"RESPONSE"``, ...).
        id: the message id (per sender; a reply carries its request's id).
        src: the sender's rank.
        dst: the destination's rank.
        nbytes: payload plus tensor bytes.
        seq: the message number: one per send, shared by every event about that message; ``None``
            when unknown (a send that never left, or an unpaired event of a recorded gloo run).
    """

    kind: str
    id: int
    src: int
    dst: int
    nbytes: int
    seq: int | None

    def describe(self) -> str:
        return f"{self.kind}#{self.id} {self.src}->{self.dst} ({self.nbytes} B)"


@dataclass(frozen=True, slots=True)
class TraceEvent:
    """One event of a trace.

    Attributes:
        time: virtual seconds (wall-clock seconds in a recorded gloo run).
        worker: the rank the event happened on; ``-1`` for the simulation itself (monitors).
        event: what happened (``send``, ``deliver``, ``switch``, ``rref-user-created``, ...).
        detail: the event's text.
        message: the message of a message event (``send``, ``deliver``, ``drop``, ...), else ``None``.
        clock: the worker's vector clock after the event (one entry per rank), ``None`` for
            worker ``-1``.
        index: the event's position in the trace.
    """

    time: float
    worker: int
    event: str
    detail: str
    message: MessageInfo | None = None
    clock: tuple[int, ...] | None = None
    index: int = -1

    def line(self) -> str:
        """The event as a line of :meth:`Trace.text`."""
        return f"{self.time:.9f} w{self.worker} {self.event} {self.detail}"


@dataclass(frozen=True, slots=True)
class TraceData:
    """A trace read back whole, as its exports render it (``Trace._data()``).

    Attributes:
        events: every event, with its message and vector clock.
        names: the workers' names by rank, for every rank the header or an event names.
        seed: the simulation's seed (``None`` in a recorded gloo run).
        source: ``"simulator"``, or ``"gloo"`` for a recorded real run.
        clock: ``"virtual"`` or ``"wall"``: what event times mean.
    """

    events: tuple[TraceEvent, ...]
    names: tuple[str, ...]
    seed: int | None
    source: str
    clock: str

    @property
    def world_size(self) -> int:
        return len(self.names)

    def worker_name(self, rank: int) -> str:
        """The name of ``rank`` (``"simulation"`` for -1)."""
        return "simulation" if rank < 0 else self.names[rank]


@dataclass(frozen=True, slots=True)
class Divergence:
    """The first difference between trace A and trace B.

    Attributes:
        index: the position of the first difference: the event index (exact mode), or the position
            in ``worker``'s sequence of sends and deliveries (structural mode).
        worker: the worker of the differing event (A's; B's where A has no event there).
        time: the differing event's time (A's, else B's).
        a: A's event there, or ``None`` when A ended first.
        b: B's event there, or ``None`` when B ended first.
        context_a: A's events around the difference (a few before, the event, a few after).
        context_b: B's events around the difference.
        structural: whether this came from a structural comparison.
    """

    index: int
    worker: int
    time: float
    a: TraceEvent | None
    b: TraceEvent | None
    context_a: tuple[TraceEvent, ...]
    context_b: tuple[TraceEvent, ...]
    structural: bool = False

    def describe(self, names: tuple[str, str] = ("A", "B")) -> str:
        """A readable report: where, both events, and the context in each trace."""
        na, nb = names
        where = (
            f"position {self.index} of worker {self.worker}'s sends and deliveries (times and ids ignored)"
            if self.structural
            else f"event #{self.index}"
        )
        lines = [f"traces diverge at {where}, t={self.time:.9f}, worker {self.worker}:"]
        lines.append(f"  {na}: {_show(self.a, na)}")
        lines.append(f"  {nb}: {_show(self.b, nb)}")
        for name, context, mark in ((na, self.context_a, self.a), (nb, self.context_b, self.b)):
            lines.append(f"context in {name}:")
            if not context:
                lines.append("    (no events)")
            for ev in context:
                lines.append(f"  {'>' if ev is mark else ' '} #{ev.index:<6} {ev.line()}")
        return "\n".join(lines)


def _show(ev: TraceEvent | None, name: str) -> str:
    return f"#{ev.index} {ev.line()}" if ev is not None else f"(no event: trace {name} ended)"

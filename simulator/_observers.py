"""Who watches one simulation's protocol: its trace observer and its online RRef monitors.

The protocol core reports RRef and autograd events to a world's observers
(``twinrpc._world.ProtocolObservers``). In a simulation those are the trace
(``simulator/_traces/_observer.py``), which forwards RRef events to the monitors
(``simulator/_checks/_monitors.py``), or the monitors alone when the trace is off. The monitors stop
at the first fault outside the protocol's assumptions (a crash, a message lost for good, a worker
declared dead, a non-graceful shutdown): :meth:`RunObservers.stop_monitors` is that one switch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from twinrpc._world import NO_OBSERVERS, ProtocolObservers

if TYPE_CHECKING:
    from ._checks._monitors import RRefMonitor
    from ._traces._observer import TraceObserver


class RunObservers:
    """The trace observer and the RRef monitors of one simulation (either may be ``None``: off)."""

    __slots__ = ("monitor", "trace_observer")

    def __init__(self, monitor: RRefMonitor | None, trace_observer: TraceObserver | None) -> None:
        self.monitor = monitor
        #: records RRef and autograd events (and forwards RRef events to the monitors); None: trace off
        self.trace_observer = trace_observer

    def protocol_observers(self) -> ProtocolObservers:
        """What a world's agent reports its RRef and autograd events to."""
        if self.trace_observer is not None:
            return ProtocolObservers(rrefs=self.trace_observer, autograd=self.trace_observer)
        if self.monitor is not None:
            return ProtocolObservers(rrefs=self.monitor)
        return NO_OBSERVERS

    def stop_monitors(self, why: str) -> None:
        """The RRef monitors stop checking (a fault outside the protocol's assumptions happened: a
        crash, a peer declared dead, a non-graceful shutdown); RRef events still reach the trace."""
        if self.monitor is None or self.monitor.stopped is not None:
            return
        self.monitor.stop(why)  # a stopped monitor reports no violation
        if self.trace_observer is not None:
            self.trace_observer.monitor = None

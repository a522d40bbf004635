"""Who watches one simulation's protocol: its trace observer and its online RRef monitors.

The protocol core reports RRef and autograd events to a world's observers
(``twinrpc._world.ProtocolObservers``). In a simulation those are the trace
(``simulator/_traces/_observer.py``), which forwards RRef events to the monitors
(``simulator/_checks/_monitors.py``), or the monitors alone when the trace is off. The monitors stop
at the first fault outside the protocol's assumptions (a crash, a message lost for good, a worker
declared dead, a non-graceful shutdown): :meth:`RunObservers.stop_monitors` is that one switch.
The monitors check each generation of groups on its own (``simulator/_checks/_monitors.py``), so a
worker's RRef events reach the monitor of the generation its ``init_rpc`` joined.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from twinrpc._world import NO_OBSERVERS, ProtocolObservers

from ._traces._observer import TraceObserver

if TYPE_CHECKING:
    from ._checks._monitors import RRefMonitor


class RunObservers:
    """The trace observer and the RRef monitors of one simulation (either may be ``None``: off)."""

    __slots__ = ("_rref_tracers", "monitor", "trace_observer")

    def __init__(self, monitor: RRefMonitor | None, trace_observer: TraceObserver | None) -> None:
        self.monitor = monitor
        #: records RRef and autograd events (and forwards generation 0's RRef events to the monitors);
        #: None: trace off
        self.trace_observer = trace_observer
        #: generation -> the trace observer that forwards that generation's RRef events
        self._rref_tracers: dict[int, TraceObserver] = {}
        if trace_observer is not None:
            self._rref_tracers[0] = trace_observer

    def protocol_observers(self, generation: int = 0) -> ProtocolObservers:
        """What an agent of a group of generation ``generation`` reports its RRef and autograd events to."""
        monitor = self.monitor
        checks = None if monitor is None or monitor.stopped is not None else monitor.generation(generation)
        tracer = self.trace_observer
        if tracer is not None:
            rrefs = self._rref_tracers.get(generation)
            if rrefs is None:
                rrefs = self._rref_tracers[generation] = TraceObserver(tracer.sched, tracer.trace, checks)
            return ProtocolObservers(rrefs=rrefs, autograd=tracer)
        if checks is not None:
            return ProtocolObservers(rrefs=checks)
        return NO_OBSERVERS

    def stop_monitors(self, why: str) -> None:
        """The RRef monitors stop checking (a fault outside the protocol's assumptions happened: a
        crash, a peer declared dead, a non-graceful shutdown); RRef events still reach the trace."""
        if self.monitor is None or self.monitor.stopped is not None:
            return
        self.monitor.stop(why)  # a stopped monitor reports no violation
        for tracer in self._rref_tracers.values():
            tracer.monitor = None

"""twinrpc.simulator: a deterministic, in-process world on virtual time.

Run a program as N workers in one process::

    from twinrpc.simulator import Simulation

    result = Simulation(world_size=3, seed=7).run(program)   # program(rank) on every worker
    result.values(), result.digest

Faults are verbs and plain data: ``sim.crash(2, at=0.5)`` or ``FaultPlan(crashes=(Crash(2, at=0.5),))``.
"""

from __future__ import annotations

from ._determinism import NondeterminismError, check_determinism
from ._errors import SimulationDeadlock, SimulationError
from ._faults import Crash, Delay, Deliver, Drop, Duplicate, FaultPlan, Hold
from ._monitors import MonitorViolation, RRefMonitor
from ._network import NetworkModel
from ._simulation import RunResult, Simulation, WorkerOutcome, now, sleep
from ._trace import MessageInfo, Trace, TraceEvent, TraceFormatError
from ._trace_diff import Divergence, diff_traces

__all__ = [
    "Crash",
    "Delay",
    "Deliver",
    "Divergence",
    "Drop",
    "Duplicate",
    "FaultPlan",
    "Hold",
    "MessageInfo",
    "MonitorViolation",
    "NetworkModel",
    "NondeterminismError",
    "RRefMonitor",
    "RunResult",
    "Simulation",
    "SimulationDeadlock",
    "SimulationError",
    "Trace",
    "TraceEvent",
    "TraceFormatError",
    "WorkerOutcome",
    "check_determinism",
    "diff_traces",
    "now",
    "sleep",
]

"""twinrpc.simulator: a deterministic, in-process world on virtual time.

Run a program as N workers in one process::

    from twinrpc.simulator import Simulation

    result = Simulation(world_size=3, seed=7).run(program)   # program(rank) on every worker
    result.values(), result.digest

Faults are verbs and plain data: ``sim.drop("response", src=1, dst=0)``, ``sim.partition(0, 1)``,
``sim.crash(2, at=0.5)``, or ``FaultPlan([Crash(2, at=0.5)])``, also read from JSON/TOML
(``FaultPlan.load``); ``Swarm`` draws the faults themselves from the seed.
"""

from __future__ import annotations

from ._checks._determinism import check_determinism
from ._checks._monitors import RRefMonitor
from ._config import SimConfig
from ._errors import (
    FaultPlanError,
    MonitorViolation,
    NondeterminismError,
    SimulationDeadlock,
    SimulationError,
    SimulationWarning,
    TraceFormatError,
)
from ._exploration._case import replay
from ._exploration._explore import explore
from ._exploration._failure import Exploration, Failure
from ._model._compute import ComputeModel
from ._model._files import load_faults
from ._model._network import NetworkModel
from ._model._plan import (
    FAULT_KINDS,
    MESSAGE_CLASSES,
    RETRIED_MESSAGES,
    SURVIVABLE_KINDS,
    Crash,
    Delay,
    Deliver,
    Drop,
    Duplicate,
    FaultPlan,
    Hold,
    Partition,
    Pause,
)
from ._model._swarm import Swarm
from ._simulation import RunResult, Simulation, WorkerOutcome, current, now, sleep
from ._traces._data import Divergence, MessageInfo, TraceEvent
from ._traces._diff import diff_traces
from ._traces._trace import Trace

__all__ = [
    "FAULT_KINDS",
    "MESSAGE_CLASSES",
    "RETRIED_MESSAGES",
    "SURVIVABLE_KINDS",
    "ComputeModel",
    "Crash",
    "Delay",
    "Deliver",
    "Divergence",
    "Drop",
    "Duplicate",
    "Exploration",
    "Failure",
    "FaultPlan",
    "FaultPlanError",
    "Hold",
    "MessageInfo",
    "MonitorViolation",
    "NetworkModel",
    "NondeterminismError",
    "Partition",
    "Pause",
    "RRefMonitor",
    "RunResult",
    "SimConfig",
    "Simulation",
    "SimulationDeadlock",
    "SimulationError",
    "SimulationWarning",
    "Swarm",
    "Trace",
    "TraceEvent",
    "TraceFormatError",
    "WorkerOutcome",
    "check_determinism",
    "current",
    "diff_traces",
    "explore",
    "load_faults",
    "now",
    "replay",
    "sleep",
]

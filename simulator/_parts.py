"""``RunParts``: what a collaborator of one run is built from, instead of the whole ``Simulation``.

The simulation makes its parts (the scheduler, the trace, the network model, the workers, the
crashes) and hands a collaborator this frozen bundle of them and of the callbacks it may call back
(deliver a message, stop the monitors). A collaborator so built cannot reach the facade above it:
what it may touch is what it was given.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from twinrpc._message import Message

    from ._crashes import Crashes
    from ._kernel._scheduler import Scheduler
    from ._model._network import NetworkModel
    from ._traces._trace import Trace
    from ._world import SimWorker


@dataclass(frozen=True, slots=True)
class RunParts:
    """The parts of one run and its callbacks (see the module docstring)."""

    seed: int
    sched: Scheduler
    trace: Trace
    network: NetworkModel
    #: the workers by rank: the simulation's own list, so a worker added later is in it
    workers: list[SimWorker]
    crashes: Crashes
    #: rank -> (heartbeat_interval, heartbeat_misses) of the options it passed to init_rpc
    heartbeat_options: dict[int, tuple[float, int]]
    #: delivers a message that arrives now (``Links.deliver``)
    deliver: Callable[[Message], None]
    #: stops the online RRef monitors, saying why (``RunObservers.stop_monitors``)
    stop_monitors: Callable[[str], None]

    @property
    def world_size(self) -> int:
        return len(self.workers)

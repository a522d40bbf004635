"""``current()``: the simulation the calling task runs in.

A program run by ``python -m twinrpc.simulator run`` (or any function under :meth:`Simulation.run`)
never sees the :class:`Simulation` object; this hands it over, so the program can put faults on its
own run with the fault verbs (``current().pause(1, 0.5)``, ``current().crash(2)``), e.g. at an exact
point of its own code rather than at a virtual time.
"""

from __future__ import annotations

import contextvars
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .._simulation import Simulation

#: set in each simulated worker's context (every task of the worker copies it)
CURRENT_SIMULATION: contextvars.ContextVar[Simulation | None] = contextvars.ContextVar(
    "twinrpc_simulation", default=None
)


def current() -> Simulation | None:
    """The :class:`Simulation` the calling task belongs to, or ``None`` outside a simulation.

    Any task of a simulated worker sees it: its program (under ``run``, its simulated processes too),
    its RPC handlers, its callbacks. Code outside every simulation, and the scheduler's own callbacks
    between tasks, get ``None``, so a program can test ``current() is None`` to run unchanged in the
    real world.
    """
    return CURRENT_SIMULATION.get()

"""The simulation the running task belongs to, carried in each simulated worker's context.

The kernel holds it without knowing what it is (the simulation stands on the kernel, not under it);
:func:`twinrpc.simulator.current` (``simulator/_simulation.py``) hands it to programs.
"""

from __future__ import annotations

import contextvars
from typing import Any

#: set in each simulated worker's context (every task of the worker copies it): its ``Simulation``
CURRENT_SIMULATION: contextvars.ContextVar[Any] = contextvars.ContextVar("twinrpc_simulation", default=None)

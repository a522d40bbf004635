"""Errors the simulator itself raises."""

from __future__ import annotations


class SimulationError(RuntimeError):
    """The simulation could not go on (a simulated task crashed, or virtual time ran out)."""


class SimulationDeadlock(SimulationError):
    """Every task is blocked and no event is pending; the message lists each blocked task's stack."""

"""Errors the simulator itself raises."""

from __future__ import annotations


class SimulationError(RuntimeError):
    """The simulation could not go on (a simulated task crashed, or virtual time ran out)."""


class SimulationDeadlock(SimulationError):
    """Every task is blocked and no event is pending; the message lists each blocked task's stack."""


class FaultPlanError(ValueError):
    """A fault plan, a network model or a swarm description is malformed (a Python object or a
    JSON/TOML file); the message names the field, e.g. ``faults[2] (drop).nth``."""

"""The one error of the simulator's plain data (the rest of the tree is ``simulator/_errors.py``)."""

from __future__ import annotations


class FaultPlanError(ValueError):
    """A fault plan, a network model or a swarm description is malformed (a Python object or a
    JSON/TOML file); the message names the field, e.g. ``faults[2] (drop).nth``."""

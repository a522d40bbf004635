"""Reading the simulator's plain data from where users give it: a file that holds a fault plan or
a swarm (``--faults FILE``), or a command-line flag's value (a JSON object or a file's path).

Each model's own dict form is beside it (``FaultPlan.to_dict``, ``NetworkModel.from_dict``...); the
formats themselves (dicts, JSON, TOML) are ``_codec.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ._codec import data_from_text, read_data, source_of
from ._compute import ComputeModel, compute_from_dict
from ._network import NetworkModel, network_from_dict
from ._plan import FaultPlan, plan_from_dict
from ._swarm import Swarm, swarm_from_dict


def plan_from_text(text: str, flag: str = "faults") -> FaultPlan:
    """A fault plan given as a flag's value (``--sim-faults``, ``replay --faults``): its JSON
    object, or the path of a JSON or TOML file; errors name ``flag``."""
    return plan_from_dict(data_from_text(text, flag), f"{source_of(text, flag)}: ")


def network_from_text(text: str, flag: str = "network") -> NetworkModel:
    """A network model given as a flag's value (``--sim-network``, ``replay --network``): its JSON
    object, or the path of a JSON or TOML file; errors name ``flag``."""
    return network_from_dict(data_from_text(text, flag), source_of(text, flag))


def compute_from_text(text: str, flag: str = "compute") -> ComputeModel:
    """A compute model given as a flag's value (``--sim-compute``): its JSON object, or the path of a
    JSON or TOML file; errors name ``flag``."""
    return compute_from_dict(data_from_text(text, flag), source_of(text, flag))


def load_faults(path: str | Path) -> FaultPlan | Swarm:
    """Read a ``.json`` or ``.toml`` fault file: a :class:`~twinrpc.simulator.FaultPlan`, or a
    :class:`~twinrpc.simulator.Swarm` when the file holds a ``swarm`` table (what ``--faults FILE``
    accepts).

    Raises:
        FaultPlanError: the file is not JSON or TOML, or a field is unknown or malformed (named).
        OSError: the file cannot be read.
    """
    data = read_data(path)
    if isinstance(data, dict) and "swarm" in data:
        return swarm_from_dict(data, f"{path}: ")
    return plan_from_dict(data, f"{path}: ")


def plan_of(value: dict[str, Any] | str, flag: str = "faults") -> FaultPlan:
    """A fault plan given as its dict (:meth:`FaultPlan.to_dict`'s form), or as text: its JSON object
    or the path of a JSON or TOML file (errors name ``flag``)."""
    if isinstance(value, str):
        return plan_from_text(value, flag)
    return FaultPlan.from_dict(value)

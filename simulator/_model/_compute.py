"""The compute model: how much virtual time the torch operators a simulated task runs take.

:class:`ComputeModel` is plain data; the kernel's meter (``simulator/_kernel/_compute.py``) counts a
task's operators and FLOPs and books ``op_cost * ops + flop_cost * flops`` on its worker.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ._codec import build, dump_data, plain, read_data
from ._errors import FaultPlanError


@dataclass(frozen=True, slots=True)
class ComputeModel:
    """How much virtual time computation takes: ``op_cost`` per torch operator call plus
    ``flop_cost`` per floating-point operation.

    FLOPs are counted for matrix products and convolutions, forward and backward
    (:data:`torch.utils.flop_counter.flop_registry`); every other operator costs ``op_cost`` only.
    A task's own clock does not move while it computes (it still runs in zero virtual time), but its
    worker is busy: its next messages leave after the computation, and messages reaching it wait.
    Fit both constants to a real machine with
    :func:`~twinrpc.simulator.calibration.fit_compute_model`.

    Args:
        op_cost: virtual seconds per operator call (the framework's fixed cost per op).
        flop_cost: virtual seconds per floating-point operation.

    Raises:
        FaultPlanError: a value is negative or not a finite number.
    """

    op_cost: float = 0.0
    flop_cost: float = 0.0

    def __post_init__(self) -> None:
        for name in ("op_cost", "flop_cost"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not (0 <= value < math.inf):
                raise FaultPlanError(f"ComputeModel.{name} must be a finite number >= 0, got {value!r}")

    def cost(self, ops: int, flops: int) -> float:
        """Virtual seconds for ``ops`` operator calls doing ``flops`` floating-point operations."""
        return self.op_cost * ops + self.flop_cost * flops

    # -- plain data --------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Both fields by name (``ComputeModel.from_dict(m.to_dict()) == m``)."""
        return compute_to_dict(self)

    @classmethod
    def from_dict(cls, data: Any) -> ComputeModel:
        """The model a dict describes; a missing field takes its default.

        Raises:
            FaultPlanError: naming an unknown or malformed field.
        """
        return compute_from_dict(data)

    @classmethod
    def load(cls, path: str | Path) -> ComputeModel:
        """Read a model from a ``.json`` or ``.toml`` file (the form of :meth:`to_dict`), e.g. the one
        ``benchmarks/bench_calibration.py`` fits to this machine."""
        return compute_from_dict(read_data(path), f"{path}")

    def dump(self, path: str | Path) -> None:
        """Write the model to a ``.json`` or ``.toml`` file."""
        dump_data(self.to_dict(), path)


def compute_to_dict(model: ComputeModel) -> dict[str, Any]:
    return plain(model, include_defaults=True)


def compute_from_dict(data: Any, where: str = "") -> ComputeModel:
    return build(ComputeModel, data, where or "compute model")  # type: ignore[no-any-return]

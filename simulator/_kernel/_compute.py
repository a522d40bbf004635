"""The compute model: virtual time for the torch operators simulated tasks run.

Without it, everything a task computes (a user function, a forward or backward pass, an optimizer
step) takes no virtual time. With ``Simulation(compute=ComputeModel(op_cost, flop_cost))`` the
scheduler counts, while a task runs, the torch operators it calls and their floating-point operations
(as :mod:`torch.utils.flop_counter` counts them), and books ``op_cost * ops + flop_cost * flops`` on
the task's worker: on the same one-at-a-time timeline as ``NetworkModel.message_cost``, so what the
worker sends afterwards leaves later and what it receives meanwhile waits. The counts depend only on
the program and the schedule, so runs stay deterministic.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from .._errors import FaultPlanError

if TYPE_CHECKING:
    from .._simulation import Simulation


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
        from .._files import compute_to_dict

        return compute_to_dict(self)

    @classmethod
    def from_dict(cls, data: Any) -> ComputeModel:
        """The model a dict describes; a missing field takes its default.

        Raises:
            FaultPlanError: naming an unknown or malformed field.
        """
        from .._files import compute_from_dict

        return compute_from_dict(data)

    @classmethod
    def load(cls, path: str | Path) -> ComputeModel:
        """Read a model from a ``.json`` or ``.toml`` file (the form of :meth:`to_dict`), e.g. the one
        ``benchmarks/bench_calibration.py`` fits to this machine."""
        from .._files import load_compute

        return load_compute(path)

    def dump(self, path: str | Path) -> None:
        """Write the model to a ``.json`` or ``.toml`` file."""
        from .._files import dump_data

        dump_data(self.to_dict(), path)


class OperationCounter(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch's mode is untyped
    """Counts the torch operators run under it and their FLOPs (a ``TorchDispatchMode``)."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.ops = 0
        self.flops = 0

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.ops += 1
        count = flop_registry.get(func.overloadpacket)
        if count is not None:
            self.flops += int(count(*args, **kwargs, out_val=out))
        return out


def count_operations(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, int, int]:
    """Run ``fn(*args, **kwargs)`` and count its operators; returns ``(value, ops, flops)``."""
    counter = OperationCounter()
    with counter:
        value = fn(*args, **kwargs)
    return value, counter.ops, counter.flops


class ComputeMeter:
    """The scheduler's side: counts each task's operators while it runs, books them on its worker."""

    __slots__ = ("counter", "model", "ops", "sim")

    def __init__(self, sim: Simulation, model: ComputeModel) -> None:
        self.sim = sim
        self.model = model
        self.counter = OperationCounter()
        self.ops = 0  # operators charged so far (all workers)

    def enter(self) -> None:
        self.counter.__enter__()  # type: ignore[no-untyped-call]

    def exit(self) -> None:
        self.counter.__exit__(None, None, None)  # type: ignore[no-untyped-call]

    def charge(self, rank: int) -> None:
        """Book what the running task computed since the last charge on worker ``rank``."""
        counter = self.counter
        ops, flops = counter.ops, counter.flops
        if ops:
            counter.ops = counter.flops = 0
            self.ops += ops
            self.sim.links.book(rank, self.model.cost(ops, flops))

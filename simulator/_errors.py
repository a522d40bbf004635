"""Every error and warning the simulator raises, in one tree.

Each class mixes in the builtin a caller would already catch, so ``except RuntimeError:`` or
``except ValueError:`` keeps working::

    SimulationError(RuntimeError)        the run could not go on
    ├── SimulationDeadlock               every task blocked, no event pending
    ├── MonitorViolation                 an RRef protocol invariant broke
    ├── NondeterminismError              two runs with one seed differed
    └── TraceFormatError(.., ValueError) a file that is not a twinrpc trace
    FaultPlanError(ValueError)           a malformed fault plan, swarm, network or compute model
                                         (defined with the plain data, ``simulator/_model/``)
    CalibrationError(ValueError)         measurements that determine no model
    LaunchError(ValueError)              bad input to ``python -m twinrpc.simulator run``/``explore``
    ReplayError(ValueError)              bad input to ``python -m twinrpc.simulator replay``
    ProgramError(Exception)              a simulated process's uncaught exception, read from its traceback
    SimulationWarning(UserWarning)       a program did something that makes runs with one seed differ

:class:`~twinrpc.simulator.Failure` (an ``AssertionError``), what :func:`~twinrpc.simulator.explore`
raises, lives with exploration (``_exploration/_failure.py``): it carries the shrunk case and replays it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._model._errors import FaultPlanError

__all__ = [
    "CalibrationError",
    "FaultPlanError",
    "LaunchError",
    "MonitorViolation",
    "NondeterminismError",
    "ProgramError",
    "ReplayError",
    "SimulationDeadlock",
    "SimulationError",
    "SimulationWarning",
    "TraceFormatError",
]

if TYPE_CHECKING:
    from ._traces._data import Divergence


class SimulationError(RuntimeError):
    """The simulation could not go on (a simulated task crashed, or virtual time ran out)."""


class SimulationDeadlock(SimulationError):
    """Every task is blocked and no event is pending; the message lists each blocked task's stack."""


class MonitorViolation(SimulationError):
    """A protocol invariant broke during a simulation.

    Attributes:
        requirement: the spec ID the invariant belongs to (e.g. ``"RREF-F1"``).
        invariant: a short name ("G1", "G2", "owner-free", "no-leak").
        time: the virtual time of the violation.
    """

    def __init__(self, requirement: str, invariant: str, time: float, message: str) -> None:
        super().__init__(f"[{requirement} {invariant}] at t={time:.6f}: {message}")
        self.requirement = requirement
        self.invariant = invariant
        self.time = time


class NondeterminismError(SimulationError):
    """Two runs of one scenario with the same seed differed.

    Attributes:
        divergence: where the traces of the two runs first differ (``None`` when the traces agree
            but the runs ended differently, one raising and the other not).
        seed: the seed both runs used.
    """

    def __init__(self, message: str, divergence: Divergence | None, seed: int) -> None:
        super().__init__(message)
        self.divergence = divergence
        self.seed = seed


class TraceFormatError(SimulationError, ValueError):
    """A trace file that is not in twinrpc's trace format (or of a newer version)."""


class CalibrationError(ValueError):
    """The measurements cannot determine a model (too few distinct sizes, a value not positive)."""


class LaunchError(ValueError):
    """Bad input to ``python -m twinrpc.simulator run`` (a file, a flag value)."""


class ReplayError(ValueError):
    """Bad input to ``replay`` (a target that does not import, a value that does not parse)."""


class ProgramError(Exception):
    """An uncaught exception of a simulated process, known by its printed traceback: its type's name
    and message are what "the same failure" compares."""

    def __init__(self, type_name: str, message: str, traceback_text: str) -> None:
        super().__init__(message)
        self.type_name = type_name
        self.traceback_text = traceback_text

    def __reduce__(self) -> tuple[type[ProgramError], tuple[str, str, str]]:
        # pickled whole: a parallel exploration's worker process sends its failure to the parent
        return (type(self), (self.type_name, str(self), self.traceback_text))


class SimulationWarning(UserWarning):
    """A simulated program did something that makes runs with the same seed differ (it read the wall
    clock, slept in wall time or started an OS thread). The message names the file and line."""

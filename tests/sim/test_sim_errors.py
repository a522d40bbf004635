"""The simulator's errors are one documented tree in one module, and each mixes in the builtin a caller
already catches."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import warnings
from pathlib import Path

import pytest
import twinrpc.simulator
import twinrpc.simulator.calibration
from twinrpc.simulator import (
    FaultPlan,
    FaultPlanError,
    MonitorViolation,
    NondeterminismError,
    SimulationDeadlock,
    SimulationError,
    SimulationWarning,
    Trace,
    TraceFormatError,
    _errors,
)

#: exception classes that live outside _errors.py on purpose: the error of the plain data, defined on
#: the ground floor (simulator/_model/ imports nothing else of the simulator) and re-exported by
#: _errors.py; explore's result, which carries the shrunk case and replays it; and two private
#: control-flow signals that never leave their module
ELSEWHERE = {
    "twinrpc.simulator._model._errors.FaultPlanError",
    "twinrpc.simulator.Failure",  # defined in _exploration/_failure.py, named by its public module
    "twinrpc.simulator._exploration._search._Cached",
    "twinrpc.simulator._exploration._search._Stopped",  # control flow inside a search, like _Cached
    "twinrpc.simulator._cli._trace._BadInput",
}


def _simulator_modules() -> list[str]:
    names = ["twinrpc.simulator"]
    for info in pkgutil.walk_packages(twinrpc.simulator.__path__, "twinrpc.simulator."):
        if not info.name.endswith("__main__"):
            names.append(info.name)
    return names


def test_every_simulator_exception_and_warning_class_is_defined_in_the_errors_module() -> None:
    defined_elsewhere = []
    for name in _simulator_modules():
        module = importlib.import_module(name)
        for cls in vars(module).values():
            if not (inspect.isclass(cls) and issubclass(cls, BaseException)):
                continue
            where = f"{cls.__module__}.{cls.__qualname__}"
            if not where.startswith("twinrpc.simulator"):
                continue  # imported from torch, hypothesis or twinrpc's core
            if cls.__module__ != _errors.__name__ and where not in ELSEWHERE:
                defined_elsewhere.append(where)
    assert defined_elsewhere == []


def test_public_error_names_are_the_classes_of_the_errors_module() -> None:
    public = {n: getattr(twinrpc.simulator, n) for n in twinrpc.simulator.__all__}
    errors = {n: c for n, c in public.items() if inspect.isclass(c) and issubclass(c, BaseException)}
    assert {n for n, c in errors.items() if c.__module__ != _errors.__name__} == {"Failure", "FaultPlanError"}
    for name, cls in errors.items():
        if name != "Failure":
            assert cls is getattr(_errors, name)
    assert twinrpc.simulator.calibration.CalibrationError is _errors.CalibrationError


@pytest.mark.parametrize(
    ("error", "builtins"),
    [
        (SimulationError, (RuntimeError,)),
        (SimulationDeadlock, (SimulationError, RuntimeError)),
        (MonitorViolation, (SimulationError, RuntimeError)),
        (NondeterminismError, (SimulationError, RuntimeError)),
        (TraceFormatError, (SimulationError, ValueError)),
        (FaultPlanError, (ValueError,)),
        (_errors.CalibrationError, (ValueError,)),
        (_errors.LaunchError, (ValueError,)),
        (_errors.ReplayError, (ValueError,)),
        (_errors.ProgramError, (Exception,)),
        (SimulationWarning, (UserWarning,)),
    ],
)
def test_each_error_is_caught_by_the_builtin_it_mixes_in(
    error: type[BaseException], builtins: tuple[type[BaseException], ...]
) -> None:
    assert issubclass(error, builtins)


def test_a_file_that_is_not_a_trace_is_caught_as_a_simulation_error_and_as_a_value_error(
    tmp_path: Path,
) -> None:
    bad = tmp_path / "not-a-trace.jsonl"
    bad.write_text('{"format": "something else"}\n')
    with pytest.raises(SimulationError):
        Trace.load(bad)
    with pytest.raises(ValueError, match="not-a-trace"):
        Trace.load(bad)


def test_a_malformed_fault_plan_is_caught_as_a_value_error() -> None:
    with pytest.raises(ValueError, match="faults"):
        FaultPlan.from_dict({"faults": [{"type": "no-such-fault"}]})


def test_a_monitor_violation_names_its_requirement_invariant_and_time() -> None:
    violation = MonitorViolation("RREF-F1", "G1", 0.25, "user deleted before the owner knew of it")
    assert str(violation) == "[RREF-F1 G1] at t=0.250000: user deleted before the owner knew of it"
    assert (violation.requirement, violation.invariant, violation.time) == ("RREF-F1", "G1", 0.25)
    with pytest.raises(RuntimeError):
        raise violation


def test_simulation_warning_is_filtered_as_a_user_warning() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("ignore", UserWarning)
        warnings.warn("read the wall clock", SimulationWarning, stacklevel=1)
    assert caught == []

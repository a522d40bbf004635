"""The simulator's objects keep to their seams, as the core's do (tests/test_core_boundaries.py).

``Simulation`` is a facade over collaborators that own their state (the scheduler, the rendezvous, the
links, the crashes, the fault engine, the observers); they talk through public methods and the
callbacks they were given, never through each other's private attributes. This test reads the
simulator's source, so a shortcut across a seam fails here, not in a later refactoring.
"""

from __future__ import annotations

import inspect
import pathlib
from collections.abc import Iterator

import twinrpc.simulator
from _private_reaches import private_reaches as scan

SIMULATOR = pathlib.Path(twinrpc.simulator.__file__).parent
PACKAGE = "twinrpc.simulator"

#: private names the simulator may use on objects of other libraries, each because no public way
#: exists to do what the simulator must do to run an unchanged program in one process:
ALLOWED = {
    # os.environ's backing dict: each simulated process has an environment of its own, swapped in as
    # os.environ's data at every switch between processes (simulator/_launch/_program.py), so that the
    # program's os.environ is the real object and a switch costs no copy
    "_data",
    # multiprocessing.Process's Popen object and start method: a simulated child process is one whose
    # Popen is the simulator's (simulator/_launch/_processes.py), as multiprocessing's own start
    # methods do it
    "_popen",
    "_start_method",
}


def _modules() -> Iterator[pathlib.Path]:
    yield from sorted(SIMULATOR.rglob("*.py"))


def _package_of(path: pathlib.Path) -> str:
    """The package a module of the simulator is in (to resolve its relative imports)."""
    parts = path.relative_to(SIMULATOR).with_suffix("").parts
    return ".".join([PACKAGE, *parts[:-1]])


def private_reaches(path: pathlib.Path, base: pathlib.Path = SIMULATOR.parent) -> list[str]:
    """The shared scan (tests/_private_reaches.py), lenient about modules' privates, as the simulator
    runs unchanged programs and patches library modules for them."""
    package = _package_of(path) if path.is_relative_to(SIMULATOR) else PACKAGE
    return scan(path, base=base, allowed=ALLOWED, package=package)


def test_no_simulator_object_reaches_into_another_objects_private_state() -> None:
    reaches = [r for path in _modules() for r in private_reaches(path)]
    assert not reaches, "private attributes used across objects:\n" + "\n".join(reaches)


def test_the_scan_finds_a_private_reach_across_objects(tmp_path: pathlib.Path) -> None:
    """The scan itself works: a collaborator calling the simulation's private method is found, a
    module's own private and a library module's private are not."""
    source = tmp_path / "probe.py"
    source.write_text(
        "import sys\n\n\ndef _own() -> None:\n    pass\n\n\n"
        "def f(sim, self):\n    sim._book(0, 1.0)\n    _own()\n    sys._getframe()\n    self._mine()\n"
    )
    assert private_reaches(source, tmp_path) == ["probe.py:9: sim._book"]


def test_the_simulation_is_a_facade_over_collaborators_that_own_their_state() -> None:
    """The run's parts are reachable by public names, and the simulation keeps none of their state."""
    from twinrpc.simulator import Simulation

    sim = Simulation(2)
    assert sim.crashed is sim.crashes.crashed
    assert sim.heartbeat_options is sim.rendezvous.heartbeat_options
    assert sim.faults is sim.links.faults is None
    sim.drop("CALL")
    assert sim.faults is sim.links.faults is not None
    assert sim.monitor is sim.observers.monitor
    state = set(vars(sim))
    for owned in ("busy_until", "booking", "_rendezvous", "_rosters", "_dynamic"):
        assert owned not in state


def test_the_facade_keeps_the_public_face_of_simulation() -> None:
    """Its constructor's keywords (config= added last), the fault verbs, ``run`` and ``now``."""
    from twinrpc.simulator import Simulation

    assert list(inspect.signature(Simulation).parameters) == [
        "world_size",
        "seed",
        "network",
        "trace",
        "max_time",
        "faults",
        "monitors",
        "compute",
        "config",
    ]
    verbs = ("apply", "delay", "drop", "duplicate", "hold", "release", "partition", "heal", "pause", "crash")
    assert all(callable(getattr(Simulation, verb)) for verb in (*verbs, "run"))
    sim = Simulation(2, 5)
    assert (sim.world_size, sim.seed, sim.now, sim.crashed, sim.plan) == (2, 5, 0.0, {}, None)

"""The simulator's objects keep to their seams, as the core's do (tests/architecture/test_core_boundaries.py).

``Simulation`` is a facade over collaborators that own their state (the scheduler, the rendezvous, the
links, the crashes, the fault engine, the observers); they talk through public methods and the
callbacks they were given, never through each other's private attributes. This test reads the
simulator's source, so a shortcut across a seam fails here, not in a later refactoring.
"""

from __future__ import annotations

import ast
import dataclasses
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


# -- the layers: the import graph, read with ast -------------------------------------------------------
#: the simulator's floors, lowest first (docs/explanation/architecture.md, "The simulator's floors"):
#: a module's floor is that of the longest prefix of its name (relative to twinrpc.simulator) listed here
FLOORS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("plain data", ("_model", "_traces._data")),
    ("errors", ("_errors",)),
    ("traces", ("_traces",)),
    ("kernel", ("_kernel",)),
    ("worlds", ("_world", "_dynamic_group")),
    (
        "collaborators",
        (
            "_parts",
            "_liveness",
            "_network",
            "_faults",
            "_crashes",
            "_rendezvous",
            "_observers",
            "_checks._monitors",
            "_traces._observer",
        ),
    ),
    ("simulation", ("_simulation", "_config")),
    (
        "entry points",
        (
            "",
            "__main__",
            "_checks",
            "_exploration",
            "_launch",
            "_cli",
            "pytest_plugin",
            "calibration",
            "strategies",
        ),
    ),
)
#: the entry points: the modules besides Simulation's own that may name ``Simulation``
ENTRY_POINTS = ("_simulation", "_config", *FLOORS[-1][1])
#: the most imports that may run from a lower floor up (none does today)
MAX_IMPORTS_UP = 4
MAX_LOCAL_IMPORTS = 19


@dataclasses.dataclass(frozen=True)
class _Import:
    source: str  # the importing module, relative to twinrpc.simulator ("" for the package)
    target: str
    line: int
    local: bool  # inside a function
    typing_only: bool  # under ``if TYPE_CHECKING:``
    names: tuple[str, ...]


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(SIMULATOR).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> list[_Import]:
    """Every import of a simulator module by a simulator module: module-level, function-local and
    type-only alike (a name a module uses is a dependency, whenever it is bound)."""
    modules = {_module_name(p) for p in _modules()}
    found = []
    for path in _modules():
        source = _module_name(path)
        tree = ast.parse(path.read_text())
        local: set[int] = set()
        typing_only: set[int] = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                local.update(id(n) for n in ast.walk(node))
            elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                typing_only.update(id(n) for n in ast.walk(node))
        package = source.split(".") if path.name == "__init__.py" else source.split(".")[:-1]
        package = [p for p in package if p]
        for node in ast.walk(tree):
            targets: list[tuple[str, tuple[str, ...]]] = []
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package[: len(package) - node.level + 1] + ([node.module] if node.module else [])
                    module = ".".join(base)
                elif (node.module or "").startswith(PACKAGE + ".") or node.module == PACKAGE:
                    module = node.module.removeprefix(PACKAGE).lstrip(".")  # type: ignore[union-attr]
                else:
                    continue
                for alias in node.names:
                    sub = f"{module}.{alias.name}".lstrip(".")
                    targets.append((sub, ()) if sub in modules else (module, (alias.name,)))
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith(PACKAGE + "."):
                        targets.append((alias.name.removeprefix(PACKAGE + "."), ()))
            for target, names in targets:
                if target in modules and target != source:
                    found.append(
                        _Import(
                            source, target, node.lineno, id(node) in local, id(node) in typing_only, names
                        )
                    )
    return found


def _floor(module: str) -> int:
    best, floor = -1, -1
    for index, (_, prefixes) in enumerate(FLOORS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".") or prefix == "") and len(prefix) > best:
                best, floor = len(prefix), index
    return floor


def _circles(imports: list[_Import]) -> list[set[str]]:
    """The strongly connected components of the import graph that hold more than one module."""
    graph: dict[str, set[str]] = {}
    for i in imports:
        graph.setdefault(i.source, set()).add(i.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return circles


def test_every_simulator_module_has_a_floor() -> None:
    assert [m for m in map(_module_name, _modules()) if _floor(m) < 0] == []


def test_the_plain_data_imports_nothing_else_of_the_simulator() -> None:
    up = [i for i in _imports() if i.source.startswith("_model") and not i.target.startswith("_model")]
    assert up == []


def test_no_import_circle_is_wider_than_two_modules() -> None:
    """Module-level, function-local and type-only imports alike: a module that names another for its
    types depends on it as much as one that calls it (the worlds are built from ``WorkerParts``, not
    from ``Simulation``; the trace's exports and ``NondeterminismError`` use ``_traces/_data.py``)."""
    wide = [sorted(c) for c in _circles(_imports()) if len(c) > 2]
    assert wide == []


def test_at_most_four_imports_run_from_a_lower_floor_up() -> None:
    """Type-only imports count: a module that names a higher one depends on it."""
    up = [f"{i.source}:{i.line} -> {i.target}" for i in _imports() if _floor(i.target) > _floor(i.source)]
    assert len(up) <= MAX_IMPORTS_UP, "\n".join(up)


def test_function_local_imports_are_few_and_each_says_why() -> None:
    local = []
    unexplained = []
    for path in _modules():
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for inner in ast.walk(node):
                    if isinstance(inner, (ast.Import, ast.ImportFrom)):
                        where = f"{path.relative_to(SIMULATOR)}:{inner.lineno}"
                        local.append(where)
                        here, above = lines[inner.lineno - 1], lines[inner.lineno - 2].strip()
                        if "#" not in here and not above.startswith("#"):
                            unexplained.append(where)
    assert len(set(local)) <= MAX_LOCAL_IMPORTS, "\n".join(sorted(set(local)))
    assert unexplained == [], "function-local imports without a comment saying why:\n" + "\n".join(
        unexplained
    )


def test_only_the_simulation_and_the_entry_points_name_simulation() -> None:
    naming = sorted(
        {
            i.source
            for i in _imports()
            if "Simulation" in i.names
            and i.source not in ENTRY_POINTS
            and not any(i.source.startswith(p + ".") for p in ENTRY_POINTS if p)
        }
    )
    assert naming == []


def test_the_graph_reader_finds_imports_of_every_kind() -> None:
    """The reader itself works: the kernel's scheduler imports the errors at module level, the
    config imports the simulation inside ``build``, the fault engine its parts for types only."""
    imports = {(i.source, i.target): i for i in _imports()}
    assert not imports[("_kernel._scheduler", "_errors")].local
    assert imports[("_config", "_simulation")].local
    assert imports[("_faults._engine", "_parts")].typing_only
    assert _floor("_traces._observer") > _floor("_traces._trace") > _floor("_model._plan")

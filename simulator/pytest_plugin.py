"""twinrpc's pytest plugin: the ``simulation`` fixture, seeds, exploration, replay and export.

The plugin is installed with twinrpc (entry point ``pytest11`` ``twinrpc``) and does nothing to a test
that does not ask for the ``simulation`` fixture. A test that does runs its program through it::

    def test_counter_keeps_every_update(simulation):
        result = simulation.run(program, 3)      # program(rank) on 3 simulated workers
        assert result.values()[0] == 6

Options (``pytest --help``, group "twinrpc"):

``--sim-seed S``
    Run every simulation with seed ``S`` (default: the marker's seed, else 0). The conformance
    suite reads the same option for its own simulations.
``--sim-faults PLAN``
    The fault plan of every simulation: JSON text, or a JSON/TOML file.
``--sim-network MODEL``
    The network model: JSON text (the :class:`~twinrpc.simulator.NetworkModel` fields), or a JSON file.
``--sim-compute MODEL``
    The compute model: JSON text (the :class:`~twinrpc.simulator.ComputeModel` fields), or a JSON/TOML
    file.
``--sim-explore N``
    Run each simulation test over N drawn seeds and fault plans (:func:`twinrpc.simulator.explore`'s
    search); on the first failure, shrink it and fail with the replay command and the minimal plan.
``--sim-explore-seed S``
    The exploration's own seed (default 0): the same seed explores the same cases.
``--sim-explore-jobs J``
    Spread each test's runs over ``J`` processes, forks of the test's own (they carry its fixtures),
    as ``explore --jobs`` does: blocks of runs, the lowest failing run reported. Given at all (even
    ``1``), the runs are those blocks, so ``J`` does not change which failure is found.
``--sim-export DIR``
    Write each shrunk failure as a regression test file in ``DIR`` (``--sim-export-expect fail``:
    one that asserts the known failure instead of its absence).

The marker ``@pytest.mark.simulation(seed=..., faults=..., network=..., compute=...)`` configures the
fixture: ``faults`` and ``network`` are a :class:`~twinrpc.simulator.FaultPlan` and a
:class:`~twinrpc.simulator.NetworkModel` (or their data) for plain runs, or hypothesis strategies for
``--sim-explore``; ``compute`` is a :class:`~twinrpc.simulator.ComputeModel` (or its fields) for every
run. A marker with ``seed`` pins the case: such a test is a replay, and exploration
leaves it alone. ``--sim-shrink-runs N`` bounds the runs spent shrinking (default 500).

A failing simulation test prints the command that replays it (section "twinrpc simulation").
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import pprint
import shlex
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ._config import SimConfig
from ._exploration._case import Case, _Outcome, _run
from ._exploration._failure import Failure
from ._exploration._parallel import ExplorationPlan, Found, explore_blocks
from ._exploration._reproduce import _is_literal, raises_block, regression_header
from ._exploration._search import _Search, cases
from ._model._compute import ComputeModel
from ._model._files import compute_from_text, network_from_text, plan_from_text, plan_of
from ._model._network import NetworkModel
from ._model._plan import FaultPlan
from ._simulation import RunResult

__all__ = ["SimulationFixture"]

FIXTURE = "simulation"
MARKER = "simulation"


def _load_plan(text: str) -> FaultPlan:
    """``--sim-faults``: a JSON object, or a JSON/TOML file (:meth:`FaultPlan.load`)."""
    try:
        return plan_from_text(text, "--sim-faults")
    except (ValueError, TypeError, OSError) as exc:
        raise pytest.UsageError(str(exc)) from exc


def _load_network(text: str) -> NetworkModel:
    """``--sim-network``: a JSON object, or a JSON/TOML file (:meth:`NetworkModel.load`)."""
    try:
        return network_from_text(text, "--sim-network")
    except (ValueError, TypeError, OSError) as exc:
        raise pytest.UsageError(str(exc)) from exc


def _load_compute(text: str) -> ComputeModel:
    """``--sim-compute``: a JSON object, or a JSON/TOML file (:meth:`ComputeModel.load`)."""
    try:
        return compute_from_text(text, "--sim-compute")
    except (ValueError, TypeError, OSError) as exc:
        raise pytest.UsageError(str(exc)) from exc


def _as_plan(value: Any, where: str) -> FaultPlan | None:
    if value is None or isinstance(value, FaultPlan):
        return value
    if isinstance(value, dict | str):
        return plan_of(value, "faults")
    if _is_strategy(value) or callable(value):
        return None  # a strategy: for --sim-explore only
    raise TypeError(f"{where}: faults= takes a FaultPlan, its data, or a hypothesis strategy; got {value!r}")


def _as_network(value: Any, where: str) -> NetworkModel | None:
    if value is None or isinstance(value, NetworkModel):
        return value
    if isinstance(value, dict):
        return NetworkModel.from_dict(value)
    if _is_strategy(value):
        return None
    raise TypeError(
        f"{where}: network= takes a NetworkModel, its fields, or a hypothesis strategy; got {value!r}"
    )


def _as_compute(value: Any, where: str) -> ComputeModel | None:
    if value is None or isinstance(value, ComputeModel):
        return value
    if isinstance(value, dict):
        return ComputeModel.from_dict(value)
    raise TypeError(f"{where}: compute= takes a ComputeModel or its fields; got {value!r}")


def _is_strategy(value: Any) -> bool:
    try:
        from hypothesis.strategies import SearchStrategy  # an optional dependency: a strategy needs it
    except ImportError:  # pragma: no cover - hypothesis is a test dependency
        return False
    return isinstance(value, SearchStrategy)


class SimulationFixture:
    """The ``simulation`` fixture: runs a test's program in a :class:`~twinrpc.simulator.Simulation`
    under the case pytest chose (a seed, a fault plan, a network model, a compute model).

    One case per test run: every :meth:`run` of one test run uses it. Under ``--sim-explore`` the
    test function runs once per explored case.
    """

    def __init__(self, item: pytest.Item) -> None:
        self._item = item
        config = item.config
        marker = item.get_closest_marker(MARKER)
        kwargs = dict(marker.kwargs) if marker is not None else {}
        unknown = set(kwargs) - {"seed", "faults", "network", "compute"}
        if unknown or (marker is not None and marker.args):
            raise pytest.UsageError(
                f"{item.nodeid}: @pytest.mark.simulation takes seed=, faults=, network=, compute= (keywords "
                f"only); got {marker.args if marker else ()} {sorted(unknown)}"
            )
        where = f"{item.nodeid}: @pytest.mark.simulation"
        self.pinned = "seed" in kwargs
        seed_option = config.getoption("sim_seed")
        seed = kwargs.get("seed", 0) if seed_option is None else seed_option
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise pytest.UsageError(f"{where}: seed must be an int, got {seed!r}")
        faults_option = config.getoption("sim_faults")
        plan = _load_plan(faults_option) if faults_option else _as_plan(kwargs.get("faults"), where)
        network_option = config.getoption("sim_network")
        net = _load_network(network_option) if network_option else _as_network(kwargs.get("network"), where)
        compute_option = config.getoption("sim_compute", None)
        compute = (
            _load_compute(compute_option) if compute_option else _as_compute(kwargs.get("compute"), where)
        )
        #: the case plain runs use (exploration draws its own, with this compute model)
        self.case = Case(seed, plan or FaultPlan(), net, compute)
        #: strategies for exploration (marker values that are strategies, else the defaults)
        self.fault_strategy: Any = kwargs.get("faults") if plan is None and not faults_option else None
        self.network_strategy: Any = (
            kwargs.get("network") if net is None and _is_strategy(kwargs.get("network")) else None
        )
        if self.fault_strategy is not None and not (
            _is_strategy(self.fault_strategy) or callable(self.fault_strategy)
        ):
            self.fault_strategy = None
        self._draw: Callable[[int], Case] | None = None
        #: the outcome of the last run (what failed, where)
        self.last: _Outcome | None = None
        self.ran = False

    @property
    def seed(self) -> int:
        """The current case's simulation seed."""
        return self.case.seed

    @property
    def faults(self) -> FaultPlan:
        """The current case's fault plan."""
        return self.case.faults

    @property
    def network(self) -> NetworkModel | None:
        """The current case's network model (``None``: the default)."""
        return self.case.network

    @property
    def compute(self) -> ComputeModel | None:
        """The compute model of every run (``None``: computing is free)."""
        return self.case.compute

    def config(
        self,
        world_size: int,
        *,
        monitors: bool = True,
        trace: bool = True,
        max_time: float | None = None,
    ) -> SimConfig:
        """The settings :meth:`run` runs a program of ``world_size`` workers with, under the current
        case: to build a :class:`~twinrpc.simulator.Simulation` of one's own (``.build()``)."""
        base = SimConfig(world_size, trace=trace, monitors=monitors, max_time=max_time)
        return self.case.config(base)

    def run(
        self,
        program: Callable[..., Any],
        world_size: int,
        *args: Any,
        check: Callable[[RunResult], object] | None = None,
        monitors: bool = True,
        trace: bool = True,
        max_time: float | None = None,
    ) -> RunResult:
        """Run ``program(rank, *args)`` on ``world_size`` simulated workers under this test's case.

        Fails the way :func:`twinrpc.simulator.replay` does: the first worker error is raised (before
        the deadlock it may cause), else the simulation's error, else ``check(result)``'s.
        """
        if self._draw is not None:
            self.case = self._draw(world_size)
            trace = False  # exploring: traces are for replays
        self.ran = True
        config = self.config(world_size, monitors=monitors, trace=trace, max_time=max_time)
        outcome = _run(program, config, args, check=check)
        self.last = outcome
        if outcome.error is not None:
            raise outcome.error
        assert outcome.result is not None
        return outcome.result

    @contextlib.contextmanager
    def drawing(self, draw: Callable[[int], Case]) -> Iterator[None]:
        """Within it, each :meth:`run` takes its case from ``draw(world_size)`` (``--sim-explore``: one
        explored case per test run) and records no trace."""
        self._draw = draw
        self.last = None
        try:
            yield
        finally:
            self._draw = None

    # -- reporting -------------------------------------------------------------------------------------
    def replay_command(self, case: Case | None = None) -> str:
        """The pytest command line that replays ``case`` (default: the current one) of this test."""
        case = self.case if case is None else case
        item = self._item
        config = item.config
        path = os.path.relpath(item.path, config.invocation_params.dir)
        name = item.nodeid.split("::", 1)[1] if "::" in item.nodeid else item.name
        parts = ["pytest", shlex.quote(f"{path}::{name}"), f"--sim-seed {case.seed}"]
        data = case.faults.to_dict()
        if case.faults != FaultPlan():
            parts.append(f"--sim-faults {shlex.quote(json.dumps(data, separators=(',', ':')))}")
        if case.network is not None:
            parts.append(
                f"--sim-network {shlex.quote(json.dumps(case.network.to_dict(), separators=(',', ':')))}"
            )
        if case.compute is not None:
            parts.append(
                f"--sim-compute {shlex.quote(json.dumps(case.compute.to_dict(), separators=(',', ':')))}"
            )
        return " ".join(parts)


def make_fixture(request: pytest.FixtureRequest) -> SimulationFixture:
    fixture = SimulationFixture(request.node)
    request.node.stash[_FIXTURE_KEY] = fixture
    return fixture


_FIXTURE_KEY = pytest.StashKey[SimulationFixture]()


def report_section(item: pytest.Item) -> str | None:
    """What a failed plain run of a simulation test prints: its case and the replay command."""
    fixture = item.stash.get(_FIXTURE_KEY, None)
    if fixture is None or not fixture.ran or item.config.getoption("sim_explore"):
        return None
    lines = [f"seed {fixture.seed}, faults {fixture.faults.describe()}"]
    if fixture.last is not None and fixture.last.error is not None:
        lines.append(f"error: {fixture.last.where()}")
    lines.append(f"replay: {fixture.replay_command()}")
    return "\n".join(lines)


# -- exploration -------------------------------------------------------------------------------------------
def explore_item(item: pytest.Function) -> bool:
    """Run a simulation test under ``--sim-explore N``; True when it was explored (it passed), else
    the failure is raised. A test pinned by its marker's seed runs once, as written."""
    __tracebackhide__ = True
    fixture = item.funcargs.get(FIXTURE)
    if not isinstance(fixture, SimulationFixture) or fixture.pinned:
        return False
    config = item.config
    runs = int(config.getoption("sim_explore"))
    testfunction = item.obj
    # the test function's own arguments (fixtures and parameters), as pytest passes them
    argnames = [n for n in inspect.signature(testfunction).parameters if n in item.funcargs]
    kwargs = {name: item.funcargs[name] for name in argnames}

    def body(draw: Callable[[int], Case]) -> _Outcome:
        with fixture.drawing(draw):
            try:
                testfunction(**kwargs)
            except Exception as exc:
                last = fixture.last
                if last is not None and last.error is exc:
                    return last
                return _Outcome(None, exc, source="the test")
        return fixture.last if fixture.last is not None else _Outcome(None)

    strategy_faults = fixture.fault_strategy
    strategy_network = fixture.network_strategy
    compute = fixture.compute
    seed = int(config.getoption("sim_explore_seed"))
    shrink_runs = int(config.getoption("sim_shrink_runs"))

    def strategy(n: int, horizon: float | None) -> Any:
        return cases(n, strategy_faults, strategy_network, None, horizon, compute=compute)

    jobs = config.getoption("sim_explore_jobs", None)
    make_failure: Callable[..., Failure]
    if jobs is not None:
        plan = ExplorationPlan(
            _TestRuns(body),
            0,  # the test draws its case itself, for its own world size
            seed=seed,
            runs=runs,
            max_shrink_runs=shrink_runs,
            cases=strategy,
            calibrate=strategy_faults is None,
            baseline=Case(0, compute=compute),
        )
        found = _explore_in_blocks(plan, jobs)
        if found is None:
            return True
        make_failure = found.failure
    else:
        search = _Search(
            body,
            strategy,
            runs=runs,
            seed=seed,
            max_shrink_runs=shrink_runs,
            calibrate=strategy_faults is None,
            baseline=Case(0, compute=compute),
        )
        if not search.run():
            if search.calls == 0:
                raise pytest.UsageError(
                    f"{item.nodeid} asks for the simulation fixture but never called simulation.run(...)"
                )
            return True
        make_failure = search.failure
    failure = make_failure(
        world_size=0,
        program=None,
        args=(),
        check=None,
        command=fixture.replay_command,
        exporter=lambda f, name, expect: export_item(item, f, name, expect),
    )
    export_dir = config.getoption("sim_export")
    if export_dir:
        path = write_export(item, failure, Path(export_dir), config.getoption("sim_export_expect"))
        failure.args = (f"{failure.describe()}\n  regression test written to {path}",)
    raise failure


class _TestRuns:
    """A test's runs for a parallel exploration: the test function, run where its fixtures live (in
    this process, or a fork of it)."""

    def __init__(self, body: Callable[[Callable[[int], Case]], _Outcome]) -> None:
        self.run_drawn = body
        self.environment: dict[str, str | None] = {}

    def run(self, case: Case) -> _Outcome:
        return self.run_drawn(lambda world_size: case)

    def close(self) -> None:
        pass


def _explore_in_blocks(plan: ExplorationPlan, jobs: int) -> Found | None:
    """The failure with the lowest run index of ``plan``, found by ``jobs`` forks of this process."""
    calibration = plan.calibration()
    if plan.calibrate and calibration.run_baseline():
        return Found.of_calibration(calibration)
    return explore_blocks(plan, plan.blocks(), calibration.horizon, jobs=jobs, fork=True).found


def regression_name(item: pytest.Item, case: Case) -> str:
    base = item.originalname if isinstance(item, pytest.Function) else item.name
    return f"{base}_regression_seed_{case.seed}"


def write_export(item: pytest.Function, failure: Failure, directory: Path, expect: str) -> Path:
    """Write ``failure``'s regression test into ``directory``; returns the file's path."""
    name = regression_name(item, failure.case)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.py"
    path.write_text(export_item(item, failure, name, expect), encoding="utf-8")
    return path


def _indented(value: Any) -> str:
    """A literal for a keyword argument at 4 spaces: one line if short, else wrapped under it."""
    return pprint.pformat(value, width=100, sort_dicts=False).replace("\n", "\n    ")


def export_item(item: pytest.Item, failure: Failure, name: str, expect: str) -> str:
    """A pytest file that runs ``item``'s test function pinned to the failure's minimal case."""
    if not isinstance(item, pytest.Function) or item.cls is not None:
        raise ValueError(f"{item.nodeid}: only module-level test functions can be exported")
    module = item.module.__name__ if item.module is not None else None
    if not module or module == "__main__":
        raise ValueError(f"{item.nodeid}: the test's module cannot be imported by name")
    original = item.originalname
    params = dict(item.callspec.params) if hasattr(item, "callspec") else {}
    for key, value in params.items():
        if not _is_literal(value):
            raise ValueError(f"{item.nodeid}: parameter {key}={value!r} is not a Python literal")
    argnames = list(inspect.signature(item.obj).parameters)
    fixtures = [a for a in argnames if a not in params]
    if FIXTURE not in fixtures:
        fixtures.insert(0, FIXTURE)
    call_args = ", ".join(f"{a}={a}" if a not in params else f"{a}={params[a]!r}" for a in argnames)
    case = failure.case
    mark = [f"    seed={case.seed},", f"    faults={_indented(case.faults.to_dict())},"]
    if case.network is not None:
        mark.append(f"    network={_indented(case.network.to_dict())},")
    if case.compute is not None:
        mark.append(f"    compute={_indented(case.compute.to_dict())},")
    imports = ["import pytest", "", f"from {module} import {original} as _replayed"]
    body = [f"_replayed({call_args})"]
    if expect == "pass":
        doc = "The run that failed now passes."
        lines = [f"    {b}" for b in body]
    else:
        doc = "The run still fails the known way (remove this test, or switch it to passing, once fixed)."
        more, lines = raises_block(failure.exception_type, failure.pattern, "    ", body)
        imports.extend(more)
    return "\n".join(
        [
            *regression_header(failure),
            "",
            "from __future__ import annotations",
            "",
            *imports,
            "",
            f"PATTERN = {failure.pattern!r}",
            "",
            "",
            "@pytest.mark.simulation(",
            *mark,
            ")",
            f"def {name}({', '.join(fixtures)}) -> None:",
            f'    """{doc}"""',
            *lines,
            "",
        ]
    )


def check_options(config: pytest.Config) -> None:
    """Reject combinations that cannot mean anything."""
    explore = config.getoption("sim_explore")
    jobs = config.getoption("sim_explore_jobs", None)
    if jobs is not None and (jobs < 1 or not explore):
        raise pytest.UsageError(f"--sim-explore-jobs {jobs}: at least 1, and with --sim-explore N")
    if explore is not None and explore < 1:
        raise pytest.UsageError(f"--sim-explore {explore}: at least one run")
    if explore and config.getoption("sim_seed") is not None:
        raise pytest.UsageError("--sim-explore draws seeds itself; --sim-seed replays one: pass one of them")
    if config.getoption("sim_export") and not explore:
        raise pytest.UsageError(
            "--sim-export writes the failures --sim-explore finds: pass --sim-explore N too"
        )

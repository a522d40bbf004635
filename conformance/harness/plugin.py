"""The conformance pytest plugin: backend selection, spec tags, deviations, the matrix, ``world``.

Loaded by re-exporting its hooks and fixtures from a conftest (``from conformance.harness.plugin
import *``); the directory of such a conftest is a *suite* and the rules below apply to the tests under
it only, so running ``pytest`` from the repository root leaves ``tests/`` alone.

Rules, in the order they act:

* configure: ``--backend`` must name a usable backend; the backend's deviations file must parse and
  name existing requirements, tests and only the backends it belongs to (usage error otherwise). That
  file is ``--deviations FILE`` if given, else ``spec/deviations.toml`` for the built-in backends and
  the file a third-party backend names in ``Backend.deviations`` (twinrpc's file is not read for it).
* collection: every test carries ``@pytest.mark.spec(...)`` with IDs that are headings in
  ``spec/*.md``; ``@pytest.mark.backends(...)`` names known backends and its test has a docstring saying
  why. Violations make the test's module a collection error that names the test.
* selection: a test whose ``backends(...)`` excludes the current backend is deselected (never
  skipped); a test listed by a deviation for the current backend becomes ``xfail(strict=True)``.
* reporting: ``--matrix-json PATH`` writes one record per test: spec IDs, backend, outcome.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from .backend import BUILTIN_BACKENDS, Backend, BackendConfig, is_builtin, load_backend_class
from .spec import (
    Deviation,
    SpecError,
    find_test_definitions,
    load_deviations,
    parse_requirement_ids,
    validate_deviations,
)
from .world import World

__all__ = [
    "_twinrpc_backend",
    "pytest_addoption",
    "pytest_collection_finish",
    "pytest_collection_modifyitems",
    "pytest_configure",
    "pytest_deselected",
    "pytest_make_collect_report",
    "pytest_report_header",
    "pytest_runtest_makereport",
    "pytest_sessionfinish",
    "pytest_testnodedown",
    "pytest_unconfigure",
    "world",
]

_ENV_BACKEND = "TWINRPC_BACKEND"
_MATRIX_KEY = "twinrpc_matrix_deselected"


@dataclass
class _State:
    """Everything the plugin learned at configure time plus what it records while running."""

    backend_name: str
    backend_cls: type[Backend]
    config: BackendConfig
    suite_dirs: tuple[Path, ...]
    spec_ids: dict[str, str]
    deviations: tuple[Deviation, ...]
    deviations_file: Path | None
    backend: Backend | None = None
    records: dict[str, dict[str, Any]] = field(default_factory=dict)
    deselected: dict[str, dict[str, Any]] = field(default_factory=dict)

    def in_suite(self, item: pytest.Item) -> bool:
        return any(item.path.is_relative_to(d) for d in self.suite_dirs)


_STATE = pytest.StashKey[_State]()


def _state(config: pytest.Config) -> _State:
    return config.stash[_STATE]


# -- options and configuration -------------------------------------------------------------------------


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("twinrpc", "twinrpc conformance suite")
    group.addoption(
        "--backend",
        default=os.environ.get(_ENV_BACKEND, "sim"),
        help=f"backend to run the suite on: {', '.join(BUILTIN_BACKENDS)} or package.module:BackendClass "
        f"(default: ${_ENV_BACKEND} or sim)",
    )
    try:
        group.addoption("--sim-seed", type=int, default=0, help="seed of every simulation (default 0)")
    except ValueError:  # twinrpc's own pytest plugin (twinrpc._pytest_plugin) defines it: default None
        pass
    group.addoption(
        "--world-timeout",
        type=float,
        default=60.0,
        help="wall-clock bound in seconds for one world.run/run_on/spawn call (default 60)",
    )
    group.addoption(
        "--world-spares",
        type=int,
        default=4,
        help="pre-started interpreters the torch backend keeps warm for world.spawn once a test used it "
        "(default 4: two world_size=2 spawns ahead; 0 starts every spawn cold)",
    )
    group.addoption(
        "--matrix-json", metavar="PATH", default=None, help="write the requirement x backend results"
    )
    group.addoption("--spec-dir", metavar="DIR", default=None, help="spec folder (default: <rootdir>/spec)")
    group.addoption(
        "--deviations",
        metavar="FILE",
        default=None,
        help="the backend's deviations file, instead of its default: spec/deviations.toml for sim, torch "
        "and gloo, the file named by the backend class's `deviations` attribute for others",
    )


def _suite_dirs(config: pytest.Config) -> tuple[Path, ...]:
    """Directories of the conftests that load this plugin (the suites whose rules we enforce)."""
    dirs = []
    for plugin in config.pluginmanager.get_plugins():
        file = getattr(plugin, "__file__", None)
        if (
            file
            and Path(file).name == "conftest.py"
            and getattr(plugin, "pytest_configure", None) is pytest_configure
        ):
            dirs.append(Path(file).resolve().parent)
    return tuple(dirs)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "spec(*ids): the spec requirement IDs a test checks")
    config.addinivalue_line(
        "markers",
        "backends(*names): the only backends this test applies to (deselected elsewhere); "
        "the docstring must say why",
    )
    if _STATE in config.stash:  # configured already (the plugin is imported by more than one conftest)
        config.stash[_STATE].suite_dirs = _suite_dirs(config)
        return
    name: str = config.getoption("backend")
    try:
        backend_cls = load_backend_class(name)
    except (ValueError, ImportError) as exc:
        raise pytest.UsageError(f"--backend {name}: {exc}") from exc
    unavailable = getattr(backend_cls, "unavailable", None)
    if unavailable:
        raise pytest.UsageError(f"--backend {name}: {unavailable}")

    builtin = is_builtin(backend_cls)
    if not builtin and backend_cls.name in BUILTIN_BACKENDS:
        raise pytest.UsageError(
            f"--backend {name}: its name {backend_cls.name!r} is a built-in backend's; choose another name"
        )

    spec_dir = Path(config.getoption("spec_dir") or config.rootpath / "spec")
    spec_ids = parse_requirement_ids(spec_dir)
    if not spec_ids:
        config.issue_config_time_warning(
            pytest.PytestConfigWarning(
                f"no requirement headings found in {spec_dir}/*.md; spec IDs of conformance tests are not checked"
            ),
            stacklevel=2,
        )
    suite_dirs = _suite_dirs(config)
    deviations_file = _deviations_file(config, backend_cls, builtin, spec_dir)
    try:
        deviations = load_deviations(deviations_file) if deviations_file is not None else ()
    except SpecError as exc:
        raise pytest.UsageError(str(exc)) from exc
    problems = validate_deviations(
        deviations,
        known_ids=spec_ids,
        known_tests=find_test_definitions(suite_dirs),
        known_backends=set(BUILTIN_BACKENDS) if builtin else {backend_cls.name},
    )
    if problems:
        raise pytest.UsageError(
            f"{deviations_file} is inconsistent with the suite:\n  " + "\n  ".join(problems)
        )

    world_timeout = float(config.getoption("world_timeout"))
    backend_config = BackendConfig(
        sim_seed=int(config.getoption("sim_seed") or 0),
        world_timeout=world_timeout,
        tmp_dir=Path("/nonexistent"),  # replaced by a private directory when the backend starts
        spares=max(0, int(config.getoption("world_spares"))),
    )
    state = _State(
        backend_name=backend_cls.name,
        backend_cls=backend_cls,
        config=backend_config,
        suite_dirs=suite_dirs,
        spec_ids=spec_ids,
        deviations=deviations,
        deviations_file=deviations_file,
    )
    config.stash[_STATE] = state
    config.pluginmanager.register(_MatrixRecorder(state), "twinrpc-matrix-recorder")


def _deviations_file(
    config: pytest.Config, backend_cls: type[Backend], builtin: bool, spec_dir: Path
) -> Path | None:
    """Which deviations file applies to this run (see the module docstring); None: no deviations.

    A file named explicitly (``--deviations`` or ``Backend.deviations``) must exist; twinrpc's
    ``spec/deviations.toml`` may be absent (no deviations).
    """
    option = config.getoption("deviations")
    if option:
        path = config.invocation_params.dir / Path(option)
        origin = "--deviations"
    elif builtin:
        return spec_dir / "deviations.toml"
    else:
        found = backend_cls.deviations_path()
        if found is None:
            return None
        path = found
        origin = f"{backend_cls.__module__}.{backend_cls.__qualname__}.deviations"
    if not path.is_file():
        raise pytest.UsageError(f"{origin}: no deviations file at {path}")
    return path


def pytest_report_header(config: pytest.Config) -> list[str]:
    state = _state(config)
    seed = f", --sim-seed {state.config.sim_seed}" if state.backend_name == "sim" else ""
    return [
        f"twinrpc backend: {state.backend_name}{seed}, --world-timeout {state.config.world_timeout:g} s; "
        f"{len(state.spec_ids)} spec IDs, {len(state.deviations)} deviations"
        + (f" from {state.deviations_file}" if state.deviations else "")
    ]


def pytest_unconfigure(config: pytest.Config) -> None:
    state = config.stash.get(_STATE, None)
    if state is not None:
        _close_backend(state)


# -- collection ------------------------------------------------------------------------------------------


def _spec_ids_of(item: pytest.Item) -> list[Any]:
    return [arg for mark in item.iter_markers("spec") for arg in mark.args]


def _backends_of(item: pytest.Item) -> list[Any] | None:
    marks = list(item.iter_markers("backends"))
    if not marks:
        return None
    return [arg for mark in marks for arg in mark.args]


def _test_name(item: pytest.Item) -> str:
    return getattr(item, "originalname", None) or item.name


def _tag_problems(item: pytest.Item, state: _State) -> Iterator[str]:
    ids = _spec_ids_of(item)
    if not ids:
        yield f"{item.nodeid}: no @pytest.mark.spec(...) marker; every conformance test names the requirement IDs it checks"
    for spec_id in ids:
        if not isinstance(spec_id, str):
            yield f"{item.nodeid}: spec IDs must be strings, got {spec_id!r}"
        elif state.spec_ids and spec_id not in state.spec_ids:
            yield f"{item.nodeid}: unknown spec ID {spec_id!r} (no '### {spec_id}: ...' heading in spec/*.md)"
    backends = _backends_of(item)
    if backends is not None:
        known = set(BUILTIN_BACKENDS) | {state.backend_name}
        unknown = [b for b in backends if b not in known]
        if not backends or unknown:
            yield f"{item.nodeid}: @pytest.mark.backends{tuple(backends)!r} must name backends from {sorted(known)}"
        doc = getattr(getattr(item, "obj", None), "__doc__", None)
        if not (doc and doc.strip()):
            yield f"{item.nodeid}: declares @pytest.mark.backends{tuple(backends)!r} but has no docstring saying why"


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(
    collector: pytest.Collector,
) -> Generator[None, pytest.CollectReport, pytest.CollectReport]:
    """Turn a module with mis-tagged tests into a collection error that names each test."""
    report = yield
    state = collector.config.stash.get(_STATE, None)
    if state is None or not report.passed:
        return report
    problems = [
        problem
        for node in report.result
        if isinstance(node, pytest.Item) and state.in_suite(node)
        for problem in _tag_problems(node, state)
    ]
    if problems:
        report.outcome = "failed"
        report.longrepr = "twinrpc conformance tagging errors:\n  " + "\n  ".join(problems)
        report.result = []
    return report


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    state = _state(config)
    keep: list[pytest.Item] = []
    deselected: list[pytest.Item] = []
    for item in items:
        if not state.in_suite(item):
            keep.append(item)
            continue
        backends = _backends_of(item)
        if backends is not None and state.backend_name not in backends:
            deselected.append(item)
            continue
        ids = [str(i) for i in _spec_ids_of(item)]
        item.user_properties.append(("twinrpc_spec", ids))
        for dev in state.deviations:
            if dev.applies_to(_test_name(item), state.backend_name):
                item.add_marker(
                    pytest.mark.xfail(strict=True, reason=f"{dev.id} ({dev.requirement}): {dev.reason}")
                )
                item.user_properties.append(("twinrpc_deviation", dev.id))
        _add_hang_bound(config, item, state)
        keep.append(item)
    if deselected:
        items[:] = keep
        config.hook.pytest_deselected(items=deselected)


def _add_hang_bound(config: pytest.Config, item: pytest.Item, state: _State) -> None:
    """Last-resort bound via pytest-timeout, for hangs no world deadline sees (in-process sim loops).

    Generous on purpose: a world call has two bounded phases (pool start, program) and a test may make
    several calls; the world deadlines normally fire long before this.
    """
    if not config.pluginmanager.hasplugin("timeout") or item.get_closest_marker("timeout"):
        return
    if config.getoption("timeout", None):
        return
    item.add_marker(pytest.mark.timeout(4 * state.config.world_timeout + 60))


# -- the matrix ------------------------------------------------------------------------------------------


def pytest_deselected(items: list[pytest.Item]) -> None:
    for item in items:
        state = item.config.stash.get(_STATE, None)
        if state is None or not state.in_suite(item):
            continue
        backends = _backends_of(item)
        if backends is None or state.backend_name in backends:  # deselected by -k/-m, not by backend
            continue
        state.deselected[item.nodeid] = {
            "nodeid": item.nodeid,
            "test": _test_name(item),
            "spec": [str(i) for i in _spec_ids_of(item)],
            "backend": state.backend_name,
            "outcome": "not applicable",
            "duration": 0.0,
            "deviation": None,
            "backends": [str(b) for b in backends],
        }


def _outcome(report: pytest.TestReport, previous: str | None) -> str:
    xfail = hasattr(report, "wasxfail")
    if report.when == "call":
        if report.passed:
            return "xpassed" if xfail else "passed"
        if report.skipped:
            return "xfailed" if xfail else "skipped"
        if isinstance(report.longrepr, str) and report.longrepr.startswith("[XPASS(strict)]"):
            return "xpassed"
        return "failed"
    if report.failed:
        return "error"
    if report.skipped and previous is None:
        return "xfailed" if xfail else "skipped"
    return previous or "passed"


class _MatrixRecorder:
    """Per-session recorder of test outcomes, registered as a plugin object at configure time.

    A registered object rather than a module-level hook plus a global dict, because pytester runs nested
    sessions in one process and ``pytest_runtest_logreport`` receives no config to tell them apart.
    """

    def __init__(self, state: _State) -> None:
        self._state = state

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        props: dict[str, Any] = dict(report.user_properties)
        if "twinrpc_spec" not in props:
            return
        record = self._state.records.setdefault(
            report.nodeid,
            {
                "nodeid": report.nodeid,
                "test": report.nodeid.split("::")[-1].split("[")[0],
                "spec": list(props["twinrpc_spec"]),
                "outcome": None,
                "duration": 0.0,
                "deviation": props.get("twinrpc_deviation"),
            },
        )
        record["duration"] = round(record["duration"] + report.duration, 4)
        if report.when == "setup" and report.passed:
            return
        record["outcome"] = _outcome(report, record["outcome"])


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    """pytest-xdist controller: collect the workers' deselected tests (the controller collects nothing)."""
    config = node.config
    state = config.stash.get(_STATE, None)
    if state is not None:
        for record in getattr(node, "workeroutput", {}).get(_MATRIX_KEY, []):
            state.deselected.setdefault(record["nodeid"], record)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    config = session.config
    state = config.stash.get(_STATE, None)
    if state is None:
        return
    workeroutput = getattr(config, "workeroutput", None)
    if workeroutput is not None:  # an xdist worker: the controller writes the file
        workeroutput[_MATRIX_KEY] = list(state.deselected.values())
        return
    path = config.getoption("matrix_json")
    if not path:
        return
    tests = []
    for record in state.records.values():
        tests.append({**record, "backend": state.backend_name})
    tests.extend(r for nodeid, r in state.deselected.items() if nodeid not in state.records)
    tests.sort(key=lambda r: r["nodeid"])
    matrix = {
        "backend": state.backend_name,
        "sim_seed": state.config.sim_seed if state.backend_name == "sim" else None,
        "deviations_file": str(state.deviations_file) if state.deviations_file else None,
        "deviations": [
            {"id": d.id, "requirement": d.requirement, "backends": list(d.backends), "reason": d.reason}
            for d in state.deviations
        ],
        "tests": tests,
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(matrix, indent=2) + "\n", encoding="utf-8")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """On the simulator, print the command that replays a failure (same seed, same interleaving)."""
    report = yield
    state = item.config.stash.get(_STATE, None)
    if state is not None and report.failed and state.in_suite(item) and state.backend_name == "sim":
        report.sections.append(
            ("twinrpc replay", f"pytest '{item.nodeid}' --backend sim --sim-seed {state.config.sim_seed}")
        )
    return report


# -- fixtures -------------------------------------------------------------------------------------------


def _close_backend(state: _State) -> None:
    backend, state.backend = state.backend, None
    if backend is not None:
        try:
            backend.close()
        finally:
            shutil.rmtree(backend.config.tmp_dir, ignore_errors=True)


def _ensure_backend(state: _State) -> Backend:
    if state.backend is None:
        tmp_dir = Path(tempfile.mkdtemp(prefix=f"twinrpc-{state.backend_name}-"))
        config = BackendConfig(
            sim_seed=state.config.sim_seed,
            world_timeout=state.config.world_timeout,
            tmp_dir=tmp_dir,
            spares=state.config.spares,
        )
        state.backend = state.backend_cls(config)
    return state.backend


def pytest_collection_finish(session: pytest.Session) -> None:
    """Let the backend start slow things (interpreters importing torch) while pytest gets going."""
    state = session.config.stash.get(_STATE, None)
    if state is None or session.config.option.collectonly:
        return
    if any(state.in_suite(item) and "world" in getattr(item, "fixturenames", ()) for item in session.items):
        _ensure_backend(state).warm_up()


@pytest.fixture(scope="session")
def _twinrpc_backend(pytestconfig: pytest.Config) -> Iterator[Backend]:
    """The session's backend, created on first use so a run that needs no world starts nothing."""
    state = _state(pytestconfig)
    yield _ensure_backend(state)
    _close_backend(state)


@pytest.fixture
def world(_twinrpc_backend: Backend) -> World:
    """The backend's world: ``world.run``, ``world.run_on``, ``world.spawn`` (conformance/CONTRACT.md)."""
    return World(_twinrpc_backend, default_timeout=_twinrpc_backend.config.world_timeout)

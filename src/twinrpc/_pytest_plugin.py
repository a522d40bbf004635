"""twinrpc's pytest plugin, as pytest loads it (entry point ``pytest11``: ``twinrpc``).

Only hooks live here, and they import nothing heavy: a session whose tests never ask for the
``simulation`` fixture pays for a few options and one marker, not for importing torch. The work is in
:mod:`twinrpc.simulator.pytest_plugin`, imported the first time a test uses the fixture.

``--sim-seed`` is shared with the conformance suite's own plugin, which reads it as the seed of its
simulations too (and defines it itself when this plugin is disabled with ``-p no:twinrpc``).
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import pytest

FIXTURE = "simulation"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("twinrpc", "twinrpc: simulation tests and the conformance suite")
    group.addoption(
        "--sim-seed",
        type=int,
        default=None,
        metavar="S",
        help="run every simulation with seed S (simulation tests and the conformance suite; default 0)",
    )
    group.addoption(
        "--sim-faults",
        default=None,
        metavar="PLAN",
        help="the fault plan of every simulation test: JSON text, or a JSON/TOML file",
    )
    group.addoption(
        "--sim-network",
        default=None,
        metavar="MODEL",
        help="the network model of every simulation test: JSON text (NetworkModel fields), or a JSON file",
    )
    group.addoption(
        "--sim-compute",
        default=None,
        metavar="MODEL",
        help="the compute model of every simulation test: JSON text (ComputeModel fields), or a JSON/TOML file",
    )
    group.addoption(
        "--sim-explore",
        type=int,
        default=None,
        metavar="N",
        help="run each simulation test over N seeds and fault plans; shrink the first failure",
    )
    group.addoption(
        "--sim-explore-seed",
        type=int,
        default=0,
        metavar="S",
        help="the exploration's own seed: the same seed explores the same cases (default 0)",
    )
    group.addoption(
        "--sim-explore-jobs",
        type=int,
        default=None,
        metavar="J",
        help="spread each test's --sim-explore runs over J processes (forks of the test's process), "
        "in blocks of runs: the same seed finds the same first failure whatever J",
    )
    group.addoption(
        "--sim-shrink-runs",
        type=int,
        default=500,
        metavar="N",
        help="at most N runs to shrink a failure --sim-explore found (default 500)",
    )
    group.addoption(
        "--sim-export",
        default=None,
        metavar="DIR",
        help="write each failure --sim-explore shrinks as a regression test file in DIR",
    )
    group.addoption(
        "--sim-export-expect",
        choices=("pass", "fail"),
        default="pass",
        help="the exported test asserts the run passes (default: commit it with the fix) or still fails",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "simulation(seed=None, faults=None, network=None, compute=None): configure the simulation fixture; "
        "a seed pins the case (a replay), faults/network are values, or hypothesis strategies for "
        "--sim-explore; compute is a ComputeModel (or its fields) for every run",
    )
    if config.getoption("sim_explore") is not None or config.getoption("sim_export"):
        from twinrpc.simulator.pytest_plugin import check_options

        check_options(config)


@pytest.fixture(name=FIXTURE)
def _simulation_fixture(request: pytest.FixtureRequest) -> Any:
    """Runs this test's program in a twinrpc Simulation: ``simulation.run(program, world_size)``."""
    from twinrpc.simulator.pytest_plugin import make_fixture

    return make_fixture(request)


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("simulation") is not None and FIXTURE not in getattr(item, "fixturenames", ()):
        pytest.fail(
            f"{item.nodeid} is marked @pytest.mark.simulation but does not ask for the simulation fixture",
            pytrace=False,
        )


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    if not pyfuncitem.config.getoption("sim_explore") or FIXTURE not in pyfuncitem.fixturenames:
        return None
    from twinrpc.simulator.pytest_plugin import explore_item

    __tracebackhide__ = True
    return True if explore_item(pyfuncitem) else None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if report.when == "call" and report.failed and FIXTURE in getattr(item, "fixturenames", ()):
        from twinrpc.simulator.pytest_plugin import report_section

        section = report_section(item)
        if section is not None:
            report.sections.append(("twinrpc simulation", section))
    return report

"""twinrpc's pytest plugin (``simulation`` fixture, ``--sim-seed``, ``--sim-explore``, ``--sim-export``)
through pytester: each test writes a small test module and runs pytest on it in-process.

The planted bug is the lost update of ``tests/_lost_update.py`` (shared with ``test_sim_explore.py``):
two trainers read a server's counter and write back value + 1; a delayed message makes one trainer's
read land between the other's read and write. ``ATOMIC = True`` fixes it.
"""

from __future__ import annotations

# Imported here so that pytester's in-process runs find them loaded: a run drops the modules it
# imported when it ends, and torch cannot be imported twice into one process. The modules of
# multiprocessing that --sim-explore-jobs uses, dropped, would leave a later test's shared values and
# queues in this process with classes pickle cannot find by name.
import multiprocessing.popen_fork
import multiprocessing.queues
import multiprocessing.sharedctypes
import multiprocessing.synchronize  # noqa: F401
import shlex
from pathlib import Path

import pytest
import twinrpc.simulator._exploration._parallel
import twinrpc.simulator.pytest_plugin
from _lost_update import COUNTER_PROGRAM
from hypothesis import find, settings
from hypothesis import strategies as st

import twinrpc.rpc  # noqa: F401

PLANTED = (
    "\nimport pytest\n"
    + COUNTER_PROGRAM
    + """        return _counters.pop("worker0", 0)


def test_counter_keeps_every_update(simulation):
    total = simulation.run(program, 3).values()[0]
    assert total == 6, f"lost an update: the counter is {total}, expected 6"
"""
)


@pytest.fixture(autouse=True, scope="module")
def _hypothesis_loaded() -> None:
    """Search and shrink once, so hypothesis has imported all it needs before pytester's runs (which
    would import it again, and have pytest rewrite its asserts again, in every run)."""
    find(st.integers(0, 100), lambda x: x > 10, settings=settings(database=None))


def run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    """pytest in this process. Without the unraisable-exception plugin (its five gc.collect() passes
    per session cost a second once torch is imported) and without unrelated plugins that would be
    imported afresh in every run."""
    plugins = ("unraisableexception", "xdist", "xdist.looponfail", "benchmark")
    return pytester.runpytest(*(a for p in plugins for a in ("-p", f"no:{p}")), *args)


def _line(output: list[str], marker: str) -> str:
    """What follows ``marker`` on the first output line that holds it."""
    for line in output:
        if marker in line:
            return line.split(marker, 1)[1].strip()
    raise AssertionError(f"no line with {marker!r} in:\n" + "\n".join(output))


def test_a_simulation_test_runs_once_with_seed_0_or_the_given_seed(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_seed="""
        import twinrpc.rpc as rpc

        def program(rank):
            rpc.init_rpc(f"w{rank}", rank=rank, world_size=2)
            rpc.shutdown()
            return rank

        def test_runs(simulation):
            assert simulation.run(program, 2).values() == [0, 1]
            print("SEED", simulation.seed, simulation.faults.describe())
        """
    )
    result = run(pytester, "-s")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*SEED 0 FaultPlan(*"])
    result = run(pytester, "-s", "--sim-seed", "41")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*SEED 41 *"])


def test_the_marker_pins_the_seed_and_the_fault_plan(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_marker="""
        import pytest
        import twinrpc.rpc as rpc
        from twinrpc.simulator import Delay, FaultPlan

        def program(rank):
            rpc.init_rpc(f"w{rank}", rank=rank, world_size=2)
            rpc.shutdown()

        @pytest.mark.simulation(seed=9, faults=FaultPlan(actions=(Delay(0.5),)))
        def test_pinned(simulation):
            result = simulation.run(program, 2)
            assert simulation.seed == 9 and result.seed == 9
            assert result.virtual_time > 0.5  # the first message waited 0.5 s more
        """
    )
    run(pytester).assert_outcomes(passed=1)


def test_a_failing_simulation_test_prints_the_command_that_replays_it(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_fails="""
        import twinrpc.rpc as rpc

        def program(rank):
            rpc.init_rpc(f"w{rank}", rank=rank, world_size=2)
            if rank == 1:
                rpc.rpc_sync("w0", divmod, args=(1, 0))
            rpc.shutdown()

        def test_divides(simulation):
            simulation.run(program, 2)
        """
    )
    result = run(pytester, "--sim-seed", "7")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "*twinrpc simulation*",
            "*ZeroDivisionError raised by worker 1 at t=*",
            "replay: pytest test_fails.py::test_divides --sim-seed 7",
        ]
    )


def test_exploring_a_correct_test_runs_it_over_n_cases(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_ok=PLANTED.replace("ATOMIC = False", "ATOMIC = True")
        + """

def test_counts_runs(simulation):
    simulation.run(program, 3)
    with open("runs.txt", "a") as f:
        f.write(f"{simulation.seed} {simulation.faults.describe()}\\n")


def test_plain():
    with open("plain.txt", "a") as f:
        f.write("ran\\n")
"""
    )
    result = run(pytester, "--sim-explore", "30")
    result.assert_outcomes(passed=3)
    cases = (pytester.path / "runs.txt").read_text().splitlines()
    assert len(cases) == len(set(cases)) == 30  # 30 different cases (seed and fault plan)
    assert len({case.split()[0] for case in cases}) > 5  # with drawn seeds
    assert (pytester.path / "plain.txt").read_text() == "ran\n"  # a test without the fixture runs once


def test_exploration_finds_shrinks_replays_and_exports_the_planted_bug(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_counter=PLANTED)
    result = run(pytester, "--sim-explore", "200", "--sim-export", ".")
    result.assert_outcomes(failed=1)
    out = result.stdout.lines
    assert any("lost an update: the counter is" in line for line in out)
    header = _line(out, "twinrpc.simulator.explore: run")
    runs = int(header.split()[0])
    assert 1 < runs <= 200, header
    assert "and 1 fault" in header, header  # shrunk to one fault
    minimal = _line(out, "  minimal faults:")
    assert minimal.startswith("FaultPlan(")
    command = _line(out, "  replay:")
    assert command.startswith("pytest test_counter.py::test_counter_keeps_every_update --sim-seed ")
    assert "--sim-faults" in command
    exported = Path(_line(out, "  regression test written to"))
    assert exported.parent == Path(".") and exported.name.startswith(
        "test_counter_keeps_every_update_regression_seed_"
    )

    # the printed command replays the minimal case: the same failure
    replayed = run(pytester, *shlex.split(command)[1:])
    replayed.assert_outcomes(failed=1)
    replayed.stdout.fnmatch_lines(["*lost an update: the counter is*", "replay: pytest test_counter.py::*"])

    # the exported regression test fails while the bug is there, and passes once it is fixed
    run(pytester, str(exported)).assert_outcomes(failed=1)
    pytester.makepyfile(test_counter=PLANTED.replace("ATOMIC = False", "ATOMIC = True"))
    run(pytester, str(exported)).assert_outcomes(passed=1)


def test_an_exported_known_failure_asserts_the_bug_is_still_there(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_counter=PLANTED)
    result = run(pytester, "--sim-explore", "200", "--sim-export", "known", "--sim-export-expect", "fail")
    result.assert_outcomes(failed=1)
    exported = next((pytester.path / "known").glob("test_*.py"))
    assert "pytest.raises(AssertionError, match=PATTERN)" in exported.read_text()
    pytester.syspathinsert()  # the exported module imports the original test module by name
    run(pytester, str(exported)).assert_outcomes(passed=1)
    pytester.makepyfile(test_counter=PLANTED.replace("ATOMIC = False", "ATOMIC = True"))
    run(pytester, str(exported)).assert_outcomes(failed=1)


def test_exploration_is_reproducible(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_counter=PLANTED)
    first = run(pytester, "--sim-explore", "200").stdout.lines
    second = run(pytester, "--sim-explore", "200").stdout.lines
    assert _line(first, "  replay:") == _line(second, "  replay:")
    assert _line(first, "twinrpc.simulator.explore: run") == _line(second, "twinrpc.simulator.explore: run")


UNLUCKY = """
def program(rank):
    return rank


def test_unlucky_seeds_fail(simulation):
    simulation.run(program, 2)
    assert simulation.seed % 80 != 7, f"unlucky seed {simulation.seed}"
"""


def test_one_tests_runs_spread_over_jobs_find_and_shrink_what_one_job_does(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_unlucky=UNLUCKY)
    lines = {}
    for jobs in ("1", "2"):
        result = run(pytester, "--sim-explore", "200", "--sim-explore-jobs", jobs)
        result.assert_outcomes(failed=1)
        lines[jobs] = (
            _line(result.stdout.lines, "twinrpc.simulator.explore: run"),
            _line(result.stdout.lines, "  replay:"),
        )
    header = lines["1"][0]
    assert int(header.split()[0]) > 20, header  # past block 0: job 1 finds it while job 0 runs block 0
    assert lines["2"] == lines["1"]
    assert "--sim-explore-jobs 0: at least 1" in "\n".join(
        run(pytester, "--sim-explore", "5", "--sim-explore-jobs", "0").stderr.lines
    )


def test_exploration_under_xdist_explores_each_test_in_a_worker_as_without_it(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(test_counter=PLANTED, test_counter_too=PLANTED)
    alone = run(pytester, "--sim-explore", "200")
    alone.assert_outcomes(failed=2)
    spread = pytester.runpytest_subprocess("-p", "no:randomly", "-n", "2", "--sim-explore", "200")
    spread.assert_outcomes(failed=2)
    assert "[gw1]" in spread.stdout.str() or "2 workers" in spread.stdout.str()

    def headers(result: pytest.RunResult) -> list[str]:
        # the tracebacks' last lines (with CI set, pytest's summary repeats them untruncated)
        return sorted(
            line for line in result.stdout.lines if line.startswith("E ") and "simulator.explore: run" in line
        )

    assert headers(spread) == headers(alone) and len(headers(alone)) == 2
    assert headers(alone)[0] == headers(alone)[1]  # the same test in two files: the same search


def test_usage_errors_are_named(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_marked="""
        import pytest

        @pytest.mark.simulation(seed=1)
        def test_forgot_the_fixture():
            pass
        """
    )
    result = run(pytester)
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(
        ["*marked @pytest.mark.simulation but does not ask for the simulation fixture*"]
    )
    result = run(pytester, "--sim-explore", "5", "--sim-seed", "1")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--sim-explore draws seeds itself; --sim-seed replays one*"])
    result = run(pytester, "--sim-export", "out")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--sim-export writes the failures --sim-explore finds*"])


def test_a_bad_fault_plan_option_is_named(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_x="def test_x(simulation):\n    pass\n")
    result = run(pytester, "--sim-faults", "no-such-file.json")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*--sim-faults 'no-such-file.json': neither a JSON object nor a file*"])


def test_the_conformance_suite_reads_the_shared_sim_seed(pytester: pytest.Pytester) -> None:
    pytester.makeconftest("from conformance.harness.plugin import *  # noqa: F403\n")
    pytester.mkdir("spec")
    (pytester.path / "spec" / "rpc.md").write_text("# Requirements\n### RPC-1: rpc_sync\n", encoding="utf-8")
    pytester.makepyfile(
        test_conf="""
        import pytest

        @pytest.mark.spec("RPC-1")
        def test_a():
            pass
        """
    )
    result = run(pytester, "--sim-seed", "3")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["twinrpc backend: sim, --sim-seed 3*"])
    result = run(pytester)
    result.stdout.fnmatch_lines(["twinrpc backend: sim, --sim-seed 0*"])


def test_the_plugin_imports_nothing_heavy_for_tests_that_do_not_use_it(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_light="""
        import sys

        def test_no_torch_no_simulator():
            assert "torch" not in sys.modules
            assert "twinrpc.simulator" not in sys.modules
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    assert "--sim-explore=N" in pytester.runpytest_subprocess("--help").stdout.str()

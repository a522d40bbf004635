"""``twinrpc.simulator.explore``: find a failure over seeds and fault plans, shrink it, replay it, export it.

The planted bug is a lost update: two trainers each read a server's counter and write back value + 1,
three times. Trainer 2 starts 1.1 ms after trainer 1 (whose first call also makes its link), so with the default network trainer 1 is done
before trainer 2 reads and no update is lost; a delayed message lets trainer 2's read land between one
of trainer 1's reads and its write. The fix reads and writes in one RPC on the server.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from _lost_update import COUNTER_PROGRAM
from hypothesis import strategies as st
from twinrpc.simulator import FaultPlan, SimulationDeadlock, explore, replay
from twinrpc.simulator._exploration._failure import Failure
from twinrpc.simulator._exploration._signature import message_pattern

import twinrpc.rpc as rpc

ROOT = Path(__file__).resolve().parents[2]

PROGRAM = (
    '\n"""A counter server and two trainers that lose an update when their RPCs interleave."""\n'
    + COUNTER_PROGRAM
    + '        total = _counters.pop("worker0", 0)\n'
    + '        assert total == 6, f"lost an update: the counter is {total}, expected 6"\n'
)


@pytest.fixture
def planted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The planted program as an importable module ``planted_counter`` in ``tmp_path``."""
    (tmp_path / "planted_counter.py").write_text(PROGRAM, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("planted_counter", None)
    import planted_counter

    yield planted_counter
    sys.modules.pop("planted_counter", None)


def test_the_planted_bug_needs_a_fault(planted: Any) -> None:
    replay(planted.program, 3, seed=0)  # no fault, no lost update


def test_exploration_finds_the_lost_update_and_shrinks_it_to_one_fault(planted: Any) -> None:
    with pytest.raises(Failure) as info:
        explore(planted.program, 3, runs=200)
    failure = info.value
    assert 1 < failure.runs <= 200
    assert failure.exception_type == "builtins.AssertionError"
    assert "lost an update" in str(failure.error)
    assert "lost an update" in str(failure.minimal_error)
    assert failure.rank == 0
    assert len(failure.faults) == 1, failure.faults.describe()
    assert len(failure.original.faults) >= len(failure.faults)
    text = str(failure)
    assert failure.faults.describe() in text and failure.replay_command in text
    assert failure.replay_command.startswith("python -m twinrpc.simulator replay planted_counter:program ")
    # the minimal case replays, failing the same way
    with pytest.raises(AssertionError, match=failure.pattern):
        replay(planted.program, 3, seed=failure.seed, faults=failure.faults_data)
    # and passes once the bug is fixed
    planted.ATOMIC = True
    replay(planted.program, 3, seed=failure.seed, faults=failure.faults)


def test_exploration_is_reproducible(planted: Any) -> None:
    first = explore(planted.program, 3, runs=200, raise_on_failure=False)
    second = explore(planted.program, 3, runs=200, raise_on_failure=False)
    assert first.failure is not None and second.failure is not None
    assert (first.runs, first.failure.runs, first.failure.case) == (
        second.runs,
        second.failure.runs,
        second.failure.case,
    )
    other = explore(planted.program, 3, runs=200, seed=1, raise_on_failure=False)
    assert other.failure is not None and other.failure.original != first.failure.original


def test_a_correct_program_passes_every_run(planted: Any) -> None:
    planted.ATOMIC = True
    result = explore(planted.program, 3, runs=25)
    assert result.failure is None and result.runs == 25


def test_seeds_only_exploration_takes_a_strategy_of_plans(planted: Any) -> None:
    result = explore(planted.program, 3, runs=30, faults=st.just(FaultPlan()))
    assert result.failure is None  # the planted bug needs a fault; seeds alone do not find it


def test_swarm_exploration_draws_whole_plans_from_seeds_and_minimizes_them(planted: Any) -> None:
    failure = explore(planted.program, 3, runs=200, swarm=True, raise_on_failure=False).failure
    assert failure is not None and "lost an update" in str(failure.minimal_error)
    assert len(failure.faults) <= 3
    assert len(failure.faults) < len(failure.original.faults)
    with pytest.raises(AssertionError, match=failure.pattern):
        replay(planted.program, 3, seed=failure.seed, faults=failure.faults)
    with pytest.raises(ValueError, match="swarm=True"):
        explore(planted.program, 3, swarm=True, faults=st.just(FaultPlan()))


def test_a_failing_check_is_a_failure(planted: Any) -> None:
    planted.ATOMIC = True
    with pytest.raises(Failure) as info:
        explore(planted.program, 3, runs=5, check=lambda result: result.virtual_time < 1e-6)
    assert info.value.runs == 1
    assert "returned False" in str(info.value.minimal_error)


def test_match_restricts_which_failures_count(planted: Any) -> None:
    result = explore(planted.program, 3, runs=40, match="no such message", raise_on_failure=False)
    assert result.failure is None


def _raises_before_shutdown(rank: int) -> None:
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2)
    if rank == 1:
        raise ValueError("worker 1 gave up at step 7")
    rpc.shutdown()


def test_a_worker_error_is_the_failure_not_the_deadlock_it_causes() -> None:
    with pytest.raises(Failure) as info:
        explore(_raises_before_shutdown, 2, runs=3)
    failure = info.value
    assert failure.exception_type == "builtins.ValueError" and failure.rank == 1
    # worker 1 leaves like a process, so worker 0's shutdown fails instead of waiting forever
    assert "worker 1 gave up at step 7" in str(failure) and "SimulationDeadlock" not in str(failure)
    with pytest.raises(ValueError, match=failure.pattern):
        replay(_raises_before_shutdown, 2, seed=failure.seed, faults=failure.faults)


def _deadlocks(rank: int) -> None:
    from twinrpc._future import Future

    Future().wait()


def test_a_deadlock_is_a_failure() -> None:
    with pytest.raises(Failure) as info:
        explore(_deadlocks, 2, runs=3)
    assert isinstance(info.value.minimal_error, SimulationDeadlock)
    assert info.value.rank is None


def test_message_patterns_free_numbers_and_addresses() -> None:
    pattern = message_pattern("tensor is at version 4; expected version 3 at 0x7f00ab at t=1.5e-05 s")
    import re

    assert re.match(pattern, "tensor is at version 9; expected version 12 at 0x1 at t=0.25 s")
    assert not re.match(pattern, "tensor is at revision 9; expected version 12 at 0x1 at t=0.25 s")
    traceback_text = 'boom 3\nTraceback (most recent call last):\n  File "x.py", line 1\n'
    assert message_pattern(traceback_text) == message_pattern("boom 4")


def test_bad_arguments_are_named(planted: Any) -> None:
    with pytest.raises(ValueError, match="world_size=0"):
        explore(planted.program, 0)
    with pytest.raises(ValueError, match="runs=0"):
        explore(planted.program, 3, runs=0)
    with pytest.raises(TypeError, match="expected a function"):
        explore("planted_counter:program", 3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="seed must be an int"):
        replay(planted.program, 3, seed="0")  # type: ignore[arg-type]


def test_to_pytest_refuses_names_and_programs_it_cannot_write(planted: Any) -> None:
    failure = explore(planted.program, 3, runs=200, raise_on_failure=False).failure
    assert failure is not None
    with pytest.raises(ValueError, match="starts with 'test'"):
        failure.to_pytest("regression")
    local = explore(lambda rank: _raises_before_shutdown(rank), 2, runs=2, raise_on_failure=False).failure
    assert local is not None
    with pytest.raises(ValueError, match="cannot be imported by name"):
        local.to_pytest("test_x")
    assert local.replay_command.startswith("twinrpc.simulator.replay(")


def _pytest(directory: Path, *files: str) -> dict[str, str]:
    """Run pytest on ``files`` in a fresh interpreter; each test's outcome by name."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(directory), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", *files],
        cwd=directory,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    outcomes = {}
    for line in run.stdout.splitlines():
        word, _, rest = line.partition(" ")
        if word in ("PASSED", "FAILED", "ERROR") and "::" in rest:
            outcomes[rest.split("::")[1].split(" ")[0]] = word
    assert outcomes, run.stdout + run.stderr
    return outcomes


def test_exported_regression_tests_run_as_written(planted: Any, tmp_path: Path) -> None:
    failure = explore(planted.program, 3, runs=200, raise_on_failure=False).failure
    assert failure is not None
    (tmp_path / "test_counter_known_bug.py").write_text(
        failure.to_pytest("test_counter_known_bug", expect="fail"), encoding="utf-8"
    )
    (tmp_path / "test_counter_fixed.py").write_text(failure.to_pytest("test_counter_fixed"), encoding="utf-8")
    files = ("test_counter_known_bug.py", "test_counter_fixed.py")
    # with the bug: the known-failure test passes, the regression test fails
    assert _pytest(tmp_path, *files) == {"test_counter_known_bug": "PASSED", "test_counter_fixed": "FAILED"}
    # fixed: the regression test passes, the known-failure test fails (its bug is gone)
    fixed = PROGRAM.replace("ATOMIC = False", "ATOMIC = True")
    (tmp_path / "planted_counter.py").write_text(fixed, encoding="utf-8")
    assert _pytest(tmp_path, *files) == {"test_counter_known_bug": "FAILED", "test_counter_fixed": "PASSED"}


def test_the_replay_command_replays_the_failure(planted: Any, tmp_path: Path) -> None:
    failure = explore(planted.program, 3, runs=200, raise_on_failure=False).failure
    assert failure is not None
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run(
        failure.replay_command.replace("python", sys.executable, 1),
        shell=True,
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 1, run.stdout + run.stderr
    assert "lost an update: the counter is" in run.stderr
    assert textwrap.shorten(failure.faults.describe(), 60)[:30] in run.stderr + run.stdout


def test_a_case_is_written_and_read_back_in_the_network_model_file_format() -> None:
    from twinrpc.simulator import Drop, FaultPlanError, NetworkModel
    from twinrpc.simulator._exploration._case import Case

    network = NetworkModel(latency=2e-3, heartbeat_timeout=1.0)
    case = Case(7, FaultPlan([Drop("response", src=1, dst=0)]), network)
    assert case.to_dict()["network"] == network.to_dict()  # what --network files hold
    assert Case.from_dict(case.to_dict()) == case
    with pytest.raises(FaultPlanError, match="unknown field 'latncy'"):
        Case.from_dict({"seed": 0, "network": {"latncy": 1e-3}})

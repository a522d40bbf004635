"""``check_determinism`` runs a scenario twice and points at the first differing event."""

from __future__ import annotations

import os
import threading

import _trace_scenarios as scenarios
import pytest
from twinrpc.simulator import NondeterminismError, SimulationDeadlock, check_determinism, sleep

import twinrpc.rpc as rpc


def test_a_deterministic_scenario_passes_and_returns_the_first_run() -> None:
    result = check_determinism(scenarios.rich, 3, seed=9)
    assert result.seed == 9 and result.values()[0] == pytest.approx(4.0)
    assert len(result.trace) > 100


def test_program_arguments_and_simulation_options_are_passed_on() -> None:
    result = check_determinism(scenarios.rpc_calls, 2, seed=1, args=(2, 5), max_time=10.0)
    sends = [ev for ev in result.trace if ev.event == "send" and ev.detail.startswith("CALL")]
    assert len(sends) == 5


# the simulator warns about the wall-clock read too: expected here
@pytest.mark.filterwarnings("ignore:.*reads the wall clock")
def test_reading_the_wall_clock_is_caught_at_the_first_differing_event() -> None:
    with pytest.raises(NondeterminismError) as info:
        check_determinism(scenarios.wall_clock_backoff, 2, seed=3)
    err = info.value
    div = err.divergence
    assert div is not None and err.seed == 3
    assert div.a is not None and div.b is not None and div.a.line() != div.b.line()
    # the runs agree up to the backoff: the first difference is on worker0, after both inits
    assert div.worker == 0 and div.index > 0
    assert "ran differently twice" in str(err) and f"#{div.index}" in str(err)
    assert "run 1:" in str(err) and "run 2:" in str(err)


def test_an_unseeded_random_generator_is_caught() -> None:
    with pytest.raises(NondeterminismError) as info:
        check_determinism(scenarios.unseeded_random_payload, 2, seed=0)
    div = info.value.divergence
    assert div is not None and div.a is not None and div.b is not None
    assert div.a.event == div.b.event == "send" and div.a.detail.startswith("CALL#0")
    assert div.a.detail != div.b.detail  # same call, other payload size


def _deadlock(rank: int) -> None:
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2)
    if rank == 0:
        rpc.rpc_sync("worker1", sleep, args=(1.0,))
        from twinrpc._future import Future

        Future().wait()  # never completed


def test_a_deterministic_failure_is_passed_on() -> None:
    with pytest.raises(SimulationDeadlock):
        check_determinism(_deadlock, 2, seed=1)


def test_trace_off_is_refused() -> None:
    with pytest.raises(ValueError, match="do not pass trace=False"):
        check_determinism(scenarios.rpc_calls, 2, trace=False)


def test_a_run_in_a_forked_process_is_the_run_of_a_fresh_one(monkeypatch: pytest.MonkeyPatch) -> None:
    # An explore worker forked from a server that imported twinrpc comes through the fork on this very
    # thread (twinrpc._fork's survivor), as no fresh process does. Every simulated task runs on it, so
    # the backward pass of the gloo world's fork workaround (a task of its own) must not be taken here:
    # the run, and so the replay command's, would differ.
    import twinrpc._fork

    fresh = check_determinism(scenarios.rich, 3, seed=9).trace
    monkeypatch.setattr(twinrpc._fork, "_survivor", (os.getpid(), threading.get_ident()))
    assert twinrpc._fork.on_fork_survivor()
    forked = check_determinism(scenarios.rich, 3, seed=9).trace
    assert any(ev.event == "autograd-backward-started" for ev in forked)
    assert forked.digest() == fresh.digest()

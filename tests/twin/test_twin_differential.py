"""The differential twin test: generated RPC programs behave the same on the
simulator and in the real gloo world.

Each program (``twin.programs``) runs on the simulator under several seeds and once in gloo
processes; the gloo outcome (values, exception classes and message fragments, which calls
completed) must be one the simulator produced. On a disagreement hypothesis shrinks the program and
the failure prints it with every outcome and a command that replays it.

This bounded run is deterministic (``derandomize=True``, no example database): programs without
departures in a pooled world, and a few in fresh worlds where workers are killed or leave by
``shutdown`` (graceful or not), even while a call to them is still running (the core decides
what a departure means, ``twinrpc._departure``). ``nox -s twin -- --programs 500`` is the long run
(``TWIN_PROGRAMS``, ``TWIN_DEPARTURES``: see noxfile.py).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings

from twin import Builtin, Fail, GlooRunner, Leave, Program, Remote, SimRunner, Start, Wait, check, programs
from twin.programs import DEPARTURE_KINDS
from twin.runners import LOADED_HOST_JITTER, LOADED_HOST_SEEDS

#: programs of the bounded run (CI); the long run sets TWIN_PROGRAMS
PROGRAMS = int(os.environ.get("TWIN_PROGRAMS", "25"))
#: programs of the bounded run where workers are killed (each needs a fresh world: seconds, not ms)
KILL_PROGRAMS = int(os.environ.get("TWIN_KILL_PROGRAMS", "4"))
#: programs of the bounded run where workers leave by shutdown (graceful or not; fresh worlds too)
LEAVE_PROGRAMS = int(os.environ.get("TWIN_LEAVE_PROGRAMS", "2"))
#: simulator seeds per program
SEEDS = tuple(range(int(os.environ.get("TWIN_SEEDS", "3"))))
#: departure kinds the generator adds: none in CI; "all" or a comma-separated subset of
#: DEPARTURE_KINDS ("leave", "leave-graceful", "kill") in long runs
_departures = os.environ.get("TWIN_DEPARTURES", "")
DEPARTURES = DEPARTURE_KINDS if _departures == "all" else tuple(d for d in _departures.split(",") if d)


@pytest.fixture(scope="module")
def gloo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GlooRunner]:
    runner = GlooRunner(tmp_path_factory.mktemp("twin"), spares=2)
    try:
        yield runner
    finally:
        runner.close()


@settings(
    max_examples=PROGRAMS,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(program=programs(departures=DEPARTURES, max_ops=8))
def test_simulator_and_gloo_agree_on_generated_programs(program: Program, gloo: GlooRunner) -> None:
    verdict = check(program, sim=SimRunner(SEEDS), gloo=gloo)
    assert verdict.agree, verdict.report()


@settings(
    max_examples=KILL_PROGRAMS,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(program=programs(departures=("kill",), max_ops=6).filter(lambda p: bool(p.killed())))
def test_simulator_and_gloo_agree_when_workers_are_killed(program: Program, gloo: GlooRunner) -> None:
    """Programs in which workers may be killed (SIGKILL in gloo, Simulation.crash): pending and
    later calls to a dead worker, and the survivors' shutdown, fail alike in both worlds."""
    verdict = check(program, sim=SimRunner(SEEDS), gloo=gloo)
    assert verdict.agree, verdict.report()


@settings(
    max_examples=LEAVE_PROGRAMS,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(program=programs(departures=("leave", "leave-graceful"), max_ops=6).filter(lambda p: p.departures))
def test_simulator_and_gloo_agree_when_workers_shut_down(program: Program, gloo: GlooRunner) -> None:
    """Programs in which workers leave by ``shutdown(graceful=False)`` or a graceful shutdown (which
    waits for everyone): pending and later calls to a worker that left, and the others' shutdown,
    end alike in both worlds (SHUT-2, SHUT-3)."""
    verdict = check(program, sim=SimRunner(SEEDS), gloo=gloo)
    assert verdict.agree, verdict.report()


def test_departure_while_call_runs_agrees(gloo: GlooRunner) -> None:
    """Worker 1 leaves with ``shutdown(graceful=False)`` while the driver's call to it is still running
    (its handler sleeps HOLD seconds): a worker that has left sends nothing more, so the caller's
    future fails with the departure error in both worlds, as in gloo and TensorPipe. Five
    simulator seeds; gloo runs twice and both runs must be outcomes the simulator produces."""
    program = Program(2, (Start(dst=1), Leave(rank=1, graceful=False), Wait(slot=0)))
    verdict = check(program, sim=SimRunner(range(5)), gloo=gloo, gloo_runs=2)
    assert verdict.agree, verdict.report()


def test_a_worker_waiting_in_graceful_shutdown_is_not_named_whatever_order_the_news_takes() -> None:
    """Found by a long run on a loaded host (load average 23 on 2 cores), when a follower's graceful
    shutdown failed as soon as a peer left: worker 2's shutdown failed because worker 1 left, and the
    driver, learning of worker 2's departure first, named worker 2. A follower now waits for the
    leader's verdict (SHUT-7) and leaves only after it, so the driver names worker 1 under the default
    network model and under the loaded-host model alike (which reorders deliveries over different
    links by up to 20 ms: spec/simulator.md, "Delivery delays on a loaded host")."""
    program = Program(
        3,
        (
            Fail(dst=0, error="TypeError", sync=False),
            Remote(owner=2, x=7),
            Leave(rank=2, graceful=True),
            Leave(rank=1, graceful=False),
        ),
    )

    def named_by_the_drivers_shutdown(runner: SimRunner) -> set[str]:
        names = set()
        for outcome in runner.outcomes(program):
            (last,) = [line for line in outcome.lines(program) if line.startswith("  driver shutdown")]
            names |= {w for w in ("'worker1'", "'worker2'") if w in last}
        return names

    assert named_by_the_drivers_shutdown(SimRunner(SEEDS)) == {"'worker1'"}
    assert named_by_the_drivers_shutdown(SimRunner(LOADED_HOST_SEEDS, jitter=LOADED_HOST_JITTER)) == {
        "'worker1'"
    }


def test_simulator_and_gloo_agree_on_builtin_calls_in_the_compact_encoding(gloo: GlooRunner) -> None:
    """Both worlds send builtin operator calls in one encoding (src/twinrpc/_builtin_wire.py): values,
    the remote error of a bad call, sync and async, to a peer and to the driver itself."""
    program = Program(
        3,
        (
            Builtin(1, 4),
            Builtin(2, 1, sync=False),
            Builtin(1, 2, bad=True),
            Builtin(0, 3),
            Builtin(2, 0, bad=True, sync=False),
        ),
    )
    verdict = check(program, sim=SimRunner(SEEDS), gloo=gloo)
    assert verdict.agree, verdict.report()
    results = [result for _, kind, result in verdict.gloo.ops if kind == "op"]
    assert (
        results[0] == ("ok", (5.0, 5.0))
        and results[1] == ("ok", (2.0, 2.0))
        and results[3] == ("ok", (4.0, 4.0))
    )
    assert results[2][0] == "raised" and results[4][0] == "raised", results

"""The simulator's crash verb: ``Simulation.crash`` and ``FaultPlan([Crash(...)])`` (ERR-7 on sim)."""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import pytest
from twinrpc.simulator import Crash, FaultPlan, NetworkModel, Simulation, now, sleep

import twinrpc.rpc as rpc
from twinrpc._errors import WorkerUnavailableError
from twinrpc._message import Kind

DETECTION = 0.25


def _caller_with_victim(rank: int) -> Any:
    """Rank 0 keeps a call to rank 1 pending (timeout=0); rank 1 is crashed by the plan."""
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=3)
    if rank == 1:
        sleep(100.0)  # crashed long before this returns
        return "survived"
    if rank == 2:
        sleep(5.0)
        rpc.shutdown(graceful=False)
        return "left"
    fut = rpc.rpc_async("worker1", sleep, args=(50.0,), timeout=0)
    try:
        fut.wait()
        pending: Any = "returned"
    except WorkerUnavailableError as exc:
        pending = (now(), str(exc))
    later_start = now()
    try:
        rpc.rpc_sync("worker1", operator.add, args=(1, 2))
        later: Any = "returned"
    except WorkerUnavailableError as exc:
        later = (now() - later_start, str(exc))
    other = rpc.rpc_sync("worker2", operator.add, args=(1, 2))
    rpc.shutdown(graceful=False)
    return pending, later, other


def _run(plan: FaultPlan, seed: int = 3) -> Any:
    network = NetworkModel(failure_detection=DETECTION)
    return Simulation(3, seed=seed, network=network, faults=plan).run(_caller_with_victim)


def test_a_crash_at_a_time_fails_calls_after_the_detection_delay() -> None:
    result = _run(FaultPlan([Crash(1, at=1.0)]))
    assert result.crashed == (1,)
    values = result.values()
    assert values[1] is None and values[2] == "left"
    (pending_at, message), (later_elapsed, later_message), other = values[0]
    assert pending_at == pytest.approx(1.0 + DETECTION)  # virtual time: exact
    assert "'worker1' (rank 1) is unavailable" in message and "simulated crash at t=1.000000" in message
    assert later_elapsed == 0.0 and "'worker1'" in later_message
    assert other == 3
    events = [e.event for e in result.trace]
    assert "crash" in events and "peer-failed" in events


def test_a_crash_on_the_nth_arrival_of_a_kind_loses_that_message() -> None:
    # worker1 receives CALLs: #1 is rank 0's sleep call; crash on it, so the call is never served.
    result = _run(FaultPlan([Crash(1, on_receive=Kind.CALL, nth=1)]))
    assert result.crashed == (1,)
    (pending_at, _), _, other = result.values()[0]
    assert pending_at < 0.01 + DETECTION  # crashed on arrival (microseconds), then detected
    assert other == 3
    assert any(e.event == "fault" and "CALL" in str(e.detail) for e in result.trace)


def test_crash_runs_are_deterministic() -> None:
    plan = FaultPlan([Crash(1, at=0.5)])
    assert _run(plan, seed=11).digest == _run(plan, seed=11).digest


def _self_crash(rank: int, sim: Simulation) -> Any:
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2)
    if rank == 1:
        sim.crash(1)
        raise AssertionError("Simulation.crash returned on the crashed worker")
    sleep(1.0)
    try:
        rpc.shutdown()  # graceful, with a dead peer: raises instead of waiting (SHUT-2)
    except WorkerUnavailableError as exc:
        return str(exc)
    return "shutdown returned"


def test_a_worker_crashing_itself_stops_and_its_peer_s_graceful_shutdown_raises() -> None:
    sim = Simulation(2, seed=1)
    result = sim.run(_self_crash, sim)
    assert result.crashed == (1,)
    assert "'worker1' (rank 1) is unavailable" in result.values()[0]


def test_crash_plans_are_checked_and_printable() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        Crash(1)
    with pytest.raises(ValueError, match="exactly one"):
        Crash(1, at=1.0, on_receive=Kind.CALL)
    with pytest.raises(ValueError, match="nth"):
        Crash(1, on_receive=Kind.CALL, nth=0)
    plan = FaultPlan([Crash(2, on_receive=Kind.RREF_USER_DELETE, nth=2)])
    assert "crash worker 2 when message #2 of kind RREF_USER_DELETE arrives" in plan.describe()
    with pytest.raises(ValueError, match="no worker 5"):
        Simulation(3, faults=FaultPlan([Crash(5, at=0.0)]))


def _holder_of_a_departed_owner(rank: int) -> Any:
    """Rank 0 holds a user RRef owned by rank 1 and has a call to rank 1 running when rank 1 shuts
    down with ``graceful=False``; rank 0 then shuts down gracefully."""
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2)
    if rank == 1:
        sleep(1.0)
        rpc.shutdown(graceful=False)
        return "left"
    rref = rpc.remote("worker1", operator.add, args=(1, 2))
    assert rref.to_here() == 3
    fut = rpc.rpc_async("worker1", sleep, args=(5.0,), timeout=0)
    try:
        fut.wait()
        running: Any = "returned"
    except WorkerUnavailableError as exc:
        running = (now(), str(exc))
    try:
        rpc.shutdown()
        shutdown: Any = "returned"
    except WorkerUnavailableError as exc:
        shutdown = (now(), str(exc))
    return running, shutdown


def test_a_shutdown_without_graceful_is_announced_and_stops_the_rref_monitors() -> None:
    """SHUT-3: the running call fails with the departure error one network delay after the shutdown
    (its reply is never sent), the graceful shutdown after it raises at once (SHUT-2), and the RRef
    monitors stop (a MonitorViolation would fail the run) as after a crash."""
    result = Simulation(2, seed=5, monitors=True).run(_holder_of_a_departed_owner)
    (running_at, running), (shutdown_at, shutdown) = result.values()[0]
    assert 1.0 < running_at < 1.01  # its shutdown at t=1 (after init) plus one network delay
    assert "'worker1' (rank 1) is unavailable" in running and "It has shut down RPC" in running
    assert "probably died" not in running
    assert shutdown_at == running_at and "'worker1' (rank 1) is unavailable" in shutdown
    events = [e.event for e in result.trace]
    assert "peer-left" in events and "monitors-off" in events


EPOCHS = 6


def _parameter_server_and_two_trainers(rank: int) -> Any:
    """Worker 0 serves and calls graceful shutdown at once; trainer 2 is crashed by the plan after
    two epochs; trainer 1 trains EPOCHS epochs (a call to the server each), then calls shutdown."""
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=3)
    if rank == 0:
        try:
            rpc.shutdown()
            return "returned"
        except WorkerUnavailableError as exc:
            return now(), str(exc)
    epochs = []
    for epoch in range(1, EPOCHS + 1):
        sleep(0.5)
        epochs.append(rpc.rpc_sync("worker0", operator.add, args=(epoch, 0)))
    reached = now()
    try:
        rpc.shutdown()
        return epochs, reached, "returned"
    except WorkerUnavailableError as exc:
        return epochs, reached, str(exc)


def test_a_crash_fails_the_leader_s_shutdown_only_after_the_healthy_trainer_s_last_epoch() -> None:
    """SHUT-7, in the trace: the server learns of the crash while it waits in shutdown, keeps serving
    the healthy trainer's epochs, and fails the barrier (its verdict, a SCATTER) only after the
    trainer's contribution arrived; it leaves after telling it, and the trainer leaves after hearing
    it."""
    result = Simulation(3, seed=7, faults=FaultPlan([Crash(2, at=1.2)])).run(
        _parameter_server_and_two_trainers
    )
    assert result.crashed == (2,)
    (failed_at, server_error), (epochs, reached, trainer_error), _ = result.values()
    assert epochs == list(range(1, EPOCHS + 1))  # every epoch served
    assert failed_at >= reached  # virtual time: the server failed only after the trainer arrived
    assert "'worker2' (rank 2) is unavailable" in server_error
    assert trainer_error.startswith("the shutdown leader worker0 aborted _all_gather: " + server_error)

    events = result.trace.events()

    def first(pred: Callable[[Any], bool]) -> int:
        return next(ev.index for ev in events if pred(ev))

    def last(pred: Callable[[Any], bool]) -> int:
        return max(ev.index for ev in events if pred(ev))

    def msg(kind: str, src: int, dst: int, event: str) -> Callable[[Any], bool]:
        return lambda ev: (
            ev.event == event
            and ev.message is not None
            and (ev.message.kind, ev.message.src, ev.message.dst) == (kind, src, dst)
        )

    crash = first(lambda ev: ev.event == "crash" and ev.worker == 2)
    server_knows = first(lambda ev: ev.event == "peer-failed" and ev.worker == 0)
    barrier_entered = first(msg("GATHER", 1, 0, "send"))  # the trainer's contribution...
    last_epoch_served = last(msg("RESPONSE", 0, 1, "send"))
    contribution = last(msg("GATHER", 1, 0, "deliver"))  # ...after its news of the crash, if any
    verdict = first(msg("SCATTER", 0, 1, "send"))
    verdict_arrives = first(msg("SCATTER", 0, 1, "deliver"))
    server_leaves = first(lambda ev: ev.event == "exit" and ev.worker == 0)
    trainer_leaves = first(lambda ev: ev.event == "exit" and ev.worker == 1)
    assert crash < server_knows < last_epoch_served < barrier_entered <= contribution < verdict
    assert verdict < server_leaves and verdict_arrives < trainer_leaves
    # the server served epochs after it knew: the calls it answered then were the trainer's
    assert sum(1 for ev in events[server_knows:verdict] if msg("RESPONSE", 0, 1, "send")(ev)) >= 3


def _reinit_within_the_departure_news(rank: int) -> Any:
    """Both workers leave generation 0 without a graceful shutdown (rank 1 first, once its call
    has made the pair's link, rank 0 at t=1.5) and init_rpc again; generation 1 starts 1 ms after
    rank 0's departure, well before its news (0.1 s of latency) lands. Then rank 1 calls rank 0."""
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2)
    if rank == 1:  # links are made on first use: this call makes the one the news goes over
        rpc.rpc_sync("worker0", operator.add, args=(0, 0))
    else:
        sleep(1.5)
    rpc.shutdown(graceful=False)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2)
    result = None
    if rank == 1:
        sleep(0.2)  # rank 0's generation-0 news has landed by now
        result = rpc.rpc_sync("worker0", operator.add, args=(1, 2))
    rpc.shutdown()
    return result


def test_a_departure_s_news_reaches_only_the_worlds_running_when_it_left() -> None:
    """Rank 0's departure from generation 0 is news to no one: rank 1 had left that generation, and
    rank 1's generation-1 world started after it (a gloo worker that joins later has no link to the
    departed one, so no close frame). The call in generation 1 succeeds."""
    model = NetworkModel(latency=0.1, jitter=0.0)
    result = Simulation(2, seed=3, network=model).run(_reinit_within_the_departure_news)
    assert result.values() == [None, 3]
    left = [(e.worker, e.detail) for e in result.trace.events() if e.event == "peer-left"]
    assert left == [(0, "rank 1 (shut down)")]  # rank 1's generation-0 departure, heard by rank 0

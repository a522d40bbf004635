"""The simulator honours each worker's heartbeat options in virtual time (ERR-7 on sim).

As in the gloo world, a worker declares a silent peer (paused, or cut off by a partition) dead after
``heartbeat_interval * heartbeat_misses`` seconds of its *own* ``init_rpc`` options, and never with
``heartbeat_interval=0``; ``NetworkModel.heartbeat_timeout``, when set, overrides every worker's options.
Times are virtual, so the assertions on them are exact and the tests take milliseconds.
"""

from __future__ import annotations

import operator
from typing import Any

import pytest
from twinrpc.simulator import FaultPlan, NetworkModel, Partition, Pause, Simulation, now, sleep

import twinrpc.rpc as rpc

#: when the fault plans below start (after init_rpc's rendezvous)
START = 0.01


def _init(rank: int, world_size: int, heartbeats: dict[int, tuple[float, int]]) -> None:
    """init_rpc with this rank's (heartbeat_interval, heartbeat_misses), default options if none."""
    kwargs: dict[str, Any] = {}
    if rank in heartbeats:
        interval, misses = heartbeats[rank]
        kwargs = {"heartbeat_interval": interval, "heartbeat_misses": misses}
    options = rpc.TensorPipeRpcBackendOptions(**kwargs)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size, rpc_backend_options=options)


def _call_the_paused_worker(rank: int, world_size: int, heartbeats: dict[int, tuple[float, int]]) -> Any:
    """Every rank but the last calls the last one (paused by the plan) with no timeout: only a death
    or the end of the pause ends the call. Returns (outcome, virtual time it ended, text)."""
    _init(rank, world_size, heartbeats)
    last = world_size - 1
    out: Any = None
    if rank != last:
        sleep(2 * START - now())
        try:
            value = rpc.rpc_sync(f"worker{last}", operator.add, args=(1, 2), timeout=0)
            out = ("returned", now(), value)
        except rpc.WorkerUnavailableError as exc:
            out = ("unavailable", now(), str(exc))
    else:
        sleep(40.0)  # up (but paused for a while) until every call is over
    rpc.shutdown(graceful=False)
    return out


def _run(
    world_size: int,
    heartbeats: dict[int, tuple[float, int]],
    faults: FaultPlan,
    network: NetworkModel | None = None,
) -> Any:
    sim = Simulation(world_size, seed=1, network=network, faults=faults)
    return sim.run(_call_the_paused_worker, world_size, heartbeats)


def _declarations(result: Any) -> list[tuple[float, str]]:
    return [(e.time, e.detail) for e in result.trace if e.event == "fault" and "declares worker" in e.detail]


def test_a_worker_declares_a_paused_peer_dead_after_its_own_heartbeat_bound() -> None:
    # heartbeat_interval=0.1 x heartbeat_misses=3: dead after 0.3 s of silence, not the default 10 s.
    result = _run(2, {0: (0.1, 3), 1: (0.1, 3)}, FaultPlan([Pause(1, 30.0, at=START)]))
    outcome, when, message = result.values()[0]
    assert outcome == "unavailable", message
    assert when == pytest.approx(START + 0.3)
    assert "'worker1' (rank 1) is unavailable" in message
    assert "no frame or heartbeat from it for more than 0.3 s of simulated time" in message
    assert "heartbeat_interval x heartbeat_misses = 0.1 s x 3" in message
    assert "its process is stopped, hung or cut off from this one" in message
    (t, detail), *_ = _declarations(result)
    assert t == pytest.approx(START + 0.3) and detail.startswith("worker 0 declares worker 1 dead")


def test_with_heartbeats_off_a_paused_peer_is_never_declared_dead_by_its_silence() -> None:
    # heartbeat_interval=0: the call waits out the 30 s pause and returns (gloo: no heartbeat, no
    # silence detection). Worker 1 keeps the default options; it never had a reason to judge worker 0.
    result = _run(2, {0: (0.0, 3)}, FaultPlan([Pause(1, 30.0, at=START)]))
    assert result.values()[0][0::2] == ("returned", 3)
    assert result.values()[0][1] == pytest.approx(START + 30.0, abs=1e-3)
    assert _declarations(result) == []


def test_each_worker_judges_a_silent_peer_by_its_own_options() -> None:
    # Workers 0 (0.1 s x 3) and 1 (0.5 s x 4) both wait for worker 2, paused for 5 s: each declares
    # it dead after its own bound.
    result = _run(3, {0: (0.1, 3), 1: (0.5, 4)}, FaultPlan([Pause(2, 5.0, at=START)]))
    (outcome0, when0, message0), (outcome1, when1, message1), _ = result.values()
    assert outcome0 == outcome1 == "unavailable"
    assert when0 == pytest.approx(START + 0.3) and "= 0.1 s x 3" in message0
    assert when1 == pytest.approx(START + 2.0) and "= 0.5 s x 4" in message1
    assert "for more than 2 s of simulated time" in message1


def _partitioned(rank: int, heartbeats: dict[int, tuple[float, int]]) -> Any:
    """Both ranks wait (no timeout) for a call to the other, which is partitioned away."""
    _init(rank, 2, heartbeats)
    sleep(2 * START - now())
    try:
        rpc.rpc_sync(f"worker{1 - rank}", operator.add, args=(1, 2), timeout=0)
        out: Any = ("returned", now())
    except rpc.WorkerUnavailableError:
        out = ("unavailable", now())
    sleep(5.0 - now())  # both stay up until both calls are over
    rpc.shutdown(graceful=False)
    return out


def test_both_sides_of_a_partition_judge_by_their_own_options() -> None:
    plan = FaultPlan([Partition(0, 1, start=START, end=60.0)])
    result = Simulation(2, seed=1, faults=plan).run(_partitioned, {0: (0.1, 3), 1: (1.0, 2)})
    (outcome0, when0), (outcome1, when1) = result.values()
    assert outcome0 == outcome1 == "unavailable"
    assert when0 == pytest.approx(START + 0.3)
    assert when1 == pytest.approx(START + 2.0)


def test_the_network_models_heartbeat_timeout_overrides_every_workers_options() -> None:
    network = NetworkModel(heartbeat_timeout=5.0)
    # Shorter options (0.3 s) and heartbeats off (never) alike: the override's 5 s decides.
    for heartbeats in ({0: (0.1, 3)}, {0: (0.0, 1)}):
        result = _run(2, heartbeats, FaultPlan([Pause(1, 30.0, at=START)]), network)
        outcome, when, message = result.values()[0]
        assert outcome == "unavailable", message
        assert when == pytest.approx(START + 5.0)
        assert "for more than 5 s of simulated time (limit: NetworkModel.heartbeat_timeout" in message
    # 0 turns detection off for everyone, whatever the options say.
    result = _run(2, {0: (0.1, 3)}, FaultPlan([Pause(1, 30.0, at=START)]), NetworkModel(heartbeat_timeout=0))
    assert result.values()[0][0] == "returned"


def test_by_default_the_bound_is_the_default_options_ten_seconds() -> None:
    assert NetworkModel().heartbeat_timeout is None
    result = _run(2, {}, FaultPlan([Pause(1, 30.0, at=START)]))
    outcome, when, message = result.values()[0]
    assert outcome == "unavailable" and when == pytest.approx(START + 10.0)
    assert "heartbeat_interval x heartbeat_misses = 1 s x 10" in message


def test_a_network_model_without_an_override_round_trips_through_its_files(tmp_path: Any) -> None:
    for suffix in (".json", ".toml"):
        path = tmp_path / f"network{suffix}"
        NetworkModel(latency=1e-3).dump(path)
        assert NetworkModel.load(path) == NetworkModel(latency=1e-3)
    assert NetworkModel.from_dict({"heartbeat_timeout": None}).heartbeat_timeout is None
    assert NetworkModel.from_dict({"heartbeat_timeout": 2}).heartbeat_timeout == 2.0


def _declared_dead_then_resumes(rank: int, heartbeats: dict[int, tuple[float, int]]) -> Any:
    """Worker 0 waits on worker 1, which is paused long enough for worker 0 to declare it dead; once
    resumed, worker 1 calls worker 0. Returns (outcome, virtual time it ended, text)."""
    _init(rank, 2, heartbeats)
    out: Any = None
    if rank == 0:
        sleep(2 * START - now())
        try:
            rpc.rpc_sync("worker1", operator.add, args=(1, 2), timeout=0)
        except rpc.WorkerUnavailableError:
            pass
        sleep(10.0)  # up while worker 1 tries to reach it
    else:
        sleep(3 * START - now())  # the pause (from START for 2 s) stops it here
        try:
            rpc.rpc_sync("worker0", operator.add, args=(1, 2), timeout=0)
            out = ("returned", now(), "")
        except rpc.WorkerUnavailableError as exc:
            out = ("unavailable", now(), str(exc))
    rpc.shutdown(graceful=False)
    return out


def test_a_resumed_worker_finds_its_connection_closed_by_the_peer_that_declared_it_dead() -> None:
    # gloo: a worker that declares a peer dead closes their connection (PeerLink.abandon), and the
    # peer, once it runs again, sees the connection lost at once, with heartbeats off too (before:
    # the simulator only let it declare the other dead after its own bound, and never with
    # heartbeats off, so its call waited forever).
    plan = FaultPlan([Pause(1, 2.0, at=START)])
    result = Simulation(2, seed=1, faults=plan).run(_declared_dead_then_resumes, {0: (0.1, 3), 1: (0.0, 3)})
    outcome, when, message = result.values()[1]
    assert outcome == "unavailable", message
    assert when == pytest.approx(START + 2.0, abs=0.01)
    assert "'worker0' (rank 0) is unavailable" in message
    assert "connection lost" in message and "Its process has probably died" in message

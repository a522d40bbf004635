"""Links made on first use in the simulator, as in the gloo world (impl/_link_table.py): a worker holds
links only to the peers it talked to, the trace shows each set-up, and a peer that crashed before
anyone linked to it is reported as the gloo world reports it (tests/gloo/test_gloo_first_failure.py)."""

from __future__ import annotations

from typing import Any

import pytest
from twinrpc.simulator import FaultPlan, NetworkModel, Pause, Simulation, now, sleep
from twinrpc.simulator._network._link_setup import LINK_SETUP_ROUND_TRIPS

import twinrpc.rpc as rpc

#: every worker waits this long before shutting down (the leader's shutdown links it to everyone)
QUIET = 1.0


def _caller_of_two(rank: int) -> None:
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=5)
    if rank == 3:
        assert rpc.rpc_sync("worker1", abs, args=(-1,)) == 1
        assert rpc.rpc_sync("worker2", abs, args=(-2,)) == 2
    sleep(QUIET)
    rpc.shutdown()


def test_a_worker_that_called_two_peers_has_two_links_and_the_trace_shows_their_set_up() -> None:
    network = NetworkModel(latency=100e-6, jitter=0.0)
    trace = Simulation(5, seed=0, network=network).run(_caller_of_two).trace
    before = [e for e in trace.events() if e.time < QUIET]
    set_ups = [e for e in before if e.event == "link"]
    assert [(e.worker, e.detail) for e in set_ups] == [
        (3, "rank 3 sets up its link to rank 1"),
        (3, "rank 3 sets up its link to rank 2"),
    ]
    ups = [e for e in before if e.event == "link-up"]
    assert [e.detail for e in ups] == ["rank 3 <-> rank 1", "rank 3 <-> rank 2"]
    # each set-up costs its store round trips, then the call goes over the new link
    first_call = next(e for e in before if e.event == "send" and e.message and e.message.kind == "CALL")
    cost = LINK_SETUP_ROUND_TRIPS * 2 * network.latency
    assert ups[0].time - set_ups[0].time == pytest.approx(cost)
    assert first_call.time == ups[0].time and first_call.index > ups[0].index
    # the leader's shutdown then links it to every follower it has no link to yet
    later = {e.detail for e in trace.events() if e.event == "link" and e.time >= QUIET}
    assert {"rank 0 sets up its link to rank 1", "rank 0 sets up its link to rank 4"} <= later


def _dies_before_any_link(rank: int, sim: Simulation) -> dict[str, Any]:
    """As tests/gloo/test_gloo_first_failure.py: worker2 dies once every worker has joined, before any
    link to it; worker0 then calls it for the first time, and both others shut down gracefully."""
    options = rpc.TensorPipeRpcBackendOptions(heartbeat_interval=0.2, heartbeat_misses=5)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=3, rpc_backend_options=options)
    if rank == 2:
        sim.crash(2)
    sleep(0.01)
    out: dict[str, Any] = {}
    if rank == 0:
        start = now()
        try:
            rpc.rpc_sync("worker2", abs, args=(1,))
        except Exception as exc:
            out["first"] = f"{type(exc).__name__}: {exc}"
        out["after"] = now() - start
    try:
        rpc.shutdown()
        out["shutdown"] = "shutdown returned"
    except Exception as exc:
        out["shutdown"] = f"{type(exc).__name__}: {exc}"
    return out


def test_a_worker_that_crashed_before_any_link_to_it_is_reported_silent_after_the_liveness_bound() -> None:
    sim = Simulation(3, seed=0)
    result = sim.run(_dies_before_any_link, sim, check=False)
    got = [o.value for o in result.outcomes]
    first = got[0]["first"]
    assert first.startswith("WorkerUnavailableError: worker 'worker2' (rank 2) is unavailable"), first
    assert "did not answer this worker's connection" in first, first
    # the worker's own bound, heartbeat_interval x heartbeat_misses = 1 s, from the set-up's start
    assert got[0]["after"] == pytest.approx(1.0, abs=1e-3)
    for rank in (0, 1):
        ended = got[rank]["shutdown"]
        assert ended.startswith("WorkerUnavailableError") and "worker2" in ended, ended
    # no link carried news of the crash: nobody learnt it after failure_detection
    crash = next(e for e in sim.trace.events() if e.event == "crash")
    failed = [e for e in sim.trace.events() if e.event == "peer-failed" and e.detail == "rank 2"]
    assert failed and all(e.time >= crash.time + 1.0 for e in failed)


def _one_linked_peer_then_crash(rank: int, sim: Simulation) -> None:
    """worker0 calls worker2 (their link is made); worker1 never talks to it; worker2 then crashes."""
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=3)
    if rank == 0:
        assert rpc.rpc_sync("worker2", abs, args=(-1,)) == 1
    sleep(0.01)
    if rank == 2:
        sim.crash(2)
    sleep(QUIET)
    rpc.shutdown(graceful=False)


def test_only_a_peer_linked_to_a_crashed_worker_learns_the_crash() -> None:
    network = NetworkModel(latency=100e-6, jitter=0.0, failure_detection=0.05)
    sim = Simulation(3, seed=0, network=network)
    sim.run(_one_linked_peer_then_crash, sim, check=False)
    crash = next(e for e in sim.trace.events() if e.event == "crash")
    failed = [(e.worker, e.time) for e in sim.trace.events() if e.event == "peer-failed"]
    assert failed == [(0, pytest.approx(crash.time + 0.05))]


def _paused_peer(rank: int, late_call: float) -> Any:
    """worker0 calls worker2 before the plan pauses it (their link is made); worker1 calls it only at
    ``late_call``, long after its heartbeat bound (0.1 s x 3) passed."""
    options = rpc.TensorPipeRpcBackendOptions(heartbeat_interval=0.1, heartbeat_misses=3)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=3, rpc_backend_options=options)
    if rank == 0:
        assert rpc.rpc_sync("worker2", abs, args=(-1,)) == 1
    out: Any = None
    if rank == 1:
        sleep(late_call - now())
        try:
            rpc.rpc_sync("worker2", abs, args=(-1,), timeout=0)
        except rpc.WorkerUnavailableError:
            out = now()
    sleep(3.0 - now())
    rpc.shutdown(graceful=False)
    return out


def test_heartbeats_run_over_links_only() -> None:
    # worker2 is paused from t=0.05 for 10 s: worker0, linked to it, declares it dead after its bound;
    # worker1 has no link to it and judges nothing until its own late call makes one, which then
    # fails at once (the silence already lasted its bound) instead of waiting out the pause.
    plan = FaultPlan([Pause(2, 10.0, at=0.05)])
    network = NetworkModel(latency=100e-6, jitter=0.0)
    result = Simulation(3, seed=0, network=network, faults=plan).run(_paused_peer, 1.0, check=False)
    trace = result.trace
    declared = [(e.worker, e.time) for e in trace.events() if "declares worker 2 dead" in e.detail]
    link_up = next(e.time for e in trace.events() if e.event == "link-up" and e.detail == "rank 1 <-> rank 2")
    assert declared == [(0, pytest.approx(0.35)), (1, pytest.approx(link_up))]
    assert result.values()[1] == pytest.approx(link_up)

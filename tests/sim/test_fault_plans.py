"""Fault plans in the RPC's vocabulary: each fault, verb and data form shown on a real RPC program.

Times are virtual, so the assertions on them are exact and the tests take milliseconds.
"""

from __future__ import annotations

import json
import operator
from pathlib import Path
from typing import Any

import pytest
import tomllib
import torch
from twinrpc.simulator import (
    ComputeModel,
    Crash,
    Delay,
    Deliver,
    Drop,
    Duplicate,
    FaultPlan,
    FaultPlanError,
    Hold,
    NetworkModel,
    Partition,
    Pause,
    Simulation,
    Swarm,
    load_faults,
    now,
    sleep,
)
from twinrpc.simulator._errors import LaunchError

import twinrpc.autograd as dist_autograd
import twinrpc.rpc as rpc

TIMEOUT_FRAGMENT = "RPC ran for more than set timeout"

# -- user functions (module level: pickled by reference) ------------------------------------------------
_COUNTS: dict[int, int] = {}
_ARRIVALS: list[int] = []


def _bump() -> int:
    me = rpc.get_worker_info().id
    _COUNTS[me] = _COUNTS.get(me, 0) + 1
    return _COUNTS[me]


def _count() -> int:
    return _COUNTS.get(rpc.get_worker_info().id, 0)


def _record(x: int) -> int:
    _ARRIVALS.append(x)
    return x


def _weighted_sum(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x * w).sum()


def _failure(exc: BaseException) -> tuple[str, str]:
    return type(exc).__name__, str(exc)


@pytest.fixture(autouse=True)
def _clean() -> Any:
    _COUNTS.clear()
    _ARRIVALS.clear()
    yield
    _COUNTS.clear()
    _ARRIVALS.clear()


# -- programs ----------------------------------------------------------------------------------------
def _one_call(rank: int, timeout: float = 2.0) -> Any:
    """Rank 0 calls rank 1 once (bounded), then once more with no fault expected; graceful shutdown."""
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2)
    out: Any = None
    if rank == 0:
        start = now()
        try:
            first: Any = rpc.rpc_sync("worker1", operator.add, args=(1, 2), timeout=timeout)
        except RuntimeError as exc:
            first = _failure(exc)
        out = (first, now() - start, rpc.rpc_sync("worker1", operator.add, args=(3, 4)))
    rpc.shutdown()
    return out


def _bump_once(rank: int) -> Any:
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2)
    out: Any = None
    if rank == 0:
        reply = rpc.rpc_sync("worker1", _bump)
        sleep(0.01)  # the duplicate, if any, arrives and runs
        out = (reply, rpc.rpc_sync("worker1", _count))
    rpc.shutdown()
    return out


def _two_async(rank: int) -> Any:
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2)
    if rank == 0:
        futs = [rpc.rpc_async("worker1", _record, args=(i,)) for i in (1, 2)]
        for f in futs:
            f.wait()
    rpc.shutdown()


def _four_calls(rank: int) -> Any:
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2)
    out: list[Any] = []
    if rank == 0:
        for i in range(4):
            try:
                out.append(rpc.rpc_sync("worker1", operator.add, args=(i, 0), timeout=1.0))
            except RuntimeError as exc:
                out.append(type(exc).__name__)
    rpc.shutdown()
    return out


def _verb_program(rank: int, sim: Simulation, verb: str) -> Any:
    """Rank 0 applies a link verb, makes a call that it blocks, waits 2 s, undoes the verb."""
    world = sim.world_size
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world)
    out: Any = None
    if rank == 0:
        if verb == "hold":
            sim.hold(0, 1)
        elif verb == "oneway":
            sim.partition(1, 0, oneway=True)  # only replies from 1 to 0 are cut
        else:
            sim.partition(0)  # worker 0 against everyone else, both ways
        start = now()
        fut = rpc.rpc_async("worker1", operator.add, args=(1, 2))
        sleep(2.0)
        pending = not fut.done()
        released = sim.release(0, 1) if verb == "hold" else sim.heal()
        out = (fut.wait(), now() - start, pending, released)
    rpc.shutdown()
    return out


def _wait_for_a_dead_peer(rank: int) -> Any:
    """Rank 0 calls rank 1 with no timeout; rank 1 calls rank 0 late. Only a death ends a call."""
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2)
    out: Any = None
    try:
        if rank == 0:
            sleep(0.01)
            out = rpc.rpc_sync("worker1", operator.add, args=(1, 2), timeout=0)
        else:
            sleep(25.0)
            out = rpc.rpc_sync("worker0", operator.add, args=(1, 2), timeout=0)
    except RuntimeError as exc:
        out = (now(), *_failure(exc))
    sleep(30.0 - now())  # both stay up until rank 1's late call is done
    rpc.shutdown(graceful=False)
    return out


def _call_a_paused_worker(rank: int, sim: Simulation | None) -> Any:
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2)
    out: Any = None
    if rank == 0:
        if sim is not None:
            sim.pause(1, 3.0)
        start = now()
        out = (rpc.rpc_sync("worker1", operator.add, args=(1, 2)), now() - start)
    rpc.shutdown()
    return out


def _pause_myself(rank: int, sim: Simulation) -> Any:
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2)
    out = None
    if rank == 1:
        start = now()
        sim.pause(1, 2.0)
        out = now() - start
    rpc.shutdown()
    return out


def _backward_across_workers(rank: int) -> Any:
    """Rank 0 runs a distributed forward through workers 1 and 2, then backward."""
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=3)
    out: Any = None
    if rank == 0:
        w = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
        with dist_autograd.context() as ctx:
            loss = rpc.rpc_sync("worker1", _weighted_sum, args=(torch.ones(3), w)) + rpc.rpc_sync(
                "worker2", _weighted_sum, args=(torch.full((3,), 2.0), w)
            )
            try:
                dist_autograd.backward(ctx, [loss])
                out = dist_autograd.get_gradients(ctx)[w].tolist()
            except RuntimeError as exc:
                out = (now(), *_failure(exc))
        rpc.shutdown(graceful=False)
        return out
    sleep(100.0)  # serve the forward and backward, then leave without waiting for the others
    rpc.shutdown(graceful=False)
    return out


def _run(program: Any, *args: Any, world: int = 2, seed: int = 1, **kwargs: Any) -> Any:
    return Simulation(world, seed=seed, **kwargs).run(program, *args, check=False)


def _faults(result: Any) -> list[str]:
    return [e.detail for e in result.trace if e.event == "fault"]


# -- message faults ----------------------------------------------------------------------------------
def test_a_dropped_response_makes_rpc_sync_time_out_with_pytorchs_message() -> None:
    result = _run(_one_call, faults=FaultPlan([Drop("response", src=1, dst=0)]))
    (kind, message), elapsed, later = result.values()[0]
    assert kind == "RPCTimeoutError" and TIMEOUT_FRAGMENT in message and "(2000 ms)" in message
    assert elapsed == pytest.approx(2.0, abs=1e-3)
    assert later == 7  # only the first response was addressed; graceful shutdown still completed
    assert any(d.startswith("drop RESPONSE#") and "the 1st response 1->0" in d for d in _faults(result))


def test_a_dropped_request_times_out_and_graceful_shutdown_still_ends() -> None:
    # The lost request is never served: join() must not wait for it (WorldEvents.on_request_copies).
    result = _run(_one_call, faults=FaultPlan([Drop("request")]))
    (kind, message), _, later = result.values()[0]
    assert kind == "RPCTimeoutError" and TIMEOUT_FRAGMENT in message and later == 7
    assert result.virtual_time < 3.0


def test_a_duplicated_request_runs_the_function_twice_and_the_caller_keeps_the_first_reply() -> None:
    result = _run(_bump_once, faults=FaultPlan([Duplicate(1e-3, "CALL", nth=1)]))
    reply, count = result.values()[0]
    assert reply == 1  # the first reply; the duplicate's reply (2) was ignored
    assert count == 2  # PyTorch does not deduplicate ordinary requests: the function ran twice
    assert any(d.startswith("duplicate CALL#") for d in _faults(result))


def test_a_duplicated_response_is_ignored_by_the_caller() -> None:
    result = _run(_one_call, faults=FaultPlan([Duplicate(0.5, "response", count=None)]))
    first, _, later = result.values()[0]
    assert (first, later) == (3, 7)
    assert sum(d.startswith("duplicate RESPONSE#") for d in _faults(result)) >= 2


def test_a_delay_addressed_by_kind_link_and_nth_reorders_two_calls() -> None:
    _run(_two_async, seed=2)
    assert _ARRIVALS == [1, 2]  # under this seed the jitter keeps them in order
    _ARRIVALS.clear()
    result = _run(_two_async, seed=2, faults=FaultPlan([Delay(0.01, "request", src=0, dst=1, nth=1)]))
    assert _ARRIVALS == [2, 1]
    assert any(d.startswith("delay CALL#") and "by 0.01s" in d for d in _faults(result))


def test_nth_and_count_choose_which_messages_a_fault_hits() -> None:
    result = _run(_four_calls, faults=FaultPlan([Drop("request", nth=2, count=2)]))
    assert result.values()[0] == [0, "RPCTimeoutError", "RPCTimeoutError", 3]


def test_rate_draws_come_from_the_seed() -> None:
    plan = FaultPlan([Drop("request", count=None, rate=0.5)])
    first = _run(_four_calls, seed=7, faults=plan).values()[0]
    assert first == _run(_four_calls, seed=7, faults=plan).values()[0]
    outcomes = {tuple(_run(_four_calls, seed=s, faults=plan).values()[0]) for s in range(8)}
    assert len(outcomes) > 1  # different seeds drop different calls


def test_a_positional_action_with_a_kind_touches_only_that_kind() -> None:
    # The first messages of the run are the calls' requests: a filtered action leaves them alone.
    plan = FaultPlan(actions=(Drop("rref-control"),) * 50)
    assert _run(_four_calls, faults=plan).values()[0] == [0, 1, 2, 3]
    plan = FaultPlan(actions=(Drop(),))  # unfiltered: the first message sent, a CALL, is lost
    assert _run(_four_calls, faults=plan).values()[0] == ["RPCTimeoutError", 1, 2, 3]


def _late_reply(rank: int, sim: Simulation) -> Any:
    """Rank 0's call times out while its reply is held; the reply then arrives late."""
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2)
    out: Any = None
    if rank == 0:
        sim.hold(1, 0)
        try:
            out = rpc.rpc_sync("worker1", operator.add, args=(1, 2), timeout=0.5)
        except RuntimeError as exc:
            out = type(exc).__name__
        sim.release(1, 0)
        sleep(0.01)  # the late reply arrives now, after its call timed out
        out = (out, rpc.rpc_sync("worker1", operator.add, args=(3, 4)))
    rpc.shutdown()
    return out


def test_a_reply_that_arrives_after_its_timeout_is_dropped_by_the_caller() -> None:
    sim = Simulation(2, seed=5)
    assert sim.run(_late_reply, sim).values()[0] == ("RPCTimeoutError", 7)  # ERR-4: no error, no effect
    assert any(e.event == "deliver" and e.detail.startswith("RESPONSE#0") and e.time > 0.5 for e in sim.trace)
    assert sim.monitor is not None and sim.monitor.stopped is None  # late delivery keeps the monitors on


def test_apply_puts_any_fault_in_force_and_every_fault_is_a_trace_event() -> None:
    sim = Simulation(2, seed=1)
    sim.apply(Delay(0.25, "request"))
    sim.apply(Pause(1, 0.1))
    result = sim.run(_one_call)
    first, elapsed, _ = result.values()[0]
    assert first == 3 and elapsed == pytest.approx(0.25, abs=1e-3)
    faults = _faults(result)
    assert faults[0].startswith("pause worker 1") and faults[1] == "resume worker 1"
    assert faults[2].startswith("delay CALL#0 0->1 (42 B) by 0.25s: delay the 1st request by 0.25s")
    crashed = Simulation(2, seed=1, faults=FaultPlan([Crash(1, at=0.0005)])).run(_one_call, check=False)
    assert "crash worker 1" in _faults(crashed)


# -- links ---------------------------------------------------------------------------------------------
def test_hold_and_release_deliver_the_held_request_late() -> None:
    sim = Simulation(2, seed=2)
    value, elapsed, pending, released = sim.run(_verb_program, sim, "hold").values()[0]
    assert (value, pending, released) == (3, True, 1)
    assert elapsed == pytest.approx(2.0, abs=1e-3)  # released at 2 s, then one ordinary round trip
    faults = [e.detail for e in sim.trace if e.event == "fault"]
    assert any(d.startswith("hold CALL#") for d in faults)
    assert any("released; 1 held message(s) released" in d for d in faults)


def test_a_two_way_partition_that_heals_delivers_late() -> None:
    sim = Simulation(3, seed=3)
    value, elapsed, pending, healed = sim.run(_verb_program, sim, "partition").values()[0]
    # the call, and workers 1 and 2's first shutdown messages (sent once their links to 0 were made)
    assert (value, pending, healed) == (3, True, 3)
    assert elapsed == pytest.approx(2.0, abs=1e-3)


def test_a_one_way_partition_cuts_only_its_direction() -> None:
    # 1 -> 0 is cut: the request gets through and is served, its reply waits for the heal.
    sim = Simulation(2, seed=3)
    value, elapsed, pending, healed = sim.run(_verb_program, sim, "oneway").values()[0]
    assert (value, pending, healed) == (3, True, 2)  # the reply, and worker 1's first shutdown message
    assert elapsed == pytest.approx(2.0, abs=1e-3)
    assert any(e.event == "deliver" and "CALL#" in e.detail and e.time < 0.01 for e in sim.trace)


def test_a_dropping_partition_loses_what_it_cuts() -> None:
    # One way, 0 -> 1: the request is lost; worker 1's shutdown message to 0 gets through.
    plan = FaultPlan([Partition(0, 1, start=0.0, end=1.5, oneway=True, mode="drop")])
    result = _run(_one_call, faults=plan)
    (kind, _), _, later = result.values()[0]
    assert kind == "RPCTimeoutError" and later == 7


def test_a_partition_longer_than_the_heartbeat_timeout_declares_both_sides_dead() -> None:
    # As the gloo world's heartbeats (heartbeat_interval x heartbeat_misses): each side hears nothing
    # from the other and declares it dead after heartbeat_timeout; calls fail naming the peer.
    network = NetworkModel(heartbeat_timeout=5.0)
    plan = FaultPlan([Partition(0, 1, start=0.005, end=60.0)])
    result = _run(_wait_for_a_dead_peer, network=network, faults=plan)
    (t0, kind0, msg0), (t1, kind1, msg1) = result.values()
    assert kind0 == kind1 == "WorkerUnavailableError"
    assert t0 == pytest.approx(5.005) and "'worker1' (rank 1) is unavailable" in msg0
    assert "no frame or heartbeat from it for more than 5 s" in msg0
    assert t1 == pytest.approx(25.0, abs=0.01) and "'worker0' (rank 0) is unavailable" in msg1
    assert sum("declares worker" in d for d in _faults(result)) == 2


def test_a_partition_shorter_than_the_heartbeat_timeout_declares_nobody_dead() -> None:
    plan = FaultPlan([Partition(0, 1, start=0.005, end=4.0)])
    result = _run(_wait_for_a_dead_peer, network=NetworkModel(heartbeat_timeout=5.0), faults=plan)
    assert result.values() == [3, 3]


# -- workers -------------------------------------------------------------------------------------------
def test_a_paused_worker_replies_after_the_pause() -> None:
    assert _run(_call_a_paused_worker, None).values()[0][1] < 0.001
    sim = Simulation(2, seed=2)
    value, elapsed = sim.run(_call_a_paused_worker, sim).values()[0]
    assert value == 3 and elapsed == pytest.approx(3.0, abs=1e-3)
    faults = [e.detail for e in sim.trace if e.event == "fault"]
    assert faults[0].startswith("pause worker 1") and faults[-1] == "resume worker 1"


def test_a_worker_paused_while_init_rpc_completes_takes_calls_once_it_resumes() -> None:
    # Worker 1 is paused before the group completes (t=1 ms) until t=2.04 ms: worker 0's init_rpc
    # returns at 1 ms and its call must wait for worker 1, not fail with "it has not initialised
    # RPC" (PyTorch's init_rpc returns on no worker before every agent is up; gloo's call waits too).
    # Whether the held call or the resumed init_rpc runs first at t=2.04 ms is the seed's choice.
    plan = FaultPlan([Pause(1, 0.002, at=4e-05)])
    for seed in range(8):
        value, elapsed = _run(_call_a_paused_worker, None, seed=seed, faults=plan).values()[0]
        assert value == 3 and 0.00104 < elapsed < 0.0012, seed


def test_a_worker_that_pauses_itself_returns_after_the_pause() -> None:
    sim = Simulation(2, seed=2)
    assert sim.run(_pause_myself, sim).values()[1] == pytest.approx(2.0)


def test_a_pause_longer_than_the_heartbeat_timeout_gets_the_worker_declared_dead() -> None:
    # SIGSTOP on gloo: its peers hear no heartbeat and declare it dead; resumed, it hears nothing
    # from them either (a failed link sends no heartbeats) and declares them dead a timeout later.
    network = NetworkModel(heartbeat_timeout=4.0)
    result = _run(_wait_for_a_dead_peer, network=network, faults=FaultPlan([Pause(1, 20.0, at=0.005)]))
    (t0, kind0, msg0), (t1, kind1, msg1) = result.values()
    assert kind0 == kind1 == "WorkerUnavailableError"
    assert t0 == pytest.approx(4.005) and "'worker1' (rank 1)" in msg0
    assert t1 == pytest.approx(25.0, abs=0.01) and "'worker0' (rank 0)" in msg1


def test_a_crash_on_the_nth_gradient_kills_the_worker_mid_backward_and_the_root_names_it() -> None:
    assert _run(_backward_across_workers, world=3).values()[0] == [3.0, 3.0, 3.0]
    plan = FaultPlan([Crash(1, on_receive="GRADIENT", nth=1)])
    result = _run(_backward_across_workers, world=3, faults=plan)
    assert result.crashed == (1,)
    _, kind, message = result.values()[0]
    assert kind == "WorkerUnavailableError" and "'worker1' (rank 1) is unavailable" in message
    assert any("crash worker 1 when message #1 of kind GRADIENT arrives" in d for d in _faults(result))


def test_a_dropped_gradient_makes_backward_time_out() -> None:
    result = _run(_backward_across_workers, world=3, faults=FaultPlan([Drop("gradient", dst=2)]))
    when, kind, message = result.values()[0]
    assert kind == "RPCTimeoutError" and "GRADIENT to 'worker2'" in message
    assert when == pytest.approx(60.0, abs=0.01)  # the default rpc_timeout


_PARAMS: dict[int, torch.Tensor] = {}


def _param() -> torch.Tensor:
    return _PARAMS.setdefault(rpc.get_worker_info().id, torch.tensor([1.0, 2.0], requires_grad=True))


def _forward_on_the_server(x: torch.Tensor) -> torch.Tensor:
    return (x * _param()).sum()


def _server_gradients(context_id: int) -> list[float]:
    return dist_autograd.get_gradients(context_id)[_param()].tolist()


def _train_step_against_a_server(rank: int) -> Any:
    """Parameter-server shape: the leaf lives on worker 1; worker 0 runs forward and backward."""
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2)
    out: Any = None
    if rank == 0:
        with dist_autograd.context() as ctx:
            loss = rpc.rpc_sync(
                "worker1", _forward_on_the_server, args=(torch.ones(2, requires_grad=True) * 3,)
            )
            try:
                dist_autograd.backward(ctx, [loss])
                sleep(0.01)  # a late duplicate arrives in this window
                out = rpc.rpc_sync("worker1", _server_gradients, args=(ctx,))
            except RuntimeError as exc:
                out = str(exc)
    rpc.shutdown()
    return out


def test_a_late_duplicated_gradient_is_not_applied_twice() -> None:
    _PARAMS.clear()
    assert Simulation(2, seed=3).run(_train_step_against_a_server).values()[0] == [3.0, 3.0]
    _PARAMS.clear()
    plan = FaultPlan([Duplicate(1e-3, "gradient", dst=1)])  # arrives after the server's pass ended
    assert Simulation(2, seed=3, faults=plan).run(_train_step_against_a_server).values()[0] == [3.0, 3.0]


def test_a_gradient_copy_arriving_while_the_server_is_busy_waits_for_the_original() -> None:
    # The copy reaches the server while its pass still runs the original. Answering the copy at once
    # would complete the root's gradient RPC before the work it stands for (the root would conclude
    # early that a send function received no gradient): the copy is answered with the original.
    _PARAMS.clear()
    plan = FaultPlan([Duplicate(0.0, "gradient", dst=1)])
    result = Simulation(2, seed=3, faults=plan).run(_train_step_against_a_server)
    assert result.values()[0] == [3.0, 3.0]
    assert any(d.startswith("duplicate GRADIENT#") for d in _faults(result))


def test_a_crash_on_send_loses_the_message_with_the_sender() -> None:
    result = _run(_one_call, faults=FaultPlan([Crash(1, on_send="response")]))
    assert result.crashed == (1,)
    error = result.outcomes[0].error  # rank 0's second call: the peer is known dead by then
    assert error is not None and "'worker1' (rank 1) is unavailable" in str(error)
    assert not any(e.event == "deliver" and "RESPONSE#" in e.detail for e in result.trace)


def test_crash_verb_with_a_trigger_counts_from_the_call() -> None:
    def program(rank: int, sim: Simulation) -> Any:
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2)
        if rank == 0:
            rpc.rpc_sync("worker1", operator.add, args=(1, 1))
            sim.crash(1, on_receive="request", nth=2)  # the 3rd request of the run
            rpc.rpc_sync("worker1", operator.add, args=(1, 1))
            try:
                rpc.rpc_sync("worker1", operator.add, args=(1, 1), timeout=0)
            except RuntimeError as exc:
                rpc.shutdown(graceful=False)
                return type(exc).__name__
        sleep(10.0)
        rpc.shutdown(graceful=False)
        return None

    sim = Simulation(2, seed=4)
    result = sim.run(program, sim)
    assert result.crashed == (1,) and result.values()[0] == "WorkerUnavailableError"


# -- monitors --------------------------------------------------------------------------------------------
def test_rref_monitors_stop_at_a_lost_request_but_not_at_delays_or_control_drops() -> None:
    sim = Simulation(2, seed=1, faults=FaultPlan([Delay(0.1, "request"), Duplicate(0.0, "response")]))
    sim.run(_one_call)
    assert sim.monitor is not None and sim.monitor.stopped is None
    sim = Simulation(2, seed=1, faults=FaultPlan([Drop("request")]))
    sim.run(_one_call)
    assert sim.monitor is not None and sim.monitor.stopped is not None
    assert "was lost for good" in sim.monitor.stopped
    assert any(e.event == "monitors-off" for e in sim.trace)


# -- verbs: bad arguments --------------------------------------------------------------------------------
def test_fault_verbs_reject_bad_arguments_naming_them() -> None:
    sim = Simulation(2)
    with pytest.raises(FaultPlanError, match="kind='reply' is not a message kind"):
        sim.drop("reply")
    with pytest.raises(FaultPlanError, match="no worker 5"):
        sim.hold(0, 5)
    with pytest.raises(ValueError, match="no such worker"):
        sim.pause(3, 1.0)
    with pytest.raises(FaultPlanError, match="duration must be"):
        sim.pause(1, 0.0)
    with pytest.raises(FaultPlanError, match="on both sides"):
        sim.partition((0, 1), 1)
    with pytest.raises(FaultPlanError, match="mode must be one of hold, drop"):
        sim.partition(0, mode="lose")
    with pytest.raises(FaultPlanError, match="rate must be a probability"):
        sim.duplicate("request", rate=2.0)

    def late(rank: int) -> None:
        sleep(1.0)
        if rank == 0:
            with pytest.raises(FaultPlanError, match="virtual time is already 1s"):
                sim2.apply(Pause(1, 1.0, at=0.5))
            with pytest.raises(FaultPlanError, match="virtual time is already 1s"):
                sim2.apply(Hold(0, 1, 0.0, 0.5))
            with pytest.raises(ValueError, match="virtual time is already"):
                sim2.crash(1, at=0.5)

    sim2 = Simulation(2)
    sim2.run(late).values()


# -- plain data --------------------------------------------------------------------------------------------
EVERY_FAULT = FaultPlan(
    [
        Delay(0.5, "gradient", src=0, dst=1, nth=2, count=3, rate=0.25),
        Drop("response", src=1, dst=0, nth=3),
        Duplicate(1e-3, "rref-control", count=None),
        Hold(0, 1, 0.5),
        Hold(2, 1, 0.0, 1.25),
        Partition((0,), (1, 2), start=1.0, end=3.0, oneway=True, mode="drop"),
        Partition(2),
        Crash(2, on_receive="RREF_USER_DELETE", nth=2),
        Crash(1, on_send="CALL"),
        Crash(0, at=4.0),
        Pause(1, 2.0, at=0.5),
    ],
    actions=(Deliver(), Drop("rref-control"), Delay(1e-5), Duplicate(0.0, src=1)),
    gc_delay=1e-3,
)


@pytest.mark.parametrize("suffix", [".json", ".toml"])
def test_fault_plans_round_trip_exactly_through_json_and_toml(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"plan{suffix}"
    EVERY_FAULT.dump(path)
    assert FaultPlan.load(path) == EVERY_FAULT
    assert load_faults(path) == EVERY_FAULT
    assert FaultPlan.from_dict(EVERY_FAULT.to_dict()) == EVERY_FAULT
    assert FaultPlan.from_dict(json.loads(EVERY_FAULT.to_json())) == EVERY_FAULT
    assert FaultPlan.from_dict(tomllib.loads(EVERY_FAULT.to_toml())) == EVERY_FAULT
    assert (
        FaultPlan.load(_write(tmp_path / f"empty{suffix}", "{}" if suffix == ".json" else "")) == FaultPlan()
    )


def test_a_hand_written_toml_plan_reads_as_its_python_twin(tmp_path: Path) -> None:
    text = """
gc_delay = 0.001
[[faults]]
type = "drop"
kind = "response"
src = 1
dst = 0
nth = 3
[[faults]]
type = "partition"
a = 2
start = 1
end = 2
[[faults]]
type = "delay"
extra = 0.5
kind = "gradient"
count = "all"
"""
    plan = FaultPlan.load(_write(tmp_path / "plan.toml", text))
    assert plan == FaultPlan(
        [
            Drop("response", src=1, dst=0, nth=3),
            Partition(2, None, 1.0, 2.0),
            Delay(0.5, "gradient", count=None),
        ],
        gc_delay=1e-3,
    )


def _write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ('{"faults": [{"type": "drop", "knd": "response"}]}', "faults[0] (drop): unknown field 'knd'"),
        ('{"faults": [{"type": "drop", "nth": "3"}]}', "faults[0] (drop).nth: expected an integer"),
        ('{"faults": [{"type": "drop", "nth": 0}]}', "faults[0] (drop): Drop("),
        ('{"faults": [{"type": "drop", "kind": "reply"}]}', "kind='reply' is not a message kind"),
        ('{"faults": [{"type": "explode"}]}', "faults[0].type: 'explode' is not one of delay, drop"),
        ('{"faults": [{"type": "hold", "src": 0}]}', "faults[0] (hold): missing field(s) dst"),
        ('{"faults": [{"type": "pause", "worker": 1, "duration": -1}]}', "duration must be a finite number"),
        ('{"actions": [{"type": "drop", "nth": 2}]}', "actions[0]"),
        ('{"actions": [{"type": "pause", "worker": 1, "duration": 1}]}', "actions[0].type: 'pause'"),
        ('{"gc_delay": "soon"}', "gc_delay: expected a number"),
        ('{"fault": []}', "unknown field 'fault'"),
        ('{"faults": {"type": "drop"}}', "faults: expected a list"),
        ('{"swarm": {}}', "this describes a Swarm"),
        ("[1, 2]", "expected a table/object"),
        ("{not json", "not valid JSON"),
    ],
)
def test_bad_plan_files_get_errors_naming_the_field(tmp_path: Path, text: str, fragment: str) -> None:
    path = _write(tmp_path / "plan.json", text)
    with pytest.raises(FaultPlanError) as info:
        FaultPlan.load(path)
    assert fragment in str(info.value) and str(path) in str(info.value)


def test_bad_plan_files_in_toml_and_unknown_file_types(tmp_path: Path) -> None:
    with pytest.raises(FaultPlanError, match="not valid TOML"):
        FaultPlan.load(_write(tmp_path / "plan.toml", "faults = [\n"))
    with pytest.raises(FaultPlanError, match=r"unknown file type '\.yaml'; use \.json or \.toml"):
        FaultPlan.load(_write(tmp_path / "plan.yaml", "{}"))
    with pytest.raises(FaultPlanError, match="unknown file type"):
        FaultPlan().dump(tmp_path / "plan.txt")


@pytest.mark.parametrize("suffix", [".json", ".toml"])
def test_network_models_round_trip_and_reject_bad_fields(tmp_path: Path, suffix: str) -> None:
    model = NetworkModel(latency=1e-3, jitter=0.0, bandwidth=1e8, heartbeat_timeout=2.5)
    path = tmp_path / f"net{suffix}"
    model.dump(path)
    assert NetworkModel.load(path) == model
    assert NetworkModel.from_dict({"latency": 0.002}) == NetworkModel(latency=0.002)
    with pytest.raises(FaultPlanError, match="unknown field 'latncy'"):
        NetworkModel.from_dict({"latncy": 0.002})
    with pytest.raises(FaultPlanError, match=r"NetworkModel\.jitter must be a number >= 0"):
        NetworkModel(jitter=-1.0)
    with pytest.raises(FaultPlanError, match="bandwidth must be > 0"):
        NetworkModel.from_dict({"bandwidth": 0})


# -- swarm -----------------------------------------------------------------------------------------------
def test_a_swarm_plan_is_drawn_from_the_seed_alone() -> None:
    swarm = Swarm(kinds=("delay", "duplicate", "hold", "partition", "pause", "drop", "crash"), duration=2.0)
    plans = [swarm.plan(seed, 4) for seed in range(40)]
    assert plans == [swarm.plan(seed, 4) for seed in range(40)]  # same seed, same plan
    assert len(set(plans)) > 30  # the parameters themselves vary with the seed
    kinds_seen = {type(f).__name__ for p in plans for f in p.faults}
    assert kinds_seen == {"Delay", "Duplicate", "Hold", "Partition", "Pause", "Drop", "Crash"}
    for p in plans:
        p.check_world(4)
        assert all(f.start + 0 <= 2.0 for f in p.faults if isinstance(f, (Hold, Partition)))


def test_a_swarm_keeps_losses_to_retried_control_messages_by_default() -> None:
    for seed in range(30):
        for f in Swarm().plan(seed, 3).faults:
            assert not isinstance(f, Crash)
            if isinstance(f, (Drop, Duplicate)):
                assert f.kind == "rref-control"


def test_a_simulation_resolves_a_swarm_with_its_own_seed_and_replays_it() -> None:
    swarm = Swarm(duration=0.01)
    first = Simulation(2, seed=11, faults=swarm)
    assert first.plan == swarm.plan(11, 2)
    digest = first.run(_one_call).digest
    assert Simulation(2, seed=11, faults=swarm).run(_one_call).digest == digest


def test_swarm_files_and_bad_swarms(tmp_path: Path) -> None:
    swarm = Swarm(kinds=("delay", "crash"), duration=3.0, lossy=("request",))
    for suffix in (".json", ".toml"):
        path = tmp_path / f"swarm{suffix}"
        path.write_text(json.dumps(swarm.to_dict()) if suffix == ".json" else _swarm_toml(swarm))
        assert load_faults(path) == swarm
    with pytest.raises(FaultPlanError, match=r"Swarm\.kinds: 'flood' is not one of"):
        Swarm(kinds=("flood",))
    with pytest.raises(FaultPlanError, match="swarm: unknown field 'kind'"):
        Swarm.from_dict({"swarm": {"kind": ["delay"]}})


def _swarm_toml(swarm: Swarm) -> str:
    from twinrpc.simulator._model._codec import to_toml

    return to_toml(swarm.to_dict())


# -- one reader per file format ------------------------------------------------------------------------
def test_every_fault_file_loader_is_the_one_reader_of_the_format(tmp_path: Path) -> None:
    from twinrpc.simulator._launch import _launch
    from twinrpc.simulator._model import _files

    assert load_faults is _files.load_faults
    path = _write(tmp_path / "plan.toml", EVERY_FAULT.to_toml())
    assert FaultPlan.load(path) == load_faults(path) == _launch.load_faults(str(path)) == EVERY_FAULT
    net = tmp_path / "net.toml"
    NetworkModel(latency=2e-3, heartbeat_timeout=1.0).dump(net)
    assert NetworkModel.load(net) == _launch.load_network(str(net))
    # the launcher's readers only say which flag the bad file came from
    bad = _write(tmp_path / "compute.toml", "op_cost = 'fast'\n")
    with pytest.raises(LaunchError, match=r"^--compute: .*compute\.toml\.op_cost: expected a number"):
        _launch.load_compute(str(bad))


def test_a_flag_takes_a_plan_or_a_model_as_json_text_or_as_a_json_or_toml_file(tmp_path: Path) -> None:
    from twinrpc.simulator._model._files import compute_from_text, network_from_text, plan_from_text

    plan = FaultPlan([Drop("response", src=1, dst=0, nth=3)], gc_delay=0.01)
    toml_plan = _write(tmp_path / "plan.toml", plan.to_toml())
    assert plan_from_text(plan.to_json(), "--faults") == plan_from_text(str(toml_plan), "--faults") == plan
    model = NetworkModel(latency=1e-3, jitter=0.0)
    toml_model = tmp_path / "net.toml"
    model.dump(toml_model)
    assert network_from_text(json.dumps(model.to_dict())) == network_from_text(str(toml_model)) == model
    assert compute_from_text('{"op_cost": 1e-6}') == ComputeModel(op_cost=1e-6)
    with pytest.raises(
        FaultPlanError, match=r"^--sim-network 'nowhere\.json': neither a JSON object nor a file"
    ):
        network_from_text("nowhere.json", "--sim-network")
    with pytest.raises(FaultPlanError, match=r"^--faults: not valid JSON"):
        plan_from_text("{faults", "--faults")
    with pytest.raises(FaultPlanError, match=r"^--network: unknown field 'latncy'"):
        network_from_text('{"latncy": 1}', "--network")


# -- one spelling per concept ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("keyword", "fault"), [("holds", Hold(0, 1, 0.0, 1.0)), ("crashes", Crash(1, at=0.5))]
)
def test_a_fault_plan_takes_every_fault_in_faults_and_names_it_for_another_keyword(
    keyword: str, fault: Any
) -> None:
    with pytest.raises(
        FaultPlanError,
        match=rf"FaultPlan\(\) takes no {keyword}=: put the {type(fault).__name__} faults in faults",
    ):
        FaultPlan(**{keyword: (fault,)})
    with pytest.raises(
        FaultPlanError, match=r"FaultPlan\(\) got fualts=; it takes faults, actions and gc_delay"
    ):
        FaultPlan(fualts=[fault])
    plan = FaultPlan([fault])
    assert plan.faults == (fault,) and FaultPlan.from_dict(plan.to_dict()) == plan


def test_a_plan_file_writes_each_fault_as_a_table_with_its_type() -> None:
    assert FaultPlan.from_dict({"actions": [{"type": "deliver"}]}) == FaultPlan(actions=[Deliver()])
    with pytest.raises(
        FaultPlanError,
        match=r"actions\[0\]: expected a table/object with a 'type', e\.g\. \{type = \"deliver\"\}",
    ):
        FaultPlan.from_dict({"actions": ["deliver"]})
    with pytest.raises(
        FaultPlanError, match="unknown field 'holds'; a fault plan has gc_delay, actions and faults"
    ):
        FaultPlan.from_dict({"holds": [{"type": "hold", "src": 0, "dst": 1, "start": 0.0, "end": 1.0}]})

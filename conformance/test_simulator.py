"""The simulator's own promises (SIM-*): determinism, seeds, virtual time, deadlock reports.

These tests are simulator-only (``backends("sim")``): they inspect traces, digests and virtual time,
which only the simulated world has.
"""

from __future__ import annotations

import time
from typing import Any
from unittest import mock

import pytest
import torch
from twinrpc.simulator import NetworkModel, Simulation, SimulationDeadlock, sleep

import twinrpc.rpc as rpc
from twinrpc.futures import Future

pytestmark = pytest.mark.backends("sim")


def _double(x: int) -> int:
    return 2 * x


def _record(log: list[tuple[int, int]], sender: int, i: int) -> None:
    log.append((sender, i))


_ARRIVALS: list[tuple[int, int]] = []


def _arrive(sender: int, i: int) -> None:
    _ARRIVALS.append((sender, i))


def _racing_senders(rank: int) -> Any:
    """worker1 and worker2 each fire 5 rpc_asyncs at worker0; worker0 records the arrival order."""
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=3)
    if rank > 0:
        futs = [rpc.rpc_async("worker0", _arrive, args=(rank, i)) for i in range(5)]
        for f in futs:
            f.wait()
    rpc.shutdown()
    return None


def _arrival_order(seed: int) -> tuple[str, tuple[tuple[int, int], ...]]:
    _ARRIVALS.clear()
    result = Simulation(world_size=3, seed=seed).run(_racing_senders)
    result.values()
    return result.digest, tuple(_ARRIVALS)


@pytest.mark.spec("SIM-1")
def test_same_seed_and_program_give_identical_trace_digest() -> None:
    """Simulator-only: it inspects trace digests, which only the simulated world has."""
    first = _arrival_order(seed=42)
    second = _arrival_order(seed=42)
    assert first == second
    assert len(first[1]) == 10


@pytest.mark.spec("SIM-2")
def test_another_seed_changes_the_interleaving() -> None:
    """Simulator-only: it inspects seeds and trace digests, which only the simulated world has."""
    orders = {_arrival_order(seed)[1] for seed in range(8)}
    digests = {_arrival_order(seed)[0] for seed in range(8)}
    assert len(digests) == 8
    assert len(orders) > 1, "eight seeds all delivered the racing requests in the same order"


def _timeout_program(rank: int) -> Any:
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2)
    out = None
    if rank == 0:
        try:
            rpc.rpc_sync("worker1", sleep, args=(3600.0,), timeout=1800.0)
        except RuntimeError as exc:
            out = str(exc)
    rpc.shutdown()
    return out


@pytest.mark.spec("SIM-3", "ERR-4")
def test_timeouts_fire_in_virtual_time_and_take_no_wall_time() -> None:
    """Simulator-only: it inspects virtual time, which only the simulated world has."""
    slept: list[float] = []
    real_sleep = time.sleep

    def record_sleep(seconds: float) -> None:
        slept.append(seconds)
        real_sleep(seconds)

    with mock.patch("time.sleep", record_sleep):
        result = Simulation(world_size=2, seed=0).run(_timeout_program)
    message = result.values()[0]
    assert "RPC ran for more than set timeout (1800000 ms)" in message
    assert "simulated time" in message
    # Shutdown waits for the hour-long handler: an hour of virtual time, and not one wall-clock sleep
    # (a bound on the run's wall time would be a timed assertion, which fails on a loaded host).
    assert result.virtual_time >= 3600.0
    assert sum(slept) == 0.0, f"the simulation slept {sum(slept)} s of wall-clock time"


def _sleeper(rank: int) -> float:
    from twinrpc.simulator import now

    start = now()
    sleep(2.5 * (rank + 1))
    return now() - start


@pytest.mark.spec("SIM-3")
def test_sleep_advances_virtual_time_exactly() -> None:
    """Simulator-only: it inspects virtual time, which only the simulated world has."""
    result = Simulation(world_size=2, seed=3).run(_sleeper)
    assert result.values() == [2.5, 5.0]
    assert result.virtual_time == 5.0


_NEVER: dict[int, Future[None]] = {}


def _waits_forever(rank: int) -> None:
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2)
    if rank == 0:
        fut: Future[None] = Future()
        _NEVER[rank] = fut
        fut.wait()  # nobody completes it
    rpc.shutdown()


@pytest.mark.spec("SIM-4")
def test_deadlock_is_reported_with_each_blocked_tasks_stack() -> None:
    """Simulator-only: it inspects the scheduler's deadlock report, which only the simulated world has."""
    with pytest.raises(SimulationDeadlock) as info:
        Simulation(world_size=2, seed=0).run(_waits_forever)
    report = str(info.value)
    assert "every task is blocked and no event is pending" in report
    assert "main[0]" in report and "main[1]" in report
    assert "_waits_forever" in report  # worker0's stack shows where it waits
    assert "fut.wait()" in report
    assert "all_gather" in report  # worker1 waits in shutdown for worker0
    assert "the shutdown leader worker0 to answer _all_gather" in report  # ...and says what it waits for


def _ping(depth: int) -> int:
    """A chain A->B->A->B... of nested rpc_sync; each hop holds a request-pool thread while it waits."""
    if depth == 0:
        return 0
    me = rpc.get_worker_info().id
    return 1 + rpc.rpc_sync(f"worker{1 - me}", _ping, args=(depth - 1,))


def _nested_chain(rank: int, threads: int, depth: int) -> Any:
    rpc.init_rpc(
        f"worker{rank}",
        rank=rank,
        world_size=2,
        rpc_backend_options=rpc.RpcBackendOptions(rpc_timeout=0, num_worker_threads=threads),
    )
    out = rpc.rpc_sync("worker1", _ping, args=(depth,)) if rank == 0 else None
    rpc.shutdown()
    return out


@pytest.mark.spec("SIM-4", "RPC-7")
def test_nested_rpcs_that_exhaust_the_request_pool_are_reported_as_a_deadlock() -> None:
    """Simulator-only: it inspects the scheduler's deadlock report (a real run would hang), which only the simulated world has."""
    # Depth 3 holds two pool threads on each worker: it fits in two, not in one (PyTorch #26362).
    assert Simulation(world_size=2, seed=0).run(_nested_chain, 2, 3).values()[0] == 3
    with pytest.raises(SimulationDeadlock, match="_ping") as info:
        Simulation(world_size=2, seed=0).run(_nested_chain, 1, 3)
    assert "waiting on <twinrpc Future pending: reply to CALL#" in str(info.value)


def _bulk(rank: int) -> float:
    from twinrpc.simulator import now

    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2)
    elapsed = 0.0
    if rank == 0:
        rpc.rpc_sync("worker1", abs, args=(1,))  # makes the link (links are made on first use)
        start = now()
        rpc.rpc_sync("worker1", torch.clone, args=(torch.zeros(1_000_000, dtype=torch.uint8),))
        elapsed = now() - start
    rpc.shutdown()
    return elapsed


@pytest.mark.spec("SIM-3")
def test_bandwidth_charges_time_by_message_size() -> None:
    """Simulator-only: it inspects the network model's virtual time, which only the simulated world has."""
    net = NetworkModel(latency=1e-3, jitter=0.0, bandwidth=1e8)
    elapsed = Simulation(world_size=2, seed=0, network=net).run(_bulk).values()[0]
    # Request and reply each carry 1 MB at 100 MB/s plus 1 ms latency.
    assert elapsed == pytest.approx(2 * (1e-3 + 1e6 / 1e8), rel=0.01)


def _fails_on_one(rank: int) -> int:
    if rank == 1:
        raise KeyError("worker 1 failed")
    return rank


@pytest.mark.spec("SIM-1")
def test_run_returns_each_workers_value_or_error() -> None:
    """Simulator-only: it inspects Simulation.run's per-worker outcomes, which only the simulated world has."""
    with pytest.raises(KeyError, match="worker 1 failed"):  # run raises a worker's error by default
        Simulation(world_size=3, seed=0).run(_fails_on_one)
    result = Simulation(world_size=3, seed=0).run(_fails_on_one, check=False)
    assert [o.value for o in result.outcomes] == [0, None, 2]
    assert isinstance(result.outcomes[1].error, KeyError)
    with pytest.raises(KeyError, match="worker 1 failed"):
        result.values()


# -- SIM-5: torch.distributed process groups inside a simulation --------------------------------------
def _collectives(rank: int) -> Any:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:1", rank=rank, world_size=3)
    summed = torch.tensor([float(rank + 1)])
    dist.all_reduce(summed)
    biggest = torch.tensor([float(rank)])
    dist.all_reduce(biggest, op=dist.ReduceOp.MAX)
    sent = torch.tensor([float(rank * 10)])
    dist.broadcast(sent, src=2)
    gathered = [torch.zeros(1) for _ in range(3)]
    dist.all_gather(gathered, torch.tensor([float(rank)]))
    dist.barrier()
    seen = (dist.get_backend(), dist.get_world_size(), dist.get_rank())
    dist.destroy_process_group()
    return (
        summed.item(),
        biggest.item(),
        sent.item(),
        [g.item() for g in gathered],
        seen,
        dist.is_initialized(),
    )


@pytest.mark.spec("SIM-5")
def test_each_simulated_worker_has_its_own_process_group_with_a_real_groups_values(world: Any) -> None:
    """Process groups are served by the simulation itself (no rendezvous at the init_method)."""
    values = Simulation(3).run(_collectives).values()
    for rank, got in enumerate(values):
        assert got == (6.0, 2.0, 20.0, [0.0, 1.0, 2.0], ("gloo", 3, rank), False)
    import torch.distributed as dist

    assert not dist.is_initialized()  # the process's own c10d state is untouched by the run


def _subgroups(rank: int) -> Any:
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=4)
    odd = dist.new_group([3, 1])
    first, second = dist.new_group([0, 1, 2]), dist.new_group([0, 1, 2])
    seen: list[Any] = []
    for group in (odd, first, second):
        if group is dist.GroupMember.NON_GROUP_MEMBER:
            seen.append(None)
            continue
        summed = torch.tensor([float(10**rank)])
        dist.all_reduce(summed, group=group)
        seen.append((summed.item(), dist.get_rank(group), dist.get_world_size(group)))
    dist.destroy_process_group()
    return seen


@pytest.mark.spec("SIM-5")
def test_new_group_makes_a_simulated_subgroup_of_its_members(world: Any) -> None:
    """dist.new_group is served by the simulation: members meet in their subgroup, others get
    GroupMember.NON_GROUP_MEMBER, and each call of every member makes a group of its own."""
    values = Simulation(4).run(_subgroups).values()
    assert values[0] == [None, (111.0, 0, 3), (111.0, 0, 3)]
    assert values[1] == [(1010.0, 0, 2), (111.0, 1, 3), (111.0, 1, 3)]
    assert values[2] == [None, (111.0, 2, 3), (111.0, 2, 3)]
    assert values[3] == [(1010.0, 1, 2), None, None]


def _mismatched(rank: int) -> str:
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        if rank == 0:
            dist.all_reduce(torch.ones(1))
        else:
            dist.broadcast(torch.ones(1), src=0)
    except RuntimeError as exc:
        return str(exc)
    finally:
        dist.destroy_process_group()
    return "no error"


@pytest.mark.spec("SIM-5")
def test_members_making_different_collective_calls_get_an_error_naming_both(world: Any) -> None:
    """A mismatch a real gloo group would fail or hang on is reported on every member."""
    for message in Simulation(2).run(_mismatched).values():
        assert "allreduce" in message and "broadcast from 0" in message, message

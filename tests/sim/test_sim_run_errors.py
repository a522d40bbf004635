"""``Simulation.run`` when a worker's program raises: the worker leaves like a process, and the error
is what the user sees (not a deadlock report that hides it)."""

from __future__ import annotations

import pytest
from twinrpc.simulator import Simulation, SimulationDeadlock

import twinrpc.rpc as rpc
from twinrpc.rpc import WorkerUnavailableError


def _rank0_raises_while_rank1_shuts_down(rank: int) -> None:
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2)
    if rank == 0:
        raise ValueError("bad input on rank 0")
    rpc.shutdown()


def test_run_raises_the_workers_own_error_with_what_its_peers_saw_as_notes() -> None:
    with pytest.raises(ValueError, match="bad input on rank 0") as raised:
        Simulation(world_size=2, seed=7).run(_rank0_raises_while_rank1_shuts_down)
    (note,) = raised.value.__notes__
    assert note.startswith(
        "then rank 1 raised WorkerUnavailableError: worker 'worker0' (rank 0) is unavailable"
    )


def test_a_raising_worker_leaves_like_a_process_so_its_peers_shutdown_fails_instead_of_hanging() -> None:
    result = Simulation(world_size=2, seed=7).run(_rank0_raises_while_rank1_shuts_down, check=False)
    first, second = result.outcomes
    assert isinstance(first.error, ValueError) and not first.crashed
    assert isinstance(second.error, WorkerUnavailableError)
    assert result.crashed == ()  # it raised; nobody crashed it
    assert "raised ValueError without rpc.shutdown(): connections close" in result.trace.text()


def _rank0_raises_before_init(rank: int) -> None:
    if rank == 0:
        raise KeyError("no such config")
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2)
    rpc.shutdown()


def test_a_deadlock_report_names_the_workers_that_had_already_failed() -> None:
    # rank 1 waits in init_rpc for a rank 0 that will never come: a deadlock, caused by rank 0's error
    with pytest.raises(SimulationDeadlock) as raised:
        Simulation(world_size=2, seed=0).run(_rank0_raises_before_init)
    report = str(raised.value)
    assert "every task is blocked" in report
    assert (
        "workers that had already failed (their programs raised):\n  rank 0: KeyError: 'no such config'"
        in report
    )


def test_a_worker_that_shut_down_before_raising_is_not_crashed() -> None:
    def program(rank: int) -> int:
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2)
        rpc.shutdown()
        if rank == 1:
            raise RuntimeError("after shutdown")
        return rank

    result = Simulation(world_size=2, seed=0).run(program, check=False)
    assert result.outcomes[0].value == 0 and isinstance(result.outcomes[1].error, RuntimeError)
    assert "without rpc.shutdown()" not in result.trace.text()

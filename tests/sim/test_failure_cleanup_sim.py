"""What survivors stop keeping for a dead worker, on the simulator (RREF-D2, DAG-18).

The conformance suite (``conformance/test_failure_cleanup.py``) checks what a program sees on every
backend; these runs place a crash between two particular messages, which only a fault plan can do:
a fork the dead worker forwarded reaching the owner after the value was freed, and a child sent to a
worker that dies on its arrival.
"""

from __future__ import annotations

from typing import Any

from twinrpc.simulator import Crash, Delay, FaultPlan, Simulation, sleep

import twinrpc.autograd as dist_autograd
import twinrpc.rpc as rpc
from twinrpc._errors import WorkerUnavailableError


def _make() -> list[int]:
    return [1, 2, 3]


def _fetch(rref: Any) -> Any:
    try:
        return ("value", rref.to_here())
    except WorkerUnavailableError as exc:
        return ("raised", str(exc))


def _counts() -> tuple[int, int, int]:
    info = rpc._get_debug_info()
    return int(info["num_owner_rrefs"]), int(info["num_forks"]), int(info["num_pending_children"])


def _forwarded_by_the_dead_checked(rank: int) -> Any:
    """As above, but worker 1 reports what ``to_here()`` on the forwarded fork gave."""
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=3)
    result: Any = None
    if rank == 2:
        rref = rpc.remote("worker0", _make)
        rref.to_here()
        rpc.rpc_async("worker1", _keep_and_fetch_later, args=(rref,), timeout=0)
        rpc.rpc_async("worker0", _make, timeout=0)  # crashed by the plan when this call leaves
        sleep(100.0)
    elif rank == 1:
        rpc.rpc_sync("worker2", abs, args=(1,))  # the link worker 2's call comes over (made on first use)
        sleep(2.0)
        result = _fetch(_KEPT.pop())
    else:
        sleep(2.5)
    rpc.shutdown(graceful=False)
    return result


_KEPT: list[Any] = []


def _keep_and_fetch_later(rref: Any) -> None:
    _KEPT.append(rref)


def test_to_here_on_a_fork_whose_value_was_freed_raises_naming_the_dead_holder() -> None:
    plan = FaultPlan([Crash(2, on_send="CALL", nth=2), Delay(0.2, kind="RREF_FORK_REQUEST", src=1)])
    result = Simulation(3, seed=2, faults=plan).run(_forwarded_by_the_dead_checked)
    assert result.crashed == (2,)
    kind, text = result.values()[1]
    assert kind == "raised", text
    assert "was freed because every worker holding it died" in text, text
    assert "'worker2' (rank 2) is unavailable" in text, text


def test_without_the_delay_the_forwarded_fork_keeps_the_value() -> None:
    """The fork request arrives before the crash is known: the owner counts worker 1's fork and
    keeps the value for it."""
    plan = FaultPlan([Crash(2, on_send="CALL", nth=2)])
    result = Simulation(3, seed=2, faults=plan).run(_forwarded_by_the_dead_checked)
    assert result.values()[1] == ("value", [1, 2, 3])


def _child_to_a_dying_worker(rank: int) -> Any:
    """Worker 0 holds a user RRef owned by worker 1 and sends it to worker 2, which dies when the
    call arrives: the child will never be accepted, so worker 0 stops waiting for it."""
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=3)
    result: Any = None
    if rank == 0:
        rref = rpc.remote("worker1", _make)
        rref.to_here()
        fut = rpc.rpc_async("worker2", _fetch, args=(rref,), timeout=0)
        during = _counts()[2]
        try:
            fut.wait()
        except WorkerUnavailableError:
            pass
        result = (during, _counts()[2])
    else:
        sleep(1.0)
    if rank != 2:
        rpc.shutdown(graceful=False)
    return result


def test_a_user_stops_keeping_a_parent_for_a_child_sent_to_a_dead_worker() -> None:
    plan = FaultPlan([Crash(2, on_receive="CALL")])
    result = Simulation(3, seed=4, faults=plan).run(_child_to_a_dying_worker)
    assert result.crashed == (2,)
    assert result.values()[0] == (1, 0)


def _join(t: Any) -> Any:
    return t * 2


def _nested_join(t: Any) -> Any:
    return rpc.rpc_sync("worker1", _join, args=(t,))


def _contexts_after_a_death(rank: int) -> Any:
    """Worker 0's context reaches worker 1 only through worker 2, which then dies."""
    import torch

    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=3)
    result: Any = None
    if rank == 0:
        with dist_autograd.context() as context_id:
            rpc.rpc_sync("worker2", _nested_join, args=(torch.ones(1, requires_grad=True),))
            sleep(1.0)  # worker 2 crashed meanwhile
            dist_autograd._retrieve_context(context_id)  # its own open context is kept
        result = dist_autograd._get_debug_info()["num_autograd_contexts"]
    elif rank == 1:
        sleep(0.5)
        before = dist_autograd._get_debug_info()["num_autograd_contexts"]
        sleep(1.0)
        result = (before, dist_autograd._get_debug_info()["num_autograd_contexts"])
    else:
        sleep(100.0)
    rpc.shutdown(graceful=False)
    return result


def test_a_context_known_only_through_a_dead_worker_is_released_and_the_trace_says_why() -> None:
    plan = FaultPlan([Crash(2, at=0.6)])
    result = Simulation(3, seed=1, faults=plan).run(_contexts_after_a_death)
    assert result.values()[0] == "0"
    assert result.values()[1] == ("1", "0")
    released = [
        str(e.detail) for e in result.trace if e.event == "autograd-context-released" and e.worker == 1
    ]
    assert len(released) == 1 and "rank 2 died" in released[0], released

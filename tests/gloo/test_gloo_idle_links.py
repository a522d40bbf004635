"""An idle same-host link holds no thread of its own: once it has had no message for
``_receiver.LINGER``, its receiver hands the link's doorbell to the process's one watcher thread
(impl/_door_watch.py) and leaves; the peer's next frame, the end of its process, or shutdown wakes it.

A world of five ``spawn`` processes: worker 0 calls every peer, and every peer calls worker 0. After
the idle bound worker 0 holds no receiving thread for any of its four links, and its process no more
threads than it had after ``init_rpc`` besides gloo's event loop and the watcher (with the same-host
path off, ``TWINRPC_SHM=0``, or its doorbell off, each link keeps its one receiver instead). Links
beyond the process's budget of ring bytes, whose data goes over gloo, park too. Calls then go both
ways again, each running longer than the idle bound (so the caller's link parks while it
waits for the reply, which wakes it); the links park again, and after ``shutdown()`` nothing of them,
and no watcher, is left. A second world, without heartbeats, kills a worker with SIGKILL while its links
are parked: the end of its process wakes the watcher, and the peer's link to it fails as a sleeping
receiver's would; the other link keeps working.
"""

from __future__ import annotations

import operator
import os
import signal
import time
from typing import Any

import pytest
from _spawn_world import held_after_rpc, held_before_rpc, report, run_barrier_world
from twinrpc.impl._pool import IDLE_EXIT
from twinrpc.impl._receiver import LINGER

WORLD = 5
WORLD_TIMEOUT = 180.0
#: seconds a worker idles before it looks: its links park LINGER after their last message, and the
#: request pool's threads beyond the two it keeps exit IDLE_EXIT after their last job
IDLE = LINGER + IDLE_EXIT + 0.5
#: seconds it may look for: each peer's heartbeat (every second) wakes a parked link for a moment
LOOK = 10.0
#: threads a process gains from its first link on: gloo's event loop (one device shared by every
#: pair) and the doorbell watcher
GAINED = 2


def _slow_add(x: int, y: int) -> int:
    time.sleep(LINGER + 0.5)  # longer than the idle bound: the caller's link parks meanwhile
    return x + y


def _look(world: Any, threads_at_init: int) -> dict[str, Any]:
    """Look until every link that parks holds no receiving thread (each other link one) and the
    process holds at most GAINED threads more than after init (LOOK at most); the last look."""
    deadline = time.monotonic() + LOOK
    while True:
        links = world.links
        receivers = {peer: link.receiver_threads() for peer, link in links.items()}
        parking = sorted(peer for peer, link in links.items() if link.parks_when_idle)
        gained = len(os.listdir("/proc/self/task")) - threads_at_init
        expected = {peer: 0 if peer in parking else 1 for peer in links}
        settled = receivers == expected and gained <= GAINED + len(links) - len(parking)
        if settled or time.monotonic() > deadline:
            return {"receivers": receivers, "parking": parking, "gained": gained, "settled": settled}
        time.sleep(0.02)


def _idle_program(rank: int, port: int, barrier: Any, budget: int | None) -> dict[str, Any]:
    import twinrpc.rpc as rpc
    from twinrpc._current import current_agent

    if budget is not None:  # rings of 1 MiB, and room for only that many
        os.environ["TWINRPC_SHM_RING_BYTES"] = str(1 << 20)
        os.environ["TWINRPC_SHM_MAX_BYTES"] = str(budget << 20)
    before = held_before_rpc(barrier, WORLD_TIMEOUT)
    options = rpc.RpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}")
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=WORLD, rpc_backend_options=options)
    world = current_agent().world
    threads_at_init = len(os.listdir("/proc/self/task"))
    peers = [p for p in range(WORLD) if p != rank] if rank == 0 else [0]
    out: dict[str, Any] = {"first": [rpc.rpc_sync(f"worker{p}", operator.add, args=(p, 1)) for p in peers]}
    barrier.wait(WORLD_TIMEOUT)  # every call answered: from now on the links idle
    time.sleep(IDLE)
    out["idle"] = _look(world, threads_at_init)
    out["data_rings"] = sorted(peer for peer, link in world.links.items() if link.same_host[0])
    barrier.wait(WORLD_TIMEOUT)
    futures = [rpc.rpc_async(f"worker{p}", _slow_add, args=(p, 1)) for p in peers]
    out["again"] = [f.wait() for f in futures]
    barrier.wait(WORLD_TIMEOUT)
    time.sleep(IDLE)
    out["idle_again"] = _look(world, threads_at_init)
    barrier.wait(WORLD_TIMEOUT)  # nobody stops while another still looks
    rpc.shutdown()
    out.update(held_after_rpc(before))
    return out


def _idle_child(
    rank: int, port: int, barrier: Any, _event: Any, budget: int | None, shared: dict[str, Any]
) -> None:
    report(shared, rank, _idle_program, rank, port, barrier, budget)


@pytest.mark.parametrize("budget", [None, 2], ids=["rings", "two-rings-of-budget"])
def test_idle_same_host_links_hold_no_thread_and_wake_for_calls_both_ways(budget: int | None) -> None:
    """``budget``: rings worker 0 has room for (None: the default, room for all four); the links
    beyond it send their data over gloo, and their header frames still through the doorbell."""
    got = run_barrier_world(_idle_child, WORLD, WORLD_TIMEOUT, budget)
    for rank, found in sorted(got.items()):
        print(rank, found)
        peers = [p for p in range(WORLD) if p != rank] if rank == 0 else [0]
        assert found["first"] == [p + 1 for p in peers], found
        assert found["again"] == [p + 1 for p in peers], found
        for look in ("idle", "idle_again"):
            assert sorted(found[look]["receivers"]) == peers, found
            assert found[look]["settled"], (look, found)
        assert found["threads_left"] == {}, found
        assert found["descriptors_left"] == {}, found
    assert got[0]["idle"]["parking"] == ([1, 2, 3, 4] if _doorbell_on() else []), got[0]
    if os.environ.get("TWINRPC_SHM", "1") != "0":
        assert len(got[0]["data_rings"]) == (4 if budget is None else budget), got[0]


def _killed_program(rank: int, port: int, barrier: Any, done: Any) -> dict[str, Any]:
    import twinrpc.rpc as rpc
    from twinrpc._current import current_agent

    # no heartbeats: only the end of the peer's process (or of its connection) can fail the link
    options = rpc.RpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", heartbeat_interval=0)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=3, rpc_backend_options=options)
    if rank != 0:
        assert rpc.rpc_sync("worker0", operator.add, args=(rank, 1)) == rank + 1
    barrier.wait(WORLD_TIMEOUT)  # worker 0 holds its two links
    time.sleep(IDLE)
    links = current_agent().world.links  # type: ignore[attr-defined]
    parked = all(link.parks_when_idle and link.receiver_threads() == 0 for link in links.values())
    barrier.wait(WORLD_TIMEOUT)
    if rank == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    if rank == 1:
        done.wait(WORLD_TIMEOUT)  # worker 0 is done with us
        rpc.shutdown(graceful=False)
        return {}
    while links[2].failed is None:  # the world's timeout bounds this
        time.sleep(0.01)
    try:
        rpc.rpc_sync("worker2", operator.add, args=(1, 1))
        call_to_killed = "returned"
    except Exception as exc:
        call_to_killed = f"{type(exc).__name__}: {exc}"
    other = rpc.rpc_sync("worker1", operator.add, args=(1, 1))
    done.set()
    rpc.shutdown(graceful=False)
    return {
        "parked": parked,
        "failure": str(links[2].failed),
        "call_to_killed": call_to_killed,
        "other": other,
    }


def _killed_child(rank: int, port: int, barrier: Any, done: Any, shared: dict[str, Any]) -> None:
    report(shared, rank, _killed_program, rank, port, barrier, done)


def test_a_peer_killed_while_its_link_is_parked_fails_that_link_and_no_other() -> None:
    got = run_barrier_world(_killed_child, 3, WORLD_TIMEOUT, reporting=[0, 1])
    found = got[0]
    print(found)
    assert found["call_to_killed"].startswith("WorkerUnavailableError"), found
    assert "'worker2'" in found["call_to_killed"], found
    assert found["other"] == 2, found
    assert found["parked"] == _doorbell_on(), found


def _doorbell_on() -> bool:
    """Whether header frames take the same-host doorbell (TWINRPC_SHM=0 or TWINRPC_SHM_DOORBELL=0
    turn it off)."""
    return os.environ.get("TWINRPC_SHM", "1") != "0" and os.environ.get("TWINRPC_SHM_DOORBELL", "1") != "0"

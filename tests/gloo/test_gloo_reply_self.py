"""A caller that blocks for a reply on a same-host link receives it itself (``Receiver.receive_until``
in impl/_receiver.py): the reply completes its future on the caller's own thread, in order with
whatever the peer sent before it, and a Ctrl-C while the caller dispatches loses nothing.

Two ``spawn`` processes: worker 0 calls worker 1. With the same-host path off (``TWINRPC_SHM=0``)
links have no doorbell and callers wait to be woken, as before; the calls still answer.
"""

from __future__ import annotations

import operator
import os
import signal
import threading
import time
from typing import Any

from _spawn_world import report, run_barrier_world

WORLD_TIMEOUT = 120.0
#: calls that may each find their reply dispatched on their own thread
CALLS = 20
#: attempts at a Ctrl-C that lands while the caller dispatches an earlier reply
ATTEMPTS = 50


def _doorbell_on() -> bool:
    return os.environ.get("TWINRPC_SHM", "1") != "0" and os.environ.get("TWINRPC_SHM_DOORBELL", "1") != "0"


def _sleepy_add(x: int, y: int, seconds: float) -> int:
    time.sleep(seconds)
    return x + y


def _dispatched_by_caller() -> bool:
    """On the thread that completes a future (protocol callbacks run there at once): whether it is
    the main thread receiving its own reply."""
    from twinrpc.impl._receiver import THREAD_ROLE

    return threading.current_thread() is threading.main_thread() and THREAD_ROLE.guest


def _completed_by_caller(fut: Any) -> list[bool]:
    """Whether the caller's own receiving completes ``fut``, once it has."""
    from twinrpc._future import add_internal_callback

    seen: list[bool] = []
    add_internal_callback(fut, lambda _f: seen.append(_dispatched_by_caller()))
    return seen


def _own_reply_program(rank: int, port: int, barrier: Any) -> dict[str, Any]:
    import twinrpc.rpc as rpc

    options = rpc.RpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}")
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2, rpc_backend_options=options)
    out: dict[str, Any] = {}
    if rank == 0:
        assert rpc.rpc_sync("worker1", operator.add, args=(1, 1)) == 2  # the link exists from now on
        by_caller = 0
        for i in range(CALLS):
            fut = rpc.rpc_async("worker1", operator.add, args=(i, 1))
            seen = _completed_by_caller(fut)
            assert fut.wait() == i + 1
            by_caller += seen == [True]
        out["by_caller"] = by_caller
        # several calls in flight: their replies are dispatched in order by whoever receives
        futs = [rpc.rpc_async("worker1", operator.add, args=(i, 2)) for i in range(64)]
        out["in_flight"] = [f.wait() for f in reversed(futs)][::-1] == [i + 2 for i in range(64)]
        # the caller's time-out: it stops receiving, and the link goes on (the late reply is dropped)
        try:
            rpc.rpc_sync("worker1", _sleepy_add, args=(1, 1, 1.0), timeout=0.2)
            out["timeout"] = "returned"
        except RuntimeError as exc:
            out["timeout"] = type(exc).__name__
        out["after_timeout"] = [rpc.rpc_sync("worker1", operator.add, args=(i, 3)) for i in range(5)]
    barrier.wait(WORLD_TIMEOUT)
    rpc.shutdown()
    return out


def _own_reply_child(rank: int, port: int, barrier: Any, _event: Any, shared: dict[str, Any]) -> None:
    report(shared, rank, _own_reply_program, rank, port, barrier)


def test_a_caller_blocking_on_a_same_host_reply_completes_it_on_its_own_thread() -> None:
    got = run_barrier_world(_own_reply_child, 2, WORLD_TIMEOUT)[0]
    print(got)
    assert got["in_flight"] is True
    assert got["timeout"] == "RPCTimeoutError"
    assert got["after_timeout"] == [i + 3 for i in range(5)]
    if _doorbell_on():
        assert got["by_caller"] > 0, got  # most, unless this process was descheduled meanwhile
    else:
        assert got["by_caller"] == 0, got  # a receiver thread completes every reply


def _interrupt_program(rank: int, port: int, barrier: Any) -> dict[str, Any]:
    import twinrpc.rpc as rpc
    from twinrpc._future import add_internal_callback

    options = rpc.RpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}")
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2, rpc_backend_options=options)
    out: dict[str, Any] = {"interrupted": 0, "by_caller": 0, "lost": []}
    if rank == 0:
        assert rpc.rpc_sync("worker1", operator.add, args=(1, 1)) == 2
        for i in range(ATTEMPTS):
            first = rpc.rpc_async("worker1", operator.add, args=(i, 10))
            second = rpc.rpc_async("worker1", _sleepy_add, args=(i, 20, 0.01))
            by_caller: list[bool] = []

            def ctrl_c(_f: Any, by_caller: list[bool] = by_caller) -> None:
                # completing the first reply: Ctrl-C right in the middle of its dispatch
                by_caller.append(_dispatched_by_caller())
                signal.raise_signal(signal.SIGINT)

            try:
                add_internal_callback(first, ctrl_c)  # runs here, now, if the reply is in already
                second.wait()
            except KeyboardInterrupt:
                out["interrupted"] += 1
            out["by_caller"] += by_caller == [True]
            # nothing was lost: both calls answer, in full, and so does the next one
            if first.wait() != i + 10 or second.wait() != i + 20:
                out["lost"].append(i)
            if rpc.rpc_sync("worker1", operator.add, args=(i, 30)) != i + 30:
                out["lost"].append(i)
    barrier.wait(WORLD_TIMEOUT)
    rpc.shutdown()  # waits for every call's accounting: a half-dispatched reply would hang it
    return out


def _interrupt_child(rank: int, port: int, barrier: Any, _event: Any, shared: dict[str, Any]) -> None:
    report(shared, rank, _interrupt_program, rank, port, barrier)


def test_ctrl_c_while_the_caller_dispatches_a_reply_loses_and_reorders_nothing() -> None:
    got = run_barrier_world(_interrupt_child, 2, WORLD_TIMEOUT)[0]
    print(got)
    assert got["lost"] == [], got
    assert got["interrupted"] == ATTEMPTS, got  # every Ctrl-C reached the program
    if _doorbell_on():
        assert got["by_caller"] > 0, got  # some landed while the caller itself dispatched


def test_the_interrupt_shield_holds_ctrl_c_back_while_closed_and_delivers_it_when_lifted() -> None:
    from twinrpc.impl._interrupt_shield import InterruptShield

    before = signal.getsignal(signal.SIGINT)
    shield = InterruptShield.install()
    assert shield is not None  # pytest runs tests on the main thread, with Python's handler
    try:
        signal.raise_signal(signal.SIGINT)  # closed: noted, not raised
        assert shield.caught is not None
    finally:
        try:
            shield.lift()
            delivered = False
        except KeyboardInterrupt:
            delivered = True
    assert delivered
    assert signal.getsignal(signal.SIGINT) is before


def test_the_interrupt_shield_lets_ctrl_c_through_while_open() -> None:
    from twinrpc.impl._interrupt_shield import InterruptShield

    shield = InterruptShield.install()
    assert shield is not None
    try:
        shield.open = True
        try:
            signal.raise_signal(signal.SIGINT)
            raised = False
        except KeyboardInterrupt:
            raised = True
        shield.open = False
        assert raised
        assert shield.caught is None
    finally:
        shield.lift()


def test_the_interrupt_shield_is_not_installed_off_the_main_thread() -> None:
    from twinrpc.impl._interrupt_shield import InterruptShield

    got: list[object] = []
    thread = threading.Thread(target=lambda: got.append(InterruptShield.install()))
    thread.start()
    thread.join()
    assert got == [None]

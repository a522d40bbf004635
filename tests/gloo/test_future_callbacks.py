"""Where Future callbacks run in the real world, and torch.futures taking twinrpc futures.

User callbacks (then, add_done_callback) of a future completed on a thread that must not run user code
(a gloo receiver, the timer: ``CALLBACK_ROLE.defer`` set) go to the world's CallbackRunner; waiters
and the protocol's own callbacks still run at once. The conformance suite checks the behaviour over
real RPCs (conformance/test_futures.py); these pin the mechanism."""

from __future__ import annotations

import threading
from typing import Any

import torch
from twinrpc.impl._pool import CallbackRunner, RequestPool

from twinrpc._future import CALLBACK_ROLE, Future


def _complete_as_world_thread(fut: Future[Any], value: Any, runner: CallbackRunner) -> None:
    """Complete ``fut`` on a new thread marked as a world thread (as a gloo receiver is)."""

    def world_thread() -> None:
        CALLBACK_ROLE.defer = runner.submit
        fut.set_result(value)

    t = threading.Thread(target=world_thread)
    t.start()
    t.join(5.0)


def test_user_callbacks_leave_the_world_thread_but_waiters_and_internal_callbacks_do_not() -> None:
    pool = RequestPool(2, "test-cb-a", prestart=1)
    runner = CallbackRunner(pool.run_job)
    fut: Future[int] = Future()
    ran_on: dict[str, str] = {}
    done = threading.Event()
    fut._add_internal_callback(lambda f: ran_on.setdefault("internal", threading.current_thread().name))
    fut.add_done_callback(lambda f: ran_on.setdefault("user", threading.current_thread().name))
    fut.then(lambda f: done.set())
    _complete_as_world_thread(fut, 1, runner)
    assert done.wait(5.0)
    assert ran_on["internal"].startswith("Thread-")  # the completing thread
    assert ran_on["user"].startswith("test-cb-a")  # a pool thread
    pool.stop()
    assert pool.join(5.0) == []


def test_a_runner_that_blocks_on_a_future_hands_the_queue_on() -> None:
    """The first callback waits for a future that only the second one completes: with one runner
    draining in order that would never end; the blocked runner hands the queue to a new one."""
    pool = RequestPool(2, "test-cb-b", prestart=1)
    runner = CallbackRunner(pool.run_job)
    gate: Future[str] = Future()
    first: Future[int] = Future()
    second: Future[int] = Future()
    out = first.then(lambda f: gate.wait())
    second.add_done_callback(lambda f: gate.set_result("opened"))
    _complete_as_world_thread(first, 1, runner)
    _complete_as_world_thread(second, 2, runner)
    assert out.wait() == "opened"
    pool.stop()
    assert pool.join(5.0) == []


def test_callbacks_queued_in_a_burst_run_in_order() -> None:
    pool = RequestPool(2, "test-cb-c", prestart=1)
    runner = CallbackRunner(pool.run_job)
    seen: list[int] = []
    futs: list[Future[int]] = [Future() for _ in range(50)]
    for f in futs:
        f.add_done_callback(lambda f: seen.append(f.value()))
    last = futs[-1].then(lambda f: None)

    def world_thread() -> None:
        CALLBACK_ROLE.defer = runner.submit
        for i, f in enumerate(futs):
            f.set_result(i)

    t = threading.Thread(target=world_thread)
    t.start()
    t.join(5.0)
    last.wait()
    assert seen == list(range(50))
    pool.stop()
    assert pool.join(5.0) == []


def test_torch_collect_all_still_takes_plain_torch_futures() -> None:
    a, b = torch.futures.Future(), torch.futures.Future()
    combined = torch.futures.collect_all([a, b])
    assert type(combined) is torch._C.Future  # torch's own, unchanged
    a.set_result(1)
    b.set_result(2)
    assert [f.wait() for f in combined.wait()] == [1, 2]


def test_torch_collect_all_mixing_both_kinds_gives_a_twinrpc_future() -> None:
    a: Future[int] = Future()
    b = torch.futures.Future()
    combined = torch.futures.collect_all([a, b])
    assert isinstance(combined, Future)
    assert isinstance(a, torch.futures.Future) and isinstance(a, torch.Future)
    a.set_result(1)
    assert not combined.done()
    b.set_result(2)
    assert torch.futures.wait_all([a, b]) == [1, 2]

"""The gloo world's request pool: after stop(), join() waits until every one of its threads has
exited, so that nothing of ours is still inside a gloo call when a program exits after shutdown
(a daemon thread returning from one while the interpreter finalizes aborts the process)."""

from __future__ import annotations

import threading
import time

import pytest
from twinrpc.impl._pool import RequestPool


def _pool_threads(name: str) -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(name) and t.is_alive()]


def test_join_after_stop_leaves_no_thread_idle_or_busy() -> None:
    pool = RequestPool(4, "test-pool-a", prestart=3)
    started, release = threading.Barrier(3), threading.Event()

    def request() -> None:
        started.wait(5.0)
        release.wait(5.0)

    pool.submit(request)
    pool.run_job(request)
    started.wait(5.0)  # one request and one job running, the third prestarted thread idle
    assert len(_pool_threads("test-pool-a")) == 3
    pool.stop()
    release.set()
    assert pool.join(5.0) == []
    assert _pool_threads("test-pool-a") == []


def test_join_names_a_request_that_outlives_its_timeout_and_returns_once_it_ends() -> None:
    pool = RequestPool(2, "test-pool-b", prestart=0)
    running, release = threading.Event(), threading.Event()

    def stuck() -> None:
        running.set()
        release.wait(5.0)

    pool.submit(stuck)
    assert running.wait(5.0)
    pool.stop()
    assert pool.join(0.05) == ["test-pool-b-0"]
    release.set()
    assert pool.join(5.0) == []


def test_join_from_a_pool_thread_does_not_wait_for_itself() -> None:
    pool = RequestPool(2, "test-pool-c", prestart=1)
    left: list[list[str]] = []
    done = threading.Event()

    def stop_from_inside() -> None:
        pool.stop()
        left.append(pool.join(5.0))
        done.set()

    pool.submit(stop_from_inside)
    assert done.wait(5.0)
    assert left == [[]]  # the idle thread exited; the calling one is not waited for


def test_threads_a_burst_started_exit_once_idle_and_the_prestarted_ones_stay(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A burst (many peers' requests at once) starts threads; once idle for IDLE_EXIT they exit, down
    to the pre-started ones, and the pool still runs what comes next."""
    from twinrpc.impl import _pool

    monkeypatch.setattr(_pool, "IDLE_EXIT", 0.05)
    pool = RequestPool(8, "test-pool-d", prestart=2)
    started, release = threading.Barrier(7), threading.Event()

    def request() -> None:
        started.wait(5.0)
        release.wait(5.0)

    for _ in range(6):
        pool.submit(request)
    started.wait(5.0)
    assert len(_pool_threads("test-pool-d")) == 6
    release.set()
    for _ in range(100):
        if len(_pool_threads("test-pool-d")) == 2:
            break
        time.sleep(0.05)
    assert len(_pool_threads("test-pool-d")) == 2
    ran = threading.Event()
    pool.submit(ran.set)
    assert ran.wait(5.0)
    pool.stop()
    assert pool.join(5.0) == []
    assert _pool_threads("test-pool-d") == []

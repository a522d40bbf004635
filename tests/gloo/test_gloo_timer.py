"""The gloo world's timer thread: timers fire at their deadline, cancelled ones never, and cancelled
ones do not pile up (every RPC's 60 s timeout is cancelled when its reply comes: kept until their
deadline they grew the heap by one entry per call and set off full garbage collections)."""

from __future__ import annotations

import threading

from twinrpc.impl._timer import _COMPACT_MIN, TimerThread


def test_cancelled_timers_are_dropped_and_live_ones_still_fire() -> None:
    timer = TimerThread("test-timer")
    fired: list[str] = []
    due = threading.Event()
    try:
        timer.call_later(0.2, lambda: (fired.append("live"), due.set()))
        cancelled = timer.call_later(0.1, lambda: fired.append("cancelled"))
        cancelled.cancel()
        for _ in range(10_000):
            timer.call_later(60.0, lambda: fired.append("rpc timeout")).cancel()
        # the heap holds the live timer and at most about as many cancelled ones as the bound
        assert len(timer._heap) <= 2 * _COMPACT_MIN + 2
        assert due.wait(5.0)
        assert fired == ["live"]
    finally:
        timer.stop()


def test_a_timer_cancelled_twice_counts_once() -> None:
    timer = TimerThread("test-timer")
    try:
        handle = timer.call_later(60.0, lambda: None)
        handle.cancel()
        handle.cancel()
        assert timer._cancelled == 1
    finally:
        timer.stop()


def test_join_after_stop_waits_for_the_callback_running_at_stop() -> None:
    """shutdown must not return while the timer thread is still inside a callback (it may be in a
    gloo send: a daemon thread returning from one while the interpreter finalizes aborts it)."""
    timer = TimerThread("test-timer")
    started, finished = threading.Event(), threading.Event()
    release = threading.Event()

    def callback() -> None:
        started.set()
        release.wait(5.0)
        finished.set()

    timer.call_later(0.0, callback)
    assert started.wait(5.0)
    timer.stop()
    assert not timer.join(0.05)  # still inside the callback
    release.set()
    assert timer.join(5.0)
    assert finished.is_set()
    assert not any(t.name == "test-timer" for t in threading.enumerate())

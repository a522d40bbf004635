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

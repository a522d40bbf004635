"""One timer thread per world: fires callbacks at deadlines (RPC timeouts), woken, never polling."""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import threading
import time
from collections.abc import Callable

from twinrpc._future import CALLBACK_ROLE
from twinrpc._world import TimerHandle

_log = logging.getLogger("twinrpc.impl")
#: a timer may fire this much after its deadline (1% of its delay, at most _SLACK_MAX seconds), so
#: that nearby deadlines share one wake-up of the timer thread
_SLACK_FRACTION = 0.01
_SLACK_MAX = 0.01


#: the heap is compacted once it holds more cancelled timers than this and than live ones
_COMPACT_MIN = 64


class _Handle(TimerHandle):
    """A TimerHandle that tells its TimerThread how many cancelled timers its heap holds."""

    __slots__ = ("_timer",)

    def __init__(self, timer: TimerThread) -> None:
        super().__init__()
        self._timer = timer

    def cancel(self) -> None:
        timer = self._timer
        with timer._cond:
            if not self.cancelled:
                self.cancelled = True
                timer._cancelled += 1


class TimerThread:
    """Runs ``fn()`` on the timer thread at its deadline. Callbacks must be short and must not block.

    Most timers are cancelled long before they are due (every RPC's timeout, every RRef control
    message's resend): cancelled ones at the head of the queue are dropped without waiting for their
    deadline, so they cost the thread no wake-up of its own. The others are dropped in bulk once they
    outnumber the live timers: kept until their deadline, they were the main long-lived garbage of an
    RPC loop, whose promotion into the garbage collector's oldest generation set off full collections
    (the figures: docs/explanation/benchmarks.md).
    """

    def __init__(
        self, name: str, defer_callbacks: Callable[[Callable[[], None]], None] | None = None
    ) -> None:
        """``defer_callbacks(fn)`` runs ``fn`` later on another thread: the user callbacks of a future
        a timer completes (an RPC timeout) go there (twinrpc._future.CALLBACK_ROLE); without it they
        run on the timer thread."""
        self._defer_callbacks = defer_callbacks
        self._heap: list[tuple[float, int, TimerHandle, Callable[[], object], float]] = []
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._stopped = False
        #: cancelled timers still in the heap
        self._cancelled = 0
        #: when the thread will next wake by itself (inf: only when notified)
        self._wake_at = math.inf
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def call_later(self, delay: float, fn: Callable[[], object]) -> TimerHandle:
        handle = _Handle(self)
        deadline = time.monotonic() + delay
        latest = deadline + min(delay * _SLACK_FRACTION, _SLACK_MAX)
        with self._cond:
            heap = self._heap
            if self._cancelled > _COMPACT_MIN and 2 * self._cancelled > len(heap):
                heap[:] = [entry for entry in heap if not entry[2].cancelled]
                heapq.heapify(heap)
                self._cancelled = 0
            heapq.heappush(heap, (deadline, next(self._seq), handle, fn, latest))
            if latest < self._wake_at:
                self._wake_at = latest
                self._cond.notify()
        return handle

    def stop(self) -> None:
        """No callback starts after this; one already running finishes (see join)."""
        with self._cond:
            self._stopped = True
            self._cond.notify()

    def join(self, timeout: float) -> bool:
        """After stop(): wait for the thread to exit (a running callback may still be in a gloo call,
        see GlooWorld._stop_threads); True when it has (or when called on the timer thread itself)."""
        if threading.current_thread() is self._thread:
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        from ._link import THREAD_ROLE

        THREAD_ROLE.no_blocking_send = True  # a timer blocked in a send would delay every timeout
        CALLBACK_ROLE.defer = self._defer_callbacks  # and so would a user callback that blocks
        heap = self._heap
        while True:
            with self._cond:
                while not self._stopped:
                    while heap and heap[0][2].cancelled:
                        heapq.heappop(heap)
                        self._cancelled -= 1
                    if not heap:
                        self._wake_at = math.inf
                        self._cond.wait()
                        continue
                    now = time.monotonic()
                    if heap[0][0] <= now:
                        break
                    self._wake_at = heap[0][4]
                    self._cond.wait(self._wake_at - now)
                if self._stopped:
                    return
                self._wake_at = -math.inf  # awake: no call_later needs to notify
                _, _, handle, fn, _ = heapq.heappop(heap)
            if handle.cancelled:
                continue
            try:
                fn()
            except Exception:
                _log.exception("twinrpc: a timer callback raised")

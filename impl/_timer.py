"""One timer thread per world: fires callbacks at deadlines (RPC timeouts), woken, never polling."""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable

from twinrpc._world import TimerHandle

_log = logging.getLogger("twinrpc.impl")


class TimerThread:
    """Runs ``fn()`` on the timer thread at its deadline. Callbacks must be short and must not block."""

    def __init__(self, name: str) -> None:
        self._heap: list[tuple[float, int, TimerHandle, Callable[[], object]]] = []
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def call_later(self, delay: float, fn: Callable[[], object]) -> TimerHandle:
        handle = TimerHandle()
        deadline = time.monotonic() + delay
        with self._cond:
            heapq.heappush(self._heap, (deadline, next(self._seq), handle, fn))
            if self._heap[0][2] is handle:
                self._cond.notify()
        return handle

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()

    def _run(self) -> None:
        from ._link import THREAD_ROLE

        THREAD_ROLE.no_blocking_send = True  # a timer blocked in a send would delay every timeout
        while True:
            with self._cond:
                while not self._stopped:
                    if not self._heap:
                        self._cond.wait()
                        continue
                    deadline = self._heap[0][0]
                    now = time.monotonic()
                    if deadline <= now:
                        break
                    self._cond.wait(deadline - now)
                if self._stopped:
                    return
                _, _, handle, fn = heapq.heappop(self._heap)
            if handle.cancelled:
                continue
            try:
                fn()
            except Exception:
                _log.exception("twinrpc: a timer callback raised")

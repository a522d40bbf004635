"""The request pool: ``num_worker_threads`` threads that run incoming requests (like TensorPipe's)."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

_log = logging.getLogger("twinrpc.impl")
_STOP = object()


class RequestPool:
    """A fixed pool of daemon threads fed by a lock-free-ish ``SimpleQueue`` (cheaper than an executor)."""

    def __init__(self, size: int, name: str) -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True) for i in range(size)
        ]
        for t in self._threads:
            t.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        self._queue.put((fn, args))

    def stop(self) -> None:
        for _ in self._threads:
            self._queue.put(_STOP)

    def _run(self) -> None:
        get = self._queue.get
        while True:
            item = get()
            if item is _STOP:
                return
            fn, args = item
            try:
                fn(*args)
            except Exception:
                _log.exception("twinrpc: a request task raised")

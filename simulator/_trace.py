"""The trace of a simulation: every send, delivery and task event with its virtual time.

Recording is on the hot path, so an event is stored as a tuple and formatted only when read.
A message event stores (kind, id, src, dst, nbytes), never the message (which would keep its
tensors alive).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from twinrpc._message import Kind


@dataclass(frozen=True, slots=True)
class TraceEvent:
    time: float
    worker: int
    event: str
    detail: str

    def line(self) -> str:
        return f"{self.time:.9f} w{self.worker} {self.event} {self.detail}"


def _detail(detail: Any) -> str:
    if isinstance(detail, tuple):
        kind, msg_id, src, dst, nbytes = detail
        return f"{Kind(kind).name}#{msg_id} {src}->{dst} ({nbytes} B)"
    return str(detail)


class Trace:
    """Events in the order they happened. Same seed + same program = the same trace (SIM-1)."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._events: list[tuple[float, int, str, Any]] = []

    def record(self, time: float, worker: int, event: str, detail: Any) -> None:
        """Record an event; ``detail`` is a string or a message tuple (kind, id, src, dst, nbytes)."""
        if self.enabled:
            self._events.append((time, worker, event, detail))

    def __len__(self) -> int:
        return len(self._events)

    def __iter__(self) -> Iterator[TraceEvent]:
        for t, w, e, d in self._events:
            yield TraceEvent(t, w, e, _detail(d))

    def digest(self) -> str:
        """A SHA-256 over every event: equal digests mean identical runs."""
        h = hashlib.sha256()
        for t, w, e, d in self._events:
            h.update(f"{t:.9f}|{w}|{e}|{_detail(d)}\n".encode())
        return h.hexdigest()

    def text(self, limit: int | None = None) -> str:
        """A readable timeline, one event a line."""
        return "\n".join(ev.line() for i, ev in enumerate(self) if limit is None or i < limit)

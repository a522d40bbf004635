"""The trace of a simulation: every send, delivery and task event with its virtual time."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TraceEvent:
    time: float
    worker: int
    event: str
    detail: str

    def line(self) -> str:
        return f"{self.time:.9f} w{self.worker} {self.event} {self.detail}"


class Trace:
    """Events in the order they happened. Same seed + same program = the same trace (SIM-1)."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._events: list[tuple[float, int, str, str]] = []

    def record(self, time: float, worker: int, event: str, detail: str) -> None:
        if self.enabled:
            self._events.append((time, worker, event, detail))

    def __len__(self) -> int:
        return len(self._events)

    def __iter__(self) -> Iterator[TraceEvent]:
        for e in self._events:
            yield TraceEvent(*e)

    def digest(self) -> str:
        """A SHA-256 over every event: equal digests mean identical runs."""
        h = hashlib.sha256()
        for e in self._events:
            h.update(f"{e[0]:.9f}|{e[1]}|{e[2]}|{e[3]}\n".encode())
        return h.hexdigest()

    def text(self, limit: int | None = None) -> str:
        """A readable timeline, one event a line."""
        events = self._events if limit is None else self._events[:limit]
        return "\n".join(TraceEvent(*e).line() for e in events)

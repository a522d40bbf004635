"""The trace file format both worlds write: JSON lines, a versioned header line, then one event a line.

The simulator saves whole traces in it (``twinrpc.simulator.Trace.save``); the gloo world's opt-in
recorder (``TWINRPC_TRACE=dir``, ``twinrpc.impl._trace``) writes one file per worker in it, and
``Trace.load`` reads both. It lives in the core so the gloo world can write it without importing the
simulator.

Header::

    {"format": "twinrpc-trace", "version": 1, "source": "simulator"|"gloo", "clock": "virtual"|"wall",
     "seed": 7|null, "world_size": 2, "workers": ["worker0", "worker1"], "rank": null|0}

Event (keys in this order; ``m`` only for message events, ``vc`` only where known)::

    {"t": 0.00105, "w": 1, "e": "deliver", "d": "CALL#0 0->1 (44 B)",
     "m": ["CALL", 0, 0, 1, 44, 3], "vc": [1, 2]}

``m`` is ``[kind name, message id, src rank, dst rank, bytes, message number]``: the message number
names one send and every event about that message (its deliveries, a drop, ...); it is ``null`` in the
gloo recorder's files (``Trace.load`` pairs sends and deliveries itself). Floats are written with
``repr``, so a trace saved twice is byte-identical.
"""

from __future__ import annotations

import json
from typing import Any

FORMAT = "twinrpc-trace"
VERSION = 1

_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode


def header_line(
    *,
    source: str,
    clock: str,
    seed: int | None,
    world_size: int,
    workers: list[str],
    rank: int | None = None,
) -> str:
    """The first line of a trace file (no newline)."""
    return _dumps(
        {
            "format": FORMAT,
            "version": VERSION,
            "source": source,
            "clock": clock,
            "seed": seed,
            "world_size": world_size,
            "workers": workers,
            "rank": rank,
        }
    )


def event_line(
    time: float,
    worker: int,
    event: str,
    detail: str,
    message: tuple[str, int, int, int, int, int | None] | None = None,
    clock: tuple[int, ...] | None = None,
) -> str:
    """One event line (no newline)."""
    obj: dict[str, Any] = {"t": time, "w": worker, "e": event, "d": detail}
    if message is not None:
        obj["m"] = list(message)
    if clock is not None:
        obj["vc"] = list(clock)
    return _dumps(obj)

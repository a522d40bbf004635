"""A text timeline of a trace: a header, then one aligned line per event with its vector clock.

A delivery also says when and by whom its message was sent, so a latency or a reordering reads off
one line.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._data import TraceData


def to_text(trace: TraceData, *, limit: int | None = None) -> str:
    """The timeline (the first ``limit`` events, or all)."""
    events = trace.events
    n = trace.world_size
    names = trace.names
    seed = f", seed {trace.seed}" if trace.seed is not None else ""
    unit = "virtual seconds" if trace.clock == "virtual" else "wall-clock seconds"
    out = [
        f"# twinrpc trace: {trace.source}{seed}, {n} workers ({', '.join(names)}), {len(events)} events; "
        f"times in {unit}",
        "# index  time  worker  event  detail  [vector clock]",
    ]
    width = max((len(name) for name in names), default=4)
    width = max(width, len("simulation"))
    sends: dict[int, tuple[float, int]] = {}
    for ev in events[:limit] if limit is not None else events:
        detail = ev.detail
        m = ev.message
        if m is not None and m.seq is not None:
            if ev.event == "send":
                sends[m.seq] = (ev.time, ev.worker)
            elif ev.event in ("deliver", "lost", "bounce") and m.seq in sends:
                t, w = sends[m.seq]
                detail += f"  <- sent by {trace.worker_name(w)} at {t:.9f} (+{(ev.time - t) * 1e6:.3f} us)"
        clock = f"  [{', '.join(map(str, ev.clock))}]" if ev.clock is not None else ""
        out.append(
            f"{ev.index:>6}  {ev.time:.9f}  {trace.worker_name(ev.worker):<{width}}  {ev.event:<22} {detail}{clock}"
        )
    return "\n".join(out) + "\n"

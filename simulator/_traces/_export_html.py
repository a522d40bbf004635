"""A self-contained HTML space-time diagram of a trace: one lane per worker, an arrow per message.

The page needs nothing from outside (inline SVG drawn by inline JavaScript from the trace's events,
embedded as JSON): it opens from a file, offline, and can be attached to a bug report. Arrows are
coloured by message kind (legend at the top); crashes, drops and lost messages are marked with a
red cross, dropped messages and messages still in flight at the end are dashed. Clicking an event or
an arrow shows its details (time, worker, message, vector clock) and outlines what happened before
and after it. The mouse wheel zooms, dragging scrolls, and a window of event numbers (or times) can
be typed in, so a few thousand events stay usable.
"""

from __future__ import annotations

import html
import json
from importlib import resources
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._data import TraceData

_TEMPLATE = "_export_html_template.html"


def _json_for_script(obj: Any) -> str:
    # Inside <script>, "</script" or "<!--" in a string would end or confuse the element: escape
    # "<", ">" and "&" as JSON unicode escapes (valid JSON, same strings).
    text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def to_html(trace: TraceData, *, title: str | None = None) -> str:
    """The trace as one HTML page (see the module docstring)."""
    events = trace.events
    n = trace.world_size
    names = list(trace.names)
    if title is None:
        seed = f", seed {trace.seed}" if trace.seed is not None else ""
        title = f"twinrpc trace ({trace.source}{seed}, {n} workers, {len(events)} events)"
    rows = []
    for ev in events:
        m = ev.message
        rows.append(
            [
                ev.time,
                ev.worker,
                ev.event,
                ev.detail,
                [m.kind, m.id, m.src, m.dst, m.nbytes, m.seq] if m is not None else None,
                list(ev.clock) if ev.clock is not None else None,
            ]
        )
    data = {
        "title": title,
        "meta": {"source": trace.source, "clock": trace.clock, "seed": trace.seed, "world_size": n},
        "workers": names,
        "events": rows,
    }
    template = resources.files(__package__).joinpath(_TEMPLATE).read_text(encoding="utf-8")
    head, rest = template.split("__TITLE__", 1)
    before, after = rest.split("__DATA__", 1)
    return head + html.escape(title) + before + _json_for_script(data) + after

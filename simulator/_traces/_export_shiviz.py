"""ShiViz logs: a space-time diagram drawn from vector clocks (paste the file into ShiViz, or load it).

The file follows ShiViz's upload format: the first line is the log-parsing regular expression (its
documented default, :data:`SHIVIZ_REGEX`), the second the multiple-executions delimiter (empty: one
execution), then two lines per event: its text, then the host (the worker's name) and its vector
clock as JSON, with zero entries left out (``{"worker0": 3, "worker1": 1}``). Events of the simulation
itself (worker -1, e.g. a monitor violation) appear as host ``simulation`` with a clock of its own.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._data import TraceData

#: the log-parsing regular expression written on the file's first line (ShiViz's default)
SHIVIZ_REGEX = r"(?<event>.*)\n(?<host>\S*) (?<clock>{.*})"


def _hosts(trace: TraceData, n: int) -> list[str]:
    hosts: list[str] = []
    for rank in range(n):
        host = re.sub(r"\s+", "_", trace.worker_name(rank)) or f"rank{rank}"
        if host in hosts or host == "simulation":
            host = f"{host}-rank{rank}"
        hosts.append(host)
    return hosts


def to_shiviz(trace: TraceData) -> str:
    """The trace as a ShiViz log (see the module docstring)."""
    events = trace.events
    n = trace.world_size
    hosts = _hosts(trace, n)
    lines = [SHIVIZ_REGEX, ""]
    own = 0  # the simulation's own clock
    for ev in events:
        text = f"t={ev.time:.9f} #{ev.index} {ev.event} {ev.detail}".replace("\n", " ")
        if ev.worker < 0 or ev.clock is None:
            own += 1
            host, clock = "simulation", {"simulation": own}
        else:
            host = hosts[ev.worker]
            clock = {hosts[i]: c for i, c in enumerate(ev.clock) if c}
        lines.append(text)
        lines.append(f"{host} {json.dumps(clock, ensure_ascii=False, separators=(',', ':'))}")
    return "\n".join(lines) + "\n"

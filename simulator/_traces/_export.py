"""One entry point for a trace's exports: ``Trace.export(format, path)`` and ``trace export``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from ._export_html import to_html
from ._export_perfetto import to_perfetto
from ._export_shiviz import to_shiviz
from ._export_text import to_text

if TYPE_CHECKING:
    from ._data import TraceData

#: export format -> (file suffix, what it is for)
EXPORT_FORMATS: dict[str, tuple[str, str]] = {
    "perfetto": (".json", "Chrome trace / Perfetto JSON (ui.perfetto.dev, chrome://tracing)"),
    "shiviz": (".log", "ShiViz log: events with vector clocks"),
    "text": (".txt", "a text timeline"),
    "html": (".html", "a self-contained HTML space-time diagram"),
}


def _renderer(fmt: str) -> Callable[[TraceData], str]:
    if fmt == "perfetto":
        return to_perfetto
    if fmt == "shiviz":
        return to_shiviz
    if fmt == "text":
        return to_text
    if fmt == "html":
        return to_html
    raise ValueError(f"unknown trace export format {fmt!r}; choose one of {', '.join(EXPORT_FORMATS)}")


def export(trace: TraceData, fmt: str, path: str | Path | None = None) -> str:
    """Render ``trace`` (``Trace._data()``) as ``fmt``; also write it to ``path`` when given. Returns the text."""
    text = _renderer(fmt)(trace)
    if path is not None:
        Path(path).write_text(text, encoding="utf-8", newline="\n")
    return text

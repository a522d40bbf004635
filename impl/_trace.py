"""The gloo world's opt-in trace recorder: ``TWINRPC_TRACE=dir`` writes ``dir/rank<r>.jsonl``.

Each worker process writes its own file in twinrpc's trace format (``twinrpc._trace_format``): a
header, then a ``send`` event for every message it sends and a ``deliver`` event for every message that
reaches it, with wall-clock times (``time.time()``). ``twinrpc.simulator.Trace.load(dir)`` merges the
files into one trace (pairing each delivery with its send), which the simulator's exports and
``trace diff --structural`` read like a simulated run. Off (``None``, no cost) unless the variable is
set. One run per directory: a worker's file is overwritten when the next run starts.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from twinrpc._trace_format import event_line, header_line

if TYPE_CHECKING:
    from twinrpc._message import Message
    from twinrpc._worker_info import WorkerInfo

#: the environment variable naming the directory traces are written to
TRACE_ENV = "TWINRPC_TRACE"


class TraceRecorder:
    """Appends this worker's message events to its trace file. Thread-safe."""

    def __init__(self, path: Path, rank: int, workers: list[WorkerInfo]) -> None:
        self.rank = rank
        self.path = path
        self._lock = threading.Lock()
        self._file: TextIO | None = open(path, "w", encoding="utf-8", newline="\n")  # noqa: SIM115
        names = [w.name for w in sorted(workers, key=lambda w: w.id)]
        self._file.write(
            header_line(
                source="gloo", clock="wall", seed=None, world_size=len(names), workers=names, rank=rank
            )
            + "\n"
        )

    @classmethod
    def from_env(cls, rank: int, workers: list[WorkerInfo]) -> TraceRecorder | None:
        """A recorder writing to ``$TWINRPC_TRACE/rank<rank>.jsonl``, or ``None`` when unset."""
        where = os.environ.get(TRACE_ENV)
        if not where:
            return None
        directory = Path(where)
        directory.mkdir(parents=True, exist_ok=True)
        return cls(directory / f"rank{rank}.jsonl", rank, workers)

    def record(self, event: str, msg: Message) -> None:
        """Record ``send`` or ``deliver`` of ``msg`` now."""
        line = event_line(
            time.time(),
            self.rank,
            event,
            msg.describe(),
            (msg.kind.name, msg.id, msg.src, msg.dst, msg.nbytes, None),
        )
        with self._lock:
            if self._file is not None:
                self._file.write(line + "\n")

    def close(self) -> None:
        with self._lock:
            f, self._file = self._file, None
        if f is not None:
            f.close()

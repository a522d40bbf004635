"""Whether a peer on this host is slow or stopped: a silent peer whose process still runs is not dead.

Silence alone cannot tell a stopped peer (SIGSTOP, a hung host) from a starved one: with many
processes on few cores, a worker may wait seconds for a core, and its heartbeats with it. On one
host the kernel can tell: :class:`PeerProcess` names the peer's process (pid and start time, so a
reused pid is not taken for it) and reads its state from ``/proc/<pid>/stat``. A process that is
running, runnable or sleeping is alive however late it is; only a stopped (``T``, ``t``), dead
(``Z``, ``X``) or vanished one is not. Between hosts (or where ``/proc`` is missing) nothing can be
read, and silence is judged by the clock alone.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from enum import Enum

#: states of ``/proc/<pid>/stat`` of a process that will not answer until someone acts on it
_STOPPED_STATES = frozenset("TtZXx")


class Verdict(Enum):
    """What this host knows of a peer's process."""

    #: it runs (or waits for a core, or sleeps): a silent peer is slow, not dead
    ALIVE = "alive"
    #: stopped (SIGSTOP, traced), a zombie, or gone: it will not answer
    STOPPED = "stopped"
    #: not a process of this host (or no ``/proc``): judge by the clock
    UNKNOWN = "unknown"


@dataclass(frozen=True, slots=True)
class PeerProcess:
    """A process of this host, named so that a reused pid is not mistaken for it."""

    pid: int
    #: clock ticks after boot when it started (field 22 of ``/proc/<pid>/stat``)
    start: int

    @classmethod
    def of(cls, pid: int) -> PeerProcess | None:
        """The process ``pid`` of this host now; None if it is gone or ``/proc`` cannot be read."""
        fields = _stat(pid)
        return None if fields is None else cls(pid, int(fields[19]))

    @classmethod
    def me(cls) -> PeerProcess | None:
        return cls.of(os.getpid())

    def encode(self) -> str:
        return f"{self.pid}:{self.start}"

    @classmethod
    def decode(cls, text: str) -> PeerProcess | None:
        """The inverse of :meth:`encode`; None for anything else."""
        pid, _, start = text.partition(":")
        if not (pid.isdigit() and start.isdigit()):
            return None
        return cls(int(pid), int(start))

    def verdict(self) -> Verdict:
        """Whether the process is alive (see the module docstring). Reads ``/proc``: for a peer that
        is silent already, not for every heartbeat."""
        fields = _stat(self.pid)
        if fields is None or int(fields[19]) != self.start:
            return Verdict.STOPPED  # gone (its pid free or reused)
        return Verdict.STOPPED if fields[0] in _STOPPED_STATES else Verdict.ALIVE


def _stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` from the state on (the name, in parentheses, may hold
    spaces); None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            text = f.read()
    except OSError:
        return None
    return text[text.rfind(")") + 2 :].split()

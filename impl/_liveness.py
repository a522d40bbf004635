"""Whether a peer is alive: what the link last heard from it and what it waits for, and the verdict.

The receiver and the sender record here what they wait for (plain field writes on their own path, no
call); the world's heartbeat tick judges from it (check_alive) and fails the link of a peer that has
been silent too long while this worker depended on it. A peer on this host whose process still runs
is never judged dead for its silence: it is starved of CPU or busy, not gone (``_peer_process``).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ._framing import HEADER_BYTES
from ._link_state import LinkState
from ._peer_process import PeerProcess, Verdict

#: bytes per second a peer is allowed to be slow at while sending a large frame (heartbeat allowance)
MIN_FRAME_RATE = 10e6


class PeerSilent(RuntimeError):
    """Nothing came from the peer within the liveness bound: it is stopped, hung or cut off."""


class Liveness:
    """One peer's liveness record. Fields are written by the link's receiver (``heard``,
    ``header_waiters`` and ``header_since`` under its rx lock, ``data_wait``) and sender
    (``sending``), and read without a lock by the heartbeat tick (on the world's timer thread)."""

    def __init__(
        self,
        state: LinkState,
        fail: Callable[[BaseException], None],
        send_timeout: float | None,
        peer_process: PeerProcess | None = None,
    ) -> None:
        """``peer_process``: the peer's process when it runs on this host (None: another host, or
        unknown), asked before a silent peer is declared dead."""
        self._state = state
        self._peer_process = peer_process
        self._fail = fail
        #: seconds (plus the size allowance) a send may wait in gloo before the link is failed; None:
        #: no bound of its own (the heartbeat tick judges stuck sends, see check_alive)
        self.send_timeout = send_timeout
        #: monotonic time of the last frame received from the peer (None: nothing heard yet)
        self.heard: float | None = None
        #: a silent peer is only suspect while we wait for it, never while our own receivers are
        #: busy handling messages: threads blocked in gloo on a header, since when (first of them)
        self.header_waiters = 0
        self.header_since = 0.0
        #: (since, allowance) while the dispatching receiver waits for a payload or tensor frame
        self.data_wait: tuple[float, float] | None = None
        #: (since, allowance) while a thread waits in gloo for one of our frames to be taken by the peer
        self.sending: tuple[float, float] | None = None

    def check_alive(self, now: float, threshold: float) -> None:
        """Declare the peer dead if it has been silent for longer than ``threshold`` seconds (plus
        time for a large frame at ``MIN_FRAME_RATE``) while we depend on it: while our receiver waits
        for its next frame, or (when the receiver is not waiting, e.g. busy handling a message) while
        one of our sends waits for the peer to take a frame. Failing the link wakes those waits.

        Only a peer heard at least once is judged, so a peer still setting up its world is never
        mistaken for a dead one; nor is a silent peer on this host whose process still runs (many
        workers on few cores can keep one from a core for longer than the bound: it is slow, and a
        dead or stopped one is told apart by its process). Seeing its process run counts as hearing
        from it, so a peer stopped for less than the bound is not cut off, as with heartbeats. Runs
        on the world's timer thread; never blocks for long (one read of ``/proc`` for a peer on this
        host that we wait for).
        """
        waiting, sending, heard = self.data_wait, self.sending, self.heard
        if waiting is None and self.header_waiters:
            waiting = (self.header_since, HEADER_BYTES / MIN_FRAME_RATE)
        state = self._state
        if heard is None or state.failed is not None or state.closing or state.closed_by_peer:
            return
        # A receiver waiting is the better judge: the peer's heartbeats land right there. (While it is
        # in the middle of a large frame the peer's heartbeats queue behind that frame: its allowance.)
        what = "while waiting for one" if waiting is not None else "while a send to it waited"
        judged = waiting if waiting is not None else sending
        if judged is None:
            return
        if self._still_runs():
            self.heard = now  # as good as a heartbeat: a stopped peer is judged from its last one
            return
        since, allowance = judged
        silent = now - max(since, heard)
        if silent > threshold + allowance:
            self._fail(
                PeerSilent(
                    f"no frame or heartbeat from it for {silent:.1f} s {what} (limit "
                    f"{threshold + allowance:.1f} s: heartbeat_interval x heartbeat_misses); its process is "
                    "stopped, hung or cut off from this one"
                )
            )

    @property
    def judged_by_process(self) -> bool:
        """Whether the peer runs on this host, so its process, not its heartbeats, tells whether it
        is alive (see check_alive)."""
        return self._peer_process is not None

    def _still_runs(self) -> bool:
        """Whether the peer's process is known to run on this host (a silent peer is then slow)."""
        process = self._peer_process
        return process is not None and process.verdict() is Verdict.ALIVE

    def restart(self, now: float) -> None:
        """Forget past silence (this process itself was stalled: the peer's frames are still queued)."""
        if self.heard is not None:
            self.heard = now

    def overdue_send(self) -> PeerSilent | None:
        """The error to report if a send is past its own bound (heartbeats off). gloo's timeout wakes
        the receiver too, which may report first: both say this rather than gloo's 'Application
        timeout caused pair closure'."""
        sending, timeout = self.sending, self.send_timeout
        if sending is None or timeout is None:
            return None
        since, allowance = sending
        waited = time.monotonic() - since
        if waited < timeout + allowance - 0.01:
            return None
        return PeerSilent(
            f"a frame to it was not taken within {timeout + allowance:.1f} s (rpc_timeout plus "
            f"{allowance:.1f} s for its size; heartbeats are off); its process is stopped, hung or cut "
            "off from this one"
        )

"""One link per peer: a facade over the parts that each own one concept and its state.

* ``_pair.py``: the pair's private 2-rank gloo process group, its tags and its kill switch (``Pair``);
* ``_sender.py``: frames to the peer under the send lock, several messages to a frame when they wait
  together (coalescing), and the outbox thread (``Sender``);
* ``_receiver.py``: the ring of receives posted ahead, the staging buffer and the receive loop's
  threads (``Receiver``);
* ``_riders.py``: deferrable messages that ride at the end of the next header frame (``Riders``);
* ``_liveness.py``: what was last heard from the peer and what we wait for, and the verdict
  (``Liveness``);
* ``_link_state.py``: whether the link is up, failed, closed by the peer or closing (``LinkState``),
  shared by all of them.

``PeerLink`` builds them, wires them together and holds what spans them: failing the link (``fail``),
closing in reply to the peer, and waiting for the link's threads. The message path (``send``,
``try_send_now``, ``send_later``, ``defer``) is the parts' own bound methods, so a message costs no
extra Python call for going through the facade.

Nothing waits in gloo forever for a stopped peer. A gloo send completes only once the peer has posted
the matching receive, so a thread sending to a peer whose process is stopped (SIGSTOP, a hung or cut-off
host) blocks inside gloo, and so does a receiver waiting for the rest of a message. How long at most:

* with heartbeats (the default), the world's heartbeat tick declares the peer dead once it has been
  silent for ``heartbeat_interval * heartbeat_misses`` seconds (plus ``size / 10 MB/s`` for a large
  frame) while this worker waits for one of its frames or for one of our sends to it to complete; any
  frame heard from the peer restarts the count, so a live but slow peer is never cut off, and a peer
  on this host whose process still runs (not stopped) is never judged by its silence: with many
  workers on few cores a starved one may miss its heartbeats for longer than the bound
  (``_peer_process``); such a peer gets no heartbeats through its doorbell either, which would
  only wake its parked link for nothing;
* with heartbeats off, each send waits at most ``rpc_timeout`` (plus the size allowance); with
  ``rpc_timeout=0`` too, a stopped peer can block a sender for good, as the user asked.

Failing the link then closes the pair's gloo connection at once (:meth:`PeerLink.abandon`: a receive
posted for no other purpose is waited on with a 1 ms timeout, and gloo closes every pair of a context on
an application timeout), which wakes every thread blocked in it with an error; the pair's process group
is unusable afterwards, and nothing uses it again. Every call pending on the peer fails with
``WorkerUnavailableError`` naming it, as for a killed peer; other peers' links are untouched. Shutdown
closes a link the same way if its peer has not closed it within ``_CLOSE_WAIT``, so no thread is left
blocked in native code.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from twinrpc._message import Message

from ._auth import FrameAuth
from ._link_state import LinkState, PeerShutDown, link_broken
from ._liveness import Liveness, PeerSilent
from ._pair import Pair, PairGroup, make_pair_group
from ._receiver import THREAD_ROLE, Receiver
from ._riders import Riders, report_failed
from ._sender import Sender

__all__ = ["THREAD_ROLE", "PeerLink", "PeerShutDown", "PeerSilent", "link_broken", "make_pair_group"]


class PeerLink:
    """Messages to and from one peer, in order, over that pair's own gloo process group.

    Thread safety: each part guards its own state with its own lock(s) (see their classes); the
    facade has none. ``fail`` may be called from any thread, once or more (the first error wins).
    """

    def __init__(
        self,
        me: int,
        peer: int,
        group: PairGroup,
        on_message: Callable[[Message], None],
        on_failure: Callable[[int, BaseException], None],
        send_timeout: float | None = None,
        auth: FrameAuth | None = None,
    ) -> None:
        """``send_timeout``: seconds (plus the size allowance) a send may wait in gloo before the link
        is failed; None: no bound of its own (the heartbeat tick judges stuck sends, see check_alive).
        ``group``: what make_pair_group made for this peer (the pair's process group and rings).
        ``auth``: the link's frame MACs with a job key (impl/_auth.py); None: frames carry none."""
        self.me = me
        self.peer = peer
        self._on_failure = on_failure
        self._run_elsewhere: Callable[[Callable[[], None]], None] | None = None
        self.state = LinkState(me, peer)
        self.pair = Pair(group, me, peer)
        self.liveness = Liveness(self.state, self.fail, send_timeout, group.rings.peer_process)
        self.riders = Riders(self.state, on_message)
        self.receiver = Receiver(
            self.state, self.pair, self.liveness, self.riders, on_message, self.fail, self._peer_closed, auth
        )
        self.sender = Sender(
            self.state, self.pair, self.liveness, self.riders, self.receiver, self.fail, auth
        )
        # The message path calls the parts' own methods, bound here: no extra call per message.
        #: Send one message (in a header frame with whatever else waits for the peer, then its data
        #: frames); raises on a broken link, or with ``on_error`` may ride the next frame (Sender.send).
        self.send = self.sender.send
        #: Send a whole message now if that cannot wait for the peer, else return False
        #: (Sender.try_send_now).
        self.try_send_now = self.sender.try_send_now
        #: Send from the link's outbox thread, for threads that must not block (Sender.send_later).
        self.send_later = self.sender.send_later
        #: Let a deferrable message ride in the next header frame; False: send it as usual
        #: (Sender.defer).
        self.defer = self.sender.defer
        #: How a thread blocking on a reply from the peer receives it itself (Receiver.receive_until);
        #: None where the peer's header frames do not take the same-host doorbell.
        self.reply_receiver = self.receiver.receive_until if self.receiver.parks else None

    # -- what the world reads and sets -------------------------------------------------------------
    @property
    def failed(self) -> BaseException | None:
        """The error that broke the link (IO error, malformed frame, silence); None while it works."""
        return self.state.failed

    @property
    def closing(self) -> bool:
        """We are shutting down: receive errors are expected and no longer reported."""
        return self.state.closing

    @closing.setter
    def closing(self, value: bool) -> None:
        self.state.closing = value

    @property
    def peer_name(self) -> str:
        """How logs and errors name the peer (the world sets "'worker1' (rank 1)")."""
        return self.state.peer_name

    @peer_name.setter
    def peer_name(self, value: str) -> None:
        self.state.peer_name = value

    @property
    def bad_frames(self) -> int:
        """Malformed frames rejected so far (each logged, naming the peer)."""
        return self.receiver.bad_frames

    @property
    def pg(self) -> Any:
        """The pair's gloo process group."""
        return self.pair.pg

    @property
    def same_host(self) -> tuple[bool, bool]:
        """Whether our data goes to the peer through shared memory, and whether the peer's comes to
        us that way (see ``_same_host``)."""
        rings = self.pair.rings
        out, inbound = rings.out, rings.inbound
        return out is not None and out.capacity > 0, inbound is not None and inbound.capacity > 0

    @property
    def parks_when_idle(self) -> bool:
        """Whether an idle link holds no thread: its receiver hands the same-host doorbell to the
        process's watcher (``_receiver.LINGER``); else it keeps one receiver while it lasts."""
        return self.receiver.parks

    def receiver_threads(self) -> int:
        """Threads receiving for this link now (0 while it is parked or once receiving has ended)."""
        return self.receiver.receiving()

    # -- life --------------------------------------------------------------------------------------
    def start(
        self,
        run_elsewhere: Callable[[Callable[[], None]], None] | None = None,
        defer_callbacks: Callable[[Callable[[], None]], None] | None = None,
    ) -> None:
        """Start receiving. ``run_elsewhere(fn)`` runs ``fn`` on another (idle) thread: with it, a
        receiver can hand its role over (see Receiver.hand_off) instead of making a request wait for a
        thread. ``defer_callbacks(fn)`` runs ``fn`` later on another thread: the link's receivers and
        outbox hand it the user callbacks of the futures they complete (twinrpc._future.CALLBACK_ROLE),
        which must never block them; without it those run on the receiver."""
        self._run_elsewhere = run_elsewhere
        self.sender.start(defer_callbacks)
        self.pair.arm()
        self.receiver.start(run_elsewhere, defer_callbacks)

    def fail(self, exc: BaseException) -> None:
        """The link is broken (IO error, silence): report it once (a send past its own bound is
        reported as such, see Liveness.overdue_send), close the pair's connection so that every
        thread waiting in gloo on it wakes, and report the riders still waiting. Ignored once failed
        or while closing."""
        state = self.state
        if state.failed is None and not state.closing:
            state.failed = exc = self.liveness.overdue_send() or link_broken(exc)
            self._on_failure(self.peer, exc)  # first: pending calls fail with this error, not gloo's
            self.pair.abandon()
            self.pair.rings.release()
            report_failed(self.riders.take(), exc)

    def _peer_closed(self) -> None:
        """The peer's first close frame (the receiver has recorded it): calls to it fail, and we close
        our side too (see _close_in_reply)."""
        self._on_failure(self.peer, PeerShutDown(self.state.peer_graceful))
        self._close_in_reply()

    def _close_in_reply(self) -> None:
        """The peer left while we keep running (a member leaving a dynamic group, or the first of a
        static group to stop): close our side too, so that its receivers for us end now rather than
        when its stop() gives up waiting for them."""
        self.state.closing = True
        run = self._run_elsewhere
        if run is not None:
            sender = self.sender
            run(lambda: sender.send_close(graceful=True))

    # -- liveness ----------------------------------------------------------------------------------
    def check_alive(self, now: float, threshold: float) -> None:
        """Fail the link if the peer has been silent too long while we depend on it (see
        Liveness.check_alive). On the world's timer thread; never blocks for long."""
        self.liveness.check_alive(now, threshold)

    def restart_liveness(self, now: float) -> None:
        """Forget past silence (this process itself was stalled: the peer's frames are still queued)."""
        self.liveness.restart(now)

    def send_heartbeat(self) -> None:
        """Send one heartbeat frame unless the outbox is busy (never blocks; see Sender.send_heartbeat).
        None to a peer on this host that takes our header frames through its doorbell: it judges us by
        our process (Liveness.judged_by_process), and a heartbeat would wake its parked link every
        interval (a pool thread per idle link and interval, at 64 workers hundreds of wake-ups a
        second on each host)."""
        out = self.pair.rings.out
        if self.liveness.judged_by_process and out is not None and out.bell is not None:
            return
        self.sender.send_heartbeat()

    def flush_riders(self) -> None:
        """Send the riders still waiting, in a heartbeat frame of their own (never blocks: for the
        world's timer)."""
        if self.riders:
            self.sender.send_beat()

    # -- closing -----------------------------------------------------------------------------------
    def send_close(self, graceful: bool = False, deadline: float | None = None) -> None:
        """Tell the peer's receivers for us to stop, after anything still queued (see Sender.send_close)."""
        self.sender.send_close(graceful, deadline)

    def abandon(self) -> None:
        """Close the pair's gloo connection now: every thread blocked in a send to or a receive from
        this peer wakes with an error (see Pair.abandon). Idempotent; blocks about 1 ms."""
        self.pair.abandon()

    def close_now(self) -> None:
        """End the link at once, for a process that exits without shutdown: no close frames, the
        pair's connection closed (the peer sees it as when a process dies), nothing reported here;
        the link's threads then exit (join_threads)."""
        self.state.closing = True
        self.pair.abandon()
        self.sender.stop_outbox()

    def release(self) -> None:
        """Once the link's threads have exited (``threads_done``): let go of everything of gloo's it
        holds, so that the pair's gloo threads and sockets end now. The link's parts refer to each
        other, so without this only a garbage collection would free them."""
        self.pair.rings.release()
        self.pair.release()
        self.sender.release()
        self.receiver.release()

    def join(self, timeout: float) -> bool:
        """Wait until receiving has ended (whichever thread receives by then)."""
        return self.receiver.join(timeout)

    def threads_done(self) -> bool:
        """Whether no thread of this link is left: receiving has ended and the outbox thread exited."""
        return self.receiver.done() and self.sender.outbox_done()

    def join_threads(self, timeout: float) -> list[str]:
        """Wait up to ``timeout`` for the link's own threads (the first receiver, which may have
        handed its role off and be finishing a reply, and the outbox) to exit; the names of those
        still running. (Receivers on pool threads are the pool's to join.)"""
        deadline = time.monotonic() + timeout
        me = threading.current_thread()
        threads = [t for t in (*self.receiver.threads(), *self.sender.threads()) if t is not me]
        for thread in threads:
            if thread.ident is not None:  # started
                thread.join(max(0.0, deadline - time.monotonic()))
        self.pair.rings.release()  # nothing sends or receives on the link any more
        return [t.name for t in threads if t.is_alive()]

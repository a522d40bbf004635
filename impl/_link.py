"""One link per peer: a private 2-rank gloo process group, a send lock and a receiver thread.

A process group per pair (not one for the whole world) keeps failures apart: when a peer dies only
its link breaks, and every other peer keeps working (gloo closes the whole context on an IO error).
The receiver posts receives with an explicit source, which gloo serves much faster than any-source.

Nothing waits in gloo forever for a stopped peer. A gloo send completes only once the peer has posted
the matching receive, so a thread sending to a peer whose process is stopped (SIGSTOP, a hung or cut-off
host) blocks inside gloo, and so does a receiver waiting for the rest of a message. How long at most:

* with heartbeats (the default), the world's heartbeat tick declares the peer dead once it has been
  silent for ``heartbeat_interval * heartbeat_misses`` seconds (plus ``size / 10 MB/s`` for a large
  frame) while this worker waits for one of its frames or for one of our sends to it to complete; any
  frame heard from the peer restarts the count, so a live but slow peer is never cut off;
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

import collections
import logging
import os
import queue
import threading
import time
from _thread import allocate_lock
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from twinrpc._future import CALLBACK_ROLE
from twinrpc._message import Kind, Message

from ._framing import (
    HEADER_BYTES,
    MAX_RIDER_BYTES,
    FrameError,
    Header,
    can_ride,
    encode_close,
    encode_header,
    new_header_tensor,
    recv_buffer,
    rider_bytes,
)

_log = logging.getLogger("twinrpc.impl")
_TAG = 0  # header frames (and close frames)
_DATA_TAG = 1  # payload and tensor frames up to _STAGED_BYTES, which follow their header in order
_KILL_TAG = 2  # a receive posted on it never completes: waiting on it with a timeout closes the pair
_LARGE_TAG = 3  # payload and tensor frames over _STAGED_BYTES (a receive of their exact size is posted)
#: data frames up to this size land in a receive posted ahead of time (the staging buffer), so the
#: sender writes them right behind their header instead of waiting until the receiving process has
#: woken up, decoded the header and posted a receive (a notify round trip plus a Python wake-up per
#: frame); they are copied out of it. Larger frames are received in place into their own buffer.
_STAGED_BYTES = 1 << 20
#: header receives kept posted ahead: a gloo send waits until the peer has posted the matching
#: receive, so with one posted header a stream of messages pays a notify round trip per message
_RING = 16
#: header slots a receiver lets wait for this worker's next send before it posts their receives
#: again itself (see PeerLink._repost): one is the usual backlog of a request and its reply; two mean
#: messages arrive faster than this worker sends (many calls in flight), and a sender that posts
#: receives for every reply would be the bottleneck (64 calls in flight: 2,100-2,500 calls/s with 4
#: here, 2,550-2,950 with 2, the latency loop unchanged within noise)
_REPOST_BATCH = 2
#: threads per link in the receive loop: while one handles a message, another is already blocked in
#: gloo on the next header, so a receiver that goes off to run a request (or to make a blocking send)
#: wakes nobody; it rejoins when done. Messages are still dispatched one at a time, in order.
_RECEIVERS = 2
_CLOSE_FLUSH = 10.0  # seconds to let the outbox drain before the close frame
#: bytes per second a peer is allowed to be slow at while sending a large frame (heartbeat allowance)
_MIN_FRAME_RATE = 10e6


class PeerShutDown(RuntimeError):
    """The peer sent its close frame: it shut down RPC (``graceful``: after completing the graceful
    shutdown protocol, an orderly departure; twinrpc._departure decides what follows)."""

    def __init__(self, graceful: bool) -> None:
        super().__init__("the peer has shut down RPC")
        self.graceful = graceful


class PeerSilent(RuntimeError):
    """Nothing came from the peer within the liveness bound: it is stopped, hung or cut off."""


class _ThreadRole(threading.local):
    #: True on threads that must never block in a gloo send: receivers (a peer's receiver may be
    #: sending to us at the same moment, and gloo sends wait for the matching receive) and the timer.
    no_blocking_send = False
    #: the PeerLink this thread receives for (None: not a receiver); see PeerLink.hand_off
    link: Any = None


THREAD_ROLE = _ThreadRole()


class PeerLink:
    """Messages to and from one peer, in order, over that pair's own gloo process group."""

    def __init__(
        self,
        me: int,
        peer: int,
        pg: Any,
        on_message: Callable[[Message], None],
        on_failure: Callable[[int, BaseException], None],
        send_timeout: float | None = None,
    ) -> None:
        """``send_timeout``: seconds (plus the size allowance) a send may wait in gloo before the link
        is failed; None: no bound of its own (the heartbeat tick judges stuck sends, see check_alive)."""
        self.me = me
        self.peer = peer
        self.pg = pg
        self._peer_rank_in_pg = 1 if me < peer else 0
        self._on_message = on_message
        self._on_failure = on_failure
        self._send_lock = threading.Lock()
        self._send_header, self._send_view = new_header_tensor()
        self._ring = [new_header_tensor() for _ in range(_RING)]
        self._ring_works: list[Any] = []
        #: the staging buffer for data frames up to _STAGED_BYTES, with its posted receive
        self._staging = torch.empty(_STAGED_BYTES, dtype=torch.uint8)
        #: the staging buffer's posted receive (None: its last frame was taken, not posted again yet)
        self._staging_work: Any = None
        #: ring slots whose header frame was taken and whose receive is not posted again yet, in
        #: slot order (see _repost); under _post_lock, which keeps the posts in that order
        self._repost_queue: collections.deque[int] = collections.deque()
        self._post_lock = threading.Lock()
        # -- the receive loop's threads (see _RECEIVERS), under _rx_lock --------------------------
        self._rx_lock = threading.Lock()
        #: next header slot (absolute index; ring buffer slot % _RING) a receiver thread waits on
        self._claimed = 0
        #: next header slot to dispatch (decode, receive its data frames, deliver): in order
        self._turn = 0
        #: a receiver is dispatching slot _turn
        self._busy = False
        #: slots whose frame has arrived, not yet dispatched (their receiver parked as a spare)
        self._ready: set[int] = set()
        #: slots a receiver waits on in gloo
        self._native: set[int] = set()
        #: locks of parked spare receivers (woken only when no receiver waits for slot _turn)
        self._spares: list[Any] = []
        #: threads in the receive loop (THREAD_ROLE.link is this link)
        self._receivers = 0
        #: receiving has ended for good (close frame, IO error): receivers leave, none rejoin
        self._ended = False
        # -- credit: header receives the peer has posted that no header of ours has used yet ------
        #: header frames we have sent (under the send lock)
        self._headers_sent = 0
        #: header frames we have taken from our ring and posted a receive again for (receiver only);
        #: every header we send carries it as ``ack``
        self._consumed = 0
        #: the peer's latest ``ack``: it has re-posted a receive for that many of our headers, and
        #: gloo has learnt of those receives before the header carrying the ack reached us (same
        #: connection, in order); so ``_headers_sent - _peer_acked < _RING`` means a header send
        #: completes without the peer's receiver doing anything
        self._peer_acked = 0
        #: the error that broke the link (IO error, malformed frame): nothing can be sent any more
        self.failed: BaseException | None = None
        #: the peer sent its close frame (it shut down): calls to it fail, our own close frame may still go
        self.closed_by_peer = False
        #: the peer's close frame said it completed graceful shutdown
        self.peer_graceful = False
        #: we are shutting down: receive errors are expected and no longer reported
        self.closing = False
        #: our close frames went (or are going): send_close runs once
        self._close_started = False
        self._close_lock = threading.Lock()
        # -- liveness (heartbeat): written by the receiver, read by the world's heartbeat tick --
        #: how logs and errors name the peer (the world sets "'worker1' (rank 1)")
        self.peer_name = f"rank {peer}"
        #: monotonic time of the last frame received from the peer (None: nothing heard yet)
        self.heard: float | None = None
        #: a silent peer is only suspect while we wait for it, never while our own receivers are
        #: busy handling messages: threads blocked in gloo on a header, since when (first of them)
        self._header_waiters = 0
        self._header_since = 0.0
        #: (since, allowance) while the dispatching receiver waits for a payload or tensor frame
        self._data_wait: tuple[float, float] | None = None
        #: (since, allowance) while a thread waits in gloo for one of our frames to be taken by the peer
        self._sending: tuple[float, float] | None = None
        self._send_timeout = send_timeout
        #: the kill switch (see abandon): a receive nobody ever sends to
        self._kill_buf = torch.zeros(1, dtype=torch.uint8)
        self._kill_work: Any = None
        self._abandoned = False
        #: malformed frames rejected so far (each logged, naming the peer)
        self.bad_frames = 0
        self._receiver = threading.Thread(target=self._receive_loop, name=f"twinrpc-recv-{peer}", daemon=True)
        self._receive_done = threading.Event()
        self._run_elsewhere: Callable[[Callable[[], None]], None] | None = None
        self._defer_callbacks: Callable[[Callable[[], None]], None] | None = None
        self._outbox: queue.SimpleQueue[tuple[Message, Callable[[Message, BaseException], None]] | None] = (
            queue.SimpleQueue()
        )
        self._outbox_thread: threading.Thread | None = None
        self._outbox_lock = threading.Lock()
        #: deferrable messages waiting to ride in the next header frame to the peer (see defer)
        self._riders: list[tuple[Message, Callable[[Message, BaseException], None]]] = []
        self._riders_lock = threading.Lock()
        #: this receiver is delivering a header's riders: it must not hand its role off (the header's
        #: own message is still to be dispatched by it)
        self._delivering_riders = False

    def start(
        self,
        run_elsewhere: Callable[[Callable[[], None]], None] | None = None,
        defer_callbacks: Callable[[Callable[[], None]], None] | None = None,
    ) -> None:
        """Start receiving. ``run_elsewhere(fn)`` runs ``fn`` on another (idle) thread: with it, a
        receiver can hand its role over (see hand_off) instead of making a request wait for a thread.
        ``defer_callbacks(fn)`` runs ``fn`` later on another thread: the link's receivers and outbox
        hand it the user callbacks of the futures they complete (twinrpc._future.CALLBACK_ROLE), which
        must never block them; without it those run on the receiver."""
        self._run_elsewhere = run_elsewhere
        self._defer_callbacks = defer_callbacks
        self._receivers = 1
        try:
            self._kill_work = self.pg.recv([self._kill_buf], self._peer_rank_in_pg, _KILL_TAG)
        except RuntimeError:
            self._kill_work = None  # a pair broken from the start: the receiver reports it
        self._receiver.start()

    def hand_off(self) -> bool:
        """Called on this link's receiver thread, while it handles a message (all of whose frames it
        has received): the next message may be dispatched at once, by the receiver already waiting
        for it (a new one is started only if none is left), and this thread becomes an ordinary
        thread that may block, run a request or send; it rejoins the receive loop when done. Returns
        False (nothing changed) where that cannot be done."""
        if THREAD_ROLE.link is not self or self._run_elsewhere is None or self._delivering_riders:
            return False
        THREAD_ROLE.link = None
        THREAD_ROLE.no_blocking_send = False
        CALLBACK_ROLE.defer = None
        with self._rx_lock:
            self._receivers -= 1
            self._turn += 1
            self._busy = False
            spare, start = None, False
            if not self._ended and (self._turn in self._ready or self._turn not in self._native):
                # nobody waits for the next slot (or its frame is here already): wake a spare, or
                # start a receiver if there is none
                if self._spares:
                    spare = self._spares.pop()
                else:
                    start = True
                    self._receivers += 1
        if spare is not None:
            spare.release()
        if start:
            self._run_elsewhere(self._receive_more)
        return True

    # -- sending -----------------------------------------------------------------------------------
    def send(self, msg: Message) -> None:
        """Send one message (header, maybe payload, then each storage). Raises on a broken link."""
        if self.failed is not None:
            raise self.failed
        if self.closed_by_peer:
            raise PeerShutDown(self.peer_graceful)
        pg, dst = self.pg, self._peer_rank_in_pg
        with self._send_lock:
            if self.failed is not None:  # failed while this thread waited for the lock
                raise self.failed
            inline, inline_tensors, riders = self._encode(msg)
            try:
                self._headers_sent += 1
                self._wait_sent(pg.send([self._send_header], dst, _TAG), HEADER_BYTES)
                if not inline:
                    payload = torch.frombuffer(bytearray(msg.payload), dtype=torch.uint8)
                    n = len(msg.payload)
                    self._wait_sent(
                        pg.send([payload], dst, _DATA_TAG if n <= _STAGED_BYTES else _LARGE_TAG), n
                    )
                if not inline_tensors:
                    for t in msg.tensors:
                        n = t.numel()
                        if n:
                            self._wait_sent(
                                pg.send([t], dst, _DATA_TAG if n <= _STAGED_BYTES else _LARGE_TAG), n
                            )
            except RuntimeError as exc:
                self._frame_failed(exc, riders)
                raise
        self._repost_after_send()

    def try_send_now(self, msg: Message) -> bool:
        """Send ``msg`` now if that cannot make this thread wait for the peer's receiver: it is one
        header frame (small payload and storages inline), the send lock is free and the peer has a
        header receive posted that none of our headers has used (see ``_peer_acked``). For threads
        that must not block (receivers, the timer): replying this way saves handing the receiver
        role to another thread. Returns False (nothing sent) otherwise; raises as send() does."""
        if self.failed is not None or self.closed_by_peer:
            return False  # the ordinary path reports it
        if self._headers_sent - self._peer_acked >= _RING - 1:
            return False
        if not self._send_lock.acquire(blocking=False):
            return False
        try:
            if self.failed is not None or self._headers_sent - self._peer_acked >= _RING - 1:
                return False
            inline, inline_tensors, riders = self._encode(msg)
            if not inline or not (inline_tensors or not any(t.numel() for t in msg.tensors)):
                self._return_riders(riders)
                return False  # more frames would follow: their receives are not posted yet
            self._headers_sent += 1
            try:
                self._wait_sent(self.pg.send([self._send_header], self._peer_rank_in_pg, _TAG), HEADER_BYTES)
            except RuntimeError as exc:
                self._frame_failed(exc, riders)
                raise
        finally:
            self._send_lock.release()
        self._repost_after_send()
        return True

    def _encode(
        self, msg: Message
    ) -> tuple[bool, bool, list[tuple[Message, Callable[[Message, BaseException], None]]]]:
        """Fill the send header for ``msg`` with the riders waiting (under the send lock): whether its
        payload and its storages are inline (see encode_header), and the riders taken."""
        riders = self._take_riders()
        try:
            inline, inline_tensors = encode_header(self._send_view, msg, self._consumed, _messages(riders))
        except BaseException:
            self._return_riders(riders)  # msg cannot be framed: they wait for the next one
            raise
        return inline, inline_tensors, riders

    def _frame_failed(
        self, exc: RuntimeError, riders: list[tuple[Message, Callable[[Message, BaseException], None]]]
    ) -> None:
        """A frame of ours failed in gloo: fail the link (unless it had failed already) and report the
        riders it carried; raises the link's own error if abandon() woke the send (it says why)."""
        earlier = self.failed
        if earlier is None:
            self._fail(exc)
        _riders_failed(riders, self.failed or exc)
        if earlier is not None:
            raise earlier from None

    # -- riders: deferrable messages that travel in the next header frame ---------------------------
    def defer(self, msg: Message, on_error: Callable[[Message, BaseException], None]) -> bool:
        """Let ``msg`` (a ``Message.deferrable`` one: small, payload only) wait to ride at the end of
        the next header frame to the peer, which delivers it before that frame's own message (see
        ``_framing``): a message that no caller waits on, such as a context's release, then costs
        neither a frame of its own nor a wake-up of the peer's receiver. The world sends whatever
        still waits after a short while (flush_riders). False: it cannot wait; send it as usual.
        ``on_error(msg, exc)`` reports a rider whose frame failed."""
        if not can_ride(msg) or self.failed is not None or self.closed_by_peer or self.closing:
            return False
        with self._riders_lock:
            if sum(rider_bytes(m) for m, _ in self._riders) + rider_bytes(msg) > MAX_RIDER_BYTES:
                return False
            self._riders.append((msg, on_error))
        return True

    def flush_riders(self) -> None:
        """Send the riders still waiting, in a heartbeat frame of their own (never blocks: for the
        world's timer)."""
        if self._riders:
            self._send_beat()

    def _take_riders(self) -> list[tuple[Message, Callable[[Message, BaseException], None]]]:
        if not self._riders:
            return []
        with self._riders_lock:
            riders, self._riders = self._riders, []
        return riders

    def _return_riders(self, riders: list[tuple[Message, Callable[[Message, BaseException], None]]]) -> None:
        """Put riders taken for a frame that was not sent back in front of the queue, in order."""
        if riders:
            with self._riders_lock:
                self._riders[:0] = riders

    def _wait_sent(self, work: Any, nbytes: int) -> None:
        """Wait until the peer has taken one frame of ours, recording the wait for check_alive."""
        allowance = nbytes / _MIN_FRAME_RATE
        since = time.monotonic()
        self._sending = (since, allowance)
        try:
            if self._send_timeout is None:
                work.wait()
                return
            try:
                work.wait(timedelta(seconds=self._send_timeout + allowance))
            except RuntimeError as exc:
                self._fail(exc)  # while _sending is still set: see _overdue_send
                raise
        finally:
            self._sending = None

    def _overdue_send(self) -> PeerSilent | None:
        """The error to report if a send is past its own bound (heartbeats off). gloo's timeout wakes
        the receiver too, which may report first: both say this rather than gloo's 'Application
        timeout caused pair closure'."""
        sending, timeout = self._sending, self._send_timeout
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

    def send_later(self, msg: Message, on_error: Callable[[Message, BaseException], None]) -> None:
        """Send from the link's outbox thread (for threads that must not block, see THREAD_ROLE)."""
        if self._outbox_thread is None:
            # Not under the send lock: the timer queues heartbeats here and must never wait for a
            # send that is stuck on a stopped peer (it is the thread that judges that peer).
            with self._outbox_lock:
                if self._outbox_thread is None:
                    self._outbox_thread = threading.Thread(
                        target=self._outbox_loop, name=f"twinrpc-send-{self.peer}", daemon=True
                    )
                    self._outbox_thread.start()
        for rider in self._take_riders():  # they were sent before msg: they stay before it
            self._outbox.put(rider)
        self._outbox.put((msg, on_error))

    def _outbox_loop(self) -> None:
        CALLBACK_ROLE.defer = self._defer_callbacks  # a failed send fails its call's future here
        while True:
            item = self._outbox.get()
            if item is None:
                return
            msg, on_error = item
            try:
                self.send(msg)  # raises at once once the link failed, so a failed outbox drains fast
            except Exception as exc:
                on_error(msg, exc)

    def send_close(self, graceful: bool = False, deadline: float | None = None) -> None:
        """Tell the peer's receiver for us to stop, after anything still queued. ``graceful``: we
        completed graceful shutdown, so the peer must not treat our departure as a failure.
        Waits until ``deadline`` (monotonic; default ``_CLOSE_FLUSH`` from now) at most, but gives the
        close frame itself at least 1 s; a stopped peer leaves it unsent (abandon() cleans up)."""
        with self._close_lock:
            if self._close_started:
                return
            self._close_started = True
        if deadline is None:
            deadline = time.monotonic() + _CLOSE_FLUSH
        if self._outbox_thread is not None:
            self._outbox.put(None)  # the outbox thread ends after what is queued (or at once if failed)
            if self.failed is None:
                self._outbox_thread.join(max(0.0, deadline - time.monotonic()))
        if self.failed is not None or (self._outbox_thread is not None and self._outbox_thread.is_alive()):
            return  # a dead peer reads nothing; a stuck outbox holds the send lock
        left = max(1.0, deadline - time.monotonic())
        if not self._send_lock.acquire(timeout=left):
            return
        riders = self._take_riders()
        try:
            if riders:  # in a heartbeat frame of their own, before the close frames
                beat = Message(Kind.HEARTBEAT, 0, self.me, self.peer, b"")
                encode_header(self._send_view, beat, self._consumed, _messages(riders))
                self._headers_sent += 1
                work = self.pg.send([self._send_header], self._peer_rank_in_pg, _TAG)
                work.wait(timedelta(seconds=max(1.0, deadline - time.monotonic())))
                riders = []
            encode_close(self._send_view, self.me, graceful)
            for _ in range(_RECEIVERS):  # one for each of the peer's receivers (each ends one)
                self._headers_sent += 1
                work = self.pg.send([self._send_header], self._peer_rank_in_pg, _TAG)
                work.wait(timedelta(seconds=max(1.0, deadline - time.monotonic())))
        except RuntimeError as exc:
            _log.debug("twinrpc: close frame to %d failed: %s", self.peer, exc)
            _riders_failed(riders, exc)
        finally:
            self._send_lock.release()

    def _close_in_reply(self) -> None:
        """The peer left while we keep running (a member leaving a dynamic group, or the first of a
        static group to stop): close our side too, so that its receivers for us end now rather than
        when its stop() gives up waiting for them."""
        self.closing = True
        run = self._run_elsewhere
        if run is not None:
            run(lambda: self.send_close(graceful=True))

    # -- receiving ---------------------------------------------------------------------------------
    def _recv_data(self, nbytes: int, as_bytes: bool = False) -> Any:
        """Receive the next data frame (``nbytes`` long) as a tensor of its own (or as ``bytes``),
        recording for the heartbeat that we wait for the peer: copied out of the staging buffer (whose
        receive is then posted again), or, for a large frame, received in place."""
        self._data_wait = (time.monotonic(), nbytes / _MIN_FRAME_RATE)
        try:
            if nbytes > _STAGED_BYTES:
                t = recv_buffer(nbytes)
                self.pg.recv([t], self._peer_rank_in_pg, _LARGE_TAG).wait()
                out: Any = t.numpy().tobytes() if as_bytes else t
            else:
                with self._post_lock:
                    if self._staging_work is None:  # not posted again since the last frame (_repost)
                        self._staging_work = self._post_staging()
                    work = self._staging_work
                work.wait()
                staged = self._staging[:nbytes]
                out = staged.numpy().tobytes() if as_bytes else staged.clone()
                with self._post_lock:
                    self._staging_work = None  # posted again by the next idle receiver (_repost)
        finally:
            self._data_wait = None
        self.heard = time.monotonic()
        return out

    def _post_staging(self) -> Any:
        return self.pg.recv([self._staging], self._peer_rank_in_pg, _DATA_TAG)

    def _post_header(self, i: int) -> None:
        t, _ = self._ring[i]
        # gloo accepts a frame shorter than the buffer silently: clear it, so a truncated
        # header shows as zeros (bad magic/version) rather than as the previous header's tail.
        t.zero_()
        self._ring_works[i] = self.pg.recv([t], self._peer_rank_in_pg, _TAG)

    def _repost(self) -> None:
        """Post again the receives of the frames already taken: the header slots (in slot order: gloo
        matches a pair's receives of one tag in the order they were posted, which is how a frame
        lands in the slot the receivers expect) and the staging buffer.

        Posting a receive is a socket write under the pair's lock that wakes the peer's event loop
        (20-30 us of CPU), so it is kept off the critical path of a request and its reply: not done
        by the receiver that has just taken a frame (it delivers the message first), nor right after
        that (it would hold the GIL while the thread it woke runs), but after this worker's next send
        on the link, while the peer is busy with that message (_repost_after_send). Receivers post
        again themselves once _REPOST_BATCH slots are waiting (a peer that sends faster than it hears
        back), and always before claiming a slot whose receive is still pending (see _next_header),
        so a frame never lands in a slot whose receive is not posted again; a data frame's receive is
        posted on demand (_recv_data) if it is still pending then."""
        if not self._repost_queue and self._staging_work is not None:
            return
        with self._post_lock:
            while self._repost_queue:
                self._post_header(self._repost_queue[0])
                self._repost_queue.popleft()
                self._consumed += 1
            if self._staging_work is None:
                self._staging_work = self._post_staging()

    def _repost_after_send(self) -> None:
        """See _repost. The message went out: a failure here is the receivers' to report."""
        try:
            self._repost()
        except RuntimeError as exc:
            if not self.closing:
                self._fail(exc)

    def _pass_turn(self) -> None:
        """The dispatching receiver is done with slot _turn (it goes on to the next, see
        _next_header, which takes a frame that is already here without waiting)."""
        with self._rx_lock:
            self._turn += 1
            self._busy = False

    def _next_header(self) -> Header | None:
        """Become the dispatcher of the next slot: take it at once if its frame is here, else claim
        a slot and wait in gloo for its frame (receives are kept posted ahead, see _RING); a frame
        that arrives before its turn is left for the dispatcher and this thread parks as a spare.
        Decode the header; its buffer's receive is posted again later (_repost). None: receiving
        ended meanwhile."""
        while True:
            if len(self._repost_queue) >= _REPOST_BATCH:
                self._repost()
            with self._rx_lock:
                if self._ended:
                    return None
                if not self._busy and self._turn in self._ready:
                    slot = self._turn
                    self._ready.discard(slot)
                    self._busy = True
                    break
                slot = self._claimed
                # the receive of slot s is the s-th one posted: _RING at first, one per _consumed
                unposted = slot >= _RING + self._consumed
                if not unposted:
                    self._claimed += 1
                    work = self._ring_works[slot % _RING]
                    self._native.add(slot)
                    if not self._header_waiters:
                        self._header_since = time.monotonic()
                    self._header_waiters += 1
            if unposted:  # its buffer still holds a frame taken earlier, whose receive is pending
                if not self._repost_queue:
                    raise RuntimeError(
                        f"twinrpc: header ring out of step (slot {slot} has no receive to post)"
                    )
                self._repost()
                continue
            try:
                work.wait()
            finally:
                with self._rx_lock:
                    self._header_waiters -= 1
                    self._native.discard(slot)
            self.heard = time.monotonic()
            with self._rx_lock:
                if self._ended:
                    return None
                if not self._busy and self._turn == slot:
                    self._busy = True
                    break
                self._ready.add(slot)  # early: the dispatcher takes it when its turn comes
                gate = allocate_lock()
                gate.acquire()
                self._spares.append(gate)
            gate.acquire()  # woken when no receiver waits for the next slot (or at the end)
        i = slot % _RING
        try:
            header = Header(self._ring[i][1], self.peer, self.me, self._ring[i][0])
        except FrameError:
            self._repost_queue.append(i)
            raise
        if not header.closing:
            self._repost_queue.append(i)  # posted again after this message is handled (_repost)
            self._peer_acked = header.ack
        return header

    def _receive_loop(self) -> None:
        try:
            self._ring_works = [None] * _RING
            with self._post_lock:  # a send may already have posted the staging receive (_repost)
                for i in range(_RING):
                    self._post_header(i)
                if self._staging_work is None:
                    self._staging_work = self._post_staging()
        except RuntimeError as exc:
            if not self.closing:
                self._fail(exc)
            self._leave(ended=True)
            return
        if self._run_elsewhere is not None:
            with self._rx_lock:
                more = self._receivers < _RECEIVERS and not self._ended
                if more:
                    self._receivers += 1
            if more:
                self._run_elsewhere(self._receive_more)
        self._receive_more()

    def _receive_more(self) -> None:
        """Receive (this thread is counted in _receivers) until the link ends; after handing the
        role off (to run a request or make a blocking send), rejoin if the link is short of
        receivers, else return (to the pool)."""
        while True:
            THREAD_ROLE.no_blocking_send = True
            THREAD_ROLE.link = self
            CALLBACK_ROLE.defer = self._defer_callbacks
            try:
                handed_off = self._receive_messages()
            except BaseException:
                self._leave(ended=True)
                raise
            finally:
                if THREAD_ROLE.link is self:
                    THREAD_ROLE.link = None
                    THREAD_ROLE.no_blocking_send = False
                CALLBACK_ROLE.defer = None
            if not handed_off:
                self._leave(ended=True)
                return
            with self._rx_lock:
                rejoin = self._receivers < _RECEIVERS and not self._ended
                if rejoin:
                    self._receivers += 1
            if not rejoin:
                return

    def _leave(self, ended: bool) -> None:
        """This thread leaves the receive loop; ``ended``: receiving has ended for good."""
        with self._rx_lock:
            self._receivers -= 1
            if ended:
                self._ended = True
            gates: list[Any] = []
            if self._ended:
                gates, self._spares = self._spares, []
            done = self._ended and self._receivers <= 0
        for gate in gates:
            gate.release()
        if done:
            self._receive_done.set()

    def _receive_messages(self) -> bool:
        """Dispatch messages in turn; True: this thread handed its role off, False: receiving ended."""
        while True:
            try:
                header = self._next_header()
                if header is None:
                    return False
                if self.failed is not None:
                    return False  # declared dead (heartbeat): nothing it still sends is trusted
                if header.closing:  # the peer sends one per receiver of ours: each ends one
                    first = not self.closed_by_peer
                    self.closed_by_peer = True
                    if first and not self.closing:
                        self.peer_graceful = bool(header.graceful)
                        self._on_failure(self.peer, PeerShutDown(self.peer_graceful))
                        self._close_in_reply()
                    self._pass_turn()
                    return False
                if header.riders:
                    self._deliver_riders(header)
                if header.kind is Kind.HEARTBEAT:
                    self._pass_turn()
                    continue
                payload = header.inline_payload
                if payload is None:
                    payload = self._recv_data(header.payload_len, as_bytes=True)
                tensors = header.inline_tensors
                if tensors is None:
                    tensors = [
                        self._recv_data(size) if size else torch.empty(0, dtype=torch.uint8)
                        for size in header.sizes
                    ]
            except FrameError as exc:
                # gloo is message-based: each receive gets exactly one send's frame, so after a bad
                # header the next frame starts a message again. Reject this one and keep the link.
                self.bad_frames += 1
                _log.error(
                    "twinrpc: rejected a malformed frame from %s: %s; frame dropped, link kept",
                    self.peer_name,
                    exc,
                )
                self._pass_turn()
                continue
            except RuntimeError as exc:
                if not self.closing:
                    self._fail(exc)
                return False
            try:
                self._on_message(Message(header.kind, header.id, self.peer, self.me, payload, tensors))
            except Exception:
                _log.exception("twinrpc: handling a message from %s failed", self.peer_name)
            if THREAD_ROLE.link is not self:
                return True  # handed off while handling it (the turn went with it)
            self._pass_turn()

    def _deliver_riders(self, header: Header) -> None:
        """Deliver a header's riders, in order, before its own message (they were sent before it)."""
        self._delivering_riders = True
        try:
            for kind, msg_id, payload in header.riders:
                try:
                    self._on_message(Message(kind, msg_id, self.peer, self.me, payload))
                except Exception:
                    _log.exception("twinrpc: handling a message from %s failed", self.peer_name)
        finally:
            self._delivering_riders = False

    # -- liveness ----------------------------------------------------------------------------------
    def check_alive(self, now: float, threshold: float) -> None:
        """Declare the peer dead if it has been silent for longer than ``threshold`` seconds (plus
        time for a large frame at ``_MIN_FRAME_RATE``) while we depend on it: while our receiver waits
        for its next frame, or (when the receiver is not waiting, e.g. busy handling a message) while
        one of our sends waits for the peer to take a frame. Failing the link wakes those waits.

        Only a peer heard at least once is judged, so a peer still setting up its world is never
        mistaken for a dead one. Runs on the world's timer thread; never blocks for long.
        """
        waiting, sending, heard = self._data_wait, self._sending, self.heard
        if waiting is None and self._header_waiters:
            waiting = (self._header_since, HEADER_BYTES / _MIN_FRAME_RATE)
        if heard is None or self.failed is not None or self.closing or self.closed_by_peer:
            return
        # A receiver waiting is the better judge: the peer's heartbeats land right there. (While it is
        # in the middle of a large frame the peer's heartbeats queue behind that frame: its allowance.)
        what = "while waiting for one" if waiting is not None else "while a send to it waited"
        judged = waiting if waiting is not None else sending
        if judged is None:
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

    def restart_liveness(self, now: float) -> None:
        """Forget past silence (this process itself was stalled: the peer's frames are still queued)."""
        if self.heard is not None:
            self.heard = now

    def send_heartbeat(self) -> None:
        """Send one heartbeat frame if that cannot block, else queue it on the outbox (never blocks);
        skipped while the outbox is busy, since whatever it is sending tells the peer we are alive
        just as well."""
        if self.failed is not None or self.closing or self.closed_by_peer or not self._outbox.empty():
            return
        self._send_beat()

    def _send_beat(self) -> None:
        """A heartbeat frame (with any riders waiting) now if that cannot block, else on the outbox."""
        if self.failed is not None or self.closed_by_peer or self.closing:
            return  # closing: send_close takes the riders
        beat = Message(Kind.HEARTBEAT, 0, self.me, self.peer, b"")
        try:
            if self.try_send_now(beat):  # usually: no outbox thread to wake
                return
        except Exception:
            return  # the link failed (riders were reported): nothing to report for a heartbeat
        self.send_later(beat, _ignore_heartbeat_error)

    def _fail(self, exc: BaseException) -> None:
        if self.failed is None and not self.closing:
            self.failed = exc = self._overdue_send() or exc
            self._on_failure(self.peer, exc)  # first: pending calls fail with this error, not gloo's
            self.abandon()
            _riders_failed(self._take_riders(), exc)

    def abandon(self) -> None:
        """Close the pair's gloo connection now: every thread blocked in a send to or a receive from
        this peer wakes with an error. The pair's process group is unusable afterwards (gloo closes
        every pair of a context on an application timeout). Idempotent; blocks about 1 ms."""
        work = self._kill_work
        if work is None or self._abandoned:
            return
        self._abandoned = True
        try:
            work.wait(timedelta(milliseconds=1))
        except RuntimeError:
            pass  # expected: "Timed out waiting 1ms for recv operation" (or the pair was closed already)

    def close_now(self) -> None:
        """End the link at once, for a process that exits without shutdown: no close frames, the
        pair's connection closed (the peer sees it as when a process dies), nothing reported here;
        the link's threads then exit (join_threads)."""
        self.closing = True
        self.abandon()
        if self._outbox_thread is not None:
            self._outbox.put(None)

    def join(self, timeout: float) -> bool:
        """Wait until receiving has ended (whichever thread receives by then)."""
        return self._receive_done.wait(timeout)

    def threads_done(self) -> bool:
        """Whether no thread of this link is left: receiving has ended and the outbox thread exited."""
        outbox = self._outbox_thread
        return self._receive_done.is_set() and (outbox is None or not outbox.is_alive())

    def join_threads(self, timeout: float) -> list[str]:
        """Wait up to ``timeout`` for the link's own threads (the first receiver, which may have
        handed its role off and be finishing a reply, and the outbox) to exit; the names of those
        still running. (Receivers on pool threads are the pool's to join.)"""
        deadline = time.monotonic() + timeout
        me = threading.current_thread()
        threads = [t for t in (self._receiver, self._outbox_thread) if t is not None and t is not me]
        for thread in threads:
            if thread.ident is not None:  # started
                thread.join(max(0.0, deadline - time.monotonic()))
        return [t.name for t in threads if t.is_alive()]


def _messages(riders: list[tuple[Message, Callable[[Message, BaseException], None]]]) -> list[Message]:
    return [msg for msg, _ in riders]


def _riders_failed(
    riders: list[tuple[Message, Callable[[Message, BaseException], None]]], exc: BaseException
) -> None:
    for msg, on_error in riders:
        try:
            on_error(msg, exc)
        except Exception:
            _log.exception("twinrpc: reporting a failed deferred %s failed", msg.describe())


def _ignore_heartbeat_error(msg: Message, exc: BaseException) -> None:
    """A heartbeat that cannot be sent needs no report: the failed send broke the link already."""


#: gloo applies a process group's timeout to every receive, including a receiver idling between
#: messages; RPC timeouts are the agent's business, and a dead peer shows as a closed connection.
_LINK_OP_TIMEOUT = timedelta(days=30)


def make_pair_group(store: Any, me: int, peer: int) -> Any:
    """The 2-rank gloo process group of the pair (me, peer), over its own key prefix; the event-loop
    thread gloo starts for it runs at a lower priority (see LOOP_NICENESS)."""
    low, high = min(me, peer), max(me, peer)
    prefix = dist.PrefixStore(f"pair/{low}-{high}", store)  # type: ignore[attr-defined]
    before = _gloo_loop_threads()
    pg = dist.ProcessGroupGloo(prefix, 0 if me == low else 1, 2, _LINK_OP_TIMEOUT)
    _lower_priority(_gloo_loop_threads() - before)
    return pg


#: How much nicer than the process the event-loop thread of each pair's gloo device runs. gloo's loop
#: waits on level-triggered epoll and only *try*-locks a pair to read from it: while another thread
#: holds that pair's lock (every send, and every receive posted, writes to the socket under it), the
#: loop returns at once and epoll reports the same readable socket again. A lock holder preempted in
#: its socket write (a loopback write wakes the peer, and with few cores the woken thread often takes
#: the holder's core) then has the loop spinning on epoll_wait for the rest of its time slice, taking
#: a core from the thread it waits for: 180,000 epoll_wait calls a second per process were counted in
#: the distributed-autograd benchmark. At a lower priority the spinning loop yields to the holder:
#: that benchmark went from 160 to 225 iterations/s on 2 cores. A loop that sleeps in epoll until data
#: arrives is still scheduled soon when it wakes (the scheduler favours sleepers). The cost shows when
#: other programs keep every core busy: there a 2-worker rpc_sync round trip took 406-489 us at the
#: median against 362-412 us at the process's own priority (and 8 ms at niceness 19, hence not 19).
LOOP_NICENESS = 10


def _gloo_loop_threads() -> set[int]:
    """Native ids of this process's gloo event-loop threads (Linux; empty where /proc is missing)."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return set()
    found = set()
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm", encoding="ascii", errors="replace") as f:
                if f.read().strip() == "gloo_tcp_loop":
                    found.add(int(tid))
        except (OSError, ValueError):
            continue
    return found


def _lower_priority(tids: set[int]) -> None:
    """Make these threads LOOP_NICENESS nicer (best effort: raising niceness needs no privilege)."""
    for tid in tids:
        try:
            nice = os.getpriority(os.PRIO_PROCESS, tid)
            os.setpriority(os.PRIO_PROCESS, tid, min(19, nice + LOOP_NICENESS))
        except OSError as exc:
            _log.debug("twinrpc: could not lower the priority of gloo loop thread %d: %s", tid, exc)

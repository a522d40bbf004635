"""A link's send side: frames to the peer under one send lock, and the outbox thread for threads
that must not block.

A message goes as one header frame (small payloads and storages inline, riders at its end; see
``_framing``), then a frame per larger payload or storage. A gloo send completes only once the peer
has posted the matching receive; the receiver's credit (``Receiver.consumed`` and
``Receiver.peer_acked``) tells when a header send cannot wait for the peer (try_send_now). Several
messages in one frame would be encoded here.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

from twinrpc._future import CALLBACK_ROLE
from twinrpc._message import Kind, Message

from ._framing import HEADER_BYTES, encode_close, encode_header, new_header_tensor
from ._link_state import LinkState, PeerShutDown
from ._liveness import MIN_FRAME_RATE, Liveness
from ._pair import DATA_TAG, LARGE_TAG, TAG, Pair
from ._receiver import RECEIVERS, RING, STAGED_BYTES, Receiver
from ._riders import Rider, Riders, messages, report_failed

_log = logging.getLogger("twinrpc.impl")
_CLOSE_FLUSH = 10.0  # seconds to let the outbox drain before the close frame


class Sender:
    """Sends one peer's messages, in order.

    Thread safety: ``lock`` (the send lock) is held while a message's frames go out, in order, and
    guards the header tensor and ``headers_sent``; ``_outbox_lock`` only guards starting the outbox
    thread; ``_close_lock`` lets send_close run once. A failed frame fails the link through ``fail``.
    """

    def __init__(
        self,
        state: LinkState,
        pair: Pair,
        liveness: Liveness,
        riders: Riders,
        receiver: Receiver,
        fail: Callable[[BaseException], None],
    ) -> None:
        self._state = state
        self._pg = pair.pg
        self._dst = pair.peer_rank
        self._live = liveness
        self._send_timeout = liveness.send_timeout
        self._riders = riders
        self._receiver = receiver
        self._fail = fail
        #: the send lock: held by whoever writes frames to the peer (a test injecting raw frames too)
        self.lock = threading.Lock()
        self._header, self._view = new_header_tensor()
        #: header frames we have sent (under the send lock); see Receiver.peer_acked
        self.headers_sent = 0
        self._defer_callbacks: Callable[[Callable[[], None]], None] | None = None
        self._outbox: queue.SimpleQueue[tuple[Message, Callable[[Message, BaseException], None]] | None] = (
            queue.SimpleQueue()
        )
        self._outbox_thread: threading.Thread | None = None
        self._outbox_lock = threading.Lock()
        #: our close frames went (or are going): send_close runs once
        self._close_started = False
        self._close_lock = threading.Lock()

    def start(self, defer_callbacks: Callable[[Callable[[], None]], None] | None) -> None:
        """``defer_callbacks``: where the outbox thread hands the user callbacks of futures it fails
        (see PeerLink.start)."""
        self._defer_callbacks = defer_callbacks

    def send(self, msg: Message) -> None:
        """Send one message (header, maybe payload, then each storage). Raises on a broken link."""
        state = self._state
        if state.failed is not None:
            raise state.failed
        if state.closed_by_peer:
            raise PeerShutDown(state.peer_graceful)
        pg, dst = self._pg, self._dst
        with self.lock:
            if state.failed is not None:  # failed while this thread waited for the lock
                raise state.failed
            inline, inline_tensors, riders = self._encode(msg)
            try:
                self.headers_sent += 1
                self._wait_sent(pg.send([self._header], dst, TAG), HEADER_BYTES)
                if not inline:
                    payload = torch.frombuffer(bytearray(msg.payload), dtype=torch.uint8)
                    n = len(msg.payload)
                    self._wait_sent(pg.send([payload], dst, DATA_TAG if n <= STAGED_BYTES else LARGE_TAG), n)
                if not inline_tensors:
                    for t in msg.tensors:
                        n = t.numel()
                        if n:
                            self._wait_sent(
                                pg.send([t], dst, DATA_TAG if n <= STAGED_BYTES else LARGE_TAG), n
                            )
            except RuntimeError as exc:
                self._frame_failed(exc, riders)
                raise
        self._receiver.repost_after_send()

    def try_send_now(self, msg: Message) -> bool:
        """Send ``msg`` now if that cannot make this thread wait for the peer's receiver: it is one
        header frame (small payload and storages inline), the send lock is free and the peer has a
        header receive posted that none of our headers has used (see ``Receiver.peer_acked``). For
        threads that must not block (receivers, the timer): replying this way saves handing the
        receiver role to another thread. Returns False (nothing sent) otherwise; raises as send() does."""
        state, receiver = self._state, self._receiver
        if state.failed is not None or state.closed_by_peer:
            return False  # the ordinary path reports it
        if self.headers_sent - receiver.peer_acked >= RING - 1:
            return False
        if not self.lock.acquire(blocking=False):
            return False
        try:
            if state.failed is not None or self.headers_sent - receiver.peer_acked >= RING - 1:
                return False
            inline, inline_tensors, riders = self._encode(msg)
            if not inline or not (inline_tensors or not any(t.numel() for t in msg.tensors)):
                self._riders.give_back(riders)
                return False  # more frames would follow: their receives are not posted yet
            self.headers_sent += 1
            try:
                self._wait_sent(self._pg.send([self._header], self._dst, TAG), HEADER_BYTES)
            except RuntimeError as exc:
                self._frame_failed(exc, riders)
                raise
        finally:
            self.lock.release()
        receiver.repost_after_send()
        return True

    def _encode(self, msg: Message) -> tuple[bool, bool, list[Rider]]:
        """Fill the send header for ``msg`` with the riders waiting (under the send lock): whether its
        payload and its storages are inline (see encode_header), and the riders taken."""
        riders = self._riders.take()
        try:
            inline, inline_tensors = encode_header(self._view, msg, self._receiver.consumed, messages(riders))
        except BaseException:
            self._riders.give_back(riders)  # msg cannot be framed: they wait for the next one
            raise
        return inline, inline_tensors, riders

    def _frame_failed(self, exc: RuntimeError, riders: list[Rider]) -> None:
        """A frame of ours failed in gloo: fail the link (unless it had failed already) and report the
        riders it carried; raises the link's own error if abandon() woke the send (it says why)."""
        state = self._state
        earlier = state.failed
        if earlier is None:
            self._fail(exc)
        report_failed(riders, state.failed or exc)
        if earlier is not None:
            raise earlier from None

    def _wait_sent(self, work: Any, nbytes: int) -> None:
        """Wait until the peer has taken one frame of ours, recording the wait for the liveness check."""
        live = self._live
        allowance = nbytes / MIN_FRAME_RATE
        since = time.monotonic()
        live.sending = (since, allowance)
        try:
            if self._send_timeout is None:
                work.wait()
                return
            try:
                work.wait(timedelta(seconds=self._send_timeout + allowance))
            except RuntimeError as exc:
                self._fail(exc)  # while sending is still set: see Liveness.overdue_send
                raise
        finally:
            live.sending = None

    # -- the outbox --------------------------------------------------------------------------------
    def send_later(self, msg: Message, on_error: Callable[[Message, BaseException], None]) -> None:
        """Send from the link's outbox thread (for threads that must not block, see THREAD_ROLE)."""
        if self._outbox_thread is None:
            # Not under the send lock: the timer queues heartbeats here and must never wait for a
            # send that is stuck on a stopped peer (it is the thread that judges that peer).
            with self._outbox_lock:
                if self._outbox_thread is None:
                    self._outbox_thread = threading.Thread(
                        target=self._outbox_loop, name=f"twinrpc-send-{self._state.peer}", daemon=True
                    )
                    self._outbox_thread.start()
        for rider in self._riders.take():  # they were sent before msg: they stay before it
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

    def stop_outbox(self) -> None:
        """Let the outbox thread end after what is queued (at once if the link failed)."""
        if self._outbox_thread is not None:
            self._outbox.put(None)

    def outbox_done(self) -> bool:
        """Whether no outbox thread is running (none was started, or it exited)."""
        outbox = self._outbox_thread
        return outbox is None or not outbox.is_alive()

    def threads(self) -> list[threading.Thread]:
        """The sender's own thread (the outbox), if started."""
        return [] if self._outbox_thread is None else [self._outbox_thread]

    # -- heartbeats --------------------------------------------------------------------------------
    def send_heartbeat(self) -> None:
        """Send one heartbeat frame if that cannot block, else queue it on the outbox (never blocks);
        skipped while the outbox is busy, since whatever it is sending tells the peer we are alive
        just as well."""
        state = self._state
        if state.failed is not None or state.closing or state.closed_by_peer or not self._outbox.empty():
            return
        self.send_beat()

    def send_beat(self) -> None:
        """A heartbeat frame (with any riders waiting) now if that cannot block, else on the outbox."""
        state = self._state
        if state.failed is not None or state.closed_by_peer or state.closing:
            return  # closing: send_close takes the riders
        beat = Message(Kind.HEARTBEAT, 0, state.me, state.peer, b"")
        try:
            if self.try_send_now(beat):  # usually: no outbox thread to wake
                return
        except Exception:
            return  # the link failed (riders were reported): nothing to report for a heartbeat
        self.send_later(beat, _ignore_heartbeat_error)

    # -- closing -----------------------------------------------------------------------------------
    def send_close(self, graceful: bool = False, deadline: float | None = None) -> None:
        """Tell the peer's receiver for us to stop, after anything still queued. ``graceful``: we
        completed graceful shutdown, so the peer must not treat our departure as a failure.
        Waits until ``deadline`` (monotonic; default ``_CLOSE_FLUSH`` from now) at most, but gives the
        close frame itself at least 1 s; a stopped peer leaves it unsent (abandon() cleans up)."""
        with self._close_lock:
            if self._close_started:
                return
            self._close_started = True
        state = self._state
        if deadline is None:
            deadline = time.monotonic() + _CLOSE_FLUSH
        if self._outbox_thread is not None:
            self._outbox.put(None)  # the outbox thread ends after what is queued (or at once if failed)
            if state.failed is None:
                self._outbox_thread.join(max(0.0, deadline - time.monotonic()))
        if state.failed is not None or (self._outbox_thread is not None and self._outbox_thread.is_alive()):
            return  # a dead peer reads nothing; a stuck outbox holds the send lock
        left = max(1.0, deadline - time.monotonic())
        if not self.lock.acquire(timeout=left):
            return
        riders = self._riders.take()
        try:
            if riders:  # in a heartbeat frame of their own, before the close frames
                beat = Message(Kind.HEARTBEAT, 0, state.me, state.peer, b"")
                encode_header(self._view, beat, self._receiver.consumed, messages(riders))
                self.headers_sent += 1
                work = self._pg.send([self._header], self._dst, TAG)
                work.wait(timedelta(seconds=max(1.0, deadline - time.monotonic())))
                riders = []
            encode_close(self._view, state.me, graceful)
            for _ in range(RECEIVERS):  # one for each of the peer's receivers (each ends one)
                self.headers_sent += 1
                work = self._pg.send([self._header], self._dst, TAG)
                work.wait(timedelta(seconds=max(1.0, deadline - time.monotonic())))
        except RuntimeError as exc:
            _log.debug("twinrpc: close frame to %d failed: %s", state.peer, exc)
            report_failed(riders, exc)
        finally:
            self.lock.release()


def _ignore_heartbeat_error(msg: Message, exc: BaseException) -> None:
    """A heartbeat that cannot be sent needs no report: the failed send broke the link already."""
